"""A plan per length bucket for a Hugging Face ``Trainer``, and a Trainer that trains with it.

The integration's side of :mod:`dptune.lengths.trainer`::

    from dptune.integrations.trainer_lengths import tune_trainer_lengths

    trainer = Trainer(model=model, args=args, train_dataset=ds,
                      data_collator=DataCollatorWithPadding(tok))
    trainer = tune_trainer_lengths(trainer, buckets=8, simulate="4x24GB")  # plans, hands back
    print("\n".join(trainer.length_plan.lines()))
    trainer.train()        # batches within buckets, each of its bucket's planned size

- :func:`plan_trainer_lengths`: a :class:`dptune.lengths.LengthPlan` from the Trainer's own
  data (every example's length; the probes' batches are its examples resized to each
  bucket's length, through its collator), model, optimizer and step settings.
- :func:`with_length_plan`: the Trainer (same model, arguments, data, collator, callbacks and
  optimizers) mixed with :class:`~dptune.integrations.transformers.BalancedTrainerMixin`
  and the plan; ``BalancedTrainer(..., plan=plan)`` builds one directly.
- :func:`bucket_dataloader` (from :mod:`dptune.integrations.trainer_buckets`): the train
  dataloader such a Trainer uses: the Trainer's dataset (unused columns removed) and
  collator, batches from :class:`dptune.lengths.BucketBatchSampler` (seed ``args.data_seed``
  or ``args.seed``, ``dataloader_drop_last`` drops each bucket's short tail batch),
  reshuffled every epoch.

Limitations: a map-style train dataset whose examples' lengths dptune can read
(``input_ids`` or :data:`dptune.lengths.trainer.LENGTH_KEYS`); a DataParallel (or one-card)
plan: a DDP plan (``ddp=True``) and ``torchrun`` are refused, train those with the sampler in
your own loop.
"""

from __future__ import annotations

import copy
from typing import Any, Mapping

from dptune.errors import UsageError
from dptune.integrations.trainer_buckets import all_lengths, bucket_dataloader, trainer_plan
from dptune.integrations.trainer_workload import (
    TrainerLoss, checkpointing, trainer_optimizer, trainer_sample, trainer_step_settings,
)
from dptune.lengths.trainer import _length

__all__ = ["TrainerLengthSample", "plan_trainer_lengths", "tune_trainer_lengths",
           "with_length_plan", "bucket_dataloader", "trainer_plan", "all_lengths"]


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
        self.warned = False

    def __call__(self, n: int, length: int) -> Any:
        examples = [_resized(ex, self.key, length) for ex in self.inner._examples(n)]
        with _CountTorchCalls() as calls:
            batch = self.inner.collator(examples)
        if per_example_ops(calls.count, n) and not self.warned:
            import warnings

            from dptune.errors import DptuneWarning

            self.warned = True
            warnings.warn(DptuneWarning(
                f"the Trainer's collator made {calls.count:,} tensor calls for a batch of {n} "
                "examples (tensor operations example by example): on the simulated cards each "
                "is simulated one at a time, so a length plan may take many minutes; pad lists "
                "and build each tensor once per batch (e.g. tokenizer.pad(features, "
                "return_tensors='pt') on lists of token ids)"), stacklevel=2)
        return dict(batch) if isinstance(batch, Mapping) else batch


def per_example_ops(calls: int, n: int) -> bool:
    """Whether a collator's ``calls`` torch calls for ``n`` examples grow with the examples
    (at least one per example, past a constant for building a batch's few tensors): the
    slow path under a simulator, where every call is simulated."""
    return n >= 16 and calls >= n + 64


class _CountTorchCalls:
    """Counts the torch function calls (``torch.cat``, ``F.pad``, ``torch.tensor``, tensor
    methods) made inside it, passing each on unchanged."""

    def __init__(self) -> None:
        from dptune._torch_private import function_mode_base

        counter = self

        class _Mode(function_mode_base()):  # type: ignore[misc]
            def __torch_function__(self, func: Any, types: Any, args: Any = (),
                                   kwargs: Any = None) -> Any:
                counter.count += 1
                return func(*args, **(kwargs or {}))

        self.count = 0
        self._mode = _Mode()

    def __enter__(self) -> "_CountTorchCalls":
        self._mode.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._mode.__exit__(*exc)


