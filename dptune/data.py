"""Samplers for training with a dptune plan (``import dptune.data`` imports torch)."""

from dptune.lengths.sampler import BucketBatchSampler

__all__ = ["BucketBatchSampler"]
