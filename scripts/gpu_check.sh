#!/usr/bin/env bash
# Everything the lent GPU machine should run, in one go and in under 8 minutes, so that a second
# try of one step still fits in a 15-minute device session:
#   1. the gpu-marked tests, then the Triton kernel tests (compiled, on GPU tensors); the first
#      failing (or hanging) test is run once more alone with CUDA_LAUNCH_BLOCKING=1, so that a
#      CUDA error is reported at the launch that caused it,
#   2. the decode-attention kernel micro-benchmark (batch 256, contexts of ~1,000 tokens),
#   3. bench.py on the default workload, with the Hugging Face baseline capped in time, then
#      again with the synchronous loop (--no-async-scheduling) to show what overlap buys,
#   4. a short bench.py of the mixture of experts Qwen3-30B-A3B (random weights, ~61 GB) with
#      CUDA graphs, at its serving shape, when the GPU has the memory,
#   5. batch-1 greedy decode of a repetitive prompt, with and without n-gram speculation, and with a
#      draft model equal to the target (the mechanism's bound: every draft accepted),
#   6. quantization: the GEMM micro-benchmark (bf16, block FP8, AWQ), the decode kernel over an
#      FP8 KV cache, and one short bench.py workload in bf16, fp8 (online), an FP8 block
#      checkpoint's shape, an AWQ checkpoint's shape and with an FP8 KV cache,
#   7. the multi-turn benchmark of the prefix cache's host tier, off and on, at the 0.6B shape.
# A one-line summary per step (pass/fail, seconds) ends the log; the exit status is 0 only if
# every step that ran passed.
# Runs from the source tree (no install, no network) with python3, the GPU image's interpreter.
# The log goes to $OUT/gpu_check.log ($OUT is the device tool's output folder; elsewhere it
# defaults to /tmp/gpu_check).
#
# Time boxes (seconds), 585 in all: gpu tests 80, Triton kernel tests 90, the one-test rerun 30,
# decode micro-benchmark 20, bench.py vs HF 75, synchronous bench.py 40, MoE bench.py 60,
# batch-1 decode without speculation, with n-gram and with draft-model speculation 20 each,
# quantized GEMM and fp8-KV decode micro-benchmarks 12 each, the five short quantization
# bench.py runs 20 each, the multi-turn host-tier benchmark 25.
# A step that reaches its box gets SIGINT (pytest then still prints its failures, durations and
# the test it was in; python prints a traceback), and SIGKILL 15 s later if it is still running.
# Each box is also cut to what is left of the whole budget (GPU_CHECK_BUDGET_S, default 585, so
# the script ends within 10 minutes whatever happens; a smaller one makes a quick dry run); a
# step with under MIN_STEP_S left is skipped and reported so.
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH=. PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/gpu_check}
BUDGET_S=${GPU_CHECK_BUDGET_S:-585}
MIN_STEP_S=5           # less than this left: skip the step rather than start it to be killed at once
KILL_AFTER_S=15        # after the SIGINT of a time box: enough for pytest's summary, not for a hang
mkdir -p "$OUT"
exec 3>&1 4>&2         # the script's own stdout/stderr, restored at the end so that tee sees EOF
exec > >(tee "$OUT/gpu_check.log") 2>&1
tee_pid=$!
start_all=$SECONDS
status=0
summary=()
step_log=$(mktemp)     # the output of the step running now (to find a failing test's id)
reran=0

run() {  # run NAME BOX_S CMD...: time-boxed, never stops the script; sets step_rc
  local name=$1 box=$2; shift 2
  local left=$((BUDGET_S - (SECONDS - start_all)))
  if ((left < MIN_STEP_S)); then
    echo "=== $name: skipped, $((left > 0 ? left : 0)) s left of the ${BUDGET_S} s budget"
    summary+=("$(printf '%-5s %5s  %s (out of time)' SKIP - "$name")")
    status=1 step_rc=-1
    return
  fi
  local limit=$((box < left ? box : left))
  echo "=== $name (box ${limit} s): $*"
  local start=$SECONDS
  timeout -s INT -k "$KILL_AFTER_S" "$limit" "$@" 2>&1 | tee "$step_log"
  step_rc=${PIPESTATUS[0]}
  local took=$((SECONDS - start)) verdict=PASS
  if ((step_rc == 124 || step_rc == 137)); then
    verdict=TIME
  elif ((step_rc != 0)); then
    verdict=FAIL
  fi
  echo "=== $name: $verdict (exit $step_rc) in $took s"
  summary+=("$(printf '%-5s %4ss  %s%s' "$verdict" "$took" "$name" "$( ((step_rc)) && echo " (exit $step_rc)")")")
  ((step_rc == 0)) || status=1
}

rerun_first_failure() {  # after a failed pytest step: its first failing test, or the one it hung in, alone
  ((step_rc > 0 && !reran)) || return 0
  local test
  # -v prints "tests/x.py::name[params] FAILED"; a test stopped by the SIGINT has no verdict after its id
  test=$(grep -m1 -oE '^tests/[^ ]+::[^ ]+ (FAILED|ERROR)' "$step_log" | cut -d' ' -f1)
  [[ -n $test ]] || test=$(grep -oE '^tests/[^ ]+::[^ ]+' "$step_log" | tail -n1)
  if [[ -z $test ]]; then
    echo "=== no failing test id in that step's output (a collection error?): nothing to rerun"
    return 0
  fi
  reran=1
  run "rerun of $test, CUDA_LAUNCH_BLOCKING=1" 30 \
    env CUDA_LAUNCH_BLOCKING=1 python3 -m pytest -v -x -rs --durations=15 "$test"
}

