"""dptune's benchmarks on the simulated cluster: ``python -m benchmarks`` (or ``make bench``).

For each example model on each simulated cluster it compares, at a headroom of 1 GiB per card:

- the even split of plain ``DataParallel`` (peak per card, imbalance, largest batch that fits);
- dptune's two objectives (``balance`` and ``max_batch``): the same figures, the gain in largest
  batch, the number of probes and the wall time of the search;
- what a user would do instead: a grid over the old class's ``gpu0_bsz`` and a Lightning-style
  power-then-binary search for the largest even batch, each with its number of probes;
- the exact optimum, found by exhaustive search over splits on the simulator
  (:mod:`benchmarks.search`), and dptune's distance to it;

then the cost of one estimate of each full-size configuration (:mod:`benchmarks.scale`) and,
where CUDA GPUs exist, the per-step overhead of ``BalancedDataParallel`` against
``DataParallel`` (:mod:`benchmarks.overhead`). Results go to ``reports/benchmarks/``.

Modules: :mod:`benchmarks.config` (models, scenarios, headroom), :mod:`benchmarks.search`
(baselines and the exhaustive optimum), :mod:`benchmarks.run` (the driver and the outputs).
``benchmarks/validate_gpu.py`` is a separate script (real-GPU validation), not part of this run.
"""
