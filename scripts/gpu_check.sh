#!/usr/bin/env bash
# Everything the lent GPU machine should run, in one go and in under 8 minutes:
#   1. the gpu-marked tests, and the Triton kernel tests (compiled, on GPU tensors),
#   2. the decode-attention kernel micro-benchmark (batch 256, contexts of ~1,000 tokens),
#   3. bench.py on the default workload, with the Hugging Face baseline capped in time, then
#      again with the synchronous loop (--no-async-scheduling) to show what overlap buys.
# Runs from the source tree (no install, no network). The log goes to $OUT/gpu_check.log
# ($OUT is the device tool's output folder; elsewhere it defaults to /tmp/gpu_check).
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH=. PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/gpu_check}
mkdir -p "$OUT"
exec > >(tee "$OUT/gpu_check.log") 2>&1
status=0
run() {  # run STEP_NAME TIMEOUT_S CMD...: time-boxed, never stops the script
  local name=$1 limit=$2; shift 2
  echo "=== $name: $*"
  local start=$SECONDS
  timeout "$limit" "$@" || { echo "=== $name FAILED (exit $?)"; status=1; }
  echo "=== $name took $((SECONDS - start)) s"
}
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
python -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__)"
# Time boxes: 110 + 120 + 40 + 125 + 75 = 470 s, under 8 minutes with the two probes above.
run "gpu tests" 110 python -m pytest -q -rs -m gpu tests/
# ~60-70 kernel variants to compile on a cold Triton cache, a second or two each
run "triton kernels on the GPU" 120 python -m pytest -q -rs tests/test_triton_backend.py
run "decode kernel micro-benchmark" 40 python scripts/bench_decode_attention.py --batch 256 --context 1024 --cuda-graph
# start-up + warm-up + ~20 s timed run, then HF: loading, and 30 s of generation at most;
# the summary includes the GPU idle share between decode steps (CUDA events)
run "bench.py default workload vs HF" 125 python bench.py --compare hf --hf-time-limit 30 --json
run "bench.py default workload, synchronous loop" 75 python bench.py --no-async-scheduling --json
echo "=== gpu_check exit status $status"
exit $status
