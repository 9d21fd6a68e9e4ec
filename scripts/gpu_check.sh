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
exit "${PIPESTATUS[0]}"
