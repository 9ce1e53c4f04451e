"""The one line ``dptune search`` and ``dptune plan`` print first: which objective the command
answers, and how to ask for the others.

The two commands keep their own defaults, each the common case of its setup: ``search``
balances memory at the batch given (DataParallel's card 0 runs out first, and the batch is
usually fixed), ``plan`` takes the fastest per-rank batches that fit (DDP ranks are
independent, so the slowest rank sets the step). The line makes the difference visible.
"""

from __future__ import annotations

from typing import Optional

__all__ = ["objective_line"]

#: what each objective answers, in one clause, per command
_WHAT = {
    ("search", "balance"): "the split of the batch that gives every card the same share of its budget",
    ("search", "max-batch"): "the largest batch that fits, and its split",
    ("search", "throughput"): "the fastest split of the batch that fits",
    ("plan", "balance"): "per-rank batches that use the same share of every card's memory",
    ("plan", "max-batch"): "the largest global batch that fits, split per rank",
    ("plan", "throughput"): "the per-rank batches of the global batch with the shortest step that fit",
}
_DEFAULT = {"search": "balance", "plan": "throughput"}
#: with --lengths a plan per length bucket: ``search`` takes each bucket's largest batch unless
#: asked for throughput, ``plan`` the fastest per-rank batches unless asked for max-batch
_LENGTHS = {
    ("search", "max-batch"): "each length bucket's largest batch that fits",
    ("search", "throughput"): "each length bucket's fastest split that fits",
    ("plan", "max-batch"): "each length bucket's largest per-rank batches",
    ("plan", "throughput"): "each length bucket's fastest per-rank batches that fit",
}


def objective_line(command: str, objective: Optional[str], lengths: bool = False) -> str:
    """``dptune: objective <name>: <what it answers> (<default or not>; --objective <other>:
    ...)``. ``objective`` is the flag's value (``None``: the command's default); ``lengths``:
    a plan per length bucket, where balance is not an objective."""
    if lengths:
        default = "max-batch" if command == "search" else "throughput"
        chosen = objective if objective in ("max-batch", "throughput") else default
        origin = f"the default of dptune {command} --lengths" if chosen == default else "as asked"
        other = "throughput" if chosen == "max-batch" else "max-batch"
        return (f"dptune: objective {chosen}: {_LENGTHS[(command, chosen)]} ({origin}; "
                f"--objective {other}: {_LENGTHS[(command, other)]})")
    chosen = objective or _DEFAULT[command]
    origin = f"the default of dptune {command}" if chosen == _DEFAULT[command] else "as asked"
    others = "; ".join(f"--objective {o}: {_WHAT[(command, o)]}"
                       for o in ("balance", "max-batch", "throughput") if o != chosen)
    return f"dptune: objective {chosen}: {_WHAT[(command, chosen)]} ({origin}; {others})"
