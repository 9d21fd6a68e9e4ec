#!/usr/bin/env bash
# The GPU check, on the lent GPU machine: scripts/gpu_check.py says what it runs and why (most
# valuable first; a group of steps a process; each step's row in the Markdown record as it ends).
#   bash scripts/gpu_check.sh [--quick] [--plan]      GPU_CHECK_DRY=1: every GPU step skipped
# From the source tree (no install, no network), with python3: the GPU image's interpreter. The
# record goes to $OUT (the device tool's output folder) when set, else docs/gpu-runs/; the log
# beside it as gpu_check.log (git ignores it there: the record is what to commit).
set -uo pipefail
cd "$(dirname "$0")/.."
# (COLUMNS: pytest cuts its summary lines to the terminal's width, a time-out's reason with them)
export PYTHONPATH=. PYTHONUNBUFFERED=1 COLUMNS=400
[[ " $* " == *" --plan "* ]] && exec python3 scripts/gpu_check.py "$@"
# Packages the GPU image lacks, where the call carried them as wheels (bash scripts/gpu_wheels.sh
# here fills .whl/: fla-core, Qwen3.5's linear-attention kernels; the device call carries .whl)
if compgen -G ".whl/*.whl" > /dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=.:/tmp/site
fi
log_dir=${GPU_CHECK_RECORD_DIR:-${OUT:-docs/gpu-runs}}
mkdir -p "$log_dir"
python3 scripts/gpu_check.py "$@" 2>&1 | tee -a "$log_dir/gpu_check.log"
status=${PIPESTATUS[0]}

# Last, the cost of batch-invariant mode (LLM(batch_invariant=True), features/batch_invariant.py):
# bench.py on the headline's preset (Qwen3-0.6B's shape), short, without and with --batch-invariant,
# one after the other on the same GPU; the ratio of their output tok/s is the figure. A row in the
# plan's record (its newest .md here) and the two results in batch_invariant.json. Not with --quick
# or GPU_CHECK_DRY=1. (Its place is a Step of scripts/gpu_check.py's PLAN; until then it runs here.)
BATCH_INVARIANT_BOX_S=90  # each of the two runs: ~10 s of imports and graph capture, ~30 s of work at most
invariant_bench() {
  timeout "$BATCH_INVARIANT_BOX_S" python3 bench.py --dummy qwen3-0.6b --num-seqs 32 --min-input-len 100 \
    --max-input-len 512 --min-output-len 32 --max-output-len 128 --json "$@" 2>>"$log_dir/gpu_check.log" | tail -n 1
}
if [[ " $* " != *" --quick "* && -z "${GPU_CHECK_DRY:-}" ]]; then
  start=$SECONDS
  plain=$(invariant_bench)
  invariant=$(invariant_bench --batch-invariant)
  row=$(LOG_DIR="$log_dir" PLAIN="$plain" INVARIANT="$invariant" python3 - <<'PY'
import json, os
try:
    plain, invariant = (json.loads(os.environ[k]) for k in ("PLAIN", "INVARIANT"))
except ValueError:  # (a run failed or ran out of its box: no JSON line)
    print("FAIL | a run gave no result (gpu_check.log has its error)")
else:
    ok = invariant.get("batch_invariant") is True and not plain["failed_checks"] and not invariant["failed_checks"]
    ratio = invariant["output_tok_per_s"] / plain["output_tok_per_s"]
    print(f"{'PASS' if ok else 'FAIL'} | batch-invariant {invariant['output_tok_per_s']:.0f} vs plain "
          f"{plain['output_tok_per_s']:.0f} output tok/s = {ratio:.2f}x "
          f"(decode {invariant['decode_tok_per_s'] / plain['decode_tok_per_s']:.2f}x, prefill "
          f"{invariant['prefill_tok_per_s'] / plain['prefill_tok_per_s']:.2f}x)")
    with open(os.path.join(os.environ.get("LOG_DIR", "."), "batch_invariant.json"), "w") as f:
        json.dump({"plain": plain, "batch_invariant": invariant}, f)
PY
)
  echo "batch_invariant: $row" | tee -a "$log_dir/gpu_check.log"
  record=$(ls -t "$log_dir"/*.md 2>/dev/null | head -n 1)
  [[ -n "$record" ]] && echo "| + | batch_invariant | $row | $((SECONDS - start)) |" >> "$record"
  [[ "$row" == FAIL* && "$status" == 0 ]] && status=1
fi
exit "$status"
