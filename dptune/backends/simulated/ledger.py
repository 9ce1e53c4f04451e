"""The simulated cluster: per-card memory of a DataParallel training step, without GPUs.

Design notes: docs/concepts/design-notes.md, "dptune/backends/simulated/ledger.py".
"""

from __future__ import annotations

import contextlib
import weakref
from typing import Any, Callable, Iterator, Optional

import torch

from dptune._torch_private import sparse_parts, upper_bound
from dptune.backends.base import CATEGORIES
from dptune.backends.simulated.device_rules import HOST
from dptune.backends.simulated.sharing import ReplicaPlan
from dptune.errors import BackendUnavailableError

__all__ = ["ROUND_BYTES", "FOLLOW"]

ROUND_BYTES = 512                     # the caching allocator's minimum block size
FOLLOW = -2                           # current card in the backward: the card last computed on
_STRIDED = torch.strided


# --------------------------------------------------------------------------------------------
# The ledger: which card holds each storage, live bytes and peaks per card and category.
# --------------------------------------------------------------------------------------------
def _rounded(nbytes: int) -> int:
    return -(-nbytes // ROUND_BYTES) * ROUND_BYTES


class _Record:
    __slots__ = ("card", "nbytes", "raw", "category", "ref", "seq", "mirror", "keep")

    def __init__(self, card: int, nbytes: int, category: str, seq: int, raw: int = 0):
        self.card, self.nbytes, self.category, self.seq = card, nbytes, category, seq
        # the storage's own size: the allocator trace gets it (the replay rounds as the
        # allocator does), so a size that grows linearly with the batch stays linear there
        self.raw = raw or nbytes
        self.ref: Any = None
        self.mirror: Optional[_Record] = None    # the same storage counted on card 0 too
        self.keep: Any = None                    # what lives as long as this storage


class _Ledger:
    """Live and peak bytes per virtual card, by category."""

    def __init__(self, n: int):
        self.n = n
        self.live = [0] * n
        self.peak = [0] * n
        self.by_cat = [dict.fromkeys(CATEGORIES, 0) for _ in range(n)]
        self.peak_breakdown = [dict(b) for b in self.by_cat]
        self._records: dict[int, _Record] = {}
        self._seq = 0                  # allocations so far
        self._peak_seq = [0] * n       # allocations made when each card reached its peak
        # bytes of a bound, not a measurement, in the scratch of the op at each card's peak
        # (cuDNN's convolution workspace: simulated.scratch); 0 where a storage set the peak
        self.peak_bound = [0] * n
        # what the dispatch mode consults
        self.current_card = HOST       # the replica running (factory ops go there), or FOLLOW
        self.last_card = 0             # the card of the last op that read a card's tensor
        self.forced_card: Optional[int] = None
        self.as_cuda = False           # the step runs: CUDA's device rules (simulated.device_rules)
        self.scratch = True            # charge what CUDA's kernels allocate inside an op (scratch)
        self.category = "other"
        self.bounded: dict[str, str] = {}   # data-dependent ops seen -> how their size was bounded
        # the allocator trace: (card, +/-bytes, seq, stream); stream 1: the scatter's copy stream
        self.on_event: Optional[Callable[[int, int, int, int], None]] = None
        self.stream = 0
        self.observer: Optional[Callable[..., None]] = None  # sees every op (backends.timing)
        # the step simulates one card per class of like cards (simulated.sharing), or all
        self.sharing: Optional[ReplicaPlan] = None
        # (card, 0): what the card's replica makes is card 0's replica's too (sharing.mirror)
        self.mirror: Optional[tuple[int, int]] = None
        self.mirroring = True          # off around what card 0's replica would not make

    # -- storages ------------------------------------------------------------------------
    def record_of(self, t: torch.Tensor) -> Optional[_Record]:
        if t.layout is not _STRIDED:
            parts = sparse_parts(t)
            return self.record_of(parts[0]) if parts else None
        st = t.untyped_storage()
        rec = self._records.get(id(st))
        if rec is not None and rec.ref() is st:
            return rec
        return None

    def card_of(self, t: torch.Tensor) -> int:
        if t.layout is not _STRIDED:
            rec = self.record_of(t)
            return HOST if rec is None else rec.card
        st = t.untyped_storage()
        rec = self._records.get(id(st))
        return rec.card if rec is not None and rec.ref() is st else HOST

    def charge(self, t: torch.Tensor, card: int, category: str) -> None:
        """Charge ``t``'s storage to ``card`` if it is not known yet (a sparse tensor: the
        storages of its indices and values)."""
        if t.layout != torch.strided:
            for part in sparse_parts(t):
                self.charge(part, card, category)
            return
        st = t.untyped_storage()
        key = id(st)
        old = self._records.get(key)
        if old is not None and old.ref() is st:
            return
        nbytes = st.nbytes()
        if not isinstance(nbytes, int):   # a size that depends on tensor values
            bound = upper_bound(nbytes)
            if bound is None:
                raise BackendUnavailableError(
                    f"a tensor's size depends on tensor values with no known bound ({nbytes} "
                    "bytes, e.g. torch.zeros(int(x.item()))); the simulated cluster computes no "
                    "values: tune on real GPUs (--devices), or give the size without reading values")
            nbytes = bound
        self._seq += 1
        rec = _Record(card, _rounded(nbytes), category, self._seq, raw=nbytes)
        records = self._records

        def release(_ref: Any, key: int = key, rec: _Record = rec) -> None:
            if records.get(key) is rec:
                del records[key]
            self._free(rec)
            rec.keep = None

        rec.ref = weakref.ref(st, release)
        records[key] = rec
        if card != HOST and rec.nbytes:
            self._add(rec)
            if self.mirrors(card):
                rec.mirror = _Record(self.mirror[1], rec.nbytes, category, rec.seq,  # type: ignore[index]
                                     raw=rec.raw)
                self._add(rec.mirror)

    def _add(self, rec: _Record) -> None:
        card = rec.card
        if self.on_event is not None:
            self.on_event(card, rec.raw, rec.seq, self.stream)
        self.live[card] += rec.nbytes
        self.by_cat[card][rec.category] += rec.nbytes
        if self.live[card] > self.peak[card]:
            self.peak[card] = self.live[card]
            self.peak_breakdown[card] = dict(self.by_cat[card])
            self._peak_seq[card] = self._seq
            self.peak_bound[card] = 0

    def _free(self, rec: _Record) -> None:
        if rec.card != HOST and rec.nbytes:
            if self.on_event is not None:
                self.on_event(rec.card, -rec.raw, rec.seq, 0)
            self.live[rec.card] -= rec.nbytes
            self.by_cat[rec.card][rec.category] -= rec.nbytes
        if rec.mirror is not None:
            self._free(rec.mirror)
            rec.mirror = None

    def transient(self, card: int, nbytes: int, bound: int = 0) -> None:
        """``nbytes`` allocated on ``card`` and freed at once (an op's scratch,
        :mod:`dptune.backends.simulated.scratch`; ``bound`` of them a bound, not a measurement):
        a new peak if it comes at the peak. On the card whose replica stands for card 0's
        (``mirror``), card 0 gets it too."""
        raw, nbytes = nbytes, _rounded(nbytes)
        if card == HOST or nbytes <= 0:
            return
        self._transient(card, nbytes, bound, raw)
        if self.mirrors(card):
            self._transient(self.mirror[1], nbytes, bound, raw)  # type: ignore[index]

    def _transient(self, card: int, nbytes: int, bound: int, raw: int) -> None:
        self._seq += 1
        if self.on_event is not None:
            self.on_event(card, raw, self._seq, self.stream)
        if self.live[card] + nbytes > self.peak[card]:
            self.peak[card] = self.live[card] + nbytes
            self.peak_breakdown[card] = dict(self.by_cat[card])
            self.peak_breakdown[card]["other"] += nbytes
            self._peak_seq[card] = self._seq
            self.peak_bound[card] = bound
        if self.on_event is not None:
            self.on_event(card, -raw, self._seq, 0)

    def retag(self, t: torch.Tensor, category: str) -> None:
        rec = self.record_of(t)
        if rec is None or rec.category == category:
            return
        self._retag(rec, category)
        if rec.mirror is not None:
            self._retag(rec.mirror, category)

    def _retag(self, rec: _Record, category: str) -> None:
        card = rec.card
        if card != HOST:
            self.by_cat[card][rec.category] -= rec.nbytes
            self.by_cat[card][category] += rec.nbytes
            if rec.seq <= self._peak_seq[card]:
                # alive now and allocated before the peak, so it was live at the peak
                self.peak_breakdown[card][rec.category] -= rec.nbytes
                self.peak_breakdown[card][category] += rec.nbytes
        rec.category = category

    def to_host(self, t: torch.Tensor) -> None:
        """Stop charging ``t``'s storage to a card (it lives on the host on real GPUs)."""
        rec = self.record_of(t)
        if rec is not None and rec.card != HOST:
            self._free(rec)       # and its mirror on card 0
            rec.card = HOST

    def hold(self, t: torch.Tensor, other: Any) -> None:
        """Keep ``other`` alive as long as ``t``'s storage (card 0's replica holds a view of
        ``other`` where the replica that stands for it holds ``t``, a copy)."""
        rec = self.record_of(t)
        if rec is not None:
            rec.keep = other

    def mirrors(self, card: int) -> bool:
        """Whether what lands on ``card`` now is card 0's replica's too (sharing.mirror)."""
        return self.mirror is not None and card == self.mirror[0] and self.mirroring

    @contextlib.contextmanager
    def unmirrored(self) -> Iterator[None]:
        """What card 0's replica would not make (the copies of the weights, say)."""
        prev, self.mirroring = self.mirroring, False
        try:
            yield
        finally:
            self.mirroring = prev

    def reset_peaks(self) -> None:
        """Like ``torch.cuda.reset_peak_memory_stats``: peaks restart from what is live."""
        self.peak = list(self.live)
        self.peak_breakdown = [dict(b) for b in self.by_cat]
        self._peak_seq = [self._seq] * self.n
        self.peak_bound = [0] * self.n

    def running_card(self) -> int:
        """The card that runs now (the card last computed on, in the backward)."""
        return self.last_card if self.current_card == FOLLOW else self.current_card

    # -- context -------------------------------------------------------------------------
    @contextlib.contextmanager
    def _setting(self, attr: str, card: Optional[int], category: Optional[str]) -> Iterator[None]:
        prev = getattr(self, attr), self.category
        setattr(self, attr, card)
        if category is not None:
            self.category = category
        try:
            yield
        finally:
            setattr(self, attr, prev[0])
            self.category = prev[1]

    def on(self, card: int, category: Optional[str] = None) -> contextlib.AbstractContextManager:
        """Run code as the replica on ``card`` (factory ops land there)."""
        return self._setting("current_card", card, category)

    def forced(self, card: int, category: Optional[str] = None) -> contextlib.AbstractContextManager:
        """Every new storage goes to ``card`` (a copy between cards)."""
        return self._setting("forced_card", card, category)

    @contextlib.contextmanager
    def cuda_rules(self, on: bool) -> Iterator[None]:
        """CUDA's device rules (:mod:`dptune.backends.simulated.device_rules`) on or off: on while the step
        runs, off while dptune itself builds things (the model, the batch)."""
        prev = self.as_cuda
        self.as_cuda = on
        try:
            yield
        finally:
            self.as_cuda = prev

    @contextlib.contextmanager
    def phase(self, category: str) -> Iterator[None]:
        prev = self.category
        self.category = category
        try:
            yield
        finally:
            self.category = prev

