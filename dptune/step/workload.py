"""What a probe runs: the user's training step, described once for both backends.

A :class:`Workload` holds the model, how to build a batch, the loss, the optimizer factory and
the step's settings (:class:`StepSettings`: mixed precision, gradient accumulation, gradient
clipping, or the user's own step function). :func:`run_step` is the step both backends run,
so a probe means the same thing on real and virtual cards. The built-in step is a plain
training loop::

    for batch in micro_batches:                   # accumulate=N micro-batches
        with torch.autocast("cuda", dtype):       # amp="bf16" | "fp16"
            output = model(*args, **kwargs)       # model: DataParallel over the split
            loss = loss_fn(output, batch) / N
        scaler.scale(loss).backward()             # a GradScaler for fp16 only
    scaler.unscale_(optimizer)                    # fp16 with clipping
    clip_grad_norm_(params, max_norm)             # clip_grad_norm=max_norm
    scaler.step(optimizer); scaler.update()       # optimizer.step() without fp16

``output`` is kept alive as a plain loop keeps it: through its own backward, until the next
micro-batch's forward has returned, and through the optimizer step after the last one.
``step=fn`` replaces all of this with ``fn(model, batch, optimizer)``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import warnings
from dataclasses import dataclass
from typing import (TYPE_CHECKING, Any, Callable, ContextManager, Iterable, Iterator, Mapping,
                    Optional, Union)

from dptune.step.advice import CACHE_MARK
from dptune.errors import DptuneWarning, UsageError, UserCodeError

if TYPE_CHECKING:  # pragma: no cover
    import torch

__all__ = ["Workload", "StepSettings", "StepRuntime", "StepOutcome", "run_step", "AMP_DTYPES", "batch_to_args",
           "default_loss", "has_batchnorm", "BATCHNORM_MIN_CHUNK", "min_chunk", "smallest_chunk",
           "model_name", "function_name", "unwrap_parallel",
           "UnwrappingFactory"]

ModelLike = Union["torch.nn.Module", Callable[[], "torch.nn.Module"]]
StepFn = Callable[[Any, Any, Any], None]

#: ``amp=`` values and the autocast dtype each one names.
AMP_DTYPES = {"bf16": "bfloat16", "fp16": "float16"}


def function_name(fn: Any) -> str:
    """``"module:qualname"`` of a function, as reports and ``--step`` name it."""
    module = getattr(fn, "__module__", None) or "?"
    name = getattr(fn, "__qualname__", None) or getattr(fn, "__name__", None) or type(fn).__name__
    return f"{module}:{name}"


#: The most micro-batches per step (``accumulate``), and why.
MAX_ACCUMULATE = 1024
ACCUMULATE_BOUND = (f"at most {MAX_ACCUMULATE} micro-batches per step: every probe runs each one, "
                    "and the memory peak does not grow after the second, so a smaller number "
                    "gives the same split sooner")


@dataclass(frozen=True)
class StepSettings:
    """What a split was tuned for: the training step's settings that change its memory.

    Stored in ``TuneResult.settings``, ``report.json`` and the summary, so a split is not
    reused for another step unnoticed (``TuneResult.wrap`` compares them).
    """

    amp: Optional[str] = None              # None | "bf16" | "fp16"
    accumulate: int = 1                    # micro-batches per optimizer step
    clip_grad_norm: Optional[float] = None
    step: Optional[str] = None             # the user's step function's "module:qualname"
    gradient_checkpointing: bool = False   # read from the model (HF is_gradient_checkpointing)

    def __post_init__(self) -> None:
        if self.amp is not None and self.amp not in AMP_DTYPES:
            raise UsageError(f"amp must be None, 'bf16' or 'fp16', got {self.amp!r}")
        if isinstance(self.accumulate, bool) or not isinstance(self.accumulate, int) or self.accumulate < 1:
            raise UsageError(f"accumulate must be an int >= 1 (micro-batches per optimizer step), "
                             f"got {self.accumulate!r}")
        if self.accumulate > MAX_ACCUMULATE:
            raise UsageError(f"accumulate={self.accumulate}: {ACCUMULATE_BOUND}")
        if self.clip_grad_norm is not None:
            c = self.clip_grad_norm
            if isinstance(c, bool) or not isinstance(c, (int, float)) or not (c > 0 and math.isfinite(c)):
                raise UsageError(f"clip_grad_norm must be a positive number (the max norm), got {c!r}")
        if self.step is not None and not isinstance(self.step, str):
            raise UsageError(f"step must be the step function's 'module:qualname', got {self.step!r}")
        if not isinstance(self.gradient_checkpointing, bool):
            raise UsageError(f"gradient_checkpointing must be true or false, got {self.gradient_checkpointing!r}")

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: Optional[Mapping[str, Any]]) -> "StepSettings":
        if not d:
            return cls()
        kw = {k: d[k] for k in ("amp", "accumulate", "clip_grad_norm", "step",
                                "gradient_checkpointing") if k in d}
        return cls(**kw)

    def describe(self) -> str:
        """One line, e.g. ``"bf16 autocast, accumulate 2, clip 1.0"`` or ``"fp32"``."""
        if self.step:
            parts = [f"step {self.step}"]
        else:
            parts = [f"{self.amp} autocast" if self.amp else "fp32"]
            if self.accumulate > 1:
                parts.append(f"accumulate {self.accumulate}")
            if self.clip_grad_norm is not None:
                parts.append(f"clip {self.clip_grad_norm:g}")
        if self.gradient_checkpointing:
            parts.append("gradient checkpointing")
        return ", ".join(parts)

    def differences(self, other: "StepSettings") -> list[str]:
        """``"amp: bf16 (report) vs None (given)"``-style lines for each field that differs."""
        out = []
        for f in dataclasses.fields(self):
            a, b = getattr(self, f.name), getattr(other, f.name)
            if a != b:
                out.append(f"{f.name}: {a!r} vs {b!r}")
        return out


def unwrap_parallel(model: "torch.nn.Module") -> "torch.nn.Module":
    """The module inside a ``DataParallel``/``BalancedDataParallel``/``DistributedDataParallel``
    (any number of them), with a one-line :class:`DptuneWarning` when there was a wrapper:
    dptune probes the module itself and wraps it in its own ``BalancedDataParallel``."""
    from dptune.checkpoint import unwrap

    inner = unwrap(model)
    if inner is not model:
        warnings.warn(
            f"the model is wrapped in {type(model).__name__}; dptune tunes the module inside it "
            f"(model.module, a {type(inner).__name__}) and wraps that in its own "
            "BalancedDataParallel", DptuneWarning, stacklevel=3)
    return inner


class UnwrappingFactory:
    """A model factory whose model is taken out of any ``DataParallel``-style wrapper
    (see :func:`unwrap_parallel`); it keeps the factory's name for reports."""

    def __init__(self, factory: Callable[[], "torch.nn.Module"]) -> None:
        self.factory = factory
        self.__name__ = model_name(factory)

    def __call__(self) -> "torch.nn.Module":
        import torch

        model = self.factory()
        return unwrap_parallel(model) if isinstance(model, torch.nn.Module) else model


