"""The user's exceptions on the simulated cluster, mapped to dptune's: a step that reads
tensor values (one line naming the user's line), a device mismatch, a failure in torch's fake
kernels (said so), anything else as :class:`~dptune.errors.UserCodeError`; and a failure in
dptune's own machinery around the user's code as :class:`~dptune.errors.InternalError`
(:func:`_internal`)."""

from __future__ import annotations

import functools
import os
import traceback
from typing import Any, Callable, Sequence, TypeVar

import torch

from dptune._torch_private import fake_kernel_files
from dptune._torch_private import torch_file as torch_file_path
from dptune.backends.simulated.device_rules import DeviceMismatchError
from dptune.backends.simulated.index_bounds import IndexOutOfRangeError
from dptune.errors import BackendUnavailableError, DptuneError, InternalError, UserCodeError


class _ValueReadingError(BackendUnavailableError):
    """The step reads tensor values in a way even symbolic sizes cannot follow."""


def _raised_in(e: BaseException, torch_file: str) -> bool:
    """Whether a frame of ``e``'s traceback is in ``torch/nn/modules/<torch_file>``."""
    where = torch_file_path("nn", "modules", torch_file)
    return any(os.path.abspath(f.filename) == where for f in traceback.extract_tb(e.__traceback__))


def _user_error(e: Exception, where: str, sizes: Sequence[int]) -> Exception:
    if isinstance(e, DptuneError):
        return e
    name = type(e).__name__
    # an RNN on a PackedSequence passes batch_sizes[0], a 0-dim tensor, as a size: a TypeError
    # on fake tensors (other TypeErrors that name a FakeTensor are the model's own)
    as_number = isinstance(e, TypeError) and "got FakeTensor" in str(e) and _raised_in(e, "rnn.py")
    if "DataDependent" in name or "DynamicOutputShape" in name or "item()" in str(e) or as_number:
        # Not a bug in the model: the simulator computes no values. One line, naming the
        # user's line that reads them, instead of FakeTensor's internals.
        at = _users_line(e)
        first = (str(e).strip().splitlines() or [""])[0].strip()
        if _raised_in(e, "rnn.py"):
            return _ValueReadingError(
                f"an RNN{at} runs on a PackedSequence, whose state it sizes from the values of "
                f"batch_sizes ({first}); the simulated cluster computes no values, so it cannot run "
                "this step: tune on real GPUs (--devices), or estimate with padded batches (no "
                "pack_padded_sequence): packing only saves memory, so that is an upper bound")
        return _ValueReadingError(
            f"the model reads tensor values{at} and decides on them (an `if` on .item(), or a size "
            f"from int(t)) ({first}); the simulated cluster computes no values, so it cannot run "
            "this step (sizes from nonzero() or boolean masks it can bound, not decisions): "
            "tune on real GPUs (--devices), or move value-dependent code out of the training step")
    if isinstance(e, DeviceMismatchError):   # raised in dptune's dispatch mode: name the user's line
        return UserCodeError(f"RuntimeError {where}{_users_line(e)} (split {list(sizes)}): {e}")
    if isinstance(e, IndexOutOfRangeError):  # raised in dptune's dispatch mode too
        return UserCodeError(f"IndexError {where}{_users_line(e)} (split {list(sizes)}): {e}")
    return UserCodeError(f"{name} {where} (split {list(sizes)}): {e}{_fake_kernel_note(e)}")


_FAKE_KERNEL_FILES = fake_kernel_files()


def _fake_kernel_note(e: BaseException) -> str:
    """When the error was raised inside one of torch's fake (meta) kernels, which stand in for
    CUDA's on the simulated cluster, a sentence saying so: the fault is the model's when the
    same step fails on a GPU too, and the simulator's when it does not."""
    frames = [f for f in traceback.extract_tb(e.__traceback__)
              if os.path.abspath(f.filename).startswith(_FAKE_KERNEL_FILES)]
    if not frames:
        return ""
    return (f" [raised in torch's fake kernel {frames[-1].name}, which stands in for CUDA's on "
            "the simulated cluster: if this step runs on a GPU, the simulator is wrong here; "
            "tune on the GPUs with --devices and report it]")


_LIBRARY_DIRS = (os.path.dirname(torch.__file__) + os.sep,
                 os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))) + os.sep)


def _users_line(e: BaseException) -> str:
    """`` at mymodel.py:12 (if x.sum().item() > 0:)``: the innermost frame outside torch and
    dptune, or ``""``."""
    frames = [f for f in traceback.extract_tb(e.__traceback__)
              if not os.path.abspath(f.filename).startswith(_LIBRARY_DIRS)
              and not f.filename.startswith("<")]
    if not frames:
        return ""
    f = frames[-1]
    code = f" ({f.line.strip()})" if f.line else ""
    return f" at {os.path.basename(f.filename)}:{f.lineno}{code}"


_F = TypeVar("_F", bound=Callable[..., Any])


def _internal(part: str, *users: type[BaseException]) -> Callable[[_F], _F]:
    """Report a failure inside ``part`` of dptune's machinery as dptune's, not the user's
    (exceptions of the types ``users`` are the user's: they pass)."""
    passing: tuple[type[BaseException], ...] = (DptuneError, *users)

    def wrap(fn: _F) -> _F:
        @functools.wraps(fn)
        def run(*args: Any, **kwargs: Any) -> Any:
            try:
                return fn(*args, **kwargs)
            except passing:
                raise
            except Exception as e:
                raise InternalError(
                    f"dptune's simulator failed in {part} ({type(e).__name__}: {e}); this is a bug "
                    "in dptune, not in your model: please report it with the model that shows it"
                ) from e
        return run  # type: ignore[return-value]
    return wrap
