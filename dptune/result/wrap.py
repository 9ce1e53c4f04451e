"""Wrapping a model with a result's split: :func:`wrap_model` (what
:meth:`dptune.result.model.TuneResult.wrap` does), and the warning when the training step differs
from the one the split was tuned for (:func:`warn_settings`).

Above :mod:`dptune.parallel` (the wrapper, which reads no report) and below the result,
which it takes as an argument through the :class:`TunedSplit` protocol (it does not import
the result); torch is imported when called.
"""

from __future__ import annotations

import warnings
from typing import TYPE_CHECKING, Any, Optional, Protocol, Sequence

from dptune.errors import UsageError
from dptune.step.workload import StepSettings

if TYPE_CHECKING:  # pragma: no cover
    import torch

    from dptune.parallel import BalancedDataParallel

__all__ = ["wrap_model", "warn_settings", "NOT_GIVEN", "TunedSplit"]


class TunedSplit(Protocol):
    """What wrapping needs of a result (:class:`dptune.result.model.TuneResult` has it): the split,
    where the outputs are gathered, the step it was tuned for, and what to call it in a
    message. A protocol, so that this module does not import the result back."""

    chunk_sizes: list[int]
    output_device: int
    settings: StepSettings
    cluster: str
    source: Optional[str]


#: "not given" for :func:`wrap_model`'s step settings (``None`` is a value some of them take)
NOT_GIVEN: Any = type("_NotGiven", (), {"__repr__": lambda self: "NOT_GIVEN"})()


def wrap_model(result: TunedSplit, model: "torch.nn.Module",
               device_ids: Optional[Sequence[Any]] = None, *, amp: Any = NOT_GIVEN,
               accumulate: Any = NOT_GIVEN, clip_grad_norm: Any = NOT_GIVEN,
               step: Any = NOT_GIVEN) -> "BalancedDataParallel":
    """``model`` in a ``BalancedDataParallel`` with ``result``'s split (:meth:`TuneResult.wrap`).

    ``device_ids`` defaults to the first ``len(chunk_sizes)`` visible CUDA devices; the model
    is moved to the first of them (where DataParallel needs its parameters) and the outputs
    are gathered on the result's ``output_device``. On a machine without CUDA (and no
    ``device_ids``) the model stays where it is and the wrapper is a plain pass-through, with
    the constructor's warning that the split is not used, so the same line runs on a laptop.

    ``amp``, ``accumulate``, ``clip_grad_norm`` and ``step`` (a function or its
    ``"module:qualname"``) describe the training step this model will run, as for ``Tuner``;
    each one given is compared with the step the result was tuned for, as is the model's own
    gradient checkpointing flag, and a :class:`~dptune.errors.DptuneWarning` lists any
    difference: the split's memory was measured for the other step.
    """
    import torch

    from dptune.parallel import BalancedDataParallel

    where = f"the report at {result.source!r}" if result.source else "the result"
    warn_settings(result.settings, model, where, amp=amp, accumulate=accumulate,
                   clip_grad_norm=clip_grad_norm, step=step)
    sizes = list(result.chunk_sizes)
    n = len(sizes)
    if device_ids is None and not torch.cuda.is_available():
        return BalancedDataParallel(model, chunk_sizes=sizes)
    if device_ids is None:
        visible = torch.cuda.device_count()
        if visible < n:
            raise UsageError(
                f"{where} was tuned for {n} cards ({result.cluster}) but {visible} CUDA "
                f"device(s) are visible; run on a machine with {n} cards, check "
                "CUDA_VISIBLE_DEVICES, or re-run `dptune search` for these cards")
        device_ids = list(range(n))
    elif len(device_ids) != n:
        raise UsageError(
            f"{where} has a split for {n} cards {sizes} but device_ids={list(device_ids)} "
            f"names {len(device_ids)}; give {n} device ids")
    ids = list(device_ids)
    first = torch.device("cuda", ids[0]) if isinstance(ids[0], int) else torch.device(ids[0])
    if torch.cuda.is_available():   # without CUDA, DataParallel itself is a pass-through
        model = model.to(first)
    return BalancedDataParallel(model, device_ids=ids,
                                output_device=ids[result.output_device], chunk_sizes=sizes)


def warn_settings(tuned: StepSettings, model: "torch.nn.Module", where: str, **given: Any) -> None:
    """One :class:`DptuneWarning` listing how the step described by ``given`` (those given)
    and the model's gradient checkpointing differ from the result's ``tuned`` settings."""
    from dptune.errors import DptuneWarning
    from dptune.step.workload import function_name, gradient_checkpointing

    if given.get("step") is not NOT_GIVEN and callable(given.get("step")):
        given["step"] = function_name(given["step"])
    if given.get("clip_grad_norm") not in (NOT_GIVEN, None):
        given["clip_grad_norm"] = float(given["clip_grad_norm"])
    given = {k: v for k, v in given.items() if v is not NOT_GIVEN}
    given.setdefault("gradient_checkpointing", gradient_checkpointing(model))
    mine = StepSettings.from_dict({**tuned.to_dict(), **given})
    diffs = [f"{k}={getattr(tuned, k)!r} in the report, {getattr(mine, k)!r} here"
             for k in given if getattr(tuned, k) != getattr(mine, k)]
    if diffs:
        warnings.warn(
            f"the split in {where} was tuned for another training step ({tuned.describe()}; "
            f"now {mine.describe()}): {'; '.join(diffs)}. Its memory was measured for that step, "
            "so it may run out of memory or leave memory unused: re-run `dptune search` with "
            "these settings", DptuneWarning, stacklevel=4)
