"""Variable lengths without a search: bucket edges, the plan, the bucket sampler and
BalancedDataParallel taking the plan (all on the CPU, fast)."""

from __future__ import annotations

import collections
import dataclasses

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from dptune.errors import ReportError, UsageError
from dptune.lengths import BucketBatchSampler, LengthPlan, bucket_edges, check_lengths
from dptune.lengths.buckets import assign, padded, read_lengths
from dptune.lengths.plan import BucketPlan


# ---- edges --------------------------------------------------------------------------------
def test_quantile_edges_end_at_the_longest():
    lengths = list(range(1, 101))
    assert bucket_edges(lengths, 4) == [25, 50, 75, 100]
    assert bucket_edges(lengths, 1) == [100]


def test_explicit_edges_never_stop_short_of_the_longest():
    lengths = [10, 200, 300, 700]
    assert bucket_edges(lengths, [128, 256, 512]) == [128, 256, 512, 700]
    assert bucket_edges(lengths, "128,256,512,1024,2048") == [128, 256, 512, 700]
    assert bucket_edges(lengths, [128, 700]) == [128, 700]


def test_empty_buckets_are_dropped():
    assert bucket_edges([5, 6, 600], [8, 16, 32, 64]) == [8, 600]


def test_pad_to_multiple_of_rounds_lengths_and_edges():
    assert padded(13, 8) == 16 and padded(16, 8) == 16 and padded(13, None) == 13
    assert bucket_edges([3, 13, 17, 250], [10, 100], pad_to_multiple_of=8) == [16, 104, 256]


@settings(max_examples=60, deadline=None)
@given(lengths=st.lists(st.integers(1, 5000), min_size=1, max_size=200),
       k=st.integers(1, 12), m=st.sampled_from([None, 1, 8, 64]))
def test_every_sample_has_a_bucket_and_the_last_edge_is_the_longest(lengths, k, m):
    edges = bucket_edges(lengths, k, pad_to_multiple_of=m)
    assert edges == sorted(set(edges)) and len(edges) <= k
    assert edges[-1] == max(padded(x, m) for x in lengths)
    where = assign(lengths, edges, m)
    for x, b in zip(lengths, where):
        lo = edges[b - 1] if b else 0
        assert lo < padded(x, m) <= edges[b]
    assert set(where) == set(range(len(edges)))      # no empty bucket


@pytest.mark.parametrize("bad,match", [([], "empty"), ([3, -1], "lengths must be >= 1"),
                                       ([3, 0], ">= 1"), ([2.5], "not an integer"),
                                       (["x"], "not an integer"), ([True], "integer length")])
def test_bad_lengths_are_one_line_usage_errors(bad, match):
    with pytest.raises(UsageError, match=match):
        check_lengths(bad)


def test_bad_edges_and_too_long_data():
    with pytest.raises(UsageError, match="increasing"):
        bucket_edges([1, 2], [64, 32])
    with pytest.raises(UsageError, match="at most 512 positions"):
        bucket_edges([1, 600], 2, max_length=512)
    with pytest.raises(UsageError, match="count"):
        bucket_edges([1, 2], "a,b")


def test_read_lengths_from_text_and_csv(tmp_path):
    (tmp_path / "l.txt").write_text("3\n\n17\n5\n")
    assert read_lengths(str(tmp_path / "l.txt")) == [3, 17, 5]
    (tmp_path / "l.csv").write_text("n_tokens,other\n4,a\n9,b\n")
    assert read_lengths(str(tmp_path / "l.csv"), "n_tokens") == [4, 9]
    with pytest.raises(UsageError, match="name the length column"):
        read_lengths(str(tmp_path / "l.csv"))
    (tmp_path / "bad.txt").write_text("3\nabc\n")
    with pytest.raises(UsageError, match="line 2"):
        read_lengths(str(tmp_path / "bad.txt"))
    with pytest.raises(UsageError, match="no such file"):
        read_lengths(str(tmp_path / "missing.txt"))


# ---- the plan -----------------------------------------------------------------------------
def make_plan(pad=None):
    b = [BucketPlan(0, 64, 10, (4, 12, 12), (9, 9, 9), 0, True, 3),
         BucketPlan(64, 128, 5, (1, 6, 7), (9, 9, 9), 2, True, 2),
         BucketPlan(128, 512, 2, (0, 2, 1), (9, 9, 9), 1, False, 4)]
    return LengthPlan(buckets=tuple(b), devices=("a", "b", "c"), budget_bytes=(10, 10, 10),
                      pad_to_multiple_of=pad)


