"""The ranks together: every rank simulated in this process, or this process as one rank of
an initialised ``torch.distributed`` job (each round's results all-gathered, an error on one
rank raised on every rank with the same class and message, the failing rank's own exception
as the cause there)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Optional, Protocol, TypeVar

from dptune.errors import (BackendUnavailableError, DptuneError, ImportStringError, InternalError,
                           NoFeasibleSplitError, OutputError, ReportError, SpecError, UsageError,
                           UserCodeError)

__all__ = ["Group", "LocalGroup", "TorchGroup"]

T = TypeVar("T")


class Group(Protocol):
    world_size: int

    def each(self, fn: Callable[[int], T]) -> list[T]:
        """Run ``fn(rank)`` for every rank; the results in rank order, on every rank."""
        ...


class LocalGroup:
    """All ranks simulated in this process, one after another."""

    def __init__(self, world_size: int):
        self.world_size = world_size

    def each(self, fn: Callable[[int], T]) -> list[T]:
        return [fn(r) for r in range(self.world_size)]


@dataclass(frozen=True)
class _Failed:
    rank: int
    kind: str
    message: str
    shortfall_bytes: Optional[int] = None


_ERRORS: dict[str, type] = {c.__name__: c for c in (
    UsageError, SpecError, ImportStringError, ReportError, OutputError, NoFeasibleSplitError,
    BackendUnavailableError, UserCodeError, InternalError)}


def _error(f: _Failed) -> DptuneError:
    """The error every rank raises for the first rank that failed: its dptune class by name
    (another exception: :class:`DptuneError`), its message after the rank's."""
    cls = _ERRORS.get(f.kind, DptuneError)
    message = f"rank {f.rank} failed while planning ({f.kind}): {f.message}"
    if cls is NoFeasibleSplitError:
        return NoFeasibleSplitError(message, shortfall_bytes=f.shortfall_bytes)
    return cls(message)


class TorchGroup:
    """This process is one rank of an initialised ``torch.distributed`` job."""

    def __init__(self) -> None:
        import torch.distributed as dist

        self.dist = dist
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()

    def each(self, fn: Callable[[int], T]) -> list[T]:
        mine: Any
        error: Optional[BaseException] = None
        try:
            mine = fn(self.rank)
        except Exception as e:  # gathered, then raised on every rank
            error = e
            mine = _Failed(self.rank, type(e).__name__, str(e), getattr(e, "shortfall_bytes", None))
        gathered: list[Any] = [None] * self.world_size
        self.dist.all_gather_object(gathered, mine)
        failed = [g for g in gathered if isinstance(g, _Failed)]
        if failed:   # the first failed rank's error, the same on every rank
            raise _error(failed[0]) from error
        return gathered
