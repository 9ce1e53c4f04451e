#!/usr/bin/env bash
# One session's checks on a lent real GPU, in one call (the device time is short):
#   OUT=/some/folder bash benchmarks/gpu_session.sh
# Runs from the checkout with PYTHONPATH=. (nothing installed). Each step has its own time
# limit and log, so a step that fails or overruns leaves the others' figures. Steps that
# read the card's time or its total use (validate_reserved, validate_time) run alone on it;
# the allocated-level checks (the `cuda` tests and validate_gpu, each reading its own
# process's max_memory_allocated) run side by side.
set -u
OUT=${OUT:-reports/benchmarks/gpu_session}
mkdir -p "$OUT"
export PYTHONPATH=. PYTHONUNBUFFERED=1 MPLBACKEND=Agg
T_CUDA=${T_CUDA:-130}
T_GPU=${T_GPU:-130}
T_RES=${T_RES:-80}
T_TIME=${T_TIME:-45}
T_SWEEP=${T_SWEEP:-120}
T_ALL=${T_ALL:-0}

{
  date -u +%Y-%m-%dT%H:%M:%SZ
  nvidia-smi --query-gpu=name,memory.total,memory.used,driver_version --format=csv
  python3 -c 'import torch, sys; print(sys.version.split()[0], "torch", torch.__version__, "cuda", torch.version.cuda, torch.cuda.get_device_name(0), torch.cuda.get_device_capability(0))'
  python3 -c 'import transformers; print("transformers", transformers.__version__)' 2>&1 | tail -1
  python3 -c 'import pynvml; print("nvidia-ml-py ok")' 2>&1 | tail -1
} > "$OUT/env.txt" 2>&1
cat "$OUT/env.txt"

( timeout "$T_CUDA" python3 -m pytest -m cuda -q -p no:cacheprovider -p no:benchmark -rfEs \
    > "$OUT/pytest_cuda.txt" 2>&1; echo "pytest -m cuda rc=$?" >> "$OUT/pytest_cuda.txt" ) &
timeout "$T_GPU" python3 benchmarks/validate_gpu.py ${GPU_ARGS:-} --csv "$OUT/validate_gpu.csv" \
  > "$OUT/validate_gpu.txt" 2>&1
echo "validate_gpu rc=$?" >> "$OUT/validate_gpu.txt"
wait
timeout "$T_RES" python3 benchmarks/validate_reserved.py ${RES_ARGS:---quick} --csv "$OUT/validate_reserved.csv" \
  > "$OUT/validate_reserved.txt" 2>&1
echo "validate_reserved rc=$?" >> "$OUT/validate_reserved.txt"
# Where the card's reserved peak falls as the batch grows by one sample, against the
# simulator (it predicts falls for SegNet at 9 and SmallResNet(BN) fp32 at 44, 47, 48, 50, 52, 59):
# a reserved-level certificate is a proof only where the figure does not fall.
timeout "$T_SWEEP" python3 benchmarks/validate_reserved.py --only SegNet --only 'SmallResNet(BN)' \
    --batches 4:60 --csv "$OUT/reserved_sweep.csv" > "$OUT/reserved_sweep.txt" 2>&1
echo "reserved sweep rc=$?" >> "$OUT/reserved_sweep.txt"
timeout "$T_TIME" python3 -m benchmarks.validate_time --steps 5 > "$OUT/validate_time.txt" 2>&1
echo "validate_time rc=$?" >> "$OUT/validate_time.txt"
cp reports/benchmarks/validate_time.csv "$OUT/" 2>/dev/null
if [ "$T_ALL" -gt 0 ]; then
  timeout "$T_ALL" python3 -m pytest -q -n 8 -m "not slow" -p no:cacheprovider -p no:benchmark -x \
    > "$OUT/pytest_all.txt" 2>&1
  echo "pytest all rc=$?" >> "$OUT/pytest_all.txt"
fi
for f in "$OUT"/*.txt; do echo "== $f"; tail -n 40 "$f"; done