def test_plan_lookup_and_json_round_trip(tmp_path):
    plan = make_plan()
    assert plan.chunk_sizes_for(64) == [4, 12, 12]
    assert plan.chunk_sizes_for(65) == [1, 6, 7]
    assert plan.chunk_sizes_for(500) == [0, 2, 1]
    small = plan.chunk_sizes_for(100, 7)
    assert sum(small) == 7 and all(s <= c for s, c in zip(small, [1, 6, 7]))
    with pytest.raises(UsageError, match="larger than the 14 planned"):
        plan.chunk_sizes_for(100, 15)
    with pytest.raises(UsageError, match="longer than the last bucket edge 512"):
        plan.chunk_sizes_for(513)
    assert plan.buckets[0].describe() == "length <= 64: batch 28 = [4, 12, 12], 1,792 tokens/step"
    assert "(not certified)" in plan.buckets[2].describe()
    plan.save(str(tmp_path))
    again = LengthPlan.load(str(tmp_path))
    assert again == plan
    (tmp_path / "x.json").write_text("{}")
    with pytest.raises(ReportError):
        LengthPlan.load(str(tmp_path / "x.json"))


# ---- the sampler --------------------------------------------------------------------------
@settings(max_examples=40, deadline=None)
@given(lengths=st.lists(st.integers(1, 512), min_size=1, max_size=300),
       shuffle=st.booleans(), seed=st.integers(0, 5), epoch=st.integers(0, 3))
def test_an_epoch_covers_every_sample_exactly_once(lengths, shuffle, seed, epoch):
    plan = make_plan()
    s = BucketBatchSampler(lengths, plan, shuffle=shuffle, seed=seed)
    s.set_epoch(epoch)
    batches = list(s)
    assert len(batches) == len(s)
    seen = collections.Counter(i for b in batches for i in b)
    assert sorted(seen) == list(range(len(lengths))) and set(seen.values()) == {1}
    for b in batches:
        ks = {plan.edges.index(plan.bucket_for(lengths[i]).length) for i in b}
        assert len(ks) == 1                              # one bucket per batch
        k = ks.pop()
        full = plan.buckets[k].batch_size
        assert len(b) <= full
    # at most one smaller batch (the tail) per bucket
    tails = collections.Counter(plan.bucket_for(lengths[b[0]]).length for b in batches
                                if len(b) < plan.bucket_for(lengths[b[0]]).batch_size)
    assert all(v == 1 for v in tails.values())


def test_drop_last_drops_only_the_tails_and_set_epoch_reshuffles_reproducibly():
    lengths = [10] * 30 + [100] * 20 + [400] * 5
    plan = make_plan()
    s = BucketBatchSampler(lengths, plan, drop_last=True, seed=3)
    batches = list(s)
    assert all(len(b) == plan.bucket_for(lengths[b[0]]).batch_size for b in batches)
    assert sum(map(len, batches)) == 28 + 14 + 3     # 2 + 6 + 2 samples of tails dropped
    a = BucketBatchSampler(lengths, plan, seed=3)
    b = BucketBatchSampler(lengths, plan, seed=3)
    assert list(a) == list(b)
    a.set_epoch(1)
    assert list(a) != list(b)
    b.set_epoch(1)
    assert list(a) == list(b)
    ordered = list(BucketBatchSampler(lengths, plan, shuffle=False))
    assert ordered == [list(range(28)), [28, 29], list(range(30, 44)), list(range(44, 50)),
                       [50, 51, 52], [53, 54]]


