#!/usr/bin/env bash
# The wheels a GPU check carries to the GPU machine, whose image lacks them and has no network
# (scripts/gpu_check.sh installs whatever .whl/ holds): fla-core, the Triton kernels of Qwen3.5's
# linear-attention layers (pure Python; the image has its einops and triton). Run here, then name
# .whl in the device call's carry.
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux2014_x86_64 -d .whl "fla-core==0.6.0"
ls .whl
