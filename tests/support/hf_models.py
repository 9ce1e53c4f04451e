"""A tiny GPT-2 built from a transformers config (no download), a token dataset held in
memory and the TrainingArguments the Trainer tests start from: the Hugging Face tests
(tests/integrations/, the CLI's --hf-trainer tests) build their Trainers from these."""

from __future__ import annotations

import torch
import transformers
from torch import nn

VOCAB, SEQ = 64, 12


def tiny_gpt2() -> nn.Module:
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=VOCAB,
                                  n_positions=SEQ, resid_pdrop=0.0, embd_pdrop=0.0,
                                  attn_pdrop=0.0, use_cache=False, bos_token_id=0,
                                  eos_token_id=0)
    return transformers.GPT2LMHeadModel(cfg)


class TokenData(torch.utils.data.Dataset):
    """Token ids and labels; example i has its last ``i % 5`` labels masked (-100), so
    examples carry different numbers of loss items."""

    def __init__(self, n: int = 24):
        g = torch.Generator().manual_seed(1)
        self.ids = torch.randint(0, VOCAB, (n, SEQ), generator=g)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict:
        labels = self.ids[i].clone()
        masked = i % 5
        if masked:
            labels[-masked:] = -100
        return {"input_ids": self.ids[i], "labels": labels, "unused_column": "text"}


def training_args(tmp_path, **kw) -> transformers.TrainingArguments:
    base = dict(output_dir=str(tmp_path / "out"), per_device_train_batch_size=4, max_steps=3,
                learning_rate=1e-2, logging_steps=1, save_strategy="no", report_to=[],
                use_cpu=True, seed=0, disable_tqdm=True, dataloader_pin_memory=False)
    base.update(kw)
    return transformers.TrainingArguments(**base)
