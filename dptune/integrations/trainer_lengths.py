"""A plan per length bucket for a Hugging Face ``Trainer``: its own data, collator, model,
optimizer and step settings (the integration's side of :mod:`dptune.lengths.trainer`)."""

from __future__ import annotations

from typing import Any, Mapping

from dptune.errors import UsageError
from dptune.integrations.transformers import trainer_optimizer, trainer_sample, trainer_step_settings
from dptune.lengths.trainer import _length, trainer_lengths

__all__ = ["TrainerLengthSample", "plan_trainer_lengths"]


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
        self.inner = trainer_sample(trainer)
        self.key = key

    def __call__(self, n: int, length: int) -> Any:
        examples = [_resized(ex, self.key, length) for ex in self.inner._examples(n)]
        batch = self.inner.collator(examples)
        return dict(batch) if isinstance(batch, Mapping) else batch


def plan_trainer_lengths(trainer: Any, buckets: Any = 8, *, simulate: Any = None,
                         headroom: Any = None, **options: Any) -> Any:
    """A :class:`dptune.lengths.LengthPlan` for a ``transformers.Trainer``: the train
    dataset's lengths, batches from its own examples and collator at each bucket's length,
    its model, optimizer and step settings (as :func:`tune_trainer` reads them). ``options``
    go to :func:`dptune.lengths.plan_lengths` (``pad_to_multiple_of``, ``max_probes``, ...)."""
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