@dataclass
class Workload:
    """The user's training step, as given to ``Tuner`` or ``estimate_memory``.

    - ``model``: an ``nn.Module``, or a zero-argument factory that builds one (the simulated
      backend calls it on the ``meta`` device, so it may describe a model far larger than
      this machine's memory).
    - ``sample(batch_size)``: builds one batch. A tensor is passed as ``model(x)``, a tuple
      or list as ``model(*batch)``, a dict as ``model(**batch)``. With variable lengths the
      user's ``sample(batch_size, length)`` is given as a
      :class:`dptune.lengths.LengthSample` (``sample(n)`` at its current ``length``, checked
      along the length axis): fixed-shape workloads are unchanged.
    - ``loss_fn(output, batch)``: the scalar loss; ``None`` means :func:`default_loss`.
    - ``optimizer``: a factory ``params -> torch.optim.Optimizer``; ``None`` means no
      optimizer (no optimizer state, no step).
    - ``amp``: ``None`` (fp32), ``"bf16"`` or ``"fp16"``: the forward and the loss under
      ``torch.autocast("cuda", dtype)``, with a ``torch.amp.GradScaler`` for fp16.
    - ``accumulate``: micro-batches per optimizer step, each of the probe's batch size and
      split (the batch size stays per forward pass, as ``per_device_train_batch_size``).
    - ``clip_grad_norm``: ``torch.nn.utils.clip_grad_norm_`` to this max norm before the step.
    - ``step``: the user's own step, ``step(model, batch, optimizer) -> None``, which replaces
      the built-in one (see :func:`run_step`): ``model`` is already wrapped for DataParallel,
      ``batch`` is ``sample(batch_size)``, ``optimizer`` is built from the factory (or None).
    - ``compute_loss``: ``compute_loss(model, batch) -> loss``, the forward and the loss in one
      call (a Hugging Face Trainer's ``compute_loss``) in place of ``model(**batch)`` and
      ``loss_fn``; the output lives only inside it. Amp, accumulation and clipping still apply.
    """

    model: ModelLike
    sample: Callable[[int], Any]
    loss_fn: Optional[Callable[[Any, Any], Any]] = None
    optimizer: Optional[Callable[[Iterable[Any]], Any]] = None
    amp: Optional[str] = None
    accumulate: int = 1
    clip_grad_norm: Optional[float] = None
    step: Optional[StepFn] = None
    compute_loss: Optional[Callable[[Any, Any], Any]] = None

    def __post_init__(self) -> None:
        import torch

        if self.compute_loss is not None and (self.loss_fn is not None or self.step is not None):
            raise UsageError("compute_loss= runs the forward and the loss itself; drop loss_fn= "
                             "and step=")

        StepSettings(amp=self.amp, accumulate=self.accumulate, clip_grad_norm=self.clip_grad_norm)
        if self.step is not None:
            if not callable(self.step):
                raise UsageError("step must be a function step(model, batch, optimizer) -> None, "
                                 f"got {type(self.step).__name__}")
            given = [n for n, v in (("amp", self.amp), ("clip_grad_norm", self.clip_grad_norm))
                     if v is not None] + (["accumulate"] if self.accumulate != 1 else [])
            if given:
                raise UsageError(
                    f"step= replaces the built-in step, so {', '.join(given)} would be ignored; "
                    "do the autocast, accumulation or clipping inside your step function")
            if self.loss_fn is not None:
                raise UsageError("step= replaces the built-in step, so loss_fn would be ignored; "
                                 "compute the loss inside your step function")
        if not isinstance(self.model, torch.nn.Module) and not callable(self.model):
            raise UsageError(
                f"model must be an nn.Module or a zero-argument factory, got {type(self.model).__name__}")
        if isinstance(self.model, torch.nn.Module):
            self.model = unwrap_parallel(self.model)
        elif not isinstance(self.model, UnwrappingFactory):
            self.model = UnwrappingFactory(self.model)
        if not callable(self.sample):
            raise UsageError(
                "sample must be a function batch_size -> batch (a tensor, tuple or dict), "
                f"got {type(self.sample).__name__}")
        if self.loss_fn is not None and not callable(self.loss_fn):
            raise UsageError("loss_fn must be callable as loss_fn(output, batch) -> scalar tensor")
        if self.optimizer is not None and not callable(self.optimizer):
            raise UsageError(
                "optimizer must be a factory params -> torch.optim.Optimizer, "
                "e.g. lambda p: torch.optim.AdamW(p, lr=1e-4)")

    @property
    def is_factory(self) -> bool:
        import torch

        return not isinstance(self.model, torch.nn.Module)

    @property
    def settings(self) -> StepSettings:
        """The step's settings; gradient checkpointing is read from a model given as a module."""
        import torch

        ckpt = False
        if isinstance(self.model, torch.nn.Module):
            ckpt = gradient_checkpointing(self.model)
        return StepSettings(amp=self.amp, accumulate=self.accumulate,
                            clip_grad_norm=None if self.clip_grad_norm is None else float(self.clip_grad_norm),
                            step=None if self.step is None else function_name(self.step),
                            gradient_checkpointing=ckpt)

    def loss(self, output: Any, batch: Any) -> "torch.Tensor":
        fn = self.loss_fn or default_loss
        return fn(output, batch)


