"""The balance search with a map of the figure (``search.Known.balance_map``), against brute
force over every split.

A synthetic surface (no torch work): card 1's figure is its allocated one plus 1 GiB of cached
blocks from 300 to 339 samples, so it is high in that window and low again past it. The
shares are equal near 330 samples on card 1, inside the window: the least largest share is at
340 (past it), where a certificate reading "card 1 at or above the share from its first chunk
measured there" says nothing fits: without the map the search certifies [601, 299] at 77.5%
of a budget at batch 900, where [560, 340] reaches 76.4%. The map here is brute force on the same surface, every
chunk of every card (what :meth:`SimulatedBackend.balance_map` draws on the allocator model,
tested against real steps in ``tests/backends/simulated/test_balance_map.py``)."""

from __future__ import annotations

from typing import Optional, Sequence

import pytest

from dptune import search
from dptune.backends.base import ProbeResult
from dptune.types import BalanceMap, CardCurve

GiB, MiB = 2**30, 2**20
BUDGET = 10 * GiB


def figure(i: int, c: int, batch: int, fall: bool = True) -> int:
    if i > 0 and c == 0:
        return 0
    if i == 0:
        return GiB + 10 * MiB * c + MiB * batch
    return GiB + 20 * MiB * c + (GiB if fall and 300 <= c < 340 else 0)


def probe(split: Sequence[int]) -> ProbeResult:
    s = tuple(int(c) for c in split)
    return ProbeResult(s, tuple(figure(i, c, sum(s)) for i, c in enumerate(s)))


def brute_map(calls: list):  # type: ignore[no-untyped-def]
    def make(split: Sequence[int], share: float, min_chunk: int = 1,
             alike: Optional[Sequence[object]] = None) -> BalanceMap:
        calls.append((tuple(split), share))
        b = sum(split)
        curves = tuple(CardCurve(i, 1, tuple(figure(i, c, b) for c in range(1, b + 1)),
                                 zero=figure(i, 0, b)) for i in range(len(split)))
        return BalanceMap(b, share, curves, replays=len(split) * b)
    return make


def least_by_brute_force(batch: int) -> tuple[float, list[tuple[int, int]]]:
    tops = {(c0, batch - c0): max(figure(0, c0, batch), figure(1, batch - c0, batch)) / BUDGET
            for c0 in range(batch + 1)}
    least = min(tops.values())
    return least, [s for s, t in tops.items() if t == least]


@pytest.mark.parametrize("batch", [880, 900, 930])
def test_the_map_finds_the_least_largest_share_past_a_fall(batch: int) -> None:
    calls: list = []
    out = search.run(probe, [BUDGET, BUDGET], "balance", batch,
                     known=search.Known(balance_map=brute_map(calls)))
    least, at = least_by_brute_force(batch)
    assert calls, "the map was not asked"
    assert out.certified, out.notes
    assert tuple(out.best.chunk_sizes) in at
    assert max(out.best.peak_bytes) / BUDGET == least
    assert len(out.probes) <= 12
    assert any("on the allocator model every split of the batch holds a card at" in n
               for n in out.notes)


def test_a_map_the_probe_does_not_match_certifies_nothing() -> None:
    """A map that reads card 1 low inside its window (the drawing missed the cached blocks):
    its split, probed, reads higher than the map says, so the answer is not certified."""
    def wrong(split: Sequence[int], share: float, min_chunk: int = 1,
              alike: Optional[Sequence[object]] = None) -> BalanceMap:
        b = sum(split)
        curves = tuple(CardCurve(i, 1, tuple(figure(i, c, b, fall=False) for c in range(1, b + 1)),
                                 zero=figure(i, 0, b)) for i in range(len(split)))
        return BalanceMap(b, share, curves, replays=1)
    out = search.run(probe, [BUDGET, BUDGET], "balance", 900,
                     known=search.Known(balance_map=wrong))
    assert not out.certified
    assert any("not certified" in n for n in out.notes)


# ---- through the tuner: the result, its report and its certificate line ------------------

