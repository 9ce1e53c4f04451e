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

import contextlib
import dataclasses
import warnings
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Iterator, Mapping, Optional, Union

try:
    import transformers
except ImportError as err:  # pragma: no cover - exercised only without the extra
    raise ImportError("dptune.integrations.transformers needs the transformers package: "
                      "pip install 'dptune[hf]'") from err

from dptune.errors import UsageError
from dptune.integrations.dataparallel import Tuned, chunk_sizes_of, patch_dataparallel

if TYPE_CHECKING:  # pragma: no cover
    import torch

    from dptune.result import TuneResult
    from dptune.workload import StepSettings

__all__ = ["tune_trainer", "BalancedTrainer", "BalancedTrainerMixin", "TrainerSample",
           "TrainerOptimizer", "TrainerLoss", "trainer_step_settings"]


# ---- the workload, read from a Trainer ---------------------------------------------------

@dataclass
class TrainerSample:
    """``sample(n)`` for probes: ``n`` examples of the Trainer's train dataset, collated by its
    data collator with the columns the Trainer would drop removed, as a plain dict.

    Map-style datasets are indexed ``0, 1, ...`` and cycled when ``n`` exceeds their length;
    iterable datasets are read once and their examples cycled.
    """

    dataset: Any
    collator: Callable[[list], Any]
    _seen: list = field(default_factory=list, repr=False)
    _iterator: Optional[Iterator[Any]] = field(default=None, repr=False)
    _exhausted: bool = field(default=False, repr=False)

    def _examples(self, n: int) -> list:
        if hasattr(self.dataset, "__getitem__") and hasattr(self.dataset, "__len__"):
            size = len(self.dataset)
            if size == 0:
                raise UsageError("the Trainer's train_dataset is empty; dptune needs examples to "
                                 "build the probes' batches")
            return [self.dataset[i % size] for i in range(n)]
        while len(self._seen) < n and not self._exhausted:
            if self._iterator is None:
                self._iterator = iter(self.dataset)
            try:
                self._seen.append(next(self._iterator))
            except StopIteration:
                self._exhausted = True
        if not self._seen:
            raise UsageError("the Trainer's train_dataset yielded no example; dptune needs "
                             "examples to build the probes' batches")
        return [self._seen[i % len(self._seen)] for i in range(n)]

    def __call__(self, n: int) -> Any:
        batch = self.collator(self._examples(n))
        # BatchEncoding is a Mapping but not a dict: the model takes it as **batch either way
        return dict(batch) if isinstance(batch, Mapping) else batch


def trainer_sample(trainer: Any) -> TrainerSample:
    """The Trainer's train dataset and collator, as the Trainer's own dataloader uses them."""
    dataset = trainer.train_dataset
    if dataset is None:
        raise UsageError("the Trainer has no train_dataset; dptune builds the probes' batches "
                         "from it (pass train_dataset= when building the Trainer)")
    collator = trainer.data_collator
    try:
        import datasets
    except ImportError:
        datasets = None
    if _is_sentence_transformers(trainer):
        # its dataloader keeps every column (its collator tokenizes the text columns) and
        # draws each batch from one dataset of a DatasetDict: the first one stands for all
        if datasets is not None and isinstance(dataset, datasets.DatasetDict):
            dataset = next(iter(dataset.values()))
        return TrainerSample(dataset, collator)
    if datasets is not None and isinstance(dataset, datasets.Dataset):
        dataset = trainer._remove_unused_columns(dataset, description="training")
    else:
        collator = trainer._get_collator_with_removed_columns(collator, description="training")
    return TrainerSample(dataset, collator)


def _is_sentence_transformers(trainer: Any) -> bool:
    """Whether ``trainer`` is a sentence-transformers trainer (its loss takes the features of
    each text column and the labels; its model's forward takes one features dict)."""
    return any(c.__module__.startswith("sentence_transformers.") for c in type(trainer).__mro__)


