"""tune_trainer never tunes silently at one length when the collator pads dynamically."""

from __future__ import annotations

import math
import warnings

import pytest
import torch

transformers = pytest.importorskip("transformers")
tokenizers = pytest.importorskip("tokenizers")

from dptune.errors import DptuneWarning  # noqa: E402
from dptune.lengths.trainer import length_check, trainer_lengths  # noqa: E402
from hf_models import VOCAB, tiny_gpt2, training_args  # noqa: E402
from tests.integrations.test_hf_trainer import four_gpu_args  # noqa: E402


class PadWithLabels(transformers.DataCollatorWithPadding):
    """Pads as DataCollatorWithPadding does and adds the causal LM's labels (the Trainer's own
    loss is what dptune probes: the model must return one)."""

    def __call__(self, features):
        batch = super().__call__(features)
        labels = batch["input_ids"].clone()
        labels[batch["attention_mask"] == 0] = -100
        batch["labels"] = labels
        return batch


def pad_collator(padding=True):
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel({"[PAD]": 0, "a": 1}, unk_token="a"))
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="[PAD]")
    return PadWithLabels(fast, padding=padding, max_length=12 if padding == "max_length" else None)


class Texts:
    """Token ids of lengths 2..11, sorted short first (as a length-sorted dataset)."""

    def __init__(self, n=40):
        self.rows = [[(i + k) % VOCAB for k in range(2 + (i * 10) // n)] for i in range(n)]

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        return {"input_ids": self.rows[i]}


def trainer(tmp_path, collator):
    return transformers.Trainer(model=tiny_gpt2(), args=training_args(tmp_path),
                                train_dataset=Texts(), data_collator=collator)


def test_lengths_are_read_from_the_dataset(tmp_path):
    key, lengths = trainer_lengths(trainer(tmp_path, pad_collator()))
    assert key == "input_ids" and len(lengths) == 40
    assert min(lengths) == 2 and max(lengths) == 11


@pytest.mark.slow
def test_dynamic_padding_warns_and_notes_the_length(tmp_path):
    from dptune.integrations.transformers import tune_trainer

    t = trainer(tmp_path, pad_collator())
    with pytest.warns(DptuneWarning, match="lengths vary from 2 to 11") as rec:
        result = tune_trainer(t, simulate="2x24GB", verbose=False)
    message = next(str(w.message) for w in rec if issubclass(w.category, DptuneWarning))
    # the probes' batches: the first 8 examples (4 per card x 2), padded to the longest, 3
    assert "batches were 3 long" in message
    assert any("lengths vary" in n for n in result.notes)


def test_fixed_padding_says_nothing(tmp_path):
    from dptune.integrations.transformers import tune_trainer

    t = trainer(tmp_path, pad_collator(padding="max_length"))
    check = length_check(t, 8)
    assert check is not None and not check.varies
    with warnings.catch_warnings():
        warnings.simplefilter("error", DptuneWarning)
        tune_trainer(t, simulate="2x24GB", verbose=False)


@pytest.mark.slow
def test_plan_per_bucket_from_the_trainer(tmp_path):
    from dptune.integrations.trainer_lengths import TrainerLengthSample, plan_trainer_lengths

    t = trainer(tmp_path, pad_collator())
    sample = TrainerLengthSample(t, "input_ids")
    batch = sample(3, 7)
    assert tuple(batch["input_ids"].shape) == (3, 7) and batch["attention_mask"].all()
    # cards of 12 MiB each: batches of tens (the probes collate real examples)
    plan = plan_trainer_lengths(t, [4, 8], simulate="2x405.125MB,context=384MiB", headroom=0,
                                budget_level="allocated")   # 12 MiB cards: no room for NCCL
    assert plan.edges == [4, 8, 11]
    assert [b.samples for b in plan.buckets] == [12, 16, 12]
    assert plan.certified
    sizes = [b.batch_size for b in plan.buckets]
    assert sizes == sorted(sizes, reverse=True)


# ---- training with a plan -------------------------------------------------------------------

from dptune.errors import UsageError  # noqa: E402
from dptune.lengths.plan import BucketPlan, LengthPlan  # noqa: E402

EDGES = (4, 8, 11)


def hand_bucket(length):
    """Texts' buckets for EDGES, by hand: (0, 4], (4, 8], (8, 11]."""
    return 0 if length <= 4 else 1 if length <= 8 else 2


def hand_plan(splits, edges=EDGES, ddp=False):
    buckets, lo = [], 0
    for edge, split in zip(edges, splits):
        buckets.append(BucketPlan(lo=lo, length=edge, samples=0, chunk_sizes=tuple(split),
                                  peak_bytes=(0,) * len(split), binding_card=0, certified=True))
        lo = edge
    cards = len(splits[0])
    return LengthPlan(buckets=tuple(buckets), devices=tuple(f"cuda:{i}" for i in range(cards)),
                      budget_bytes=(1,) * cards, ddp=ddp)


class Recording(PadWithLabels):
    """Pads as PadWithLabels and records every batch: its examples (each Texts row starts with
    its own index) and its padded length."""

    def __init__(self, *a, **k):
        super().__init__(*a, **k)
        self.batches = []

    def __call__(self, features):
        batch = super().__call__(features)
        self.batches.append(([f["input_ids"][0] for f in features], batch["input_ids"].shape[1]))
        return batch


def recording_collator():
    base = pad_collator()
    return Recording(base.tokenizer, padding=True)


def check_epoch(batches, planned):
    """Every sample once; each batch within one bucket (by hand), of the bucket's planned size
    but for at most one smaller tail batch per bucket, padded no longer than its edge."""
    lengths = Texts().rows
    assert sorted(i for ids, _ in batches for i in ids) == list(range(40))
    tails = [0, 0, 0]
    for ids, padded in batches:
        (k,) = {hand_bucket(len(lengths[i])) for i in ids}
        assert padded <= EDGES[k]
        if len(ids) != planned[k]:
            assert len(ids) < planned[k]
            tails[k] += 1
    assert max(tails) <= 1


@pytest.mark.slow
def test_a_trainer_with_the_plan_draws_the_planned_batches(tmp_path):
    """tiny GPT-2 on the CPU (one card), two epochs: 12, 16 and 12 samples in the buckets at
    planned batches 5, 3, 2 are 3 + 6 + 6 = 15 steps an epoch, each sample once an epoch."""
    from dptune.integrations.trainer_lengths import with_length_plan
    from dptune.integrations.transformers import BalancedTrainerMixin

    collator = recording_collator()
    plain = transformers.Trainer(model=tiny_gpt2(), args=training_args(
        tmp_path, max_steps=-1, num_train_epochs=2), train_dataset=Texts(), data_collator=collator)
    before = {n: p.detach().clone() for n, p in plain.model.named_parameters()}
    t = with_length_plan(plain, hand_plan([[5], [3], [2]]))
    assert isinstance(t, BalancedTrainerMixin) and isinstance(t, transformers.Trainer)
    assert type(plain) is transformers.Trainer and not hasattr(plain, "length_plan")
    t.train()
    assert t.state.global_step == 30
    first, second = collator.batches[:15], collator.batches[15:]
    assert len(second) == 15
    check_epoch(first, [5, 3, 2])
    check_epoch(second, [5, 3, 2])
    assert [ids for ids, _ in first] != [ids for ids, _ in second]      # reshuffled
    losses = [h["loss"] for h in t.state.log_history if "loss" in h]
    assert losses and all(math.isfinite(x) for x in losses)
    assert any(not torch.equal(p, before[n]) for n, p in t.model.named_parameters())


@pytest.mark.slow
def test_several_gpus_split_each_batch_as_its_bucket_plans(tmp_path, fake_gpus,  # noqa: F811
                                                          monkeypatch):
    from dptune.integrations.transformers import BalancedTrainer
    from dptune.parallel import BalancedDataParallel

    splits = [[1, 2, 2, 2], [0, 2, 2, 1], [0, 1, 1, 1]]
    seen = []
    inner = BalancedDataParallel._parallel_apply

    def spy(self, replicas, inputs, kwargs, device_ids):
        per_card = dict(zip(device_ids, (k["input_ids"].shape[0] for k in kwargs)))
        seen.append(([per_card.get(d, 0) for d in range(4)], kwargs[0]["input_ids"].shape[1]))
        return inner(self, replicas, inputs, kwargs, device_ids)
    monkeypatch.setattr(BalancedDataParallel, "_parallel_apply", spy)
    collator = recording_collator()
    plan = hand_plan(splits)
    t = BalancedTrainer(model=tiny_gpt2(), args=four_gpu_args(tmp_path, max_steps=-1, num_train_epochs=1),
                        train_dataset=Texts(), data_collator=collator, plan=plan)
    t.train()
    assert isinstance(t.model_wrapped, BalancedDataParallel) and t.model_wrapped.plan is plan
    check_epoch(collator.batches, [7, 5, 3])
    assert len(seen) == len(collator.batches) == 2 + 4 + 4
    lengths = Texts().rows
    for (ids, padded), (per_card, length) in zip(collator.batches, seen):
        assert length == padded
        planned = splits[hand_bucket(len(lengths[ids[0]]))]
        if len(ids) == sum(planned):
            assert per_card == planned
        else:                                   # a tail: the plan scaled down, never above it
            assert sum(per_card) == len(ids) and all(c <= p for c, p in zip(per_card, planned))


def test_a_plan_for_other_cards_or_processes_is_one_line(tmp_path):
    from dptune.integrations.transformers import BalancedTrainer

    def build(**kw):
        return BalancedTrainer(model=tiny_gpt2(), args=training_args(tmp_path),
                               train_dataset=Texts(), data_collator=pad_collator(), **kw)
    with pytest.raises(UsageError, match="is for 2 cards but this Trainer trains on 1"):
        build(plan=hand_plan([[1, 1], [1, 1], [1, 1]]))
    with pytest.raises(UsageError, match="not both"):
        build(plan=hand_plan([[2], [2], [2]]), tuned=[2])
    with pytest.raises(UsageError, match="DDP plan"):
        build(plan=hand_plan([[2], [2], [2]], ddp=True))
    short = build(plan=hand_plan([[2], [2], [2]], edges=(4, 8, 10)))
    with pytest.raises(UsageError, match="length 11 is longer than the last bucket edge 10"):
        short.get_train_dataloader()


def test_a_saved_plan_is_taken_by_its_path(tmp_path):
    from dptune.integrations.transformers import BalancedTrainer

    hand_plan([[5], [3], [2]]).save(str(tmp_path / "lengths.json"))
    t = BalancedTrainer(model=tiny_gpt2(), args=training_args(tmp_path), train_dataset=Texts(),
                        data_collator=pad_collator(), plan=str(tmp_path))
    assert t.length_plan.edges == list(EDGES)
    sizes = [b["input_ids"].shape[0] for b in t.get_train_dataloader()]
    assert sorted(sizes) == sorted([5, 5, 2] + [3] * 5 + [1] + [2] * 6)


# ---- the command line: --hf-trainer --lengths -------------------------------------------------

TRAINER_MODULE = '''
import transformers
from tests.support.hf_models import tiny_gpt2, training_args
from tests.integrations.test_lengths_trainer import Texts, pad_collator
import pathlib

def make_trainer():
    return transformers.Trainer(model=tiny_gpt2(), args=training_args(pathlib.Path(".")),
                                train_dataset=Texts(), data_collator=pad_collator())
'''


@pytest.fixture
def trainer_module(tmp_path, monkeypatch):
    import sys
    import uuid

    name = f"lentrainer_{uuid.uuid4().hex[:8]}"
    (tmp_path / f"{name}.py").write_text(TRAINER_MODULE)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [str(tmp_path)] + list(sys.path))
    yield name
    sys.modules.pop(name, None)


@pytest.mark.parametrize("argv, fragment", [
    (["--model", "x:y", "--lengths"], "--lengths needs a FILE"),
    (["--hf-trainer", "{m}:make_trainer", "--lengths", "lengths.txt"], "give --lengths without a FILE"),
    (["--hf-trainer", "{m}:make_trainer", "--lengths", "--input-shape", "8"], "drop --input-shape"),
])
def test_cli_hf_trainer_lengths_errors(trainer_module, capsys, argv, fragment):
    from dptune.cli import main

    rc = main(["search", *[a.format(m=trainer_module) for a in argv], "--simulate", "1x24GB"])
    assert rc == 2
    assert fragment in capsys.readouterr().err


@pytest.mark.slow
def test_cli_hf_trainer_lengths_writes_the_trainers_plan(trainer_module, tmp_path, capsys):
    """The plan from the Trainer's own dataset (lengths 2..11, 4 each), and the line that
    trains with it; the saved plan is what BalancedTrainer(plan=folder) takes."""
    from dptune.cli import main

    code = main(["search", "--hf-trainer", f"{trainer_module}:make_trainer", "--lengths",
                 "--buckets", "4,8", "--simulate", "1x405.125MB,context=384MiB", "--headroom", "0",
                 "--budget-level", "allocated",     # 12 MiB cards: smaller than one segment
                 "--out", str(tmp_path / "rep"), "--no-plots"])
    out, err = capsys.readouterr()
    assert code == 0, err
    plan = LengthPlan.load(str(tmp_path / "rep"))
    assert plan.edges == [4, 8, 11] and [b.samples for b in plan.buckets] == [12, 16, 12]
    assert plan.certified and len(plan.devices) == 1
    assert "length <= 11: batch" in out
    assert f"with_length_plan(make_trainer(), {str(tmp_path / 'rep')!r})" in out


@pytest.mark.slow
def test_tune_trainer_lengths_hands_back_a_trainer_that_trains_with_the_plan(tmp_path):
    """Planned on one simulated card small enough that the buckets' batches are below their
    samples (cards of 402.125 MiB less 384 MiB of context), then one epoch: each bucket's batches of
    its planned size but for one tail, every sample once."""
    from dptune.integrations.trainer_lengths import tune_trainer_lengths

    collator = recording_collator()
    plain = transformers.Trainer(model=tiny_gpt2(), args=training_args(
        tmp_path, max_steps=-1, num_train_epochs=1), train_dataset=Texts(), data_collator=collator)
    t = tune_trainer_lengths(plain, [4, 8], simulate="1x402.125MB,context=384MiB", headroom=0,
                             budget_level="allocated")     # 9 MiB: smaller than one segment
    planned = [b.batch_size for b in t.length_plan.buckets]
    assert t.length_plan.edges == list(EDGES) and t.length_plan.certified
    assert any(b < n for b, n in zip(planned, [12, 16, 12]))   # some bucket takes several steps
    collator.batches.clear()                    # the probes' batches went through it too
    t.train()
    check_epoch(collator.batches, planned)
    hand = sum(-(-n // b) for n, b in zip([12, 16, 12], planned))
    assert t.state.global_step == len(collator.batches) == hand


def test_training_wraps_with_the_plan_and_evaluation_as_the_trainer_does(
        tmp_path, fake_gpus):  # noqa: F811
    from dptune.integrations.transformers import BalancedTrainer
    from dptune.parallel import BalancedDataParallel

    plan = hand_plan([[1, 2, 2, 2], [0, 2, 2, 1], [0, 1, 1, 1]])
    t = BalancedTrainer(model=tiny_gpt2(), args=four_gpu_args(tmp_path), train_dataset=Texts(),
                        data_collator=pad_collator(), plan=plan)
    assert t.balanced and t._train_batch_size == 7           # the largest planned batch
    wrapped = t._wrap_model(t.model, training=True)
    assert isinstance(wrapped, BalancedDataParallel) and wrapped.plan is plan
    evaluating = t._wrap_model(t.model, training=False)
    assert type(evaluating) is torch.nn.DataParallel
