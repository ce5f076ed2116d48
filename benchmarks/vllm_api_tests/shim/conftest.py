"""Shim for vLLM's tests/conftest.py: the OpenAI-API tests offline, against `kvexport serve`.

run.sh copies it over tests/conftest.py in the work tree (utils.py next to it
starts the servers).

* offline: every Hugging Face name a test asks for resolves to the trained
  test model's tokenizer (KVX_HF_TOK, written by run.sh: its tokenizer.json +
  the chat template the server is given), so expected token ids are computed
  with *our* vocab;
* LoRA / weight downloads return a dummy directory (the LoRA tests are
  deselected anyway);
* module-level get_vocab_size() helpers return our vocab size;
* tests that never talk to a server (unit tests of vLLM classes) and
  LoRA / tool-calling variants are deselected and listed, with the reason,
  in KVX_OUT_OF_SCOPE.
"""

import inspect
import json
import os
import tempfile

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import pytest

HF_TOK = os.environ["KVX_HF_TOK"]
OUT_OF_SCOPE = os.environ["KVX_OUT_OF_SCOPE"]
VOCAB_SIZE = json.load(open(os.path.join(HF_TOK, "config.json")))["vocab_size"]
DUMMY_DIR = tempfile.mkdtemp(prefix="kvx-dummy-")

# --- patches that must be in place before the test modules import names ----
import vllm.tokenizers as _vt  # noqa: E402

_real_get_tokenizer = _vt.get_tokenizer


def _get_tokenizer(tokenizer_name=None, *args, **kwargs):
    kwargs.pop("tokenizer_mode", None)
    return _real_get_tokenizer(HF_TOK, *args, **kwargs)


_vt.get_tokenizer = _get_tokenizer

import vllm.transformers_utils.repo_utils as _ru  # noqa: E402


class _FakeHfApi:
    def snapshot_download(self, *a, **k):
        return DUMMY_DIR


_ru.hf_api = lambda *a, **k: _FakeHfApi()

import vllm.model_executor.model_loader.weight_utils as _wu  # noqa: E402

_wu.download_weights_from_hf = lambda model_name, *a, **k: os.path.join(
    tempfile.gettempdir(), "qwen3_06b")


@pytest.fixture(autouse=True)
def _kvx_vocab(request, monkeypatch):
    mod = request.module
    if hasattr(mod, "get_vocab_size"):
        monkeypatch.setattr(mod, "get_vocab_size", lambda *a, **k: VOCAB_SIZE)
    yield


SERVER_FIXTURES = {"server", "client", "server_fixture"}


def _out_of_scope(item):
    fn = getattr(item, "function", None)
    try:
        src = inspect.getsource(fn) if fn else ""
    except (OSError, TypeError):
        src = ""
    if not (SERVER_FIXTURES & set(item.fixturenames)) and "RemoteOpenAIServer(" not in src:
        return "unit test of vLLM internals (no HTTP server)"
    params = getattr(getattr(item, "callspec", None), "params", {}) or {}
    if any("lora" in str(v).lower() for v in params.values()):
        return "LoRA adapter variant"
    if "tool" in item.name.lower():
        return "tool calling"
    return None


def pytest_collection_modifyitems(config, items):
    """Deselect the out-of-scope tests and write their list."""
    keep, drop, lines = [], [], []
    for item in items:
        why = _out_of_scope(item)
        if why:
            drop.append(item)
            lines.append(f"{item.nodeid}\t{why}")
        else:
            keep.append(item)
    if drop:
        config.hook.pytest_deselected(items=drop)
        items[:] = keep
    with open(OUT_OF_SCOPE, "w") as f:
        f.write("\n".join(lines) + "\n")
