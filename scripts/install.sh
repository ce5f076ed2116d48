#!/usr/bin/env bash
# Create .venv (if missing) and install kvexport with the export extra (torch, transformers),
# the serve extra (FastAPI, uvicorn, prometheus-client), Ray Serve (the ray extra)
# and its test tools into it, and Debian's chromium and chromium-driver for the playground's
# browser test (as root, when they are missing), and kvexport's CPU kernels.
# torch is pinned first: its CPU build lies on the CI machines' disk, while an unpinned
# torch on a fresh venv may pull a multi-GB CUDA build.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PYTHON" -m venv .venv
fi
.venv/bin/python -m pip install -q --disable-pip-version-check "torch==2.13.0"
.venv/bin/python -m pip install -q --disable-pip-version-check -e ".[export,serve,test]"
# kvexport's CPU decode kernel (a custom-op library for ONNX Runtime), built once into ~/.cache/kvexport:
# against ONNX Runtime 1.21's C API headers, which kvexport carries (kvexport/runtime/kernels/include, MIT)
if ! .venv/bin/kvexport build-kernels >/dev/null; then
  echo "note: kvexport's CPU attention kernel was not built (above); CPU sessions keep ONNX Runtime's attention" >&2
fi
if ! command -v chromium >/dev/null 2>&1 || ! command -v chromedriver >/dev/null 2>&1; then
  if [ "$(id -u)" = 0 ]; then
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium chromium-driver >/dev/null
  else
    echo "note: tests/test_playground.py needs chromium and chromium-driver: sudo apt-get install chromium chromium-driver" >&2
  fi
fi
# onnxruntime-genai in .venv-genai/, an environment of its own (it needs the CPU onnxruntime, which must not
# sit beside onnxruntime-gpu), for examples/genai_generate.py and tests/test_examples.py; the version
# pinned in scripts/genai-requirements.txt. pip leaves a venv that already holds it as it is.
if [ ! -x .venv-genai/bin/python ]; then
  .venv/bin/python -m venv .venv-genai
fi
.venv-genai/bin/python -m pip install -q --disable-pip-version-check -r scripts/genai-requirements.txt
