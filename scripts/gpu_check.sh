#!/usr/bin/env bash
# Everything the lent GPU machine should run, in one go and in under 8 minutes:
#   1. the gpu-marked tests, and the Triton kernel tests (compiled, on GPU tensors),
#   2. the decode-attention kernel micro-benchmark (batch 256, contexts of ~1,000 tokens),
#   3. bench.py on the default workload, with the Hugging Face baseline capped in time, then
#      again with the synchronous loop (--no-async-scheduling) to show what overlap buys,
#   4. a short bench.py of the mixture of experts Qwen3-30B-A3B (random weights, ~61 GB) when the
#      GPU has the memory.
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
# Time boxes: 100 + 120 + 30 + 110 + 50 + 60 = 470 s, under 8 minutes with the two probes above.
run "gpu tests" 100 python -m pytest -q -rs -m gpu tests/
# ~70-90 kernel variants to compile on a cold Triton cache, a second or two each
run "triton kernels on the GPU" 120 python -m pytest -q -rs tests/test_triton_backend.py tests/test_moe_kernel.py
run "decode kernel micro-benchmark" 30 python scripts/bench_decode_attention.py --batch 256 --context 1024 --cuda-graph
# start-up + warm-up + ~20 s timed run, then HF: loading, and 30 s of generation at most;
# the summary includes the GPU idle share between decode steps (CUDA events)
run "bench.py default workload vs HF" 110 python bench.py --compare hf --hf-time-limit 30 --json
run "bench.py default workload, synchronous loop" 50 python bench.py --no-async-scheduling --json
if python -c "import sys, torch; sys.exit(torch.cuda.get_device_properties(0).total_memory < 80e9)"; then
  run "bench.py qwen3-30b-a3b (MoE)" 60 python bench.py --dummy qwen3-30b-a3b --num-seqs 64 --max-input-len 512 \
    --max-output-len 128 --enforce-eager --json
else
  echo "=== bench.py qwen3-30b-a3b (MoE) skipped: it needs a GPU with 80 GB or more"
fi
echo "=== gpu_check exit status $status"
exit $status
