"""One token budget, for code that takes a single number, and ready-to-paste lines.

The rule a token budget obeys is the cost of a padded batch: ``count x longest padded
length <= max_tokens`` (not the sum of the lengths: a batch is padded to its longest, lhotse
#640). A budget is safe when every batch it allows is at most a planned one: a batch whose
longest length falls in bucket ``j`` (padded lengths ``lo_j < l <= L_j``) may hold at most
``floor(max_tokens / l)`` sequences, largest at the bucket's shortest padded length
``lo_j + m`` (``m``: ``pad_to_multiple_of``, else 1), and that must not exceed the bucket's
planned batch ``B_j``. So::

    max_count  = B_0      (the shortest bucket's batch: a cap on the count as well)
    max_tokens = min over buckets j with B_j < B_0 of (B_j + 1) * (lo_j + m) - 1
                 (no such bucket: B_0 x the longest length)

Per card the same with each card's own chunk. A single number gives up what the buckets
gain (the table beside it shows both); the per-bucket plan with
:class:`dptune.lengths.BucketBatchSampler` keeps every bucket's full batch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from dptune.lengths.plan import LengthPlan

__all__ = ["TokenBudget", "token_budgets", "snippets"]


@dataclass(frozen=True)
class TokenBudget:
    """``count x longest <= max_tokens`` and ``count <= max_count``: the whole batch, and
    per card (``per_card_tokens``, ``per_card_count``: each card's own chunk)."""

    max_tokens: int
    max_count: int
    per_card_tokens: tuple[int, ...]
    per_card_count: tuple[int, ...]

    def describe(self) -> str:
        return (f"one token budget (count x longest padded length <= max_tokens, at most "
                f"max_count sequences): max_tokens={self.max_tokens:,}, max_count={self.max_count}; "
                "per card: " + ", ".join(f"card {i} {t:,} tokens/{c} seqs" for i, (t, c) in
                                         enumerate(zip(self.per_card_tokens, self.per_card_count))))

    def to_dict(self) -> dict[str, object]:
        return dict(max_tokens=self.max_tokens, max_count=self.max_count,
                    per_card_tokens=list(self.per_card_tokens),
                    per_card_count=list(self.per_card_count))


def _budget(batches: Sequence[int], los: Sequence[int], lengths: Sequence[int], m: int) -> int:
    """The largest budget with the count capped at ``batches[0]``: only a bucket whose batch
    is below the cap limits it (at its shortest padded length); none: the cap at the longest."""
    cap = batches[0]
    limits = [(b + 1) * (lo + m) - 1 for b, lo in zip(batches, los) if b < cap]
    return min(limits) if limits else cap * lengths[-1]


def token_budgets(plan: LengthPlan) -> TokenBudget:
    """The largest single token budget every batch of which is at most a planned one."""
    m = plan.pad_to_multiple_of or 1
    los = [b.lo for b in plan.buckets]
    lengths = [b.length for b in plan.buckets]
    total = _budget([b.batch_size for b in plan.buckets], los, lengths, m)
    n = len(plan.devices)
    per_t, per_c = [], []
    for i in range(n):
        chunks = [b.chunk_sizes[i] for b in plan.buckets]
        per_t.append(max(0, _budget(chunks, los, lengths, m)))
        per_c.append(chunks[0])
    return TokenBudget(max_tokens=max(0, total), max_count=plan.buckets[0].batch_size,
                       per_card_tokens=tuple(per_t), per_card_count=tuple(per_c))


def snippets(plan: LengthPlan, plan_path: str = "lengths.json") -> list[str]:
    """Lines to paste: plain PyTorch with the bucket sampler and the wrapper; the Hugging Face
    Trainer; a single token budget for code that takes one number."""
    tb = token_budgets(plan)
    return [
        "# plain PyTorch: batches within buckets, each batch's chunks from its length",
        "from dptune.lengths import BucketBatchSampler, LengthPlan",
        "from dptune.parallel import BalancedDataParallel",
        f"plan = LengthPlan.load({plan_path!r})",
        "loader = DataLoader(dataset, batch_sampler=BucketBatchSampler(lengths, plan), "
        "collate_fn=pad_batch)",
        "model = BalancedDataParallel(model.cuda(), plan=plan)",
        "",
        "# Hugging Face Trainer: the same sampler (the Trainer has no token batching)",
        "class BucketTrainer(Trainer):",
        "    def get_train_dataloader(self):",
        "        return DataLoader(self.train_dataset, collate_fn=self.data_collator,",
        "                          batch_sampler=BucketBatchSampler(lengths, plan))",
        "",
        "# one number only (count x longest padded length <= max_tokens, count <= max_count):",
        f"max_tokens, max_count = {tb.max_tokens}, {tb.max_count}",
    ] + (_ddp_lines(tb) if plan.ddp else [
        "# fairseq --max-tokens is per GPU, each GPU its own batch (DDP): a DataParallel plan's "
        "card 0 also gathers the whole batch, so its per-card figures do not map onto it; plan "
        "with ddp=True for that"]) + [
        "# verl's ppo_max_token_len_per_gpu bounds the sum of unpadded lengths (packed), not "
        "count x longest: these padded-batch budgets do not map onto it exactly"]


def _ddp_lines(tb: TokenBudget) -> list[str]:
    """fairseq's per-GPU budget is count x longest padded length, as here: exact per rank."""
    out = ["# fairseq (DDP, one GPU per rank): --max-tokens / --batch-size per rank"]
    for r, (t, c) in enumerate(zip(tb.per_card_tokens, tb.per_card_count)):
        out.append(f"#   rank {r}: --max-tokens {t} --batch-size {c}")
    if len(set(tb.per_card_tokens)) > 1:
        out.append("#   (fairseq takes one value for every rank: the smallest, "
                   f"--max-tokens {min(tb.per_card_tokens)} --batch-size {min(tb.per_card_count)}, "
                   "unless each rank is launched with its own)")
    return out