def plan_trainer_lengths(trainer: Any, buckets: Any = 8, *, simulate: Any = None,
                         headroom: Any = None, lengths: Any = None, **options: Any) -> Any:
    """A :class:`dptune.lengths.LengthPlan` for a ``transformers.Trainer``: the train
    dataset's lengths, batches from its own examples and collator at each bucket's length,
    its model, optimizer, step settings and its own ``compute_loss`` (label smoothing, a
    ``compute_loss_func``, an overridden ``compute_loss``: :class:`TrainerLoss`, unless
    ``loss_fn=`` or ``step=`` is given), as :func:`tune_trainer` reads them. ``options``
    go to :func:`dptune.lengths.plan_lengths` (``pad_to_multiple_of``, ``max_probes``, ...);
    ``max_length`` is the model's ``max_position_embeddings`` (or ``n_positions``) by default.
    ``lengths``: the dataset's, when read already (:func:`all_lengths`)."""
    from dptune.lengths.search import plan_lengths

    if lengths is None:
        key, lengths = all_lengths(trainer)
    else:
        key = all_lengths(trainer, limit=1)[0]
    config = getattr(trainer.model, "config", None)
    longest = (getattr(config, "max_position_embeddings", None)
               or getattr(config, "n_positions", None))
    if isinstance(longest, int):
        options.setdefault("max_length", longest)
    settings = trainer_step_settings(trainer.args)
    pad = getattr(trainer.data_collator, "pad_to_multiple_of", None)
    options.setdefault("pad_to_multiple_of", pad)
    optimizer = options.pop("optimizer", None) or trainer_optimizer(trainer)
    if options.get("loss_fn") is None and options.get("step") is None:
        options.setdefault("compute_loss", TrainerLoss(trainer))  # the Trainer's step up to its loss
    with checkpointing(trainer.model, trainer.args):   # as the Trainer turns it on
        return plan_lengths(trainer.model, TrainerLengthSample(trainer, key), lengths, buckets,
                            optimizer=optimizer, simulate=simulate, headroom=headroom,
                            amp=settings.amp, accumulate=settings.accumulate,
                            clip_grad_norm=settings.clip_grad_norm, **options)


def tune_trainer_lengths(trainer: Any, buckets: Any = 8, *, simulate: Any = None,
                         headroom: Any = None, **options: Any) -> Any:
    """Plan per length bucket (:func:`plan_trainer_lengths`) and hand back a Trainer that
    trains with the plan (:func:`with_length_plan`); the plan is its ``length_plan``."""
    plan = plan_trainer_lengths(trainer, buckets, simulate=simulate, headroom=headroom, **options)
    return with_length_plan(trainer, plan)


def with_length_plan(trainer: Any, plan: Any) -> Any:
    """A Trainer like ``trainer`` that trains with ``plan`` (a :class:`LengthPlan`, or the
    file or report folder it was saved to): of ``trainer``'s class with
    :class:`~dptune.integrations.transformers.BalancedTrainerMixin` mixed in, sharing its model,
    arguments, data, collator, callbacks, optimizers and accelerator (train this one, not
    both). ``trainer`` itself is left as it was."""
    import transformers

    from dptune.integrations.transformers import BalancedTrainerMixin

    if not isinstance(trainer, transformers.Trainer):
        raise UsageError(f"with_length_plan expects a transformers.Trainer, got "
                         f"{type(trainer).__name__}")
    cls = type(trainer)
    if not issubclass(cls, BalancedTrainerMixin):
        cls = type(f"Balanced{cls.__name__}", (BalancedTrainerMixin, cls),
                   {"__module__": cls.__module__, "__qualname__": f"Balanced{cls.__qualname__}"})
    new = copy.copy(trainer)
    new.__class__ = cls
    new._init_balance(None, plan)  # type: ignore[attr-defined]
    return new
