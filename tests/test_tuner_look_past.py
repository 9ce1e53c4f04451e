"""The tuner's look past a certificate's over points (simulated cards, the reserved level):
what it found is in ``TuneResult.looked_past``, in ``report.json`` (read back checked), and in
the certificate line; a card that fits again above its over point leaves the answer
uncertified.

The backend is synthetic (no torch work in the probes): two 10 GiB budgets, card 1's figure its
allocated one plus 1 GiB of cached blocks from 420 to 439 samples (``fall``), so the even split
of 850 meets card 1 over at 425, the search certifies 419 samples on card 1, and 440 to 460 fit
again. Its look past is brute force over the same surface."""

from __future__ import annotations

import json
from typing import Optional, Sequence

import pytest
import torch

from dptune.backends.base import Device, ProbeResult
from dptune.budget import RESERVED_CERTIFICATE, RESERVED_CERTIFICATE_LOOKED
from dptune.report.text import render_summary, render_table
from dptune.result.model import TuneResult
from dptune.types import CardWindow, WindowCheck
from dptune.tuner import Tuner

GiB, MiB = 2**30, 2**20
ROOM = 256 * MiB          # the reserved level's default headroom

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")  # BalancedDataParallel on CPU


def allocated(i: int, c: int, batch: int) -> int:
    if i > 0 and c == 0:
        return 0
    return GiB + (20 * MiB * c if i else 10 * MiB * c + MiB * batch)


class FallingBackend:
    kind = "simulated"
    reserved = "an allocator model"         # what the tuner asks for before it looks

    def __init__(self, fall: bool):
        self.fall = fall
        self.devices = [Device(i, f"card{i}", 10 * GiB + ROOM) for i in range(2)]
        self.looks: list[tuple[tuple[int, ...], tuple[Optional[int], ...]]] = []

    def describe(self) -> str:
        return "2 synthetic cards"

    def figure(self, i: int, c: int, batch: int) -> int:
        return allocated(i, c, batch) + (GiB if self.fall and i == 1 and 420 <= c < 440 else 0)

    def probe(self, chunk_sizes: Sequence[int]) -> ProbeResult:
        s = tuple(int(c) for c in chunk_sizes)
        b = sum(s)
        res = tuple(self.figure(i, c, b) for i, c in enumerate(s))
        over = [i for i, r in enumerate(res) if r > self.devices[i].available_bytes]
        return ProbeResult(s, tuple(allocated(i, c, b) for i, c in enumerate(s)),
                           reserved_bytes=res, oom_device=over[0] if over else None)

    def look_past(self, split: Sequence[int], over: Sequence[Optional[int]],
                  budgets: Sequence[int], min_chunk: int = 1) -> WindowCheck:
        self.looks.append((tuple(split), tuple(over)))
        b, out = sum(split), []
        for i, start in enumerate(over):
            if start is None:
                continue
            c, fits = start, None
            while allocated(i, c, b + c - split[i]) <= budgets[i]:
                if self.figure(i, c, b + c - split[i]) <= budgets[i]:
                    fits = c
                    break
                c += 1
            out.append(CardWindow(i, start, None if fits is not None else c, fits,
                                  batch_start=b + start - split[0] if i == 0 else None))
        return WindowCheck(tuple(out), replays=7)

    def close(self) -> None:
        pass


def tune(backend: FallingBackend, **kw) -> TuneResult:  # type: ignore[no-untyped-def]
    return Tuner(torch.nn.Linear(4, 2), lambda n: torch.randn(n, 4), batch_size=850,
                 objective="max_batch", backend=backend, verbose=False, **kw).fit()


def test_a_fall_past_the_over_point_is_reported_and_the_answer_not_certified() -> None:
    be = FallingBackend(fall=True)
    r = tune(be)
    assert be.looks and not r.certified
    assert r.looked_past is not None and [w.fits for w in r.looked_past.falls] == [440]
    assert any("card 1 is over at 420 samples and fits again at 440 samples" in n and "not certified" in n for n in r.notes)
    back = TuneResult.from_dict(json.loads(json.dumps(r.to_dict())))
    assert back.looked_past == r.looked_past
    assert "certified: no" in (render_table(r) + render_summary(r))
    # without the look the same probes certify it, where card 1 at 460 and card 0 at 796 fit
    blind = FallingBackend(fall=True)
    blind.reserved = None  # type: ignore[assignment]
    plain = tune(blind)
    assert plain.certified and plain.chunk_sizes == r.chunk_sizes
    assert all(blind.figure(i, c, 1256) <= 10 * GiB for i, c in enumerate((796, 460)))
    assert plain.batch_size < 1256


def test_a_window_over_throughout_is_said_in_the_certificate_line() -> None:
    r = tune(FallingBackend(fall=False))
    assert r.certified and r.looked_past is not None and r.looked_past.closed
    text = (render_table(r) + render_summary(r))
    assert RESERVED_CERTIFICATE_LOOKED in text and RESERVED_CERTIFICATE not in text
    assert TuneResult.from_dict(json.loads(json.dumps(r.to_dict()))).looked_past == r.looked_past


def test_no_look_at_the_allocated_level_nor_without_an_allocator_model() -> None:
    be = FallingBackend(fall=True)
    r = tune(be, budget_level="allocated")
    assert be.looks == [] and r.looked_past is None
    be = FallingBackend(fall=False)
    be.reserved = None  # type: ignore[assignment]
    r = tune(be)
    assert be.looks == [] and r.looked_past is None and r.certified
    assert RESERVED_CERTIFICATE in (render_table(r) + render_summary(r))


def test_a_report_with_a_bad_window_is_refused_with_its_path() -> None:
    from dptune.errors import ReportError
    d = tune(FallingBackend(fall=False)).to_dict()
    d["looked_past"]["cards"][0]["card"] = 5
    with pytest.raises(ReportError, match=r"looked_past.cards\[0\].card"):
        TuneResult.from_dict(d)