# ---- BalancedDataParallel takes the plan --------------------------------------------------
class Tok(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(50, 4)

    def forward(self, ids, mask=None):
        return self.emb(ids).sum(dim=(1, 2))


def test_balanced_data_parallel_uses_the_planned_chunks_for_each_length():
    from tests.test_parallel import make_cpu

    plan = make_plan(pad=8)
    w = make_cpu(Tok(), 3, plan=plan)
    for length, batch, want in [(64, 28, [4, 12, 12]), (60, 28, [4, 12, 12]),
                                (65, 14, [1, 6, 7]), (128, 14, [1, 6, 7]),
                                (300, 3, [0, 2, 1]), (70, 7, plan.chunk_sizes_for(70, 7))]:
        w.scattered = []
        ids = torch.randint(0, 50, (batch, length))
        w(ids, mask=torch.ones(batch, length))
        assert w.last_chunk_sizes == want, (length, batch)
        assert w.scattered[0][1] == [c for c in want if c > 0]
    with pytest.raises(UsageError, match="larger than the 28 planned"):
        w(torch.randint(0, 50, (29, 64)))
    with pytest.raises(UsageError, match="not both"):
        make_cpu(Tok(), 3, plan=plan, chunk_sizes=[1, 1, 1])


# ---- the single token budget --------------------------------------------------------------
def _safe(plan, total, count, per=None):
    """Every batch the budget allows (count x longest <= total, count <= cap) is at most the
    planned batch of its bucket (by enumeration over every padded length)."""
    m = plan.pad_to_multiple_of or 1
    for L in range(m, plan.edges[-1] + 1, m):
        k = plan.edges.index(plan.bucket_for(L).length)
        allowed = min(count, total // L)
        planned = plan.buckets[k].batch_size if per is None else plan.buckets[k].chunk_sizes[per]
        if allowed > planned:
            return False
    return True


@settings(max_examples=60, deadline=None)
@given(data=st.data(), n=st.integers(1, 6), pad=st.sampled_from([None, 4]))
def test_the_token_budget_is_the_largest_safe_one(data, n, pad):
    from dptune.lengths.budget import token_budgets

    m = pad or 1
    edges = sorted(set(m * x for x in data.draw(st.lists(st.integers(1, 40), min_size=n,
                                                         max_size=n))))
    batches = sorted(data.draw(st.lists(st.integers(1, 300), min_size=len(edges),
                                        max_size=len(edges))), reverse=True)
    buckets, lo = [], 0
    for e, b in zip(edges, batches):
        buckets.append(BucketPlan(lo, e, 1, (b - b // 3, b // 3), (0, 0), 0, True))
        lo = e
    plan = LengthPlan(tuple(buckets), ("a", "b"), (1, 1), pad_to_multiple_of=pad)
    tb = token_budgets(plan)
    assert tb.max_count == batches[0]
    assert _safe(plan, tb.max_tokens, tb.max_count)
    # the largest such budget: one more token either allows no new batch or an unsafe one
    more = tb.max_tokens + 1
    changes = any(min(tb.max_count, more // L) != min(tb.max_count, tb.max_tokens // L)
                  for L in range(1, edges[-1] + 1))
    assert not changes or not _safe(plan, more, tb.max_count)
    for i in range(2):
        assert _safe(plan, tb.per_card_tokens[i], tb.per_card_count[i], per=i)


def test_snippets_give_fairseq_lines_only_for_a_ddp_plan():
    from dptune.lengths.budget import snippets, token_budgets

    plan = make_plan()
    assert not any("--max-tokens" in line and "rank" in line for line in snippets(plan))
    ddp = dataclasses.replace(plan, ddp=True)
    tb = token_budgets(ddp)
    lines = snippets(ddp)
    for r in range(3):
        assert (f"#   rank {r}: --max-tokens {tb.per_card_tokens[r]} "
                f"--batch-size {tb.per_card_count[r]}") in lines


def test_a_ddp_plan_for_another_world_size_is_refused_whatever_rank_says():
    """Inside a torch.distributed job the bucket sampler checks the plan's world size as the DDP
    sampler does, also when rank= is given (a 3-rank plan in a 1-rank gloo job)."""
    import torch.distributed as dist

    from dptune.lengths.sampler import BucketBatchSampler

    plan = dataclasses.replace(make_plan(), ddp=True)
    lengths = [10] * 20 + [100] * 10 + [300] * 4
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        with pytest.raises(UsageError, match="the plan has 3 ranks but this torch.distributed job has 1"):
            BucketBatchSampler(lengths, plan, rank=0)
    finally:
        dist.destroy_process_group()
    assert len(BucketBatchSampler(lengths, plan, rank=0)) > 0     # outside a job: rank= is enough
