#!/usr/bin/env bash
# Everything the lent GPU machine should run, in one try: every step runs whatever an earlier one
# did, each in a time box, and the log ends with one verdict line per step (PASS, FAIL, TIME or
# SKIP, with its seconds). The boxes are the STEPS table below and add up to at most MAX_BOXES_S
# (480 s: 8 minutes; with the machine's start, about 9 of a 15-minute device session, which leaves
# a second try of the steps that failed, GPU_CHECK_STEPS="fn ...", time enough);
# `bash scripts/gpu_check.sh --plan` prints them with their sum and exits (tests/test_gpu_check.py).
#
#   0. a warm-up: the steps below that build an engine or run a kernel, all at once, each small (16
#      tokens out, a small KV cache, one timed iteration): their Triton compiles fill the cache here,
#      in parallel, not in the timed boxes one after another (one it misses still compiles in its step),
#   1. the gpu-marked tests, then the Triton kernel tests (attention, MoE, quantized GEMMs, fused
#      elementwise kernels; compiled, on GPU tensors; in 8 processes with pytest-xdist where it is
#      there, so that cold compiles overlap); neither stops at a failure, and each test has its own
#      time limit (pytest-timeout, else faulthandler_timeout),
#   2. the tests that failed there (up to 3; not those that ran out of time) once more, with
#      CUDA_LAUNCH_BLOCKING=1, so that a CUDA error is reported at the launch that caused it,
#   3. the decode-attention kernel micro-benchmark (batch 256, contexts of ~1,000 tokens; then a
#      batch-1 verify step of 5 queries over 4,096 tokens, beside the prefill kernel on the same
#      step; fails if a kernel differs from the reference or a CUDA-graph replay from eager), and the kernels
#      a Qwen3-0.6B decode step launches per layer (scripts/count_kernels.py; fails above 15),
#   4. bench.py on the default workload against Hugging Face (capped in time), then the synchronous
#      loop (--no-async-scheduling: what overlap buys),
#   5. bench.py of the mixture of experts Qwen3-30B-A3B (random weights, ~61 GB) with CUDA graphs, at
#      its serving shape, when the GPU has the memory,
#   6. batch-1 greedy decode of a repetitive prompt, plain, with n-gram speculation, and with a draft
#      model equal to the target (every draft accepted: the mechanism's bound),
#   7. quantization: the GEMM micro-benchmark (bf16, block FP8, AWQ), the decode kernel over an FP8
#      KV cache, and one short bench.py workload in bf16, fp8 (online), an FP8 block checkpoint,
#      an AWQ checkpoint and with an FP8 KV cache; each quantized run's probe (bench.py: the logprobs
#      of a fixed prompt set; the dummy checkpoints are the bf16 random model quantized) is checked
#      against the bf16 run's, within its scheme's bound (PROBE_BOUNDS),
#   8. the multi-turn benchmark of the prefix cache's host tier, off and on (fails if the tier
#      saves no prefill).
# bench.py sizes max_num_seqs to its workload (the CUDA-graph ladder it captures with it), and exits
# 1 if a request got other than its max_tokens (ignore_eos), a probe is past its bound, or (draft =
# target, greedy) under 90% of the drafts were accepted (bf16: a near-tie may fall either way).
# A step that reaches its box gets SIGINT (pytest then still prints its summary; python a
# traceback), SIGKILL KILL_AFTER_S later. The exit status is 0 only if every step passed.
# Runs from the source tree (no install, no network) with python3, the GPU image's interpreter.
# The log goes to $OUT/gpu_check.log ($OUT: the device tool's output folder; else /tmp/gpu_check).
set -uo pipefail
cd "$(dirname "$0")/.."
# (COLUMNS: pytest cuts its summary lines to the terminal's width, a time-out's reason with them)
export PYTHONPATH=. PYTHONUNBUFFERED=1 COLUMNS=400
MAX_BOXES_S=480
MIN_STEP_S=5           # less than this left: skip the step rather than start it to be killed at once
KILL_AFTER_S=10        # after the SIGINT of a time box: enough for pytest's summary, not for a hang
TEST_TIMEOUT_S=30      # each test's own limit
MAX_RERUNS=3

