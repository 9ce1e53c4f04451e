"""The Lightning callback (dptune.integrations.lightning.MemoryMonitor) in a real CPU
Lightning Trainer: a few steps trained exactly as without it, one reading per batch with its
shape, the figures in the loggers; out of memory keeps the same exception. Lightning is an
optional extra (``dptune[lightning]``): without it these tests are skipped."""

from __future__ import annotations

import json
import warnings

import pytest
import torch
import torch.nn as nn

pl = pytest.importorskip("lightning.pytorch", reason="lightning is not installed (pip install 'dptune[lightning]')")

from dptune.monitor import MonitorWarning, load_run  # noqa: E402

from fake_cards import FakeCards  # noqa: E402

LENGTH = 7


class Tiny(pl.LightningModule):
    def __init__(self, raise_at=None):
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Embedding(16, 8)
        self.out = nn.Linear(8, 16)
        self.raise_at, self.raised = raise_at, []

    def training_step(self, batch, batch_idx):
        if batch_idx == self.raise_at:
            self.raised.append(torch.OutOfMemoryError("CUDA out of memory. GPU 0 has a total capacity"))
            raise self.raised[0]
        ids = batch["input_ids"]
        return nn.functional.cross_entropy(self.out(self.emb(ids)).flatten(0, 1), ids.flatten())

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)


class Ids(torch.utils.data.Dataset):
    def __init__(self):
        self.ids = torch.randint(0, 16, (12, LENGTH), generator=torch.Generator().manual_seed(1))

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i]}


class Metrics(pl.loggers.Logger):
    name, version = "metrics", 0

    def __init__(self):
        super().__init__()
        self.logged = []

    def log_metrics(self, metrics, step=None):
        self.logged.append((step, dict(metrics)))

    def log_hyperparams(self, *args, **kwargs):
        pass


def fit(tmp_path, module, callback=None, logger=None):
    trainer = pl.Trainer(accelerator="cpu", max_steps=3, log_every_n_steps=1, logger=logger or False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         callbacks=[callback] if callback else [], default_root_dir=str(tmp_path))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)     # Lightning's notes on workers etc.
        trainer.fit(module, torch.utils.data.DataLoader(Ids(), batch_size=4))
    return trainer


def test_the_lightning_callback_reads_each_batch_untouched(tmp_path):
    from dptune.integrations.lightning import MemoryMonitor

    alone = Tiny()
    fit(tmp_path / "alone", alone)
    cards = FakeCards(n=1)
    cards.alloc(0, 1 << 30)
    watched, logger = Tiny(), Metrics()
    fit(tmp_path / "watched", watched, MemoryMonitor(runtime=cards), logger)
    for k, v in alone.state_dict().items():
        assert torch.equal(v, watched.state_dict()[k])
    rec = load_run(tmp_path / "watched" / "dptune-monitor")
    assert [(r["step"], r["batch_size"], r["length"]) for r in rec.rows] == [(s, 4, LENGTH) for s in (1, 2, 3)]
    mine = [m for _, m in logger.logged if "memory/rank0/card0/reserved_bytes.all.peak" in m]
    assert len(mine) == 3 and all(m["memory/rank0/card0/reserved_bytes.all.peak"] == 1 << 30 for m in mine)


def test_out_of_memory_in_lightning_keeps_the_exception_and_writes_forensics(tmp_path):
    from dptune.integrations.lightning import MemoryMonitor

    module = Tiny(raise_at=1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", MonitorWarning)
        with pytest.raises(torch.OutOfMemoryError) as info:
            fit(tmp_path, module, MemoryMonitor(runtime=FakeCards(n=1)))
    assert info.value is module.raised[0]
    forensics = json.loads((tmp_path / "dptune-monitor" / "oom.rank0.json").read_text())
    assert (forensics["step"], forensics["batch_size"], forensics["length"]) == (2, 4, LENGTH)
