"""The Hugging Face Trainer with variable lengths: tell when one length would be tuned.

A Trainer whose collator pads each batch to its longest example (``DataCollatorWithPadding``
and the like, or ``group_by_length``) trains at many lengths; a split tuned on the first
examples of the dataset holds at their length only. :func:`length_check` reads the train
dataset's lengths and says so (never silently): ``tune_trainer`` warns with it, and
:func:`trainer_lengths` hands the lengths to :func:`dptune.lengths.plan_lengths`
(:func:`dptune.integrations.trainer_lengths.tune_trainer_lengths` plans for a Trainer and
hands back one that trains with the plan).
This module reads data only: nothing here imports the integrations above it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping, Optional, Sequence

__all__ = ["LengthCheck", "trainer_lengths", "length_check", "LENGTH_KEYS"]

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
                f"out of memory. Plan a batch per length bucket and train with it: "
                "trainer = dptune.integrations.trainer_lengths.tune_trainer_lengths(trainer, "
                "buckets=8, ...), or `dptune search --hf-trainer MODULE:FUNC --lengths`")


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
