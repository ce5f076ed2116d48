#!/usr/bin/env bash
# The test command: install (idempotent), lint, type-check, run the suite offline.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
.venv/bin/ruff check .
.venv/bin/mypy
.venv/bin/python -m pytest -q --durations=30 "$@"  # the slowest 30, so a CI log shows where its time goes
