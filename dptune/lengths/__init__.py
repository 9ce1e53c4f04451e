"""Variable-length data: a certified plan per bucket of lengths, and training with it.

::

    from dptune.lengths import plan_lengths, BucketBatchSampler

    plan = plan_lengths(model, sample, lengths, buckets=8, simulate="4x24GB")
    print("\\n".join(plan.lines()))       # length <= 512: batch 96 = [10, 29, 29, 28], ...
    loader = DataLoader(ds, batch_sampler=BucketBatchSampler(lengths, plan), collate_fn=pad)
    model = BalancedDataParallel(model, plan=plan)   # each batch's chunks from its length

``sample(batch_size, length)`` builds a batch padded to ``length``. A :class:`dptune.Tuner`
plans the same for its own step and cards: ``tuner.fit_lengths(lengths, buckets=8)``
(:func:`dptune.lengths.fit.fit_lengths`). Imports stay light: the
heavy parts load on first use.
"""

from __future__ import annotations

from typing import Any

__all__ = ["plan_lengths", "search_buckets", "LengthPlan", "BucketPlan", "BucketBatchSampler",
           "bucket_edges", "check_lengths", "read_lengths", "token_budgets", "LengthSample",
           "fit_lengths"]

_HOMES = {
    "plan_lengths": "search", "search_buckets": "search", "LengthSample": "search",
    "LengthPlan": "plan", "BucketPlan": "plan", "BucketBatchSampler": "sampler",
    "bucket_edges": "buckets", "check_lengths": "buckets", "read_lengths": "buckets",
    "token_budgets": "budget", "fit_lengths": "fit",
}


def __getattr__(name: str) -> Any:
    if name in _HOMES:
        import importlib

        return getattr(importlib.import_module(f"dptune.lengths.{_HOMES[name]}"), name)
    raise AttributeError(f"module 'dptune.lengths' has no attribute {name!r}")
