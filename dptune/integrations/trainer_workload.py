"""The workload of a Hugging Face ``Trainer``: its batches, optimizer, loss and step settings.

What :func:`dptune.integrations.transformers.tune_trainer` and
:func:`dptune.integrations.trainer_lengths.plan_trainer_lengths` probe: batches from the
Trainer's train dataset through its data collator (:class:`TrainerSample`), the optimizer it
would build (:class:`TrainerOptimizer`), its own ``compute_loss`` (:class:`TrainerLoss`), and
the step's settings from ``TrainingArguments`` (:func:`trainer_step_settings`, activation
checkpointing for the probes' block: :func:`checkpointing`). Reads the Trainer; trains nothing.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Iterator, Mapping, Optional

try:
    import transformers
except ImportError as err:  # pragma: no cover - exercised only without the extra
    raise ImportError("dptune.integrations needs the transformers package for the Trainer: "
                      "pip install 'dptune[hf]'") from err

from dptune.errors import UsageError

if TYPE_CHECKING:  # pragma: no cover
    import torch

    from dptune.step.workload import StepSettings

__all__ = ["TrainerSample", "trainer_sample", "TrainerOptimizer", "trainer_optimizer",
           "TrainerLoss", "trainer_step_settings", "checkpointing", "is_sentence_transformers"]

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
    if is_sentence_transformers(trainer):
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


def is_sentence_transformers(trainer: Any) -> bool:
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
    elif is_sentence_transformers(trainer):
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

        from dptune.step import tree as _tree

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
    if not is_sentence_transformers(trainer):
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
    from dptune.step.workload import StepSettings

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
def checkpointing(model: "torch.nn.Module", args: Any) -> Iterator[None]:
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
