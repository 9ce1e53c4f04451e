"""The Hugging Face ``Trainer``: tune its DataParallel split, then train with it.

The ``transformers`` Trainer wraps the model in ``nn.DataParallel`` whenever several GPUs are
visible and the script is not started with ``torchrun`` (``Trainer._wrap_model``), draws
``per_device_train_batch_size × n_gpu`` samples per forward pass, and averages the replicas'
losses without weights (``training_step``: ``loss.mean()``). This module tunes that step and
trains with the result::

    from dptune.integrations.transformers import BalancedTrainer, tune_trainer

    trainer = Trainer(model=model, args=args, train_dataset=ds, data_collator=collator)
    result = tune_trainer(trainer)                 # probes the Trainer's own step
    trainer = BalancedTrainer(model=model, args=args, train_dataset=ds,
                              data_collator=collator, tuned=result)
    trainer.train()

- :func:`tune_trainer` builds the workload from the Trainer itself: its model, batches from its
  train dataset and data collator (the dataset is cycled when it is smaller than a probe's
  batch), the optimizer ``args.optim`` names, and the step's settings (``bf16``/``fp16`` →
  autocast, ``gradient_accumulation_steps``, ``max_grad_norm``, activation checkpointing).
- :class:`BalancedTrainer` (or :class:`BalancedTrainerMixin` on another Trainer subclass, such
  as sentence-transformers') wraps the model in :class:`~dptune.BalancedDataParallel` with the
  tuned split instead of ``nn.DataParallel``, draws batches of the split's total, and weights
  the replicas' losses by their samples. With one GPU, no GPU, or under ``torchrun`` it is
  exactly the plain Trainer.

Needs ``transformers`` (``pip install 'dptune[hf]'``); ``import dptune`` never imports it.

Known limitations:

- The probes run the Trainer's own ``compute_loss`` (:class:`TrainerLoss`) on the wrapped
  model, as ``training_step`` does: with ``label_smoothing_factor``, a ``compute_loss_func`` or
  an overridden ``compute_loss`` the labels are popped and the loss is computed on the outputs
  gathered onto card 0, and that is what the split is tuned for. A ``loss_fn=`` or ``step=``
  given to :func:`tune_trainer` replaces it (the result's note says so).
- Optimizers that ``args.optim`` builds from the whole model (GaLore, LOMO, Muon-style
  factories, bitsandbytes 8-bit) cannot be built for a probe; pass ``optimizer=`` (a factory
  ``params -> Optimizer``) to :func:`tune_trainer`.
"""

from __future__ import annotations

import dataclasses
import warnings
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Optional, Union

try:
    import transformers
except ImportError as err:  # pragma: no cover - exercised only without the extra
    raise ImportError("dptune.integrations.transformers needs the transformers package: "
                      "pip install 'dptune[hf]'") from err

from dptune.errors import UsageError
from dptune.types import Objective
from dptune.integrations.dataparallel import Tuned, chunk_sizes_of, patch_dataparallel
from dptune.integrations.trainer_workload import (
    TrainerLoss, TrainerOptimizer, TrainerSample, checkpointing, trainer_optimizer,
    trainer_sample, trainer_step_settings,
)

if TYPE_CHECKING:  # pragma: no cover
    from dptune.lengths.plan import LengthPlan
    from dptune.result.model import TuneResult

__all__ = ["tune_trainer", "BalancedTrainer", "BalancedTrainerMixin", "TrainerSample",
           "TrainerOptimizer", "TrainerLoss", "trainer_step_settings", "trainer_sample",
           "trainer_optimizer"]


@dataclass(frozen=True)
class _ProbeStep:
    """What the probes run besides the model: the optimizer, the loss (``None``: the
    Trainer's own ``compute_loss``) and the notes that say where each came from."""

    optimizer: Any
    loss_fn: Any
    own_loss: bool
    notes: tuple[str, ...]


