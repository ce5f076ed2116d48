"""``kvexport serve --api-key``: every /v1 and tokenizer route needs ``Authorization: Bearer KEY``; /health stays open."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
from openai import OpenAI

from kvexport.serving.app import key_matches, needs_key
from kvexport.serving.config import ApiConfig
from tests.test_serving import _server

KEY = "s3cret-key"
GREEDY = {"model": "trained", "prompt": "The", "max_tokens": 4, "temperature": 0}


@pytest.fixture(scope="module")
def keyed(trained_exports: dict[str, Path]) -> Iterator[str]:
    with _server(trained_exports["none"], ApiConfig(api_key=KEY), slots=2, max_context=64) as (url, _):
        yield url


def test_the_openai_client_needs_the_right_key(keyed: str) -> None:
    right = OpenAI(base_url=f"{keyed}/v1", api_key=KEY, max_retries=0)
    text = right.completions.create(model="trained", prompt="The", max_tokens=4, temperature=0).choices[0].text
    plain = httpx.post(f"{keyed}/v1/completions", json=GREEDY, headers={"authorization": f"Bearer {KEY}"}, timeout=30)
    assert plain.status_code == 200 and plain.json()["choices"][0]["text"] == text
    assert [m.id for m in right.models.list().data] == ["trained"]
    wrong = OpenAI(base_url=f"{keyed}/v1", api_key="not-the-key", max_retries=0)
    with pytest.raises(openai.AuthenticationError) as refused:
        wrong.completions.create(model="trained", prompt="The", max_tokens=4)
    assert refused.value.status_code == 401
    body = refused.value.body
    assert isinstance(body, dict) and body["code"] == "invalid_api_key"
    assert body["message"] == "missing or wrong API key: send the server's --api-key as 'Authorization: Bearer KEY'"


@pytest.mark.parametrize(
    ("method", "path", "body"),
    [
        ("POST", "/v1/completions", GREEDY),
        ("POST", "/v1/chat/completions", {"model": "trained", "messages": [{"role": "user", "content": "hi"}]}),
        ("GET", "/v1/models", None),
        ("POST", "/tokenize", {"prompt": "The"}),
        ("POST", "/detokenize", {"tokens": [1]}),
        ("GET", "/tokenizer_info", None),
    ],
)
def test_every_keyed_route_is_401_without_the_key(keyed: str, method: str, path: str, body: dict[str, object] | None) -> None:
    for headers in ({}, {"authorization": "Bearer wrong"}, {"authorization": KEY}):  # none, wrong, not "Bearer"
        response = httpx.request(method, f"{keyed}{path}", json=body, headers=headers, timeout=30)
        assert response.status_code == 401, (path, headers)
        assert response.json()["error"]["type"] == "invalid_request_error"
    allowed = httpx.request(method, f"{keyed}{path}", json=body, headers={"authorization": f"Bearer {KEY}"}, timeout=30)
    assert allowed.status_code != 401


def test_health_and_metrics_stay_open(keyed: str) -> None:
    assert httpx.get(f"{keyed}/health", timeout=10).status_code == 200
    assert httpx.get(f"{keyed}/metrics", timeout=10).status_code == 200


def test_the_key_check() -> None:
    assert key_matches(f"Bearer {KEY}", KEY) and key_matches(f"bearer {KEY}", KEY)
    assert not key_matches(None, KEY) and not key_matches(KEY, KEY) and not key_matches(f"Bearer {KEY}x", KEY)
    assert needs_key("/v1/completions") and needs_key("/tokenize") and needs_key("/v1")
    assert not needs_key("/health") and not needs_key("/metrics") and not needs_key("/") and not needs_key("/v10")


def test_kvexport_serve_reads_the_key_from_its_environment(trained_exports: dict[str, Path]) -> None:
    import socket

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "KVEXPORT_API_KEY": KEY}
    command = [sys.executable, "-m", "kvexport.cli", "serve", str(trained_exports["none"]), "--port", str(port)]
    process = subprocess.Popen([*command, "--slots", "2", "--max-context", "64", "--warm-up", "0", "--model-name", "trained"], env=env, stderr=subprocess.PIPE, text=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            try:
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.2)
        assert httpx.post(f"{url}/v1/completions", json=GREEDY, timeout=30).status_code == 401
        authorized = httpx.post(f"{url}/v1/completions", json=GREEDY, headers={"authorization": f"Bearer {KEY}"}, timeout=30)
        assert authorized.status_code == 200
    finally:
        process.terminate()
        _, err = process.communicate(timeout=30)
    assert "API key required" in err