def batch_to_args(batch: Any) -> tuple[tuple, dict]:
    """How a batch is passed to the model: tensor -> (x,), tuple/list -> *batch, dict -> **batch."""
    if isinstance(batch, dict):
        return (), dict(batch)
    if isinstance(batch, (tuple, list)):
        return tuple(batch), {}
    return (batch,), {}


def _find_loss(output: Any) -> Any:
    if isinstance(output, dict):
        return output.get("loss")
    loss = getattr(output, "loss", None)
    if loss is not None:
        return loss
    return None


def default_loss(output: Any, batch: Any = None) -> "torch.Tensor":
    """The loss when none is given.

    The model's own loss when its output has one (``output.loss`` or ``output["loss"]``;
    per-replica losses gathered by DataParallel are averaged), else the sum of every
    floating-point tensor in the output.
    """
    loss = _find_loss(output)
    if loss is not None:
        return loss.mean() if loss.dim() > 0 else loss
    from dptune.step import tree as _tree

    leaves = [t for t in _tree.leaves(output) if t.is_floating_point() and t.requires_grad]
    if not leaves:
        raise UsageError(
            "the model's output has no floating-point tensor that requires grad, so there is "
            "nothing to backpropagate; pass loss_fn=(output, batch) -> loss")
    total = leaves[0].sum()
    for t in leaves[1:]:
        total = total + t.sum()
    return total