def _check_trainer(trainer: Any, tuner_options: dict) -> None:
    if not isinstance(trainer, transformers.Trainer):
        raise UsageError(f"tune_trainer expects a transformers.Trainer, got {type(trainer).__name__}")
    for knob in ("amp", "accumulate", "clip_grad_norm"):
        if knob in tuner_options:
            raise UsageError(f"tune_trainer reads {knob} from the Trainer's arguments; set it in "
                             "TrainingArguments (bf16/fp16, gradient_accumulation_steps, "
                             "max_grad_norm) instead")
    if trainer.model is None:
        raise UsageError("the Trainer has no model (model_init is called only by train()); "
                         "build the Trainer with model=")


def _probe_step(trainer: Any, tuner_options: dict) -> _ProbeStep:
    """The optimizer and loss the probes run (popped from ``tuner_options`` when given)."""
    notes: list[str] = []
    optimizer = tuner_options.pop("optimizer", None)
    if optimizer is None:
        built = trainer_optimizer(trainer)
        optimizer = built
        notes.append(f"optimizer: {built.name} ({built.cls.__name__}), as the Trainer builds it")
    loss_fn = tuner_options.pop("loss_fn", None)
    own_loss = loss_fn is None and tuner_options.get("step") is None
    if not own_loss:
        notes.append("loss: the loss_fn/step given to tune_trainer, not the Trainer's "
                     "compute_loss")
    return _ProbeStep(optimizer, loss_fn, own_loss, tuple(notes))


def _cards_and_batch(trainer: Any, tuner_options: dict, device_ids: Any, simulate: Any,
                     batch_size: Optional[int], objective: str = "balance") -> tuple[dict, int, list[str]]:
    """The cards for the tuner (decided once here: they decide the default batch, unless the
    caller gave a backend of its own and the batch), the batch, and a note on the batch."""
    from dptune.tuner import choose_backend

    choice = (choose_backend(device_ids, simulate)
              if tuner_options.get("backend") is None or batch_size is None else None)
    cards_given = ({"choice": choice} if choice is not None
                   else {"device_ids": device_ids, "simulate": simulate})
    if batch_size is not None:
        return cards_given, batch_size, []
    assert choice is not None
    per_device = int(trainer.args.per_device_train_batch_size)
    batch_size = per_device * choice.cards
    given = f"per_device_train_batch_size {per_device} x {choice.cards} cards"
    if Objective.parse(objective) is Objective.MAX_BATCH:   # the batch is where the search starts
        return cards_given, batch_size, [f"batch: the search started at {batch_size} samples "
                                         f"per forward pass ({given})"]
    return cards_given, batch_size, [f"batch: {batch_size} samples per forward pass ({given})"]


def tune_trainer(trainer: Any, *, objective: str = "balance", simulate: Any = None,
                 headroom: Union[int, str, None] = None, batch_size: Optional[int] = None,
                 **tuner_options: Any) -> "TuneResult":
    """Tune the DataParallel split of a ``transformers.Trainer``'s own training step.

    - The model is ``trainer.model``; batches come from ``trainer.train_dataset`` through
      ``trainer.data_collator`` (:class:`TrainerSample`); the optimizer is the one the Trainer
      would build (:func:`trainer_optimizer`); ``bf16``/``fp16``,
      ``gradient_accumulation_steps``, ``max_grad_norm`` and activation checkpointing are the
      step's settings (checkpointing is on for the probes only).
    - ``batch_size`` (per forward pass, over all cards): by default
      ``per_device_train_batch_size × cards``; with ``objective="max_batch"``, the start.
    - ``simulate``: a cluster spec such as ``"4x24GB"``; without it the visible GPUs are probed
      (``device_ids=`` picks some), or the simulated ``4x24GB`` when there is none.
    - The loss is the Trainer's own ``compute_loss`` on the wrapped model (:class:`TrainerLoss`);
      ``loss_fn=`` or ``step=`` replaces it. Other ``tuner_options`` go to :class:`dptune.Tuner`.

    Returns a :class:`~dptune.TuneResult` for :class:`BalancedTrainer` (``tuned=``); the Trainer,
    its model and its arguments are left as they were. When the collator pads each batch to
    its longest and the lengths vary, it warns: plan per bucket with
    :func:`dptune.integrations.trainer_lengths.tune_trainer_lengths` instead.
    """
    from dptune.tuner import Tuner, _notice

    _check_trainer(trainer, tuner_options)
    step = _probe_step(trainer, tuner_options)
    device_ids = tuner_options.pop("device_ids", None)
    search = tuner_options.get("search")
    verbose = search.verbose if search is not None else tuner_options.pop("verbose", True)
    looks = {} if search is not None else {"verbose": verbose}
    cards_given, batch_size, batch_note = _cards_and_batch(trainer, tuner_options, device_ids,
                                                           simulate, batch_size, objective)
    settings = trainer_step_settings(trainer.args)
    with checkpointing(trainer.model, trainer.args):
        tuner = Tuner(trainer.model, trainer_sample(trainer), batch_size=batch_size,
                      loss_fn=step.loss_fn, optimizer=step.optimizer, **cards_given,
                      objective=objective, headroom=headroom, **looks, amp=settings.amp,
                      accumulate=settings.accumulate, clip_grad_norm=settings.clip_grad_norm,
                      **tuner_options)
        if step.own_loss:   # the Trainer's compute_loss in place of model(**batch) and a loss_fn
            tuner.workload = dataclasses.replace(tuner.workload, compute_loss=TrainerLoss(trainer))
        result = tuner.fit()
    for note in (*step.notes, *batch_note):   # on the terminal too, as the tuner's own notices
        _notice(note, verbose)
        if note not in result.notes:
            result.notes.append(note)
    _warn_lengths(trainer, sum(result.chunk_sizes), result)
    return result


