"""The per-bucket search: every bucket's answer equals an exhaustive search.

Two oracles, both independent of dptune's search: a synthetic memory surface in pure Python
(every split of every batch near the answer enumerated; fast, with hypothesis over cards,
budgets and lengths), and the simulated cluster with a tiny GPT-style decoder and a tiny
BERT-style encoder, where every split of ``b + 1`` is probed through a fresh backend in a
plain loop (slow).
"""

from __future__ import annotations

import itertools

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dptune.backends.base import ProbeResult
from dptune.backends.simulated import SimulatedBackend
from dptune.errors import NoFeasibleSplitError, UsageError
from dptune.examples.models import BertClassifier
from dptune.lengths import plan_lengths
from dptune.lengths.search import search_buckets
from dptune.step.workload import Workload


# ---- a synthetic surface, enumerated ------------------------------------------------------
class Surface:
    """Card i: ``base_i + c * (a * L + q * L**2)``; card 0 also ``g * B * L`` (the gathered
    outputs). Non-decreasing in the chunk, the batch and the length, as the search assumes."""

    def __init__(self, base, a, q, g):
        self.base, self.a, self.q, self.g = base, a, q, g
        self.calls = 0

    def peaks(self, length, split):
        per = self.a * length + self.q * length * length
        out = [b + c * per for b, c in zip(self.base, split)]
        out[0] += self.g * sum(split) * length
        return out

    def probe(self, length, split):
        self.calls += 1
        return ProbeResult(tuple(split), tuple(int(p) for p in self.peaks(length, split)))


def fits(surface, budgets, length, split):
    return all(p <= b for i, (p, b, c) in enumerate(zip(surface.peaks(length, split), budgets, split))
               if i == 0 or c > 0)


def exhaustive_max(surface, budgets, length, n, top=5000):
    """The largest batch some split of which fits, by enumerating every split."""
    best = 0
    for b in range(1, top):
        if any(fits(surface, budgets, length, s) for s in splits(b, n)):
            best = b
        elif b > best + 3:
            break
    return best


def splits(total, n):
    if n == 1:
        yield (total,)
        return
    for c in range(total + 1):
        for rest in splits(total - c, n - 1):
            yield (c, *rest)


@settings(max_examples=30, deadline=None)
@given(n=st.integers(2, 3), budget=st.integers(3000, 9000), extra=st.integers(0, 3000),
       g=st.sampled_from([0, 1, 4]), q=st.sampled_from([0, 1]),
       lengths=st.lists(st.integers(8, 40), min_size=1, max_size=4, unique=True),
       neighbour=st.booleans())