def has_batchnorm(module: "torch.nn.Module") -> bool:
    """True when the module has a BatchNorm layer (a chunk of 1 sample breaks it in training)."""
    import torch.nn as nn

    kinds = (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d, nn.SyncBatchNorm)
    return any(isinstance(m, kinds) for m in module.modules())


#: The fewest samples (0 aside) a card or rank gets under BatchNorm: one sample has no batch
#: statistics to normalise with in training.
BATCHNORM_MIN_CHUNK = 2


def min_chunk(batchnorm: bool) -> int:
    """The fewest samples (0 aside) a card or rank may get: :data:`BATCHNORM_MIN_CHUNK` where
    a BatchNorm layer takes its statistics from those samples alone, else 1."""
    return BATCHNORM_MIN_CHUNK if batchnorm else 1


def smallest_chunk(model: ModelLike, *, across_ranks: bool = False) -> int:
    """The one rule for the fewest samples a card (or, ``across_ranks``, a DDP rank) may get
    (:func:`min_chunk`): in one process every BatchNorm layer takes its statistics from the
    card's own samples (:func:`has_batchnorm`, SyncBatchNorm included: it syncs nothing
    outside a process group); across DDP ranks SyncBatchNorm gathers every rank's, so only
    the plain layers count. A model factory is built on the meta device; raises
    :class:`dptune.errors.UserCodeError` where it raises."""
    import torch
    import torch.nn as nn

    if not isinstance(model, nn.Module):
        try:
            with torch.device("meta"):
                model = model()
        except Exception as e:
            raise UserCodeError(f"the model factory raised while building the model on the meta "
                                f"device: {type(e).__name__}: {e}") from e
    if not across_ranks:
        return min_chunk(has_batchnorm(model))
    plain = (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d)
    return min_chunk(any(isinstance(m, plain) and not isinstance(m, nn.SyncBatchNorm)
                         for m in model.modules()))


