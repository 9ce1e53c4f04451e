"""tune_trainer never tunes silently at one length when the collator pads dynamically."""

from __future__ import annotations

import warnings

import pytest

transformers = pytest.importorskip("transformers")
tokenizers = pytest.importorskip("tokenizers")

from dptune.errors import DptuneWarning  # noqa: E402
from dptune.lengths.trainer import length_check, trainer_lengths  # noqa: E402
from hf_models import VOCAB, tiny_gpt2, training_args  # noqa: E402


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
    plan = plan_trainer_lengths(t, [4, 8], simulate="2x396MB,context=384MiB", headroom=0,
                                budget_level="allocated")   # 12 MiB cards: no room for NCCL
    assert plan.edges == [4, 8, 11]
    assert [b.samples for b in plan.buckets] == [12, 16, 12]
    assert plan.certified
    sizes = [b.batch_size for b in plan.buckets]
    assert sizes == sorted(sizes, reverse=True)
