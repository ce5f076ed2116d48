"""``kvexport serve --replicas 2``: the same app on a local Ray Serve, replicas that fail and come back.

One Ray cluster for the module (2 CPUs, loopback only), started by the CLI as a user would;
every wait is bounded, and the server is stopped by its own process id.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest

from kvexport.runtime import Generator

pytest.importorskip("ray")

PROMPT = [5, 17, 300, 42]
GREEDY = {"prompt": PROMPT, "max_tokens": 8, "temperature": 0, "ignore_eos": True}


def _ray_processes() -> set[int]:
    """Process ids of Ray's own daemons and workers on this machine."""
    found = set()
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            command = (entry / "cmdline").read_bytes().replace(b"\0", b" ")
        except OSError:
            continue
        if any(mark in command for mark in (b"gcs_server", b"raylet", b"ray::", b"ray/_private")):
            found.add(int(entry.name))
    return found


API_KEY = "ray-secret"
AUTHORIZED = {"authorization": f"Bearer {API_KEY}"}


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def _healthy(url: str) -> bool:
    try:
        return httpx.get(f"{url}/health", timeout=10).status_code == 200
    except httpx.HTTPError:
        return False


# the line ``kvexport serve --replicas`` writes once ``serve.run`` has returned: Serve's
# application is RUNNING, which it is only when every replica runs (its /health answers as
# soon as the first one does)
SERVING = " through Ray Serve, "


@contextlib.contextmanager
def ray_deployment(export: Path, *extra: str) -> Iterator[tuple[str, subprocess.Popen[str]]]:
    """``kvexport serve EXPORT --replicas 2`` started as a user would, yielded once every replica is up;
    stopped by SIGTERM, and waited for until Ray's processes have gone."""
    before = _ray_processes()
    port = _free_port()
    # the key from the environment, as a deployment would pass it: every replica requires it
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "RAY_USAGE_STATS_ENABLED": "0", "KVEXPORT_API_KEY": API_KEY}
    # Serve's controller kills an HTTP proxy not ready within 5 s of being asked to start, and
    # serve.start() then fails; on two shared, busy cores starting its worker takes longer
    env["RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S"] = "60"
    command = [sys.executable, "-m", "kvexport.cli", "serve", str(export), "--replicas", "2"]
    command += ["--slots", "4", "--max-context", "128", "--port", str(port), *extra]
    process = subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    # stderr is read as it comes (a full pipe would stall the server), and kept for a failure's message
    stderr: list[str] = []
    serving = threading.Event()

    def read_stderr() -> None:
        assert process.stderr is not None
        for line in process.stderr:
            stderr.append(line)
            if SERVING in line:
                serving.set()

    reader = threading.Thread(target=read_stderr, daemon=True)
    reader.start()
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline and process.poll() is None and not serving.wait(0.5):
        pass
    if not serving.is_set() or not _healthy(url):
        process.kill()
        reader.join(30)
        pytest.fail(f"the Ray Serve deployment did not come up: {''.join(stderr)[-2000:]}")
    try:
        yield url, process
    finally:
        if process.poll() is None:
            process.send_signal(signal.SIGTERM)
            try:
                process.wait(90)
            except subprocess.TimeoutExpired:
                process.kill()
        deadline = time.monotonic() + 30
        while _ray_processes() - before and time.monotonic() < deadline:
            time.sleep(0.5)
        reader.join(10)


@pytest.fixture(scope="module")
def ray_server(trained_exports: dict[str, Path]) -> Iterator[tuple[str, subprocess.Popen[str]]]:
    with ray_deployment(trained_exports["none"]) as served:
        yield served


def _complete(url: str, body: dict[str, object], timeout: float = 60) -> httpx.Response:
    return httpx.post(f"{url}/v1/completions", json=body, timeout=timeout, headers=AUTHORIZED)


def _replicas_seen(url: str, count: int) -> tuple[set[str], list[httpx.Response]]:
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        responses = list(pool.map(lambda _: _complete(url, GREEDY), range(count)))
    return {r.headers.get("x-kvexport-replica", "") for r in responses}, responses


def _until_both_answer(
    send: Callable[[], tuple[set[str], list[httpx.Response]]], rounds: int = 4, seconds: float = 90
) -> tuple[set[str], list[httpx.Response]]:
    """Rounds of ``send`` (a batch of concurrent requests) until two replicas have answered, at most ``rounds``.

    Both replicas run before the first round (:func:`ray_deployment`), but Serve's router owes
    no spread: it picks the shorter of two queues, and a tie either way; every response of
    every round is returned, for the caller's checks.
    """
    replicas: set[str] = set()
    responses: list[httpx.Response] = []
    deadline = time.monotonic() + seconds
    for _ in range(rounds):
        seen, batch = send()
        replicas |= seen
        responses += batch
        if len(replicas - {""}) >= 2 or time.monotonic() > deadline:
            break
    return replicas, responses