def test_synthetic_buckets_equal_exhaustive(n, budget, extra, g, q, lengths, neighbour):
    surface = Surface(base=[500] * n, a=20, q=q, g=g)     # answers of at most ~220
    budgets = [budget + extra] + [budget] * (n - 2) + [budget + extra // 2]
    budgets = budgets[:n]
    edges = sorted(lengths)
    try:
        out = search_buckets(surface.probe, budgets, edges, start=8, max_probes=40,
                             from_neighbour=neighbour)
    except NoFeasibleSplitError:
        assert exhaustive_max(surface, budgets, edges[-1], n) == 0
        return
    for s in out:
        want = exhaustive_max(surface, budgets, s.length, n)
        assert s.best.batch_size == want, (s.length, s.best.chunk_sizes, want)
        assert fits(surface, budgets, s.length, s.best.chunk_sizes)
        assert s.outcome.certified
    assert [s.length for s in out] == edges
    sizes = [s.best.batch_size for s in out]
    assert sizes == sorted(sizes, reverse=True)     # shrinks as the length grows


def test_neighbour_spends_fewer_probes_on_a_smooth_surface():
    surface = Surface(base=[800, 500, 500, 500], a=8, q=0, g=1)
    budgets = [60_000] * 4
    edges = [16, 24, 32, 48, 64, 96, 128]
    a = search_buckets(surface.probe, budgets, edges, start=64, max_probes=40)
    b = search_buckets(surface.probe, budgets, edges, start=64, max_probes=40, from_neighbour=False)
    assert [s.best.batch_size for s in a] == [s.best.batch_size for s in b]
    pa = sum(len(s.outcome.probes) for s in a)
    pb = sum(len(s.outcome.probes) for s in b)
    assert pa < pb


# ---- the simulated cluster, probed exhaustively -------------------------------------------
from lengths_models import V, gpt  # noqa: E402  (tests/support: the CLI tests' model)


def gpt_sample(n, length):
    return torch.randint(0, V, (n, length))


def bert():
    return BertClassifier(vocab_size=V, d_model=32, n_layers=1, n_heads=2, seq_len=128)


def bert_sample(n, length):
    return {"input_ids": torch.randint(0, V, (n, length)),
            "attention_mask": torch.ones(n, length, dtype=torch.long),
            "labels": torch.randint(0, 2, (n,))}


LENGTHS = [20] * 5 + [32] * 4 + [64] * 4 + [128] * 2


def _fits_all(r: ProbeResult, budgets) -> bool:
    return r.feasible and all(p <= b for i, (p, b, c) in enumerate(
        zip(r.peak_bytes, budgets, r.chunk_sizes)) if i == 0 or c > 0)


@pytest.mark.slow
@pytest.mark.parametrize("model,sample", [(gpt, gpt_sample), (bert, bert_sample)],
                         ids=["gpt", "bert"])
@pytest.mark.parametrize("spec", ["2x403.125MB,context=384MiB", "1x403.125MB,1x404.125MB,context=384MiB"],
                         ids=["identical", "mixed"])
def test_simulated_buckets_equal_exhaustive(model, sample, spec):
    plan = plan_lengths(model, sample, LENGTHS, [32, 64], simulate=spec, headroom=0,
                        budget_level="allocated")      # the oracle's peaks are allocated
    assert plan.edges == [32, 64, 128]
    assert [b.samples for b in plan.buckets] == [9, 4, 2]
    for bucket in plan.buckets:
        length = bucket.length
        backend = SimulatedBackend(Workload(model, lambda n, L=length: sample(n, L)), spec)
        budgets = [d.budget_bytes(0) for d in backend.devices]
        b = bucket.batch_size
        assert b >= 1 and bucket.certified
        assert _fits_all(backend.probe(list(bucket.chunk_sizes)), budgets)
        for c0 in range(b + 2):      # every split of one more sample: none fits
            r = backend.probe([c0, b + 1 - c0])
            assert not _fits_all(r, budgets), (length, r.chunk_sizes)
        backend.close()
    sizes = [bk.batch_size for bk in plan.buckets]
    assert sizes == sorted(sizes, reverse=True)


def test_sample_that_ignores_the_length_is_refused():
    with pytest.raises(UsageError, match="must build its batch at the length"):
        plan_lengths(gpt, lambda n, length: torch.randint(0, V, (n, 16)), [20, 40], 2,
                     simulate="2x24GB")


@pytest.mark.slow
def test_a_length_where_nothing_fits_names_it():
    with pytest.raises(NoFeasibleSplitError, match="at length 128"):
        # budgets of 9.1 MB: one sequence of 8 tokens fits, one of 128 does not
        plan_lengths(gpt, gpt_sample, [8, 128], [8], simulate="2x402.125MB,context=384MiB",
                     headroom=9 * 2**20 - 9_100_000, budget_level="allocated")


def test_lengths_beyond_the_model_are_refused():
    with pytest.raises(UsageError, match="at most 128 positions"):
        plan_lengths(gpt, gpt_sample, [8, 300], 2, simulate="2x24GB", max_length=128)


@pytest.mark.slow     # two whole plans; test_synthetic_buckets_equal_exhaustive checks both starts in make test
def test_neighbour_and_scratch_agree_on_the_simulator():
    spec = "1x403.125MB,1x404.125MB,context=384MiB"
    a = plan_lengths(gpt, gpt_sample, LENGTHS, [32, 64], simulate=spec, headroom=0,
                     budget_level="allocated")
    b = plan_lengths(gpt, gpt_sample, LENGTHS, [32, 64], simulate=spec, headroom=0,
                     from_neighbour=False, budget_level="allocated")
    assert [x.batch_size for x in a.buckets] == [x.batch_size for x in b.buckets]
    assert all(x.certified for x in itertools.chain(a.buckets, b.buckets))


@pytest.mark.slow
def test_ddp_buckets_each_rank_at_its_own_largest_batch():
    from dptune.backends.simulated.ddp import SimulatedDDP

    spec = "1x403.125MB,1x404.125MB,context=384MiB"
    plan = plan_lengths(gpt, gpt_sample, LENGTHS, [32, 64], simulate=spec, headroom=0, ddp=True,
                        budget_level="allocated")
    assert plan.ddp and plan.certified
    for bucket in plan.buckets:
        sim = SimulatedDDP(Workload(gpt, lambda n, L=bucket.length: gpt_sample(n, L)), spec)
        for r, b in enumerate(bucket.chunk_sizes):
            budget = sim.devices[r].budget_bytes(0)
            assert b >= 1
            assert sim.rank(r).estimate([b]).peak_bytes[0] <= budget
            assert sim.rank(r).estimate([b + 1]).peak_bytes[0] > budget
        sim.close()


class Stairs(Surface):
    """The synthetic surface in whole segments of ``seg`` (as the reserved level rises)."""

    def __init__(self, seg, *args):
        super().__init__(*args)
        self.seg = seg

    def peaks(self, length, split):
        return [-(-p // self.seg) * self.seg for p in super().peaks(length, split)]


@pytest.mark.parametrize("seg,g", [(300, 12), (700, 12), (2500, 20)])
def test_alike_cards_share_card0s_slack_within_one_sample(seg, g):
    # card 0 pays for the whole batch's outputs (g per sample and token), so its term sets
    # every bucket's largest batch and the other cards share what is left: alike cards (two
    # large, two small) get chunks within one sample, the batch still the largest
    surface = Stairs(seg, [500] * 4, 20, 0, g)
    budgets = [40_000, 40_000, 20_000, 20_000]
    edges = [8, 12, 16, 24, 32]
    out = search_buckets(surface.probe, budgets, edges, start=64, max_probes=40,
                         alike=["big", "big", "small", "small"])
    plain = search_buckets(surface.probe, budgets, edges, start=64, max_probes=40)
    # without the cards named alike, some bucket gives the small cards chunks apart
    assert any(abs(p.best.chunk_sizes[2] - p.best.chunk_sizes[3]) > 1 for p in plain)
    for s, p in zip(out, plain):
        c = s.best.chunk_sizes
        assert abs(c[2] - c[3]) <= 1
        assert s.outcome.certified and fits(surface, budgets, s.length, c)
        assert s.best.batch_size == p.best.batch_size == largest(surface, budgets, s.length)


def largest(surface, budgets, length):
    """The largest batch: cards >= 1 at their caps (each alone against its budget), card 0
    the fewest samples they leave it (its peak depends on its chunk and the batch only)."""
    def cap(i):
        c = 0
        while surface.peaks(length, [0] * i + [c + 1] + [0] * (3 - i))[i] <= budgets[i]:
            c += 1
        return c
    rest = sum(cap(i) for i in range(1, 4))
    b = 0
    while True:
        c0 = max(0, b + 1 - rest)
        if surface.peaks(length, [c0, b + 1 - c0, 0, 0])[0] > budgets[0]:
            return b
        b += 1


def test_the_reserved_level_notes_say_what_a_bucket_certificate_rests_on():
    """At the reserved level a plan's notes say how the figure was predicted (the allocator
    model, checked on one card) and what a certified bucket rests on (a figure that does not
    fall as the batch grows); at the allocated level neither."""
    from dptune.budget import BudgetLevel
    from dptune.lengths.search import _level_notes

    sim = _level_notes(BudgetLevel.RESERVED, True, ())
    assert any("checked on one card only" in n for n in sim)
    assert any(n.startswith("a bucket certified") and "does not fall as the batch grows" in n
               for n in sim)
    real = _level_notes(BudgetLevel.RESERVED, False, ())
    assert any("max_memory_reserved" in n for n in real) and not any("one card only" in n for n in real)
    assert any(n.startswith("a bucket certified") for n in real)
    assert _level_notes(BudgetLevel.ALLOCATED, True, ()) == []


def test_each_certified_bucket_is_looked_past_at_the_default_level():
    """At the reserved level (the default) on simulated cards every bucket's certificate is
    looked past on the allocator model before it is kept, and its note says how far."""
    plan = plan_lengths(gpt, gpt_sample, LENGTHS, [32, 64], simulate="2x2GB")
    assert plan.certified
    for bucket in plan.buckets:
        # the look past the over points, or past the answer where the probes left brackets
        # open for it
        note = next(n for n in plan.notes if n.startswith(f"length <= {bucket.length}: ")
                    and ("looked past" in n or "probes kept for the look" in n))
        assert "card 1: over from" in note and "card 0 with the batch" in note
    plain = plan_lengths(gpt, gpt_sample, LENGTHS, [32, 64], simulate="2x2GB",
                         budget_level="allocated")
    assert not any("looked past" in n for n in plain.notes)