def model_name(model: ModelLike) -> str:
    """A short name for reports: the class name, or the factory's name."""
    import torch

    if isinstance(model, torch.nn.Module):
        return type(model).__name__
    return str(getattr(model, "__name__", None) or getattr(type(model), "__name__", "model"))


def gradient_checkpointing(module: "torch.nn.Module") -> bool:
    """Whether the model says it checkpoints activations (HF ``is_activation_checkpointing``,
    formerly ``is_gradient_checkpointing``)."""
    for name in ("is_activation_checkpointing", "is_gradient_checkpointing"):
        if hasattr(type(module), name):
            with warnings.catch_warnings():    # the older name is deprecated in transformers 5
                warnings.simplefilter("ignore", FutureWarning)
                flag = getattr(module, name, False)
            return flag if isinstance(flag, bool) else False
    return False


# --------------------------------------------------------------------------------------------
# The step both backends run
# --------------------------------------------------------------------------------------------
@dataclass
class StepRuntime:
    """What a backend gives :func:`run_step`.

    - ``model``: the user's model wrapped for DataParallel over the probe's split;
    - ``optimizer``: built from the workload's factory, or None;
    - ``next_batch()``: the next micro-batch, as the model takes it;
    - ``batch_for_loss(batch)``: the batch as the loss sees it (on the output device);
    - ``phase(name)``: a context for each part of the step ("forward", "loss", "backward",
      "clip", "optimizer", "step"); backends charge memory and name errors by it;
    - ``device_type``: the autocast device (``"cuda"`` on both backends);
    - ``scaler_device``: the device a ``GradScaler`` is built for.
    """

    model: Any
    optimizer: Any
    next_batch: Callable[[], Any]
    batch_for_loss: Callable[[Any], Any] = lambda batch: batch
    phase: Callable[[str], ContextManager[Any]] = lambda name: contextlib.nullcontext()
    device_type: str = "cuda"
    scaler_device: str = "cuda"


@dataclass(frozen=True)
class StepOutcome:
    """What :func:`run_step` saw: the output entries the loss never read.

    ``unread_outputs`` holds ``(entry, bytes)`` per top-level entry of the model's output
    (e.g. ``"output['past_key_values']"``) whose tensors require grad but got no gradient from
    the loss: DataParallel gathers them onto the output card all the same. Bytes are those of
    the whole batch's tensors. ``None`` when the user's own step function ran.
    """

    unread_outputs: Optional[tuple[tuple[str, int], ...]] = None


def _watch_reads(output: Any) -> Callable[[], tuple[tuple[str, int], ...]]:
    """Hooks on the output's tensors; the returned function lists the entries never read."""
    from dptune.step import tree as _tree

    read: set[str] = set()
    sizes: dict[str, int] = {}
    caches = _cache_entries(output)
    for path, t in _tree.tensors(output, "output"):
        if not t.requires_grad:
            continue
        entry = _entry(path)
        if entry in caches:
            entry += CACHE_MARK
        sizes[entry] = sizes.get(entry, 0) + t.numel() * t.element_size()
        t.register_hook(lambda g, entry=entry: read.add(entry))

    def unread() -> tuple[tuple[str, int], ...]:
        return tuple((e, b) for e, b in sizes.items() if e not in read)
    return unread


def _is_cache(value: Any) -> bool:
    """Whether ``value`` is a ``transformers`` ``Cache`` (checked without importing transformers)."""
    return any(c.__name__ == "Cache" and c.__module__.startswith("transformers")
               for c in type(value).__mro__)


def _cache_entries(output: Any) -> set[str]:
    """The top-level entries of the output holding a cache, named as :func:`_tree.tensors` names
    their paths (a dict, a HF ``ModelOutput``, by key; a named tuple or a dataclass by field; a
    list or a tuple by position)."""
    from dptune.step import tree as _tree

    if isinstance(output, dict):
        items: list[tuple[str, Any]] = [(f"output[{k!r}]", v) for k, v in output.items()]
    elif _tree.is_namedtuple(output):
        items = [(f"output.{f}", v) for f, v in zip(output._fields, output)]
    elif isinstance(output, (list, tuple)):
        items = [(f"output[{i}]", v) for i, v in enumerate(output)]
    elif dataclasses.is_dataclass(output) and not isinstance(output, type):
        items = [(f"output.{f.name}", getattr(output, f.name)) for f in dataclasses.fields(output)]
    else:
        items = []
    return {name for name, v in items if _is_cache(v)}


