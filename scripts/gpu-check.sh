#!/usr/bin/env bash
# The GPU check of issue 36 (scripts/gpu_check.py says what it measures): under 8 minutes on
# an H100, one JSON results file in $OUT (else here), with only torch and transformers.
#   bash scripts/gpu-check.sh [--dry-run] [--enforce-eager] [--steps 32]
# What the GPU machine lacks travels as a wheelhouse in .whl/ (no registry there): build it
# here with `bash scripts/gpu-check.sh --wheelhouse`, carry `.whl`; it is installed into
# /tmp/site when present. Nothing in it is required: the check imports without any of it.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ -z "${PYTHON:-}" ]; then
  if [ -x .venv/bin/python ]; then PYTHON=.venv/bin/python; else PYTHON=python3; fi
fi
# optional on the GPU image (structured logs); pure Python, a few hundred KB
WHEELS="structlog==26.1.0"
if [ "${1:-}" = "--wheelhouse" ]; then
  "$PYTHON" -m pip download --no-deps --only-binary=:all: --python-version 3.12 \
    --implementation cp -d .whl $WHEELS
  exit 0
fi
if compgen -G ".whl/*.whl" >/dev/null; then
  "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl
  export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,memory.total --format=csv,noheader || true
exec timeout 470 "$PYTHON" scripts/gpu_check.py "$@"