# ---- the steps: box (s), function, name --------------------------------------------------------
# The first try (H200, 2026-12-04, 360 s of boxes) ran out of time in most steps: a python3 there
# took about 9 s to import torch and transformers' tokenizer code (which pulls in scikit-learn and
# scipy there; nanovllm now imports it only for a model that ships a tokenizer), and the gpu-marked
# tests (59) reached the 12th in 45 s. These boxes are that run's times with the import left in;
# the header prints what the imports cost now. A step's verdict TIME says which box to widen.
STEPS=(
  "45 warm_up warm-up: the steps below at once, small (Triton compiles)"
  "90 gpu_tests gpu-marked tests"
  "50 kernel_tests Triton kernel tests on the GPU"
  "15 rerun_failures failed tests again, CUDA_LAUNCH_BLOCKING=1"
  "18 decode_kernel decode kernel micro-benchmark, and a verify step's (vs reference, graph vs eager)"
  "12 count_kernels kernels per Qwen3-0.6B decoder layer in a decode step (at most 15)"
  "45 bench_hf bench.py default workload vs HF"
  "25 bench_sync bench.py default workload, synchronous loop"
  "32 bench_moe bench.py qwen3-30b-a3b (MoE, CUDA graphs)"
  "13 batch1_plain bench.py batch-1 greedy decode, repetitive prompt"
  "13 batch1_ngram bench.py batch-1, n-gram speculation (k=4)"
  "13 batch1_draft bench.py batch-1, draft model = target (k=4)"
  "10 quant_gemm quantized GEMM micro-benchmark"
  "10 fp8_kv_decode decode kernel micro-benchmark, fp8 KV cache"
  "13 quant_bf16 bench.py short workload, bf16 (the probe's reference)"
  "13 quant_fp8 bench.py short workload, quantization=fp8 (online), probe vs bf16"
  "13 quant_fp8_block bench.py short workload, FP8 block checkpoint, probe vs bf16"
  "13 quant_awq bench.py short workload, AWQ checkpoint, probe vs bf16"
  "13 quant_fp8_kv bench.py short workload, fp8 KV cache, probe vs bf16"
  "18 multiturn bench_multiturn.py qwen3-0.6b, host tier off and on"
  "6 pipeline bench.py 256 short requests over 2 pipeline stages: each stage's busy share (2 GPUs; SKIP on one)"
)
BOXES_S=0
for entry in "${STEPS[@]}"; do BOXES_S=$((BOXES_S + ${entry%% *})); done
if [[ ${1:-} == --plan ]]; then
  for entry in "${STEPS[@]}"; do
    read -r box fn name <<<"$entry"
    printf '%4s s  %s\n' "$box" "$name"
  done
  printf '%4s s  in all (at most %s)\n' "$BOXES_S" "$MAX_BOXES_S"
  ((BOXES_S <= MAX_BOXES_S))
  exit
fi
((BOXES_S <= MAX_BOXES_S)) || { echo "the boxes add up to $BOXES_S s, over $MAX_BOXES_S"; exit 2; }

# ---- what the steps run --------------------------------------------------------------------------
PYTEST=(python3 -m pytest -v -rfE --durations=10)
if python3 -c "import pytest_timeout" 2>/dev/null; then
  PYTEST+=(--timeout "$TEST_TIMEOUT_S")
else  # (dumps every thread's traceback at the limit; the box still ends the step)
  PYTEST+=(-o "faulthandler_timeout=$TEST_TIMEOUT_S")
fi
XDIST=()
python3 -c "import xdist" 2>/dev/null && XDIST=(-n 8)
BATCH1=(--num-seqs 1 --min-input-len 512 --max-input-len 512 --min-output-len 256 --max-output-len 256 --repetitive
        --temperature 0 --json)