def _entry(path: str) -> str:
    """``"output['past_key_values'][3][0]"`` -> ``"output['past_key_values']"``."""
    import re

    m = re.match(r"output(\[[^\]]*\]|\.\w+)?", path)
    return m.group(0) if m else path


def run_step(wl: Workload, rt: StepRuntime) -> StepOutcome:
    """One training step as described by ``wl`` (see the module docstring).

    With ``wl.step`` set, that function runs instead: ``wl.step(rt.model, batch, rt.optimizer)``.
    Gradients are expected to be ``None`` on entry (as after ``zero_grad()``).
    """
    import torch

    if wl.step is not None:
        batch = rt.next_batch()
        with rt.phase("step"):
            wl.step(rt.model, batch, rt.optimizer)
        return StepOutcome()
    dtype = getattr(torch, AMP_DTYPES[wl.amp]) if wl.amp else None
    scaler = None
    if wl.amp == "fp16" and rt.optimizer is not None:
        scaler = torch.amp.GradScaler(rt.scaler_device)
    n = wl.accumulate
    output: Any = None
    loss: Any = None
    unread: Callable[[], tuple[tuple[str, int], ...]] = tuple
    for _ in range(n):
        batch = rt.next_batch()
        if wl.compute_loss is not None:
            loss, unread = _computed_loss(wl.compute_loss, rt, batch, dtype)
            del batch
            if n > 1:
                loss = loss / n
            with rt.phase("backward"):
                (scaler.scale(loss) if scaler is not None else loss).backward()
            continue
        args, kwargs = batch_to_args(batch)
        with rt.phase("forward"):
            with _autocast(rt.device_type, dtype), _watch_no_grad_checkpoint() as no_grad_ckpt:
                new_output = rt.model(*args, **kwargs)
        del args, kwargs
        output = new_output            # the previous micro-batch's output lives until here
        del new_output
        unread = _watch_reads(output)
        with rt.phase("loss"):
            loss = _loss(wl, output, rt.batch_for_loss(batch), rt.device_type, dtype,
                         bool(no_grad_ckpt))
            if n > 1:
                loss = loss / n
        del batch
        with rt.phase("backward"):
            (scaler.scale(loss) if scaler is not None else loss).backward()
    _update(wl, rt, scaler)
    del output, loss
    return StepOutcome(unread_outputs=unread() if n else ())


def _update(wl: Workload, rt: StepRuntime, scaler: Any) -> None:
    """The end of the built-in step: gradient clipping (if asked) and the optimizer's step,
    through the GradScaler under fp16 autocast."""
    import torch

    params = [p for p in rt.model.parameters() if p.grad is not None]
    if wl.clip_grad_norm is not None:
        with rt.phase("clip"):
            if scaler is not None:
                scaler.unscale_(rt.optimizer)
            torch.nn.utils.clip_grad_norm_(params, float(wl.clip_grad_norm))
    if rt.optimizer is not None:
        with rt.phase("optimizer"):
            if scaler is not None:
                scaler.step(rt.optimizer)
                scaler.update()
            else:
                rt.optimizer.step()


def _loss(wl: Workload, output: Any, batch: Any, device_type: str, dtype: Any,
          no_grad_ckpt: bool) -> Any:
    """The step's loss, a scalar tensor; a reentrant checkpoint that cut the gradient off
    (``no_grad_ckpt``, see :func:`_watch_no_grad_checkpoint`) is named as the cause."""
    import torch

    try:
        with _autocast(device_type, dtype):
            loss = wl.loss(output, batch)
    except UsageError:
        if no_grad_ckpt:
            raise UsageError(REENTRANT_NO_GRAD) from None
        raise
    if not isinstance(loss, torch.Tensor) or loss.dim() != 0:
        raise UsageError("the loss must be a scalar tensor; got "
                         f"{type(loss).__name__}{tuple(getattr(loss, 'shape', ()))}")
    if no_grad_ckpt and not loss.requires_grad:
        raise UsageError(REENTRANT_NO_GRAD)
    return loss