@dataclass(frozen=True)
class TrainerOptimizer:
    """``optimizer(params)`` for probes: the class and keyword arguments the Trainer would use.

    ``name`` is what ``args.optim`` (or the user's optimizer) called it, for the notes.
    """

    cls: type
    kwargs: Mapping[str, Any]
    name: str

    def __call__(self, params: Any) -> Any:
        return self.cls(params, **dict(self.kwargs))


def trainer_optimizer(trainer: Any) -> TrainerOptimizer:
    """The optimizer the Trainer builds in ``create_optimizer``: the one it was given, else
    ``optimizer_cls_and_kwargs``, else the one ``args.optim`` names. Learning rate and weight
    decay do not change memory; the optimizer's kind (and ``fused``/``foreach``) does."""
    import torch

    if trainer.optimizer is not None:
        opt = trainer.optimizer
        return TrainerOptimizer(type(opt), dict(opt.defaults), type(opt).__name__)
    if getattr(trainer, "optimizer_cls_and_kwargs", None) is not None:
        cls, kwargs = trainer.optimizer_cls_and_kwargs
        name = getattr(cls, "__name__", str(cls))
    elif _is_sentence_transformers(trainer):
        # its override only groups the loss's parameters for weight decay (optimizer_dict);
        # the optimizer itself is the one transformers' rule names
        cls, kwargs = transformers.Trainer.get_optimizer_cls_and_kwargs(trainer.args, trainer.model)
        name = str(getattr(trainer.args.optim, "value", trainer.args.optim))
    else:
        cls, kwargs = trainer.get_optimizer_cls_and_kwargs(trainer.args, trainer.model)
        name = str(getattr(trainer.args.optim, "value", trainer.args.optim))
    kwargs = dict(kwargs)
    builds_from_model = {"params", "model", "optimizer_dict"} & set(kwargs)
    if not (isinstance(cls, type) and issubclass(cls, torch.optim.Optimizer)) or builds_from_model:
        raise UsageError(f"the Trainer's optimizer {name!r} is built from the whole model, so "
                         "dptune cannot build it for a probe; pass optimizer=<params -> Optimizer> "
                         "to tune_trainer (e.g. lambda p: torch.optim.AdamW(p)), one with the same "
                         "state per parameter")
    return TrainerOptimizer(cls, kwargs, name)


@dataclass(frozen=True)
class TrainerLoss:
    """``compute_loss(model, batch)`` for probes: the Trainer's step up to its loss.

    As ``Trainer.training_step``: the batch is moved to the card the model's weights are on
    (``_prepare_inputs``: ``args.device``, card 0 of DataParallel), ``trainer.compute_loss``
    runs on the wrapped model under ``compute_loss_context_manager()``, and a vector of
    per-replica losses is averaged (``loss.mean()`` with several GPUs). ``num_items_in_batch``
    is the number of label entries, a bound of the Trainer's count (the count does not change
    memory, and counting would read the labels' values).
    """

    trainer: Any

    def __call__(self, model: Any, batch: Any) -> Any:
        import torch

        from dptune import _tree

        if not isinstance(batch, Mapping):
            raise UsageError("the Trainer's data collator must build a dict of the model's "
                             f"inputs; got {type(batch).__name__}")
        device = next(iter(model.parameters())).device
        inputs = _tree.map_tensors(lambda t: t.to(device), dict(batch))
        labels = inputs.get("labels")
        count = int(labels.numel()) if isinstance(labels, torch.Tensor) else None
        trainer = self.trainer
        view = _as_data_parallel(model)
        with trainer.compute_loss_context_manager(), _model_in_loss(trainer, view):
            loss = trainer.compute_loss(view, inputs, num_items_in_batch=count)
        del inputs
        if isinstance(loss, tuple):     # a compute_loss that returns (loss, outputs) anyway
            loss = loss[0]
        return loss.mean() if isinstance(loss, torch.Tensor) and loss.dim() > 0 else loss