def test_requests_spread_over_both_replicas_with_the_embedded_servers_tokens(
    ray_server: tuple[str, subprocess.Popen[str]], trained_exports: dict[str, Path]
) -> None:
    url, _ = ray_server
    replicas, responses = _until_both_answer(lambda: _replicas_seen(url, 16))
    assert all(r.status_code == 200 for r in responses)
    assert len(replicas) == 2 and "" not in replicas  # each names its replica
    generator = Generator(trained_exports["none"])
    assert generator.tokenizer is not None
    want = generator.tokenizer.decode(generator.generate([PROMPT], 8, eos_token_id=-1)[0, len(PROMPT) :].tolist())
    assert {r.json()["choices"][0]["text"] for r in responses} == {want}
    metrics = httpx.get(f"{url}/metrics", timeout=10)
    assert metrics.status_code == 200 and "kvexport_generation_tokens_total" in metrics.text
    assert metrics.headers["x-kvexport-replica"] in replicas
    # every replica requires the key: without it, or with another, 401 in OpenAI's shape
    for headers in ({}, {"authorization": "Bearer wrong"}):
        refused = httpx.post(f"{url}/v1/completions", json=GREEDY, timeout=30, headers=headers)
        assert refused.status_code == 401 and refused.json()["error"]["code"] == "invalid_api_key"


def test_a_killed_replica_is_replaced_and_no_request_hangs(ray_server: tuple[str, subprocess.Popen[str]]) -> None:
    url, _ = ray_server
    long = {**GREEDY, "max_tokens": 100, "stream": True}
    with httpx.Client(timeout=httpx.Timeout(60, read=30)) as client, client.stream("POST", f"{url}/v1/completions", json=long, headers=AUTHORIZED) as stream:
        victim = stream.headers["x-kvexport-replica"]
        os.kill(int(victim.rsplit(":", 1)[1]), signal.SIGKILL)
        started = time.monotonic()
        lines: list[str] = []
        try:
            lines = [line for line in stream.iter_lines() if line]
        except httpx.HTTPError:
            pass  # the connection broke: an error, not a hang
        assert time.monotonic() - started < 60
        assert "data: [DONE]" not in lines or len(lines) < 102  # cut short, or it had already finished
    # later requests succeed, and Serve brings a new replica up in the killed one's place
    deadline = time.monotonic() + 120
    replicas: set[str] = set()
    while time.monotonic() < deadline:
        seen, responses = _replicas_seen(url, 8)
        assert all(r.status_code == 200 for r in responses)
        replicas |= seen
        if len(replicas - {victim}) >= 2:
            break
        time.sleep(1)
    assert len(replicas - {victim}) >= 2 and victim not in seen


def test_sigterm_shuts_the_deployment_down_leaving_no_ray_processes(ray_server: tuple[str, subprocess.Popen[str]]) -> None:
    url, process = ray_server
    process.send_signal(signal.SIGTERM)
    assert process.wait(90) == 0
    deadline = time.monotonic() + 30
    while _ray_processes() and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not _ray_processes()
    with pytest.raises(httpx.HTTPError):
        httpx.get(f"{url}/health", timeout=2)


def test_the_example_config_builds_through_the_application_builder(
    trained_exports: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    import yaml
    from ray.serve import Application

    from kvexport.serving.config import ApiConfig
    from kvexport.serving.ray import app

    config = yaml.safe_load((Path(__file__).parents[1] / "examples" / "ray_serve.yaml").read_text())
    application = config["applications"][0]
    assert application["import_path"] == "kvexport.serving.ray:app"
    deployment = application["deployments"][0]
    assert deployment["autoscaling_config"]["target_ongoing_requests"] == application["args"]["slots"]
    args = {**{k: str(v) for k, v in application["args"].items()}, "dir": str(trained_exports["none"])}
    assert isinstance(app(args), Application)
    with pytest.raises(Exception, match="no kvexport.json; pass an export directory"):
        app({"dir": "/nonexistent"})
    # every engine setting parses from key=value, the prefix cache switch among them
    assert isinstance(app({"dir": str(trained_exports["none"]), "prefix_cache": "false", "chunk": "64", "replicas": "1"}), Application)
    with pytest.raises(Exception, match="unknown engine setting 'prefix'"):
        app({"dir": str(trained_exports["none"]), "prefix": "false"})
    # the API's settings are ApiConfig's fields, parsed the same way (the key from the environment when not given)
    monkeypatch.setenv("KVEXPORT_API_KEY", "from-env")
    built = app({"dir": str(trained_exports["none"]), "name": "m", "enable_prompt_tokens_details": "true", "slots": "2"})
    _, engine_config, api = built._bound_deployment.init_args
    assert api == ApiConfig(name="m", api_key="from-env", enable_prompt_tokens_details=True) and engine_config.slots == 2
    with pytest.raises(Exception, match="enable_prompt_tokens_details=maybe: expected true or false"):
        app({"dir": str(trained_exports["none"]), "enable_prompt_tokens_details": "maybe"})


def test_the_embedded_server_does_not_import_ray(trained_exports: dict[str, Path]) -> None:
    code = (
        "import sys; from kvexport.serving.server import serve; from kvexport.cli import main; "
        "assert 'ray' not in sys.modules, 'ray was imported'"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)
