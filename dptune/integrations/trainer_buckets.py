"""The Trainer's side of a length plan: every train example's length, the plan checked
against the Trainer's processes and cards, and the train dataloader that draws its batches
within buckets. Below both :mod:`dptune.integrations.transformers` (whose
:class:`~dptune.integrations.transformers.BalancedTrainerMixin` trains with a plan) and
:mod:`dptune.integrations.trainer_lengths` (which plans and mixes it in), so neither imports
the other back."""

from __future__ import annotations

import os
from typing import Any

from dptune.errors import UsageError
from dptune.integrations.trainer_workload import trainer_sample
from dptune.lengths.plan import LengthPlan
from dptune.lengths.trainer import trainer_lengths

__all__ = ["all_lengths", "trainer_plan", "bucket_dataloader"]


def all_lengths(trainer: Any, limit: Any = None) -> tuple[str, list[int]]:
    """The length field and every train example's length (the plan's last edge must cover the
    longest), or the first ``limit``."""
    ds = trainer.train_dataset
    if ds is None or not (hasattr(ds, "__getitem__") and hasattr(ds, "__len__")):
        raise UsageError("planning per length bucket needs a map-style train_dataset (one with "
                         "len() and indexing); an iterable dataset's lengths cannot be read ahead")
    key, lengths = trainer_lengths(trainer, limit=len(ds) if limit is None else limit)
    if not lengths:
        raise UsageError("the Trainer's train dataset has no input_ids (or other sequence) "
                         "lengths dptune can read; pass the lengths to plan_lengths yourself")
    return key, lengths


def trainer_plan(trainer: Any, plan: Any) -> LengthPlan:
    """``plan`` as a :class:`LengthPlan` (loaded when it is a path), checked against the
    Trainer's processes and cards: one process, as many cards as ``args.n_gpu`` (one on a
    single GPU or the CPU)."""
    if isinstance(plan, (str, os.PathLike)):
        plan = LengthPlan.load(os.fspath(plan))
    if not isinstance(plan, LengthPlan):
        raise UsageError(f"plan= takes a dptune LengthPlan (or its lengths.json), got "
                         f"{type(plan).__name__}")
    if plan.ddp:
        raise UsageError("this is a DDP plan (ddp=True: a batch per rank); the Trainer takes a "
                         "DataParallel or one-card plan. Train a DDP plan with "
                         "dptune.lengths.BucketBatchSampler in your own loop")
    args = trainer.args
    if args.world_size > 1:
        raise UsageError(f"this Trainer runs {args.world_size} processes (torchrun); a length "
                         "plan trains one process (DataParallel over its cards or one card)")
    cards = max(int(args.n_gpu), 1)
    if len(plan.devices) != cards:
        raise UsageError(f"the length plan is for {len(plan.devices)} cards but this Trainer "
                         f"trains on {cards}; plan again for these cards (simulate=\"{cards}x...\" "
                         "or on the GPUs themselves)")
    return plan


def bucket_dataloader(trainer: Any, plan: LengthPlan) -> Any:
    """The Trainer's train dataloader with batches from :class:`BucketBatchSampler` (the
    dataset with unused columns removed and the collator, as the Trainer's own loader)."""
    import functools

    from torch.utils.data import DataLoader
    from transformers.trainer_utils import seed_worker

    from dptune.lengths.sampler import BucketBatchSampler

    _, lengths = all_lengths(trainer)
    sample = trainer_sample(trainer)
    args = trainer.args
    seed = args.data_seed if args.data_seed is not None else args.seed
    sampler = BucketBatchSampler(lengths, plan, shuffle=True, seed=seed,
                                 drop_last=args.dataloader_drop_last)
    loader = DataLoader(
        sample.dataset, batch_sampler=sampler, collate_fn=sample.collator,
        num_workers=args.dataloader_num_workers, pin_memory=args.dataloader_pin_memory,
        persistent_workers=args.dataloader_persistent_workers,
        multiprocessing_context=args.dataloader_multiprocessing_context,
        prefetch_factor=args.dataloader_prefetch_factor, in_order=args.dataloader_in_order,
        worker_init_fn=functools.partial(seed_worker, num_workers=args.dataloader_num_workers,
                                         rank=args.process_index))
    return trainer.accelerator.prepare(loader)