@contextlib.contextmanager
def _model_in_loss(trainer: Any, view: Any) -> Iterator[None]:
    """sentence-transformers' losses hold the model they call; its ``compute_loss`` puts the
    wrapped model in them when it is given ``trainer.model_wrapped``. For the block, the probe's
    wrapped model is that; afterwards the losses hold their own model again."""
    if not _is_sentence_transformers(trainer):
        yield
        return
    import torch

    losses = trainer.loss.values() if isinstance(trainer.loss, Mapping) else [trainer.loss]
    held = [(m, m._modules["model"]) for loss in losses if isinstance(loss, torch.nn.Module)
            for m in loss.modules() if "model" in m._modules]
    wrapped = trainer.model_wrapped
    trainer.model_wrapped = view
    try:
        yield
    finally:
        trainer.model_wrapped = wrapped
        for m, model in held:
            m.model = model  # type: ignore[assignment]


def _as_data_parallel(model: Any) -> Any:
    """The probe's wrapped model as the ``nn.DataParallel`` the Trainer builds: accelerate's
    ``unwrap_model`` finds the model through ``.module`` only in a DataParallel (label
    smoothing reads the model's class from it to shift causal-LM labels)."""
    import torch

    if isinstance(model, torch.nn.DataParallel) or not isinstance(
            getattr(model, "module", None), torch.nn.Module):
        return model

    class _DataParallelView(torch.nn.DataParallel):
        def __init__(self, wrapped: Any) -> None:
            torch.nn.Module.__init__(self)
            self.module = wrapped.module
            self.wrapped = wrapped

        def forward(self, *args: Any, **kwargs: Any) -> Any:
            return self.wrapped(*args, **kwargs)

    return _DataParallelView(model)


def trainer_step_settings(args: Any) -> "StepSettings":
    """The step settings ``TrainingArguments`` describe: ``bf16``/``fp16`` → amp,
    ``gradient_accumulation_steps``, ``max_grad_norm`` (the Trainer clips when it is > 0) and
    activation (gradient) checkpointing."""
    from dptune.workload import StepSettings

    amp = "bf16" if getattr(args, "bf16", False) else "fp16" if getattr(args, "fp16", False) else None
    clip = getattr(args, "max_grad_norm", None)
    return StepSettings(
        amp=amp, accumulate=int(getattr(args, "gradient_accumulation_steps", 1) or 1),
        clip_grad_norm=float(clip) if clip is not None and clip > 0 else None,
        gradient_checkpointing=_checkpointing_args(args)[0])


def _checkpointing_args(args: Any) -> tuple[bool, dict]:
    """Whether the Trainer turns activation checkpointing on, and the kwargs it passes."""
    on = getattr(args, "activation_checkpointing", None)
    kwargs = getattr(args, "activation_checkpointing_kwargs", None)
    if on is None:  # transformers before the rename
        on = getattr(args, "gradient_checkpointing", False)
        kwargs = getattr(args, "gradient_checkpointing_kwargs", None)
    return bool(on), dict(kwargs or {})


_CHECKPOINT_ATTRS = ("gradient_checkpointing", "_gradient_checkpointing_func",
                     "_require_grads_hooks", "_require_grads_hook")


