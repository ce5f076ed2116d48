#!/usr/bin/env bash
# Run vLLM 0.32.0's own OpenAI-API tests against `kvexport serve` (README.md).
# Usage: benchmarks/vllm_api_tests/run.sh VLLM_PYTHON [WORKDIR [PYTEST_ARGS...]]
#   VLLM_PYTHON  the python of an environment with vLLM 0.32.0 (its tests import it)
#   WORKDIR      downloads, export, work tree and logs (default /tmp/vllm-api-tests)
#   ADJUST=1     model-specific constants adapted first (shim/adjust.sh) -> run-adjusted.log
# Writes WORKDIR/run.log and WORKDIR/out_of_scope.txt, prints pytest's summary line.
# Exits 0 when pytest ran (failures included), else with pytest's or timeout's status.
set -euo pipefail

[ $# -ge 1 ] || { sed -n '3,6s/^# \{0,1\}//p' "$0" >&2; exit 2; }
VLLM_PYTHON=$1
WORKDIR=${2:-/tmp/vllm-api-tests}
shift $(( $# >= 2 ? 2 : 1 ))

HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
REPO=$(cd "$HERE/../.." && pwd)
case $VLLM_PYTHON in
  */*) VLLM_PYTHON="$(cd "$(dirname "$VLLM_PYTHON")" && pwd)/$(basename "$VLLM_PYTHON")" ;;
  *) VLLM_PYTHON=$(command -v "$VLLM_PYTHON") || { echo "no such python on PATH" >&2; exit 2; } ;;
esac
[ -x "$REPO/.venv/bin/kvexport" ] || { echo "no $REPO/.venv/bin/kvexport: install the repo first" >&2; exit 2; }
mkdir -p "$WORKDIR"
WORKDIR=$(cd "$WORKDIR" && pwd)
say() { echo "[run.sh] $*"; }

# 1. vLLM's tests, from its sdist on PyPI (by name with pip, checked against its hash). pip
#    prepares an sdist's metadata before it saves it: without build isolation (no torch
#    download), with the two build tools vLLM's setup imports, and with the version held at
#    the sdist's own (vLLM's setup adds "+<device>", which pip then refuses as inconsistent).
SDIST=$WORKDIR/sdist/vllm-0.32.0.tar.gz
SDIST_SHA256=d2c957d5eee3d0985012151315ddc62cbe0cd368fc96a5fc3510438d9dddf2ad
if [ ! -f "$SDIST" ]; then
  say "downloading $(basename "$SDIST") with pip"
  "$VLLM_PYTHON" -m pip install -q --disable-pip-version-check setuptools-rust setuptools-scm
  VLLM_VERSION_OVERRIDE=0.32.0 VLLM_TARGET_DEVICE=empty "$VLLM_PYTHON" -m pip download -q --disable-pip-version-check \
    --no-deps --no-binary=:all: --no-build-isolation vllm==0.32.0 -d "$WORKDIR/sdist"
fi
"$VLLM_PYTHON" - "$SDIST" "$SDIST_SHA256" <<'EOF'
import hashlib
import sys

path, want = sys.argv[1:]
with open(path, "rb") as f:
    got = hashlib.sha256(f.read()).hexdigest()
if got != want:
    sys.exit(f"{path}: sha256 {got}, expected {want}; remove it and rerun")
EOF
SRC=$WORKDIR/vllm-src
if [ ! -d "$SRC/tests/entrypoints" ]; then
  say "extracting tests/ from the sdist"
  rm -rf "$SRC.part"; mkdir -p "$SRC.part"
  tar -xzf "$SDIST" -C "$SRC.part" --strip-components=1 \
    vllm-0.32.0/tests/__init__.py vllm-0.32.0/tests/entrypoints
  rm -rf "$SRC"; mv "$SRC.part" "$SRC"
fi

# 2. The repo's trained test model, exported by the repo's CLI (prompt logprobs need --all-logits).
if [ ! -f "$WORKDIR/trained/kvexport.json" ]; then
  say "exporting tests/data/tiny-trained -> $WORKDIR/trained"
  (cd "$REPO" && .venv/bin/kvexport gpt2 --model tests/data/tiny-trained --target ort-cpu \
    --all-logits --out "$WORKDIR/trained" --force) >"$WORKDIR/export.log" 2>&1 \
    || { cat "$WORKDIR/export.log" >&2; exit 1; }
fi

# 3. The tokenizer folder every Hugging Face name in the tests resolves to (shim/conftest.py):
#    the checkpoint's config and tokenizer, the export's tokenizer_config with our chat template.
HF_TOK=$WORKDIR/hf-tok
mkdir -p "$HF_TOK"
cp "$REPO/tests/data/tiny-trained/config.json" "$REPO/tests/data/tiny-trained/tokenizer.json" "$HF_TOK/"
"$VLLM_PYTHON" - "$WORKDIR/trained/tokenizer_config.json" "$HERE/chat_template.jinja" \
  "$HF_TOK/tokenizer_config.json" <<'EOF'
import json
import sys

config_path, template_path, out_path = sys.argv[1:]
with open(config_path) as f:
    config = json.load(f)
with open(template_path) as f:
    config["chat_template"] = f.read()
with open(out_path, "w") as f:
    json.dump(config, f, indent=2)
EOF

# 4. pytest and its plugins in vLLM's environment.
if ! "$VLLM_PYTHON" -c 'import pytest, pytest_asyncio, pytest_timeout' 2>/dev/null; then
  say "installing pytest, pytest-asyncio, pytest-timeout into $VLLM_PYTHON's environment"
  "$VLLM_PYTHON" -m pip install --quiet pytest pytest-asyncio pytest-timeout
fi

# 5. vLLM's tests with the shim over tests/utils.py and tests/conftest.py.
W=$WORKDIR/work
rm -rf "$W"; mkdir -p "$W/tests"
cp "$SRC/tests/__init__.py" "$W/tests/"
cp -r "$SRC/tests/entrypoints" "$W/tests/"
cp "$HERE/shim/utils.py" "$W/tests/utils.py"          # RemoteOpenAIServer -> kvexport serve
cp "$HERE/shim/conftest.py" "$W/tests/conftest.py"    # offline tokenizer + scope filter
cp "$HERE/shim/pytest.ini" "$W/pytest.ini"
T=tests/entrypoints/openai
FILES=(
  $T/completion/test_completion.py $T/completion/test_completion_error.py
  $T/completion/test_completion_text_offset.py $T/completion/test_prompt_validation.py
  $T/completion/test_token_in_token_out.py
  $T/chat_completion/test_chat.py $T/chat_completion/test_chat_echo.py
  $T/chat_completion/test_chat_error.py $T/chat_completion/test_chat_logit_bias_validation.py
  $T/chat_completion/test_logprob_token_ids.py $T/chat_completion/test_non_object_body_validation.py
  $T/chat_completion/test_chat_completion.py
  $T/test_return_token_ids.py $T/test_return_tokens_as_ids.py $T/test_stop_token_ids.py
  tests/entrypoints/serve/tokenize/test_tokenization.py
)
cd "$W"
LOG=$WORKDIR/run.log
if [ "${ADJUST:-0}" = 1 ]; then bash "$HERE/shim/adjust.sh"; LOG=$WORKDIR/run-adjusted.log; fi
export KVX_BIN=$REPO/.venv/bin/kvexport KVX_EXPORT=$WORKDIR/trained \
  KVX_CHAT_TEMPLATE=$HERE/chat_template.jinja KVX_HF_TOK=$HF_TOK \
  KVX_OUT_OF_SCOPE=$WORKDIR/out_of_scope.txt
say "pytest (about a minute) -> $LOG"
rc=0
timeout 1800 "$VLLM_PYTHON" -m pytest "${FILES[@]}" --timeout 120 -rA -v \
  -p no:cacheprovider "$@" >"$LOG" 2>&1 || rc=$?
grep -E '^=+ .* in [0-9.]+s' "$LOG" | tail -n 1 || tail -n 5 "$LOG"
[ "$rc" -le 1 ] || exit "$rc"
