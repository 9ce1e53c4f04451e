"""Where DataParallel is built by someone else's code.

- :mod:`dptune.integrations.dataparallel`: :func:`patch_dataparallel`, a context manager under
  which ``torch.nn.DataParallel(...)`` builds a :class:`~dptune.BalancedDataParallel` with a
  tuned split (for scripts such as YOLOv5's ``train.py`` that construct DataParallel
  themselves). Also available as ``dptune.patch_dataparallel``.
- :mod:`dptune.integrations.transformers`: ``tune_trainer`` and ``BalancedTrainer`` for the
  Hugging Face ``Trainer`` (needs the ``dptune[hf]`` extra; imported only when used); the
  Trainer's workload (batches, optimizer, loss, step settings) is read in
  :mod:`dptune.integrations.trainer_workload`.
- :mod:`dptune.integrations.trainer_lengths`: ``tune_trainer_lengths``, a plan per length
  bucket from the Trainer's own data and a Trainer that trains with it (the bucketed sampler,
  and ``BalancedDataParallel(plan=)`` on several GPUs).

Nothing here is imported by ``import dptune``.
"""