PYTEST=(python3 -m pytest -v -x -rs --durations=15)
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv || echo "=== nvidia-smi failed"
python3 - <<'EOF'
import importlib.util, signal, sys
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:  # inherited (a background job without job control)
    print("=== WARNING: SIGINT is ignored here, so Python installs no KeyboardInterrupt handler: a step that "
          "reaches its time box is killed 15 s later without pytest's summary (the -v lines still name its test)")
print("python", sys.version.split()[0], *(f"{m} {getattr(importlib.import_module(m), '__version__', '?')}"
      if importlib.util.find_spec(m) else f"{m} missing" for m in ("torch", "triton", "transformers")))
EOF
# Only the files that have gpu-marked tests: with -x, a collection error in any other file (an
# optional package the image lacks) would stop the step before its first test.
mapfile -t gpu_test_files < <(grep -l "mark.gpu" tests/test_*.py)
run "gpu tests" 80 "${PYTEST[@]}" -m gpu "${gpu_test_files[@]}"
rerun_first_failure
# ~70-90 kernel variants to compile on a cold Triton cache, a second or two each; the gpu-marked
# tests of these files ran in the step above
run "triton kernels on the GPU" 90 "${PYTEST[@]}" -m "not gpu" tests/test_triton_backend.py tests/test_moe_kernel.py \
  tests/test_quant_kernels.py
rerun_first_failure
run "decode kernel micro-benchmark" 20 python3 scripts/bench_decode_attention.py --batch 256 --context 1024 --cuda-graph
# start-up + warm-up + ~20 s timed run, then HF: loading, and 20 s of generation at most;
# the summary includes the GPU idle share between decode steps (CUDA events)
run "bench.py default workload vs HF" 75 python3 bench.py --compare hf --hf-time-limit 20 --json
run "bench.py default workload, synchronous loop" 40 python3 bench.py --no-async-scheduling --json
if python3 -c "import sys, torch; sys.exit(torch.cuda.get_device_properties(0).total_memory < 80e9)" 2>/dev/null; then
  # the serving shape: 64 sequences, CUDA graphs on (decode replays the fused MoE kernel)
  run "bench.py qwen3-30b-a3b (MoE, CUDA graphs)" 60 python3 bench.py --dummy qwen3-30b-a3b --num-seqs 64 \
    --max-input-len 512 --max-output-len 128 --max-num-seqs 64 --json
else
  echo "=== bench.py qwen3-30b-a3b (MoE) skipped: it needs a GPU with 80 GB or more"
  summary+=("$(printf '%-5s %5s  %s' SKIP - "bench.py qwen3-30b-a3b (MoE): needs a GPU with 80 GB or more")")
fi
BATCH1=(python3 bench.py --num-seqs 1 --min-input-len 512 --max-input-len 512 --min-output-len 512
        --max-output-len 512 --repetitive --temperature 0 --json)
run "bench.py batch-1 greedy decode, repetitive prompt" 20 "${BATCH1[@]}"
run "bench.py batch-1 greedy decode, repetitive prompt, n-gram speculation (k=4)" 20 "${BATCH1[@]}" \
  --speculative-config '{"method": "ngram", "num_speculative_tokens": 4}'
run "bench.py batch-1 greedy decode, draft model = target (k=4)" 20 "${BATCH1[@]}" \
  --speculative-config '{"method": "draft_model", "model": "dummy:qwen3-0.6b", "num_speculative_tokens": 4}'
run "quantized GEMM micro-benchmark" 12 python3 scripts/bench_quant_gemm.py
run "decode kernel micro-benchmark, fp8 KV cache" 12 python3 scripts/bench_decode_attention.py --batch 256 \
  --context 1024 --kv-cache-dtype fp8
# one short workload (64 sequences) per scheme, the bf16 run first as their baseline
QUANT=(python3 bench.py --num-seqs 64 --max-input-len 512 --max-output-len 256 --json)
run "bench.py short workload, bf16" 20 "${QUANT[@]}"
run "bench.py short workload, quantization=fp8 (online, per channel)" 20 "${QUANT[@]}" --quantization fp8
run "bench.py short workload, FP8 block checkpoint shape" 20 "${QUANT[@]}" --dummy qwen3-0.6b-fp8
run "bench.py short workload, AWQ checkpoint shape" 20 "${QUANT[@]}" --dummy qwen3-0.6b-awq
run "bench.py short workload, fp8 KV cache" 20 "${QUANT[@]}" --kv-cache-dtype fp8
# the host tier: multi-turn chat of the 0.6B shape, the tier off and on (its copies on the copy stream)
run "bench_multiturn.py qwen3-0.6b, host tier off and on" 25 python3 scripts/bench_multiturn.py --dummy qwen3-0.6b \
  --device cuda --conversations 16 --turns 6 --system-len 1024 --question-len 128 --answer-len 32
echo "=== summary (${BUDGET_S} s budget, $((SECONDS - start_all)) s used)"
printf '%s\n' "${summary[@]}"
echo "=== gpu_check exit status $status"
exec 1>&3 2>&4 3>&- 4>&-   # close tee's pipe, then wait for it to write the last lines to the log
wait "$tee_pid"
rm -f "$step_log"
exit $status