class MappedBackend:
    """Two synthetic cards with the surface above, and the brute-force map (no torch work)."""

    kind = "simulated"
    reserved = "an allocator model"         # what the tuner asks for before it maps

    def __init__(self) -> None:
        from dptune.backends.base import Device
        self.devices = [Device(i, f"card{i}", BUDGET + 256 * MiB) for i in range(2)]
        self.maps: list = []

    def describe(self) -> str:
        return "2 synthetic cards"

    def probe(self, chunk_sizes: Sequence[int]) -> ProbeResult:
        s = tuple(int(c) for c in chunk_sizes)
        res = tuple(figure(i, c, sum(s)) for i, c in enumerate(s))
        over = [i for i, r in enumerate(res) if r > self.devices[i].available_bytes]
        return ProbeResult(s, res, reserved_bytes=res, oom_device=over[0] if over else None)

    def balance_map(self, split: Sequence[int], level: float, budgets: Sequence[int],
                    min_chunk: int = 1, alike: Optional[Sequence[object]] = None) -> BalanceMap:
        return brute_map(self.maps)(split, level, min_chunk, alike)

    def close(self) -> None:
        pass


def test_the_tuner_reports_the_map_and_reads_it_back() -> None:
    import json

    import torch

    from dptune.budget import RESERVED_BALANCE_MAPPED, RESERVED_CERTIFICATE
    from dptune.errors import ReportError
    from dptune.report.text import render_summary, render_table
    from dptune.result.model import TuneResult
    from dptune.tuner import Tuner
    be = MappedBackend()
    r = Tuner(torch.nn.Linear(4, 2), lambda n: torch.randn(n, 4), batch_size=900,
              objective="balance", backend=be, verbose=False).fit()
    least, at = least_by_brute_force(900)
    assert be.maps and r.certified and tuple(r.chunk_sizes) in at
    assert r.balance_map is not None and r.balance_map.least == least
    text = render_table(r) + render_summary(r)
    assert RESERVED_BALANCE_MAPPED in text and RESERVED_CERTIFICATE not in text
    back = TuneResult.from_dict(json.loads(json.dumps(r.to_dict())))
    assert back.balance_map == r.balance_map
    d = r.to_dict()
    d["balance_map"]["ranges"] = [[0, 5]]
    with pytest.raises(ReportError, match=r"balance_map.ranges"):
        TuneResult.from_dict(d)
    # at the allocated level the figure does not fall: no map
    be = MappedBackend()
    r = Tuner(torch.nn.Linear(4, 2), lambda n: torch.randn(n, 4), batch_size=900,
              objective="balance", backend=be, verbose=False, budget_level="allocated").fit()
    assert be.maps == [] and r.balance_map is None


def test_a_card_with_no_samples_holds_no_share_on_the_map() -> None:
    """A card ``i >= 1`` left without samples holds none of the batch, as the probes read it,
    whatever its figure with none (NCCL's buffers): card 1 taking any sample costs 9 GiB, so
    the least split puts the whole batch on card 0, and the map's figure of an idle card 1
    (3 GiB here) must not price it out."""
    def fig(i: int, c: int, b: int) -> int:
        return GiB + 11 * MiB * c if i == 0 else (9 * GiB if c else 0)

    def probe2(split: Sequence[int]) -> ProbeResult:
        s = tuple(int(c) for c in split)
        return ProbeResult(s, tuple(fig(i, c, sum(s)) for i, c in enumerate(s)))

    def make(split: Sequence[int], share: float, min_chunk: int = 1,
             alike: Optional[Sequence[object]] = None) -> BalanceMap:
        b = sum(split)
        curves = tuple(CardCurve(i, 1, tuple(fig(i, c, b) for c in range(1, b + 1)),
                                 zero=fig(i, 0, b) if i == 0 else 3 * GiB) for i in range(2))
        return BalanceMap(b, share, curves, replays=2 * b)
    out = search.run(probe2, [BUDGET, BUDGET], "balance", 50, known=search.Known(balance_map=make))
    assert out.certified, out.notes
    assert list(out.best.chunk_sizes) == [50, 0]


def test_a_map_above_what_the_probes_measured_certifies_nothing() -> None:
    """A map that reads every card 1 GiB higher than the probes do: its least share is above
    the probes' answer, which a probe measured, so the map is wrong and nothing is certified
    from it (not the even split kept within the tolerance of it either)."""
    def high(split: Sequence[int], share: float, min_chunk: int = 1,
             alike: Optional[Sequence[object]] = None) -> BalanceMap:
        b = sum(split)
        curves = tuple(CardCurve(i, 1, tuple(figure(i, c, b) + GiB for c in range(1, b + 1)),
                                 zero=figure(i, 0, b) + GiB) for i in range(len(split)))
        return BalanceMap(b, share, curves, replays=1)
    out = search.run(probe, [BUDGET, BUDGET], "balance", 900,
                     known=search.Known(balance_map=high))
    assert not out.certified and not out.even_kept
    assert any("below it: the map missed a step" in n for n in out.notes)
