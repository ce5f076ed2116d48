#!/usr/bin/env bash
# The main job on the embedded default, offline: export GPT-2 124M with seeded random
# weights and the bundled GPT-2 tokenizer to out/gpt2, then verify it against PyTorch.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
.venv/bin/kvexport gpt2 --out out/gpt2 --random-init --force
.venv/bin/kvexport verify out/gpt2
