#!/usr/bin/env bash
# One prepared run of issue 59's CUDA checks on a machine with an NVIDIA GPU (CI never runs it).
#
# What it measures, for GPT-2 and the presets smollm2-135m, qwen2.5-0.5b and qwen3-0.6b (random
# init) as fp16, int8 and int4 weights and an int8 cache (all --target ort-cuda): each export's
# time, verify on CUDA (verify's tolerances for the dtype or scheme), the cache resident on the
# device, no Memcpy in a decode step, decode ms/token at batch 1 and 16 with the CUDA graph
# captured and not, TTFT at 128 and 1000 tokens, the engine's and `kvexport serve`'s output tok/s
# at concurrency 16 (the openai client, streamed), the captured run's tokens against the
# uncaptured run's, and the engine's tokens against the Generator's with a verdict (agree,
# batch-shape rounding or engine bug). One PASS/FAIL/SKIP line per check, TARGET PASS/MISS lines
# for the timing targets, how long each part took, and one JSON (benchmarks/results/
# gpu_check-<date>.json unless GPU_CHECK_OUT says otherwise). Exit 1 on any FAIL.
#
# Needs only the project and onnxruntime-gpu with its CUDA libraries (plus torch and
# transformers for export and verify, which a GPU machine's Python may have). It downloads
# nothing: the models are random-init presets and the hub is offline.
# It should take under 8 minutes on an H200 with 16 cores, exports included.
#
# Knobs (environment; defaults in brackets, the CPU dry run's after a slash): GPU_CHECK_PROVIDER
# [cuda] (cpu: a dry run with tiny models, as the tests run it), GPU_CHECK_MODELS
# [gpt2,smollm2-135m,qwen2.5-0.5b,qwen3-0.6b], GPU_CHECK_VARIANTS [fp16,int8,int4,kv-int8],
# GPU_CHECK_CONTEXTS [128,1000 / 16,40], GPU_CHECK_BATCHES [1,16 / 1,4], GPU_CHECK_TOKENS
# [64 / 8], GPU_CHECK_REPEATS [3 / 1], GPU_CHECK_CONCURRENCY [16 / 4], GPU_CHECK_EXPORT_WORKERS
# [min(4, cores)], GPU_CHECK_OUT (the JSON's path or directory), PYTHON.
# Usage: bash scripts/gpu_check.sh
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-.venv/bin/python}
[ -x "$PYTHON" ] || PYTHON=python3
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null || echo "nvidia-smi: not available"
exec "$PYTHON" scripts/gpu_check.py "$@"
