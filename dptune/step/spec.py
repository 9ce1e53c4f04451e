"""A training step named by strings: the one way from ``"mymod:Net"`` to a :class:`Workload`.

:class:`WorkloadSpec` is what ``dptune search`` and ``dptune plan`` build from their flags,
what an isolated CUDA probe pickles and rebuilds in its child process, and what a script can
hand to :meth:`dptune.Tuner.from_spec`. Every field is a string, a number or a mapping of
them, so the spec pickles; :meth:`WorkloadSpec.build` imports what the strings name and
returns the :class:`~dptune.step.workload.Workload` (the model as a factory: a simulated card
builds it on the meta device, a real one on the card). The callables it builds (model
factory, batch builders, optimizer factory) are small classes holding the same strings, so
the built workload pickles too.

Errors: a string that names nothing is an :class:`~dptune.errors.ImportStringError`, an
inconsistent spec a :class:`~dptune.errors.UsageError` (both exit 2); an exception raised by
the user's module while it imports is a :class:`~dptune.errors.UserCodeError` (exit 1)
chained to the original.
"""

from __future__ import annotations

import contextlib
import math
import sys
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Iterable, Iterator, Mapping, Optional

from dptune.errors import DptuneError, UsageError, UserCodeError
from dptune.step.importer import import_from_string
from dptune.step.presets import LOSSES, OPTIMIZERS, Named
from dptune.step.workload import Workload

if TYPE_CHECKING:  # pragma: no cover
    import torch

__all__ = ["WorkloadSpec", "RandomBatch", "DTYPES", "users_code", "import_users"]

#: ``dtype`` values for a batch given by its shape (``long``: token ids below ``vocab_size``).
DTYPES = ("float32", "float16", "bfloat16", "long")


# ---- the user's code ---------------------------------------------------------------------

@contextlib.contextmanager
def users_code(what: str, at_import: bool = False) -> Iterator[None]:
    """Exceptions raised by the user's code in this block become :class:`UserCodeError`
    (exit 1) chained to the original, whose traceback the command line shows. ``sys.exit()``
    in the user's code is one too: its code must not pass for one of dptune's exit codes."""
    try:
        yield
    except DptuneError:
        raise
    except SystemExit as e:
        if at_import:
            raise UserCodeError(
                f"{what}: the module exited (sys.exit({e.code!r})) while being imported; any "
                "output above is the module's own (e.g. its argparse reading the command line), not "
                "dptune's. Put module-level script code under `if __name__ == \"__main__\":`"
            ) from None
        raise UserCodeError(f"{what} called sys.exit({e.code!r}); dptune runs your code in its "
                            "own process, so it must return or raise, not exit") from None
    except Exception as e:
        raise UserCodeError(f"{what} raised {type(e).__name__}: {e}") from e


@contextlib.contextmanager
def _argv_of(module_name: str) -> Iterator[None]:
    """``sys.argv`` as a script run without arguments would see it: a module that parses the
    command line at import gets its own defaults, not dptune's flags."""
    saved = sys.argv
    sys.argv = [module_name]
    try:
        yield
    finally:
        sys.argv = saved


def import_users(import_str: str, what: str) -> Any:
    """The object ``"module:attribute"`` names, the module imported as the user's code
    (``what`` says which setting named it, e.g. ``"--model"``)."""
    module_name = import_str.partition(":")[0].strip()
    with users_code(f"importing {import_str!r} ({what})", at_import=True), _argv_of(module_name):
        return import_from_string(import_str)


# ---- the callables a spec builds (picklable: they hold strings) ----------------------------

