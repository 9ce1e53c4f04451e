"""sentence-transformers' trainer (a transformers.Trainer subclass) takes the same path.

A tiny BERT with a word-level tokenizer is written to a temporary folder (no download);
``fake_gpus`` (tests/integrations/conftest.py) makes the arguments report 4 GPUs and runs
BalancedDataParallel's replicas in turn on the CPU.
"""

from __future__ import annotations

import pytest
import torch
import transformers

pa = pytest.importorskip("pyarrow")
datasets = pytest.importorskip("datasets")
pytest.importorskip("sentence_transformers")
from sentence_transformers import (  # noqa: E402
    SentenceTransformer, SentenceTransformerTrainer, SentenceTransformerTrainingArguments,
)
from sentence_transformers.base.modules.transformer import Transformer  # noqa: E402
from sentence_transformers.sentence_transformer.losses import MultipleNegativesRankingLoss  # noqa: E402
from sentence_transformers.sentence_transformer.modules import Pooling  # noqa: E402
from tokenizers import Tokenizer, models, pre_tokenizers  # noqa: E402

from dptune.integrations.transformers import BalancedTrainerMixin  # noqa: E402
from dptune.parallel import BalancedDataParallel  # noqa: E402

WORDS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]"] + [f"w{i}" for i in range(40)]


class BalancedSentenceTransformerTrainer(BalancedTrainerMixin, SentenceTransformerTrainer):
    pass


@pytest.fixture(scope="module")
def bert_dir(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tiny-bert")
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token="[UNK]", pad_token="[PAD]", cls_token="[CLS]",
        sep_token="[SEP]").save_pretrained(folder)
    torch.manual_seed(0)
    cfg = transformers.BertConfig(vocab_size=len(WORDS), hidden_size=16, num_hidden_layers=1,
                                  num_attention_heads=2, intermediate_size=32,
                                  max_position_embeddings=32, hidden_dropout_prob=0.0,
                                  attention_probs_dropout_prob=0.0)
    transformers.BertModel(cfg).save_pretrained(folder)
    return str(folder)


def pairs() -> "datasets.Dataset":
    table = pa.Table.from_pydict({
        "anchor": [f"w{i} w{i + 1} w{(3 * i) % 40}" for i in range(24)],
        "positive": [f"w{i + 1} w{i + 2}" for i in range(24)]})
    # An explicit fingerprint: datasets 5.2 cannot hash a table here (dill fails to pickle
    # pyarrow's MonthDayNano), and the fingerprint is only a cache key.
    return datasets.Dataset(table, fingerprint="dptune-tiny-pairs")


def make(cls, bert_dir, tmp_path, per_device, n_gpu=None, **kw):
    model = SentenceTransformer(modules=[Transformer(bert_dir), Pooling(16)], device="cpu")
    args = SentenceTransformerTrainingArguments(
        output_dir=str(tmp_path / "out"), per_device_train_batch_size=per_device, max_steps=2,
        optim="sgd", learning_rate=0.5, logging_steps=1, save_strategy="no", report_to=[],
        use_cpu=True, seed=0, disable_tqdm=True, dataloader_pin_memory=False)
    if n_gpu is not None:
        _ = args.device
        args._n_gpu = n_gpu
    return cls(model=model, args=args, train_dataset=pairs(),
               loss=MultipleNegativesRankingLoss(model), **kw)


def test_sentence_transformers_trainer_takes_the_balanced_path(tmp_path, bert_dir,
                                                             fake_gpus):
    ref = make(SentenceTransformerTrainer, bert_dir, tmp_path, per_device=12)
    bal = make(BalancedSentenceTransformerTrainer, bert_dir, tmp_path, per_device=3, n_gpu=4,
               tuned=[0, 4, 4, 4])
    assert bal.balanced
    ref.train()
    bal.train()
    assert isinstance(bal.model_wrapped, BalancedDataParallel)
    assert bal.model_wrapped.chunk_sizes == [0, 4, 4, 4]
    assert fake_gpus and all(r == [4, 4, 4] for r in fake_gpus)    # card 0 got nothing
    ref_losses = [h["loss"] for h in ref.state.log_history if "loss" in h]
    bal_losses = [h["loss"] for h in bal.state.log_history if "loss" in h]
    assert len(ref_losses) == 2 and bal_losses == pytest.approx(ref_losses, rel=1e-5)
    for (n, p), q in zip(ref.model.named_parameters(), bal.model.parameters()):
        torch.testing.assert_close(q, p, rtol=1e-5, atol=1e-6, msg=n)


def test_its_own_batch_rule_is_said(tmp_path, bert_dir, fake_gpus):
    """sentence-transformers draws per_device_train_batch_size x n_gpu itself: with a tuned
    total of 10 and 3 x 4 = 12 drawn, the user is told how 12 is split."""
    bal = make(BalancedSentenceTransformerTrainer, bert_dir, tmp_path, per_device=3, n_gpu=4,
               tuned=[1, 3, 3, 3])
    with pytest.warns(UserWarning, match=r"draws 12 samples .* not the tuned total 10.*"
                                         r"\[1, 4, 4, 3\]"):
        bal.get_train_dataloader()


class AsDataParallel(torch.nn.DataParallel):
    """The simulator's wrapper as the nn.DataParallel the Trainer builds."""

    def __init__(self, wrapped):
        torch.nn.Module.__init__(self)
        self.module = wrapped.module
        self.wrapped = wrapped

    def forward(self, *args, **kwargs):
        return self.wrapped(*args, **kwargs)


@pytest.mark.slow
def test_sentence_transformers_trainer_is_tunable(tmp_path, bert_dir):
    """tune_trainer on a SentenceTransformerTrainer: its collator tokenizes the text columns
    (no column is dropped), its loss takes the features of each column and the labels on the
    wrapped model; the tuned split's peaks are those of its own training_step there."""
    from dptune.backends.simulated import estimate_memory
    from dptune.integrations.transformers import trainer_sample, tune_trainer

    trainer = make(SentenceTransformerTrainer, bert_dir, tmp_path, per_device=4)
    model, loss = trainer.model, trainer.loss
    before = {k: v.clone() for k, v in model.state_dict().items()}
    result = tune_trainer(trainer, simulate="2x24GB", verbose=False, max_probes=3,
                          budget_level="allocated")   # compared with the step's allocated peaks
    assert result.batch_size == 8 and len(result.chunk_sizes) == 2
    assert any("sgd (SGD)" in n for n in result.notes)
    # the Trainer, its loss and its model are as they were
    assert trainer.loss is loss and loss.model is model and trainer.model_wrapped is model
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())

    trainer.current_gradient_accumulation_steps = 1

    def real_step(wrapped, batch, optimizer):
        view = AsDataParallel(wrapped)
        trainer.model_wrapped = view      # as Trainer.train sets it to the DataParallel
        try:
            trainer.training_step(view, dict(batch))
        finally:
            trainer.model_wrapped = model
            loss.model = model
        optimizer.step()

    real = estimate_memory(model, trainer_sample(trainer), result.chunk_sizes, "2x24GB",
                           optimizer=lambda p: torch.optim.SGD(p, lr=0.5), step=real_step)
    for tuned, truth in zip(result.peak_bytes, real.peak_bytes):
        assert tuned == pytest.approx(truth, rel=0.005), (result.peak_bytes, real.peak_bytes)
