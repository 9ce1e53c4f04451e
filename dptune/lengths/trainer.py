"""The Hugging Face Trainer with variable lengths: tell when one length would be tuned.

A Trainer whose collator pads each batch to its longest example (``DataCollatorWithPadding``
and the like, or ``group_by_length``) trains at many lengths; a split tuned on the first
examples of the dataset holds at their length only. :func:`length_check` reads the train
dataset's lengths and says so (never silently): ``tune_trainer`` warns with it, and
:func:`trainer_lengths` hands the lengths to :func:`dptune.lengths.plan_lengths`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping, Optional, Sequence

__all__ = ["LengthCheck", "trainer_lengths", "length_check", "LENGTH_KEYS", "plan_trainer_lengths",
           "TrainerLengthSample"]

#: The fields whose length is the example's length, in the order they are looked for.
LENGTH_KEYS = ("input_ids", "input_values", "input_features", "pixel_values")
#: Examples read to tell whether the lengths vary (all of them up to this many).
MAX_READ = 20_000


@dataclass(frozen=True)
class LengthCheck:
    """The train dataset's lengths (of ``key``), and the longest in the probes' batch."""

    key: str
    lengths: tuple[int, ...]
    probe_length: int
    dynamic: bool          # the collator pads each batch to its longest (not to a fixed length)

    @property
    def varies(self) -> bool:
        return self.dynamic and len(set(self.lengths)) > 1

    def message(self) -> str:
        lo, hi = min(self.lengths), max(self.lengths)
        return (f"the train dataset's {self.key} lengths vary from {lo} to {hi} and the collator "
                f"pads each batch to its longest, but the probes' batches were {self.probe_length} "
                f"long: the split holds at that length only, and a batch of longer examples can run "
                f"out of memory. Plan a batch per length bucket: "
                "dptune.lengths.trainer.plan_trainer_lengths(trainer, buckets=8, ...) or "
                "`dptune search --lengths FILE`")


def _length(example: Any) -> Optional[tuple[str, int]]:
    if not isinstance(example, Mapping):
        return None
    for key in LENGTH_KEYS:
        if key in example:
            v = example[key]
            shape = getattr(v, "shape", None)
            if shape is not None and len(shape) >= 1:
                return key, int(shape[0])
            if isinstance(v, Sequence):
                return key, len(v)
    return None


def trainer_lengths(trainer: Any, limit: int = MAX_READ) -> tuple[str, list[int]]:
    """The field and the lengths of the Trainer's train dataset (map-style, up to ``limit``
    examples; a ``datasets.Dataset`` column is read as a whole)."""
    ds = trainer.train_dataset
    if not (hasattr(ds, "__getitem__") and hasattr(ds, "__len__")):
        return "", []
    column_names = getattr(ds, "column_names", None)
    if isinstance(column_names, list):
        for key in LENGTH_KEYS:
            if key in column_names:
                return key, [len(x) for x in ds[key][:limit]]
    out: list[int] = []
    key = ""
    for i in range(min(len(ds), limit)):
        found = _length(ds[i])
        if found is None:
            return "", []
        key = found[0]
        out.append(found[1])
    return key, out


def _pads_dynamically(trainer: Any) -> bool:
    """The collator pads to each batch's longest: anything but ``padding="max_length"`` (a
    collator that only stacks cannot batch examples of different lengths at all)."""
    padding = getattr(trainer.data_collator, "padding", True)
    return not (padding == "max_length" or getattr(padding, "value", None) == "max_length")


def length_check(trainer: Any, batch_size: int) -> Optional[LengthCheck]:
    """What the Trainer's data says about lengths, or ``None`` when it cannot tell. The
    probes' batches are the dataset's first ``batch_size`` examples (cycled), padded to the
    longest of them."""
    key, lengths = trainer_lengths(trainer)
    if not lengths:
        return None
    probe_length = max(lengths[:max(1, batch_size)])
    return LengthCheck(key, tuple(lengths), probe_length, _pads_dynamically(trainer))


def _resized(example: Mapping[str, Any], key: str, length: int) -> dict[str, Any]:
    """The example with every field as long as ``example[key]`` tiled or cut to ``length``
    (token ids, attention mask, labels); other fields (a class label) as they are."""
    found = _length(example)
    n = found[1] if found is not None else 0
    out: dict[str, Any] = {}
    for k, v in example.items():
        shape = getattr(v, "shape", None)
        size = int(shape[0]) if shape is not None and len(shape) >= 1 else (
            len(v) if isinstance(v, (list, tuple)) else None)
        if size == n and n > 0:
            reps = -(-length // n)
            if shape is not None:
                import torch

                v = torch.cat([v] * reps)[:length] if reps > 1 else v[:length]
            else:
                v = (list(v) * reps)[:length]
        out[k] = v
    return out


class TrainerLengthSample:
    """``sample(n, length)`` from the Trainer's own data: ``n`` examples (cycled), each resized
    to ``length`` (:func:`_resized`), through the Trainer's collator."""

    def __init__(self, trainer: Any, key: str):
        from dptune.integrations.transformers import trainer_sample

        self.inner = trainer_sample(trainer)
        self.key = key

    def __call__(self, n: int, length: int) -> Any:
        examples = [_resized(ex, self.key, length) for ex in self.inner._examples(n)]
        batch = self.inner.collator(examples)
        return dict(batch) if isinstance(batch, Mapping) else batch


def plan_trainer_lengths(trainer: Any, buckets: Any = 8, *, simulate: Any = None,
                         headroom: Any = "1GiB", **options: Any) -> Any:
    """A :class:`dptune.lengths.LengthPlan` for a ``transformers.Trainer``: the train
    dataset's lengths, batches from its own examples and collator at each bucket's length,
    its model, optimizer and step settings (as :func:`tune_trainer` reads them). ``options``
    go to :func:`dptune.lengths.plan_lengths` (``pad_to_multiple_of``, ``max_probes``, ...)."""
    from dptune.errors import UsageError
    from dptune.integrations.transformers import trainer_optimizer, trainer_step_settings
    from dptune.lengths.search import plan_lengths

    key, lengths = trainer_lengths(trainer)
    if not lengths:
        raise UsageError("the Trainer's train dataset has no input_ids (or other sequence) "
                         "lengths dptune can read; pass the lengths to plan_lengths yourself")
    settings = trainer_step_settings(trainer.args)
    pad = getattr(trainer.data_collator, "pad_to_multiple_of", None)
    options.setdefault("pad_to_multiple_of", pad)
    return plan_lengths(trainer.model, TrainerLengthSample(trainer, key), lengths, buckets,
                        optimizer=options.pop("optimizer", None) or trainer_optimizer(trainer),
                        simulate=simulate, headroom=headroom, amp=settings.amp,
                        accumulate=settings.accumulate, clip_grad_norm=settings.clip_grad_norm,
                        **options)