class _ModelFactory:
    """``target(**kwargs)`` for ``"mymod:Net"``; a module-level ``nn.Module`` is used as is."""

    def __init__(self, import_str: str, kwargs: Mapping[str, Any]):
        self.import_str, self.kwargs = import_str, dict(kwargs)
        target = import_users(import_str, "--model")
        import torch

        if not callable(target) and not isinstance(target, torch.nn.Module):
            raise UsageError(f"--model {import_str!r} names a {type(target).__name__}; give a model "
                             "class or a function that returns an nn.Module")
        self.__name__ = self.__qualname__ = str(
            getattr(target, "__name__", None) or import_str.rpartition(":")[2])
        self.last: Any = None           # the model built last, for a ``.method`` batch

    def build(self) -> "torch.nn.Module":
        import torch

        target = import_from_string(self.import_str)
        if isinstance(target, torch.nn.Module):
            if self.kwargs:
                raise UsageError(f"--model {self.import_str!r} is an nn.Module instance, which "
                                 "takes no --model-kwargs; name its class or a factory instead")
            return target
        model = target(**self.kwargs)
        if not isinstance(model, torch.nn.Module):
            raise UsageError(f"--model {self.import_str!r} returned a {type(model).__name__}, "
                             "not a torch.nn.Module")
        return model

    def __call__(self) -> "torch.nn.Module":
        self.last = self.build()
        return self.last

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "last": None}     # a built model does not travel


class _MethodSample:
    """``model.<name>(batch_size)`` on the model the factory built last (a meta model when
    simulating: the method may read the model's settings, such as its vocabulary)."""

    def __init__(self, factory: _ModelFactory, name: str, kwargs: Mapping[str, Any]):
        self.factory, self.name, self.kwargs = factory, name, dict(kwargs)

        self._meta: Any = None

    def __call__(self, batch_size: int) -> Any:
        model = self.factory.last
        if model is None:    # asked before the backend built the model: read a meta one
            if self._meta is None:
                import torch

                with torch.device("meta"):
                    self._meta = self.factory.build()
            model = self._meta
        from dptune.checkpoint import unwrap

        return getattr(unwrap(model), self.name)(batch_size, **self.kwargs)

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_meta": None}


class _FunctionSample:
    """``make_batch(batch_size, **kwargs)`` for ``"mymod:make_batch"``."""

    def __init__(self, import_str: str, kwargs: Mapping[str, Any]):
        self.import_str, self.kwargs = import_str, dict(kwargs)
        self.__name__ = import_str.rpartition(":")[2]

    def __call__(self, batch_size: int) -> Any:
        return import_from_string(self.import_str)(batch_size, **self.kwargs)


@dataclass(frozen=True)
class RandomBatch:
    """``sample(batch_size)`` for a batch given by its shape: random floats, or token ids
    below ``vocab_size`` for ``long``. The values do not matter for memory, only shape and
    dtype."""

    shape: tuple[int, ...]
    dtype: str = "float32"
    vocab_size: Optional[int] = None

    def __call__(self, batch_size: int) -> "torch.Tensor":
        import torch

        size = (batch_size, *self.shape)
        if math.prod(size) >= 2**63:
            raise UsageError(f"a batch of {batch_size} samples of shape {self.shape} has "
                             f"{math.prod(size):.3g} elements, more than a tensor can hold; "
                             "lower --batch-size")
        if self.dtype == "long":
            return torch.randint(0, self.vocab_size or 2, size, dtype=torch.long)
        return torch.randn(size, dtype=getattr(torch, self.dtype))


class _OptimizerFactory:
    """``Optimizer(params, **kwargs)`` for ``"torch.optim:AdamW"`` or the user's factory."""

    def __init__(self, import_str: str, kwargs: Mapping[str, Any]):
        self.import_str, self.kwargs = import_str, dict(kwargs)
        self.__name__ = import_str.rpartition(":")[2]

    def __call__(self, params: Iterable[Any]) -> Any:
        return import_from_string(self.import_str)(params, **self.kwargs)


# ---- the spec ------------------------------------------------------------------------------