#: What ``torch.utils.checkpoint`` warns when a reentrant checkpoint's inputs all lack
#: ``requires_grad`` (``check_backward_validity``).
_NO_GRAD_INPUTS = "None of the inputs have requires_grad=True"

REENTRANT_NO_GRAD = (
    "the loss does not require grad: a reentrant activation checkpoint "
    "(torch.utils.checkpoint with use_reentrant=True) got inputs none of which require grad "
    "(e.g. the batch itself), so PyTorch computes no gradient through it (torch warns \"None "
    "of the inputs have requires_grad=True\"); checkpoint with use_reentrant=False (HF: "
    "model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={\"use_reentrant\": "
    "False})), or make the checkpointed block's input require grad (HF: "
    "model.enable_input_require_grads())")

_shown_no_grad_inputs: list[bool] = []


@contextlib.contextmanager
def _watch_no_grad_checkpoint() -> Iterator[list[bool]]:
    """Records (in the list it yields) whether a reentrant checkpoint in the forward got no
    input that requires grad, from torch's own warning; the warning itself is still shown,
    once per process."""
    import re

    seen: list[bool] = []
    with warnings.catch_warnings():
        warnings.filterwarnings("always", message=re.escape(_NO_GRAD_INPUTS))
        show = warnings.showwarning

        def record(message: Any, category: Any, filename: str, lineno: int, file: Any = None,
                   line: Optional[str] = None) -> None:
            if not str(message).startswith(_NO_GRAD_INPUTS):
                show(message, category, filename, lineno, file, line)
                return
            seen.append(True)
            if not _shown_no_grad_inputs:
                _shown_no_grad_inputs.append(True)
                show(message, category, filename, lineno, file, line)

        warnings.showwarning = record
        yield seen
class _PhasedModel:
    """The wrapped model as ``compute_loss`` gets it: its forward runs in the "forward" phase,
    and the entries of its outputs the loss never reads are watched (every call's: a
    sentence-transformers loss calls the model once per text column)."""

    def __init__(self, model: Any, rt: StepRuntime) -> None:
        self._model, self._rt = model, rt
        self._watches: list[Callable[[], tuple[tuple[str, int], ...]]] = []

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        with self._rt.phase("forward"):
            output = self._model(*args, **kwargs)
        self._watches.append(_watch_reads(output))
        return output

    def unread(self) -> tuple[tuple[str, int], ...]:
        return tuple(entry for watch in self._watches for entry in watch())

    def __getattr__(self, name: str) -> Any:
        return getattr(self._model, name)


def _computed_loss(compute_loss: Callable[[Any, Any], Any], rt: StepRuntime, batch: Any,
                   dtype: Any) -> tuple[Any, Callable[[], tuple[tuple[str, int], ...]]]:
    """``compute_loss(model, batch)`` in the "loss" phase, its forward in the "forward" one."""
    import torch

    model = _PhasedModel(rt.model, rt)
    with rt.phase("loss"):
        with _autocast(rt.device_type, dtype):
            loss = compute_loss(model, batch)
        if not isinstance(loss, torch.Tensor) or loss.dim() != 0:
            raise UsageError("compute_loss must return a scalar tensor; got "
                             f"{type(loss).__name__}{tuple(getattr(loss, 'shape', ()))}")
    return loss, model.unread


def _autocast(device_type: str, dtype: Any) -> ContextManager[Any]:
    import torch

    if dtype is None:
        return contextlib.nullcontext()
    return torch.autocast(device_type, dtype=dtype)
