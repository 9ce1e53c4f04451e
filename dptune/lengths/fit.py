"""``Tuner.fit_lengths``: a plan per length bucket for the step and cards a Tuner holds.

::

    tuner = dptune.Tuner(model, sample, batch_size=256, optimizer=adamw, amp="bf16",
                         simulate="4x24GB")
    result = tuner.fit()                                  # one batch shape
    plan = tuner.fit_lengths(lengths, buckets=8)          # a batch per length bucket

The plan is :func:`dptune.lengths.plan_lengths`'s, with the tuner's model, loss, optimizer,
step settings (``amp``, ``accumulate``, ``clip_grad_norm``, ``step``), cards, headroom,
tolerance and verbosity; ``batch_size`` is where the shortest bucket's search starts. The
batch at each bucket's length comes from the tuner's own ``sample`` when it takes the length
(``sample(batch_size, length)`` or a ``length=`` keyword), else from ``sample=`` given here.
The objective does not apply: every bucket gets its largest batch.
"""

from __future__ import annotations

import inspect
from typing import Any, Callable, Iterable, Optional

from dptune.errors import UsageError
from dptune.settings import STEP_KEYWORDS, SearchSettings
from dptune.lengths.buckets import Buckets
from dptune.lengths.plan import LengthPlan

__all__ = ["fit_lengths", "length_sample_of"]


def length_sample_of(fn: Callable[..., Any]) -> Optional[Callable[[int, int], Any]]:
    """``fn`` as ``sample(batch_size, length)`` when it takes a length (a second positional
    parameter or a ``length`` keyword), else ``None``."""
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return None
    if "length" in params and params["length"].kind in (
            inspect.Parameter.KEYWORD_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD):
        return lambda n, length: fn(n, length=length)
    positional = [p for p in params.values() if p.kind in (
        inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)]
    if len(positional) >= 2 or any(p.kind is inspect.Parameter.VAR_POSITIONAL
                                   for p in params.values()):
        return fn
    return None


def fit_lengths(tuner: Any, lengths: Iterable[Any], buckets: Buckets = 8, *,
                sample: Optional[Callable[[int, int], Any]] = None,
                **options: Any) -> LengthPlan:
    """The plan for ``tuner`` (a :class:`dptune.Tuner`); ``options`` override what it holds
    and go to :func:`dptune.lengths.plan_lengths` (``pad_to_multiple_of``, ``length_axis``,
    ``max_length``, ``ddp``, ``max_probes`` per bucket, ...)."""
    from dptune.lengths.search import plan_lengths

    wl = tuner.workload
    fn = sample if sample is not None else length_sample_of(wl.sample)
    if fn is None:
        raise UsageError("the tuner's sample(batch_size) takes no length: give the batch at a "
                         "length, tuner.fit_lengths(lengths, sample=lambda n, length: ...), or "
                         "a sample taking (batch_size, length)")
    if tuner.backend is not None:
        raise UsageError("fit_lengths plans on the tuner's cards (device_ids=, simulate=), not "
                         "on a backend given to it")
    settings = tuner.settings
    if settings.output_device != 0:
        raise UsageError("fit_lengths gathers the outputs on card 0; drop output_device")
    if wl.compute_loss is not None:
        raise UsageError("fit_lengths runs the step's loss_fn/step; a compute_loss (the "
                         "Trainer's) is planned with dptune.integrations.trainer_lengths")
    search = SearchSettings(max_probes=max(settings.max_probes, 16), tolerance=settings.tolerance,
                            verbose=settings.verbose)
    given: dict[str, Any] = dict(loss_fn=wl.loss_fn, optimizer=wl.optimizer,
                                 batch_size=tuner.batch_size, **_step_keywords(wl))
    if not any(k in options for k in ("headroom", "budget_level", "allocator", "nccl_bytes", "budget")):
        given["budget"] = settings.budget        # the tuner's, unless the options ask for another
    if not any(k in options for k in ("max_probes", "tolerance", "verbose", "search")):
        given["search"] = search
    if tuner.choice is not None:
        given["choice"] = tuner.choice
    else:
        given.update(device_ids=settings.device_ids, simulate=settings.simulate)
    given.update(options)
    return plan_lengths(wl.model, fn, lengths, buckets, **given)


def _step_keywords(wl: Any) -> dict[str, Any]:
    """The step's settings of a workload, as the keywords that build it again."""
    return {k: getattr(wl, k) for k in STEP_KEYWORDS}
