"""Shim for vLLM's tests/utils.py: RemoteOpenAIServer starts `kvexport serve`.

run.sh copies it over tests/utils.py in the work tree and sets KVX_BIN (the
kvexport executable), KVX_EXPORT (the export served) and KVX_CHAT_TEMPLATE.
Only what the in-scope OpenAI-API tests use is provided.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time

import openai
import requests

KVEXPORT = os.environ["KVX_BIN"]
EXPORT_DIR = os.environ["KVX_EXPORT"]
CHAT_TEMPLATE = os.environ["KVX_CHAT_TEMPLATE"]

# vLLM serve flags with a kvexport equivalent (passed through, with value or not)
_PASS_FLAGS = {"--enable-prompt-tokens-details": False, "--api-key": True, "--return-tokens-as-token-ids": False, "--max-logprobs": True}
# vLLM flags that take no value (everything else starting with -- is assumed
# to take one unless the next token is another flag)
_BOOL_FLAGS = {
    "--enforce-eager", "--enable-lora", "--enable-auto-tool-choice",
    "--skip-tokenizer-init", "--return-tokens-as-token-ids",
    "--enable-tokenizer-info-endpoint", "--no-enable-prefix-caching",
    "--enable-prompt-tokens-details", "--trust-remote-code",
}
# ignored vLLM flags whose behaviour kvexport does not have: logged apart
_NOTE_FLAGS = {"--enable-lora", "--lora-modules", "--tool-call-parser", "--enable-auto-tool-choice",
               "--skip-tokenizer-init", "--load-format", "--max-model-len"}


class RemoteOpenAIServer:
    """`kvexport serve` of the export on 127.0.0.1, a free port, with vLLM's constructor."""

    DUMMY_API_KEY = "token-abc123"

    def __init__(self, model: str, vllm_serve_args: list[str], *, env_dict=None,
                 seed: int | None = 0, auto_port: bool = True,
                 max_wait_seconds: float | None = None, override_hf_configs=None):
        self.host = "127.0.0.1"
        self.port = None
        args = list(vllm_serve_args)
        kv_args: list[str] = []
        ignored: list[str] = []
        unsupported: list[str] = []
        chat_template = CHAT_TEMPLATE
        i = 0
        while i < len(args):
            a = args[i]
            val = None
            if "=" in a and a.startswith("--"):
                a, val = a.split("=", 1)
            elif a.startswith("-") and a not in _BOOL_FLAGS and i + 1 < len(args) \
                    and not args[i + 1].startswith("--"):
                val = args[i + 1]
                i += 1
            i += 1
            if a in ("--port", "-p"):
                raise ValueError("the shim always picks the port")
            if a in _PASS_FLAGS:
                kv_args += [a] + ([val] if _PASS_FLAGS[a] else [])
            elif a == "--chat-template" and val and os.path.isfile(val):
                chat_template = val
            else:
                ignored.append(a if val is None else f"{a} {val}")
                if a in _NOTE_FLAGS:
                    unsupported.append(a)
        if override_hf_configs:
            ignored.append(f"--hf-overrides {override_hf_configs}")
        cmd = [KVEXPORT, "serve", EXPORT_DIR, "--port", "0", "--host", self.host,
               "--chat-template", chat_template, "--max-queue", "512",
               "--model-name", model, *kv_args]
        print(f"[shim] launching: {' '.join(cmd)}", flush=True)
        print(f"[shim] vLLM args ignored: {ignored}", flush=True)
        if unsupported:
            print(f"[shim] vLLM behaviour kvexport lacks: {unsupported}", flush=True)
        env = os.environ.copy()
        env.pop("PYTHONPATH", None)
        if env_dict:
            env.update(env_dict)
        self.proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT, text=True,
                                     start_new_session=True)
        port_seen = threading.Event()

        def pump():
            assert self.proc.stdout is not None
            for line in self.proc.stdout:
                sys.__stderr__.write("[kvexport] " + line)
                sys.__stderr__.flush()
                m = re.search(r"http://127\.0\.0\.1:(\d+)", line)
                if m and self.port is None:
                    self.port = int(m.group(1))
                    port_seen.set()

        self._pump = threading.Thread(target=pump, daemon=True)
        self._pump.start()
        deadline = time.time() + (max_wait_seconds or 240)
        try:
            while not port_seen.is_set():
                if self.proc.poll() is not None:
                    raise RuntimeError("Server exited unexpectedly.")
                if time.time() > deadline:
                    raise RuntimeError("Server failed to start in time.")
                port_seen.wait(0.2)
            while True:
                try:
                    if requests.get(self.url_for("health"), timeout=5).status_code == 200:
                        break
                except Exception:
                    pass
                if self.proc.poll() is not None:
                    raise RuntimeError("Server exited unexpectedly.")
                if time.time() > deadline:
                    raise RuntimeError("Server failed to start in time.")
                time.sleep(0.3)
        except Exception:
            self._shutdown()
            raise

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc_value, traceback):
        self._shutdown()

    def _shutdown(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)  # this PID only
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)

    @property
    def url_root(self) -> str:
        """The server's base URL."""
        return f"http://{self.host}:{self.port}"

    def url_for(self, *parts: str) -> str:
        """The URL of the path ``parts`` on the server."""
        path = "/".join(part.strip("/") for part in parts if part)
        return f"{self.url_root}/{path}"

    def get_async_client(self, **kwargs):
        """An AsyncOpenAI client of the server's /v1."""
        kwargs.setdefault("timeout", 600)
        return openai.AsyncOpenAI(base_url=self.url_for("v1"),
                                  api_key=self.DUMMY_API_KEY, max_retries=0, **kwargs)