QUANT=(--num-seqs 64 --max-input-len 512 --max-output-len 128 --json)
# The quantized runs' probes against the bf16 run's (bench.py --probe-check): bounds of the relative
# error, about twice what qwen3-0.6b's shape gives on CPU in float32 with the GPU kernels' activation
# quantization emulated, at the worst probe step: fp8 online 0.20, fp8 block 0.19, AWQ int4 0.38,
# fp8 KV cache 0.076 (bf16's rounding adds to these on the GPU). A broken kernel: about sqrt(2)
# (an output unrelated to the reference), or NaN.
declare -A PROBE_BOUNDS=([fp8]=0.4 [fp8_block]=0.4 [awq]=0.8 [fp8_kv]=0.2)
PROBE_REF=probe_bf16.json   # (under $OUT, set below)
failed_tests=()        # real failures of the pytest steps (not time-outs), for rerun_failures
# The warm-up runs these steps at once, each with WARM=1: bench and micro then append arguments
# that make the run small but leave its engine and kernels as they are (argparse: the last wins).
WARM_UP_STEPS=(decode_kernel count_kernels bench_sync bench_moe batch1_plain batch1_ngram batch1_draft quant_gemm
               fp8_kv_decode quant_bf16 quant_fp8 quant_fp8_block quant_awq quant_fp8_kv multiturn)
WARM=0
# (a KV cache of two max_model_len=4096 sequences: 512 blocks of 16 tokens, under 1 GB for Qwen3-0.6B, or
# flash-attn's 32 of 256; the 15 jobs fit in 139 GB beside the MoE's 61 GB of weights)
WARM_BLOCKS=512
python3 -c "import flash_attn" 2>/dev/null && WARM_BLOCKS=32
WARM_BENCH=(--min-output-len 16 --max-output-len 16 --num-kvcache-blocks "$WARM_BLOCKS")

