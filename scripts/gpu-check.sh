#!/usr/bin/env bash
# GPU readiness: oracle tests on cuda (bf16 serving dtype, fp32 tiny models) and the decode
# efficiency benchmark for every attention backend, eager and compiled, in under 9 minutes,
# with only torch + transformers installed.
#   bash scripts/gpu-check.sh [--batch-sizes 1,8,32,64] [--steps 64]
set -euo pipefail
cd "$(dirname "$0")/.."
if [ -z "${PYTHON:-}" ]; then
  if [ -x .venv/bin/python ]; then PYTHON=.venv/bin/python; else PYTHON=python3; fi
fi
command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,memory.total --format=csv,noheader || true
exec timeout 540 "$PYTHON" scripts/gpu_check.py "$@"