@dataclass(frozen=True)
class WorkloadSpec:
    """The user's training step by import strings (the command line's flags, one to one).

    - ``model``: ``"mymod:Net"``, a class or factory called as ``Net(**model_kwargs)``, or a
      module-level ``nn.Module`` instance.
    - the batch, one of: ``sample`` (``"mymod:make_batch"``, called as
      ``make_batch(batch_size, **sample_kwargs)``, or ``".method"``: that method of the built
      model, e.g. ``".sample_with_targets"``); ``input_shape`` (one sample's shape: ``randn``
      of ``dtype``, or token ids below ``vocab_size`` for ``dtype="long"``); neither: the
      model's own ``sample(batch_size)`` method.
    - ``loss``: a built-in name (``default``, ``sum``, ``mean``, ``cross_entropy``, ``mse``)
      or ``"mymod:loss"`` called as ``loss(output, batch)``.
    - ``optimizer``: a built-in name (``adamw``, ``adam``, ``sgd``, ``none``) or
      ``"torch.optim:SGD"`` / ``"mymod:make_opt"`` called as ``f(params, **optimizer_kwargs)``.
    - ``amp``, ``accumulate``, ``clip_grad_norm``: as :class:`~dptune.step.workload.Workload`;
      ``step``: ``"mymod:train_step"``, the user's own ``step(model, batch, optimizer)``.
    """

    model: str
    model_kwargs: Mapping[str, Any] = field(default_factory=dict)
    sample: Optional[str] = None
    sample_kwargs: Mapping[str, Any] = field(default_factory=dict)
    input_shape: Optional[tuple[int, ...]] = None
    dtype: Optional[str] = None
    vocab_size: Optional[int] = None
    loss: str = "default"
    optimizer: str = "adamw"
    optimizer_kwargs: Mapping[str, Any] = field(default_factory=dict)
    amp: Optional[str] = None
    accumulate: int = 1
    clip_grad_norm: Optional[float] = None
    step: Optional[str] = None

    def __post_init__(self) -> None:
        """The checks that need no import: a spec that cannot work fails here."""
        if not isinstance(self.model, str):
            raise UsageError(f"model must be an import string such as \"mymodels:Net\", got a "
                             f"{type(self.model).__name__}; a model object goes to Tuner(model, ...)")
        for name in ("model_kwargs", "sample_kwargs", "optimizer_kwargs"):
            if not isinstance(getattr(self, name), Mapping):
                raise UsageError(f"{name} must be a mapping of keyword arguments, got "
                                 f"{type(getattr(self, name)).__name__}")
        self._check_batch_source()
        self._check_step()

    def _check_batch_source(self) -> None:
        """``input_shape`` (with ``dtype`` and ``vocab_size``) or ``sample``: one of them, well formed."""
        if self.input_shape is not None:
            if not isinstance(self.input_shape, (tuple, list)):
                raise UsageError(f"--input-shape {self.input_shape!r}: give one sample's shape as a "
                                 "tuple of positive ints, e.g. (3, 224, 224)")
            shape = tuple(self.input_shape)
            if not shape or any(isinstance(d, bool) or not isinstance(d, int) or d <= 0
                                for d in shape):
                raise UsageError(f"--input-shape {self.input_shape!r}: give one sample's shape as "
                                 "positive ints, e.g. 3,224,224 (the batch dimension is added)")
            object.__setattr__(self, "input_shape", shape)
        if self.sample is not None:
            if self.input_shape is not None:
                raise UsageError("give --sample or --input-shape, not both")
            if not isinstance(self.sample, str):
                raise UsageError(f"sample must be an import string (\"module:function\", called "
                                 "as function(batch_size)) or \".method\" of the model, got a "
                                 f"{type(self.sample).__name__}")
        if self.input_shape is None:
            if self.dtype is not None or self.vocab_size is not None:
                raise UsageError("--dtype and --vocab-size describe --input-shape; give it too")
        else:
            kind = self.batch_dtype
            if kind not in DTYPES:
                raise UsageError(f"--dtype {kind!r}: choose one of {', '.join(DTYPES)}")
            if kind == "long" and self.vocab_size is None:
                raise UsageError("--dtype long (token ids) needs --vocab-size N: ids are drawn "
                                 "from 0..N-1")
            if kind != "long" and self.vocab_size is not None:
                raise UsageError(f"--vocab-size is for token ids (--dtype long), not {kind}")
            if self.vocab_size is not None and (isinstance(self.vocab_size, bool)
                                                or not isinstance(self.vocab_size, int)
                                                or self.vocab_size < 1):
                raise UsageError(f"--vocab-size must be an int >= 1, got {self.vocab_size!r}")

    def _check_step(self) -> None:
        """The loss, the optimizer and the step function: built-in names or import strings."""
        for what, value, table in (("--loss", self.loss, LOSSES),
                                   ("--optimizer", self.optimizer, OPTIMIZERS)):
            if not isinstance(value, str) or (":" not in value and value not in table):
                raise UsageError(f"{what} {value!r}: choose one of {', '.join(table)} or give "
                                 '"module:function"')
        if self.optimizer_kwargs and ":" not in self.optimizer:
            raise UsageError("optimizer_kwargs are for an optimizer given as \"module:Class\" "
                             f"(e.g. \"torch.optim:SGD\"), not the built-in {self.optimizer!r}")
        if self.step is not None and (not isinstance(self.step, str) or ":" not in self.step):
            raise UsageError(f"--step {self.step!r}: give the step function as MODULE:FUNC, "
                             "e.g. --step mytrain:train_step")

    @property
    def batch_dtype(self) -> str:
        """The dtype of a batch given by ``input_shape``: ``dtype``, else ``long`` when a
        vocabulary is given, else ``float32``."""
        return self.dtype or ("long" if self.vocab_size is not None else "float32")

    def build(self) -> Workload:
        """Import what the strings name and return the workload (the model as a factory,
        not yet built, except on the meta device to find its own ``sample()``)."""
        factory = _ModelFactory(self.model, self.model_kwargs)
        sample: Callable[[int], Any]
        if self.sample is not None and self.sample.startswith("."):
            sample = _MethodSample(factory, self.sample[1:], self.sample_kwargs)
        elif self.sample is not None:
            self._callable(self.sample, "--sample", "a function batch_size -> batch")
            sample = _FunctionSample(self.sample, self.sample_kwargs)
        elif self.input_shape is not None:
            sample = RandomBatch(tuple(self.input_shape), self.batch_dtype, self.vocab_size)
        else:
            if not self._has_sample(factory):
                raise UsageError(
                    f"{factory.__name__} has no sample(batch_size) method, so dptune cannot "
                    "build a batch: pass --input-shape (e.g. 3,224,224, with --dtype/--vocab-size "
                    "for token ids) or --sample module:function")
            sample = _MethodSample(factory, "sample", self.sample_kwargs)
        loss_fn = self._named(self.loss, LOSSES, "--loss", "a function loss(output, batch)")
        optimizer: Optional[Callable[[Iterable[Any]], Any]]
        if ":" in self.optimizer:
            self._callable(self.optimizer, "--optimizer", "an optimizer class or a function "
                           "params -> optimizer")
            optimizer = _OptimizerFactory(self.optimizer, self.optimizer_kwargs)
        else:
            optimizer = OPTIMIZERS[self.optimizer]
        step = (self._callable(self.step, "--step", "a function step(model, batch, optimizer)")
                if self.step is not None else None)
        return Workload(model=factory, sample=sample, loss_fn=loss_fn, optimizer=optimizer,
                        amp=self.amp, accumulate=self.accumulate,
                        clip_grad_norm=self.clip_grad_norm, step=step)

    # ---- helpers ---------------------------------------------------------------------------
    @staticmethod
    def _callable(import_str: str, what: str, expected: str) -> Any:
        fn = import_users(import_str, what)
        if not callable(fn):
            raise UsageError(f"{what} {import_str!r} names a {type(fn).__name__}, not {expected}")
        return fn

    def _named(self, value: str, table: dict[str, Named], what: str, expected: str) -> Named:
        if ":" in value:
            return self._callable(value, what, expected)
        return table[value]

    def _has_sample(self, factory: _ModelFactory) -> bool:
        """Whether the model has a ``sample`` method: read from the class, or from an
        instance built on the meta device when the model is named by a factory function."""
        import torch

        target = import_from_string(self.model)
        if isinstance(target, type) or isinstance(target, torch.nn.Module):
            return callable(getattr(target, "sample", None))
        with users_code(f"building the model {factory.__name__} on the meta device"), \
                torch.device("meta"):
            instance = factory.build()
        from dptune.checkpoint import unwrap

        return callable(getattr(unwrap(instance), "sample", None))