@contextlib.contextmanager
def _checkpointing(model: "torch.nn.Module", args: Any) -> Iterator[None]:
    """Activation checkpointing on, as ``Trainer.train`` turns it on, for the block only.

    On exit every module's checkpointing attributes are as they were, and the input hook that
    enabling adds is removed.
    """
    wanted, kwargs = _checkpointing_args(args)
    if not wanted or bool(getattr(model, "is_activation_checkpointing", False)):
        yield
        return
    enable = getattr(model, "activation_checkpointing_enable", None)
    if enable is None:
        enable = getattr(model, "gradient_checkpointing_enable", None)
    if enable is None:
        raise UsageError(f"args say activation checkpointing, but {type(model).__name__} has no "
                         "activation_checkpointing_enable(); turn it off in TrainingArguments or "
                         "use a model that supports it")
    saved = {id(m): {a: m.__dict__[a] for a in _CHECKPOINT_ATTRS if a in m.__dict__}
             for m in model.modules()}
    hooks_before = list(model.__dict__.get("_require_grads_hooks") or [])
    every = kwargs.pop("every_n_layers", 1)
    offload = kwargs.pop("offload", False)
    if not kwargs.get("use_reentrant", False) and "context_fn" not in kwargs:
        kwargs.setdefault("use_reentrant", False)
        kwargs["context_fn"] = _recompute_as_forward
    try:
        if getattr(model, "activation_checkpointing_enable", None) is not None:
            enable(activation_checkpointing_kwargs=kwargs or None, every_n_layers=every,
                   offload=offload)
        else:
            enable(gradient_checkpointing_kwargs=kwargs or None)
        yield
    finally:
        for hook in model.__dict__.get("_require_grads_hooks") or []:
            if not any(hook is h for h in hooks_before):
                hook.remove()
        for m in model.modules():
            before = saved.get(id(m), {})
            for a in _CHECKPOINT_ATTRS:
                if a in before:
                    setattr(m, a, before[a])
                elif a in m.__dict__:
                    delattr(m, a)


def _recompute_as_forward() -> tuple:
    """``context_fn`` of a non-reentrant checkpoint: the recomputation runs under the
    torch-function modes and the CUDA autocast state the forward ran under.

    Autograd runs the backward, where the recomputation happens, without torch-function modes,
    and the checkpoint restores autocast only for the inputs' device. The simulated cluster's
    attention and dropout emulation is such a mode, and its tensors sit on the CPU while
    ``torch.autocast("cuda")`` is emulated; without this the recomputation would run other
    kernels in another precision and save other tensors than the forward (a CheckpointError).
    On real cards no mode is active and the autocast state is the one the checkpoint restores.
    """
    import torch

    from dptune._torch_private import function_mode_stack

    amp = torch.is_autocast_enabled("cuda")
    dtype = torch.get_autocast_dtype("cuda") if amp else None
    return contextlib.nullcontext(), _entered(function_mode_stack(), dtype)


@contextlib.contextmanager
def _entered(modes: list, amp_dtype: Any) -> Iterator[None]:
    import torch

    with contextlib.ExitStack() as stack:
        for mode in modes:
            stack.enter_context(mode)
        if amp_dtype is not None:
            stack.enter_context(torch.autocast("cuda", dtype=amp_dtype))
        yield