def _warn_lengths(trainer: Any, batch_size: int, result: Any) -> None:
    """Never tune silently at one length when the collator pads to each batch's longest."""
    from dptune.errors import DptuneWarning
    from dptune.lengths.trainer import length_check

    check = length_check(trainer, batch_size)
    if check is not None and check.varies:
        result.notes.append(check.message())
        warnings.warn(check.message(), DptuneWarning, stacklevel=3)


# ---- training with the result --------------------------------------------------------------

class BalancedTrainerMixin:
    """Train with a tuned split: mix into a ``transformers.Trainer`` subclass before it.

    With ``tuned=`` (a :class:`~dptune.TuneResult`, a report folder or a list of chunk sizes)
    and ``args.n_gpu > 1`` (several visible GPUs, no ``torchrun``):

    - the model is wrapped in :class:`~dptune.BalancedDataParallel` with the tuned split where
      the Trainer would build ``nn.DataParallel`` (so quantized models, which the Trainer does
      not wrap, stay unwrapped);
    - each forward pass draws ``sum(chunk_sizes)`` samples instead of
      ``per_device_train_batch_size × n_gpu`` (a last batch of another size is split in the same
      proportions);
    - the replicas' losses are combined into the batch's loss: per-replica mean losses weighted
      by each replica's samples (:meth:`BalancedDataParallel.reduce`), or, where the Trainer
      normalizes by the batch's item count (``num_items_in_batch``), added up as the Trainer
      does for DataParallel, also when a card got no samples.

    Otherwise (one GPU, no GPU, ``torchrun``, or no ``tuned``) it is exactly the Trainer, with
    a warning when a split was given but is not used.

    With ``plan=`` instead (a :class:`dptune.lengths.LengthPlan` for these cards, or the
    ``lengths.json`` / report folder it was saved to; see
    :mod:`dptune.integrations.trainer_lengths`): the train dataloader draws its batches with
    :class:`dptune.lengths.BucketBatchSampler` (each within one length bucket, of that bucket's
    planned size; an epoch covers every sample once) and, with several GPUs, the model is
    wrapped in ``BalancedDataParallel(plan=plan)``, which splits each batch as its bucket's plan
    says (evaluation stays the Trainer's: ``nn.DataParallel``, even split). On one GPU or the
    CPU the plan must be for one card.
    """

    def __init__(self, *args: Any, tuned: Optional[Tuned] = None, plan: Any = None,
                 **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._init_balance(tuned, plan)

    def _init_balance(self, tuned: Optional[Tuned], plan: Any) -> None:
        """The split or the length plan, checked against this Trainer's cards (also what
        :func:`dptune.integrations.trainer_lengths.with_length_plan` runs on a built Trainer)."""
        from dptune.integrations.trainer_buckets import trainer_plan

        if tuned is not None and plan is not None:
            raise UsageError("give tuned= (one split) or plan= (a split per length bucket), "
                             "not both")
        self.length_plan: Optional["LengthPlan"] = (
            None if plan is None else trainer_plan(self, plan))
        self.tuned_chunk_sizes: Optional[list[int]] = (
            None if tuned is None else chunk_sizes_of(tuned))
        self._check_settings(tuned)
        self.balanced: bool = self._uses_split()
        if self.balanced or self.length_plan is not None:
            self._train_batch_size = self._balanced_batch_size()

    def _check_settings(self, tuned: Optional[Tuned]) -> None:
        """A :class:`~dptune.DptuneWarning` when ``tuned`` (a result or a report folder) was
        tuned for another step than these arguments describe, as ``TuneResult.wrap`` warns."""
        import os

        from dptune.result.model import TuneResult, _warn_settings

        if isinstance(tuned, (str, os.PathLike)):
            tuned = TuneResult.load(os.fspath(tuned))
        if not isinstance(tuned, TuneResult):
            return   # a list of chunk sizes says nothing of the step
        args = self.args  # type: ignore[attr-defined]
        mine = trainer_step_settings(args)
        where = f"the report at {tuned.source!r}" if tuned.source else "the result"
        _warn_settings(tuned.settings, self.model, where,  # type: ignore[attr-defined]
                       amp=mine.amp, accumulate=mine.accumulate,
                       clip_grad_norm=mine.clip_grad_norm,
                       gradient_checkpointing=mine.gradient_checkpointing)

    # ---- when the split applies ------------------------------------------------------------
    def _uses_split(self) -> bool:
        if self.length_plan is not None:   # its cards were checked: wrap when there are several
            return self.args.n_gpu > 1  # type: ignore[attr-defined]
        sizes = self.tuned_chunk_sizes
        if sizes is None:
            return False
        n_gpu = self.args.n_gpu  # type: ignore[attr-defined]
        if n_gpu <= 1:
            if len(sizes) > 1:
                warnings.warn(
                    f"BalancedTrainer: this process trains on {max(n_gpu, 0)} GPU(s) "
                    "(one GPU, no GPU, or one process per GPU under torchrun), so the tuned "
                    f"split {sizes} is not used and training is the plain Trainer's", stacklevel=3)
            return False
        model = self.model  # type: ignore[attr-defined]
        if getattr(model, "is_loaded_in_8bit", False) or getattr(model, "is_loaded_in_4bit", False):
            return False  # the Trainer does not wrap quantized models in DataParallel
        if len(sizes) != n_gpu:
            raise UsageError(
                f"the tuned split {sizes} is for {len(sizes)} GPUs but this Trainer uses {n_gpu} "
                f"(all visible GPUs); set CUDA_VISIBLE_DEVICES to {len(sizes)} cards, or tune again "
                "on these cards with tune_trainer(trainer)")
        return True

    def _balanced_batch_size(self) -> int:
        """The tuned total, or with a length plan its largest bucket's batch."""
        if self.length_plan is not None:
            return max(b.batch_size for b in self.length_plan.buckets)
        return sum(self.tuned_chunk_sizes or [])

    # ---- Trainer hooks ---------------------------------------------------------------------
    def _wrap_model(self, model: Any, training: bool = True, dataloader: Any = None) -> Any:
        # a length plan is for the training step and its buckets: evaluation batches
        # (per_device_eval_batch_size x n_gpu, no gradients) are split as the Trainer splits them
        if not self.balanced or (self.length_plan is not None and not training):
            return super()._wrap_model(model, training, dataloader)  # type: ignore[misc]
        with patch_dataparallel(self.length_plan or self.tuned_chunk_sizes):
            return super()._wrap_model(model, training, dataloader)  # type: ignore[misc]

    def get_train_dataloader(self) -> Any:
        if self.length_plan is not None:
            from dptune.integrations.trainer_buckets import bucket_dataloader

            return bucket_dataloader(self, self.length_plan)
        loader = super().get_train_dataloader()  # type: ignore[misc]
        if self.balanced:
            drawn = _loader_batch_size(loader)
            total = self._balanced_batch_size()
            if drawn is not None and drawn != total:
                from dptune.split import scale_split

                warnings.warn(
                    f"{type(self).__name__}: its train dataloader draws {drawn} samples per forward "
                    f"pass (its own batch size rule), not the tuned total {total}; each batch is "
                    f"split in the tuned proportions, {scale_split(self.tuned_chunk_sizes or [], drawn)}",
                    stacklevel=2)
        return loader

    def _hp_search_setup(self, trial: Any) -> None:
        super()._hp_search_setup(trial)  # type: ignore[misc]
        if self.balanced:  # a search trial resets the batch to per_device x n_gpu
            self._train_batch_size = self._balanced_batch_size()

    def _get_num_items_in_batch(self, batch_samples: list, device: Any) -> Any:
        count = super()._get_num_items_in_batch(batch_samples, device)  # type: ignore[misc]
        import torch

        if self.balanced and torch.is_tensor(count) and count.dim() > 0:
            # For nn.DataParallel the Trainer repeats the count once per card so that the
            # even scatter hands each replica one copy; BalancedDataParallel splits every
            # tensor by the tuned split, so every replica gets the number itself instead.
            count = count.reshape(-1)[0].item()
        return count

    def compute_loss(self, model: Any, inputs: Any, return_outputs: bool = False,
                     num_items_in_batch: Any = None) -> Any:
        if not self.balanced:
            return super().compute_loss(model, inputs, return_outputs=return_outputs,  # type: ignore[misc]
                                        num_items_in_batch=num_items_in_batch)
        with warnings.catch_warnings():
            # the wrapper's advice to weight per-replica losses: combine_replica_losses does
            warnings.filterwarnings("ignore", message="BalancedDataParallel: forward returned a scalar")
            out = super().compute_loss(model, inputs, return_outputs=return_outputs,  # type: ignore[misc]
                                       num_items_in_batch=num_items_in_batch)
        loss, outputs = out if return_outputs else (out, None)
        loss = self.combine_replica_losses(model, loss, num_items_in_batch)
        return (loss, outputs) if return_outputs else loss

    def combine_replica_losses(self, model: Any, loss: Any, num_items_in_batch: Any) -> Any:
        """The batch's loss from the vector of per-replica losses the wrapper gathered.

        A scalar (a loss computed on the gathered outputs) is returned as it is.
        """
        from dptune.parallel import BalancedDataParallel

        if not isinstance(model, BalancedDataParallel) or loss.dim() != 1:
            return loss
        if num_items_in_batch is not None and self.model_accepts_loss_kwargs:  # type: ignore[attr-defined]
            # Each replica divided the sum of its items' losses by the batch's item count (and
            # the Trainer scaled it as for nn.DataParallel, where its mean() follows): over all
            # n_gpu cards that is the sum divided by n_gpu, whatever the split, and a card
            # that got no samples contributes nothing.
            return loss.sum() / self.args.n_gpu  # type: ignore[attr-defined]
        return model.reduce(loss)


def _loader_batch_size(loader: Any) -> Optional[int]:
    """Samples per batch of a (possibly accelerate-prepared) DataLoader, where it says."""
    for attr in ("total_batch_size", "batch_size"):
        try:
            value = getattr(loader, attr, None)
        except (AttributeError, TypeError):
            value = None
        if isinstance(value, int):
            return value
    sampler = getattr(loader, "batch_sampler", None)
    value = getattr(sampler, "batch_size", None)
    return value if isinstance(value, int) else None


class BalancedTrainer(BalancedTrainerMixin, transformers.Trainer):
    """``transformers.Trainer`` that trains with a tuned split (see :class:`BalancedTrainerMixin`).

    ``BalancedTrainer(model=..., args=..., train_dataset=..., tuned=result)``; every other
    argument is the Trainer's.
    """


def __getattr__(name: str) -> Any:
    """``MemoryMonitorCallback`` (the training monitor's callback) is imported on first use."""
    if name == "MemoryMonitorCallback":
        from dptune.integrations.monitor_transformers import MemoryMonitorCallback

        return MemoryMonitorCallback
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
