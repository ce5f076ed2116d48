#!/usr/bin/env bash
# CUDA checks for a machine with an NVIDIA GPU (never run by CI): parity on the CUDA
# provider, the cache bound on the device, no Memcpy nodes in a decode step, fp16, TPOT.
# Needs onnxruntime-gpu with CUDA libraries and the project installed (scripts/install.sh).
# Usage: bash scripts/gpu_check.sh [preset-or-config.json]   (default: gpt2, random init)
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-.venv/bin/python}
[ -x "$PYTHON" ] || PYTHON=python3
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null || echo "nvidia-smi: not available"
exec "$PYTHON" scripts/gpu_check.py "$@"