def tune_trainer(trainer: Any, *, objective: str = "balance", simulate: Any = None,
                 headroom: Union[int, str, None] = None, batch_size: Optional[int] = None,
                 **tuner_options: Any) -> "TuneResult":
    """Tune the DataParallel split of a ``transformers.Trainer``'s own training step.

    - The model is ``trainer.model``; batches come from ``trainer.train_dataset`` through
      ``trainer.data_collator`` (see :class:`TrainerSample`); the optimizer is the one the
      Trainer would build (:func:`trainer_optimizer`); ``args.bf16``/``args.fp16``,
      ``gradient_accumulation_steps``, ``max_grad_norm`` and activation checkpointing are the
      step's settings (checkpointing is turned on for the probes and off again afterwards).
    - ``batch_size`` (per forward pass, the total over the cards): by default what the Trainer
      splits in one forward pass, ``per_device_train_batch_size × cards``. With
      ``objective="max_batch"`` it is where the search starts.
    - ``simulate``: a cluster spec such as ``"4x24GB"``; without it the visible GPUs are probed
      (``device_ids=`` picks some), or the simulated ``4x24GB`` when there is none.
    - The loss is the Trainer's own: its ``compute_loss`` on the wrapped model
      (:class:`TrainerLoss`), with label smoothing, ``compute_loss_func`` or a subclass's
      ``compute_loss``; ``loss_fn=`` or ``step=`` replaces it.
    - ``tuner_options`` go to :class:`dptune.Tuner` (``device_ids``, ``max_probes``,
      ``verbose``, ``loss_fn``, ``optimizer``, ``budget_level``, ...); ``headroom`` ``None``:
      the budget level's default (256 MiB at the default level, reserved).

    Returns a :class:`~dptune.TuneResult`; pass it to :class:`BalancedTrainer` as ``tuned=``.
    The Trainer, its model and its arguments are left as they were.
    """
    from dptune.tuner import Tuner, choose_backend

    if not isinstance(trainer, transformers.Trainer):
        raise UsageError(f"tune_trainer expects a transformers.Trainer, got {type(trainer).__name__}")
    for knob in ("amp", "accumulate", "clip_grad_norm"):
        if knob in tuner_options:
            raise UsageError(f"tune_trainer reads {knob} from the Trainer's arguments; set it in "
                             "TrainingArguments (bf16/fp16, gradient_accumulation_steps, "
                             "max_grad_norm) instead")
    args = trainer.args
    model = trainer.model
    if model is None:
        raise UsageError("the Trainer has no model (model_init is called only by train()); "
                         "build the Trainer with model=")
    settings = trainer_step_settings(args)
    sample = trainer_sample(trainer)
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
    device_ids = tuner_options.pop("device_ids", None)
    verbose = tuner_options.pop("verbose", True)
    # the cards, decided once here: they decide the default batch, and the tuner uses them
    # (unless the caller gave a backend of its own and the batch)
    choice = (choose_backend(device_ids, simulate)
              if tuner_options.get("backend") is None or batch_size is None else None)
    cards_given = ({"choice": choice} if choice is not None
                   else {"device_ids": device_ids, "simulate": simulate})
    if batch_size is None:
        assert choice is not None
        cards = choice.cards
        per_device = int(args.per_device_train_batch_size)
        batch_size = per_device * cards
        notes.append(f"batch: {batch_size} samples per forward pass "
                     f"(per_device_train_batch_size {per_device} x {cards} cards)")
    with _checkpointing(model, args):
        tuner = Tuner(model, sample, batch_size=batch_size, loss_fn=loss_fn, optimizer=optimizer,
                      **cards_given, objective=objective,
                      headroom=headroom, verbose=verbose, amp=settings.amp,
                      accumulate=settings.accumulate, clip_grad_norm=settings.clip_grad_norm,
                      **tuner_options)
        if own_loss:   # the Trainer's compute_loss in place of model(**batch) and a loss_fn
            tuner.workload = dataclasses.replace(tuner.workload, compute_loss=TrainerLoss(trainer))
        result = tuner.fit()
    from dptune.tuner import _notice

    for note in notes:   # on the terminal too, as the tuner's own notices
        _notice(note, verbose)
    result.notes.extend(n for n in notes if n not in result.notes)
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
    """

    def __init__(self, *args: Any, tuned: Optional[Tuned] = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.tuned_chunk_sizes: Optional[list[int]] = (
            None if tuned is None else chunk_sizes_of(tuned))
        self._check_settings(tuned)
        self.balanced: bool = self._uses_split()
        if self.balanced:
            self._train_batch_size = self._balanced_batch_size()

    def _check_settings(self, tuned: Optional[Tuned]) -> None:
        """A :class:`~dptune.DptuneWarning` when ``tuned`` (a result or a report folder) was
        tuned for another step than these arguments describe, as ``TuneResult.wrap`` warns."""
        import os

        from dptune.result import TuneResult, _warn_settings

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
        return sum(self.tuned_chunk_sizes or [])

    # ---- Trainer hooks ---------------------------------------------------------------------
    def _wrap_model(self, model: Any, training: bool = True, dataloader: Any = None) -> Any:
        if not self.balanced:
            return super()._wrap_model(model, training, dataloader)  # type: ignore[misc]
        with patch_dataparallel(self.tuned_chunk_sizes):
            return super()._wrap_model(model, training, dataloader)  # type: ignore[misc]

    def get_train_dataloader(self) -> Any:
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