bench() {  # bench.py ARGS; with PROBE set, its probe too: PROBE=save writes the reference, PROBE=SCHEME checks
  local args=("$@")
  if ((WARM)); then
    args+=("${WARM_BENCH[@]}")
    [[ -n ${PROBE:-} ]] && args+=(--probe-save /dev/null)
  elif [[ ${PROBE:-} == save ]]; then
    args+=(--probe-save "$PROBE_REF")
  elif [[ -n ${PROBE:-} ]]; then
    args+=(--probe-check "$PROBE_REF" --probe-max-error "${PROBE_BOUNDS[$PROBE]}")
  fi
  python3 bench.py "${args[@]}"
}
micro() {  # micro SCRIPT ARGS: a kernel micro-benchmark
  if ((WARM)); then python3 "$@" --iters 1; else python3 "$@"; fi
}
step_env() {  # what a step's own bash needs: the settings above and every function
  declare -p PYTEST XDIST BATCH1 QUANT PROBE_BOUNDS PROBE_REF failed_tests WARM_UP_STEPS WARM WARM_BENCH OUT
  declare -f
}
note_failures() {      # the FAILED/ERROR ids of the step's short summary, time-outs left out
  local id
  while read -r id; do
    ((${#failed_tests[@]} < MAX_RERUNS)) && failed_tests+=("$id")
  done < <(grep -E '^(FAILED|ERROR) tests/[^ ]+::' "$step_log" | grep -v ' - Failed: Timeout' | awk '{print $2}')
}
warm_up() {  # each of WARM_UP_STEPS in a box of its own (this one's, less 3 s), all at once
  local dir=$OUT/warm_up budget=$((STEP_BOX_S - 3)) pids=() i rc status=0
  mkdir -p "$dir"
  for fn in "${WARM_UP_STEPS[@]}"; do
    timeout -s TERM -k 2 "$budget" bash -c "$(step_env); WARM=1; $fn" >"$dir/$fn.log" 2>&1 &
    pids+=($!)
  done
  for i in "${!pids[@]}"; do
    wait "${pids[i]}"
    rc=$?
    fn=${WARM_UP_STEPS[i]}
    case $rc in
      0 | 3) echo "warm-up $fn: done" ;;
      124 | 137) echo "warm-up $fn: cut at $budget s (its step compiles the rest)"; ((status)) || status=124 ;;
      *) echo "warm-up $fn: exit $rc; the end of $dir/$fn.log:"; tail -n 5 "$dir/$fn.log"; status=1 ;;
    esac
  done
  return $status
}
gpu_tests() {
  # only the files that have gpu-marked tests: an optional package the image lacks (a collection
  # error in another file) must not cost the step
  mapfile -t files < <(grep -l "mark.gpu" tests/test_*.py)
  "${PYTEST[@]}" -m gpu "${files[@]}"
}
kernel_tests() {
  "${PYTEST[@]}" "${XDIST[@]}" -m "not gpu" tests/test_triton_backend.py tests/test_moe_kernel.py tests/test_quant_kernels.py \
    tests/test_fused_kernels.py
}
rerun_failures() {
  ((${#failed_tests[@]})) || { echo "no test failed: nothing to rerun"; return 0; }
  env CUDA_LAUNCH_BLOCKING=1 "${PYTEST[@]}" "${failed_tests[@]}"
}
decode_kernel() {
  micro scripts/bench_decode_attention.py --batch 256 --context 1024 --cuda-graph
  local rc=$?
  micro scripts/bench_decode_attention.py --batch 1 --context 4096 --queries 5 --vs-prefill-kernel --cuda-graph \
    --iters 20 || rc=1
  return $rc
}
count_kernels() { python3 scripts/count_kernels.py --ops --max-per-layer 15; }
bench_hf() { bench --compare hf --hf-time-limit 15 --json; }
bench_sync() { bench --no-async-scheduling --json; }
bench_moe() {
  if ! python3 -c "import sys, torch; sys.exit(torch.cuda.get_device_properties(0).total_memory < 80e9)"; then
    echo "needs a GPU with 80 GB or more"; return 3
  fi
  bench --dummy qwen3-30b-a3b --num-seqs 64 --max-input-len 512 --max-output-len 128 --json
}
batch1_plain() { bench "${BATCH1[@]}"; }
batch1_ngram() { bench "${BATCH1[@]}" --speculative-config '{"method": "ngram", "num_speculative_tokens": 4}'; }
batch1_draft() {
  bench "${BATCH1[@]}" --min-acceptance-rate 0.9 \
    --speculative-config '{"method": "draft_model", "model": "dummy:qwen3-0.6b", "num_speculative_tokens": 4}'
}
quant_gemm() { micro scripts/bench_quant_gemm.py; }
fp8_kv_decode() { micro scripts/bench_decode_attention.py --batch 256 --context 1024 --kv-cache-dtype fp8; }
quant_bf16() { PROBE=save bench "${QUANT[@]}"; }
quant_fp8() { PROBE=fp8 bench "${QUANT[@]}" --quantization fp8; }
quant_fp8_block() { PROBE=fp8_block bench "${QUANT[@]}" --dummy qwen3-0.6b-fp8; }
quant_awq() { PROBE=awq bench "${QUANT[@]}" --dummy qwen3-0.6b-awq; }
quant_fp8_kv() { PROBE=fp8_kv bench "${QUANT[@]}" --kv-cache-dtype fp8; }
pipeline() {  # (two stages are two NCCL ranks, and NCCL takes one GPU a rank)
  if ! python3 -c "import sys, torch; sys.exit(torch.cuda.device_count() < 2)"; then
    echo "one GPU: 2 pipeline stages need 2 (NCCL: one rank a GPU)"
    return 3
  fi
  bench --pipeline-parallel-size 2 --max-input-len 256 --min-output-len 64 --max-output-len 64 --json
}
multiturn() {
  python3 scripts/bench_multiturn.py --dummy qwen3-0.6b --device cuda --conversations 8 --turns 4 \
    --system-len 1024 --question-len 128 --answer-len 32 $( ((WARM)) && echo --conversations 2 --turns 2)
}

# ---- running them --------------------------------------------------------------------------------
OUT=${OUT:-/tmp/gpu_check}
mkdir -p "$OUT"
PROBE_REF=$OUT/$PROBE_REF
rm -f "$PROBE_REF"     # (an earlier try's)
exec 3>&1 4>&2         # the script's own stdout/stderr, restored at the end so that tee sees EOF
exec > >(tee "$OUT/gpu_check.log") 2>&1
tee_pid=$!
start_all=$SECONDS
status=0
summary=()
step_log=$(mktemp)     # the output of the step running now (its failing tests' ids)

run() {  # run BOX_S FUNCTION NAME: time-boxed, never stops the script
  local box=$1 fn=$2 name=$3
  local left=$((BOXES_S - (SECONDS - start_all)))
  if ((left < MIN_STEP_S)); then
    echo "=== $name: skipped, $((left > 0 ? left : 0)) s left of the ${BOXES_S} s of boxes"
    summary+=("$(printf '%-5s %5s  %s (out of time)' SKIP - "$name")")
    status=1
    return
  fi
  local limit=$((box < left ? box : left))  # (a step that ended early leaves its time to the later ones)
  echo "=== $name (box ${limit} s)"
  local start=$SECONDS rc
  # (the function in a bash of its own, so that the box's signals reach everything it started)
  STEP_BOX_S=$limit timeout -s INT -k "$KILL_AFTER_S" "$limit" bash -c "$(step_env); $fn" 2>&1 | tee "$step_log"
  rc=${PIPESTATUS[0]}
  local took=$((SECONDS - start)) verdict=PASS
  if ((rc == 124 || rc == 137)); then
    verdict=TIME
  elif ((rc == 3)); then
    verdict=SKIP
  elif ((rc != 0)); then
    verdict=FAIL
  fi
  [[ $fn == gpu_tests || $fn == kernel_tests ]] && note_failures
  echo "=== $name: $verdict (exit $rc) in $took s"
  summary+=("$(printf '%-5s %4ss  %s%s' "$verdict" "$took" "$name" "$( ((rc)) && echo " (exit $rc)")")")
  ((rc == 0 || rc == 3)) || status=1
}

nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv || echo "=== nvidia-smi failed"
python3 - <<'EOF'
import importlib.util, signal, sys
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:  # inherited (a background job without job control)
    print("=== WARNING: SIGINT is ignored here, so Python installs no KeyboardInterrupt handler: a step that "
          "reaches its box is killed without pytest's summary (the -v lines still name its test)")
print("python", sys.version.split()[0], *(f"{m} {getattr(importlib.import_module(m), '__version__', '?')}"
      if importlib.util.find_spec(m) else f"{m} missing"
      for m in ("torch", "triton", "transformers", "pytest_timeout", "xdist")))
EOF
# what each step's python3 pays before it starts (most of the first try's boxes went to it)
python3 -c 'import time; t = time.perf_counter(); import torch; a = time.perf_counter(); import nanovllm.llm
b = time.perf_counter(); from transformers import AutoTokenizer; c = time.perf_counter()
print(f"import: torch {a - t:.1f} s, then nanovllm.llm {b - a:.1f} s, then transformers.AutoTokenizer {c - b:.1f} s")'
for entry in "${STEPS[@]}"; do
  read -r box fn name <<<"$entry"
  # GPU_CHECK_STEPS="fn ...": those steps alone (a dry run of the script, tests/test_gpu_check.py)
  [[ -z ${GPU_CHECK_STEPS:-} || " $GPU_CHECK_STEPS " == *" $fn "* ]] && run "$box" "$fn" "$name"
done
echo "=== summary (${BOXES_S} s of boxes, $((SECONDS - start_all)) s used)"
printf '%s\n' "${summary[@]}"
echo "=== gpu_check exit status $status"
exec 1>&3 2>&4 3>&- 4>&-   # close tee's pipe, then wait for it to write the last lines to the log
wait "$tee_pid"
rm -f "$step_log"
exit $status
