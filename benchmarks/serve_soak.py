#!/usr/bin/env python
"""Soak ``kvexport serve``: thousands of requests with random hang-ups, nothing lost, memory flat.

Outside CI (``tests/test_serving.py`` has a short form). Starts ``kvexport serve`` on an
in-place export (127.0.0.1, a free port), then sends ``--requests`` streamed completions,
``--concurrency`` at a time, each with a random length; a fraction of the clients hang up
after a few chunks. It then reads ``/metrics`` and checks:

- every accepted request ended, completed or cancelled (the finish-reason counters add up
  to the requests the server accepted) and none failed;
- every slot came back and nothing waits;
- the server's RSS after the soak against after the warm-up (sampled every ``--sample``
  requests, to see a trend, not a single point).

    .venv/bin/python benchmarks/serve_soak.py out/tiny-ort --requests 3000

Prints one JSON object; exits 1 if a check fails. The server is stopped with SIGTERM by its
process id at the end.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx


def rss_mb(pid: int) -> float:
    """Resident memory of a process in MiB (Linux)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


def metrics(url: str) -> dict[str, float]:
    """``/metrics`` as ``{name{labels}: value}``."""
    text = httpx.get(f"{url}/metrics", timeout=10).text
    return {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line and not line.startswith("#")}


async def one(client: httpx.AsyncClient, url: str, rng: random.Random, max_tokens: int, hang_up: float) -> str:
    tokens = rng.randint(1, max_tokens)
    leave_after = rng.randint(1, 4) if rng.random() < hang_up else None
    body = {"prompt": [rng.randint(5, 1000) for _ in range(rng.randint(1, 24))], "max_tokens": tokens,
            "stream": True, "ignore_eos": True, "temperature": 0.8}
    async with client.stream("POST", f"{url}/v1/completions", json=body) as response:
        if response.status_code == 503:
            return "refused"
        if response.status_code != 200:
            return f"HTTP {response.status_code}"
        chunks = 0
        async for line in response.aiter_lines():
            if line == "data: [DONE]":
                return "done"
            if line.startswith("data: "):
                chunks += 1
                if leave_after is not None and chunks >= leave_after:
                    return "hung up"
    return "incomplete"


async def soak(url: str, pid: int, requests: int, concurrency: int, max_tokens: int, hang_up: float, sample: int, seed: int) -> dict[str, Any]:
    rng = random.Random(seed)
    limit = asyncio.Semaphore(concurrency)
    outcomes: dict[str, int] = {}
    rss: list[tuple[int, float]] = []
    async with httpx.AsyncClient(timeout=httpx.Timeout(120.0), limits=httpx.Limits(max_connections=concurrency + 4)) as client:

        async def bounded(index: int) -> None:
            async with limit:
                outcome = await one(client, url, rng, max_tokens, hang_up)
            outcomes[outcome] = outcomes.get(outcome, 0) + 1
            if index % sample == 0:
                rss.append((index, rss_mb(pid)))

        await asyncio.gather(*(bounded(i) for i in range(requests)))
    return {"outcomes": outcomes, "rss_mb": rss}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("export", type=Path, help="An in-place export (--target ort-cpu).")
    parser.add_argument("--requests", type=int, default=3000)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--slots", type=int, default=8)
    parser.add_argument("--max-queue", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=24)
    parser.add_argument("--hang-up", type=float, default=0.3, help="Fraction of clients that leave mid-stream.")
    parser.add_argument("--sample", type=int, default=250, help="Sample the server's RSS every N requests.")
    args = parser.parse_args(argv)
    command = [sys.executable, "-m", "kvexport.cli", "serve", str(args.export), "--port", "0", "--slots", str(args.slots),
               "--max-queue", str(args.max_queue), "--max-context", "64"]
    server = subprocess.Popen(command, stderr=subprocess.PIPE, text=True)
    try:
        assert server.stderr is not None
        first = server.stderr.readline()
        url = first.split(" on ")[1].split(" ")[0]
        asyncio.run(soak(url, server.pid, 200, args.concurrency, args.max_tokens, 0.0, 10**9, seed=1))  # warm-up
        before, warm_rss = metrics(url), rss_mb(server.pid)
        started = time.perf_counter()
        result = asyncio.run(soak(url, server.pid, args.requests, args.concurrency, args.max_tokens, args.hang_up, args.sample, seed=0))
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and metrics(url).get('kvexport_slots_in_use{model="' + args.export.resolve().name + '"}', 0):
            time.sleep(0.1)
        after, end_rss = metrics(url), rss_mb(server.pid)
    finally:
        server.send_signal(signal.SIGTERM)
        server.wait(60)
    model = args.export.resolve().name
    ended = {
        key.split('finish_reason="')[1].split('"')[0]: after[key] - before.get(key, 0.0)
        for key in after
        if key.startswith("kvexport_requests_total{")
    }
    accepted = args.requests - result["outcomes"].get("refused", 0)
    checks = {
        "every accepted request ended": sum(ended.values()) == accepted,
        "none failed": ended.get("error", 0) == 0 and not any(k.startswith("HTTP") or k == "incomplete" for k in result["outcomes"]),
        "slots all back": after[f'kvexport_slots_in_use{{model="{model}"}}'] == 0 and after[f'kvexport_requests_waiting{{model="{model}"}}'] == 0,
    }
    report = {
        "requests": args.requests,
        "concurrency": args.concurrency,
        "seconds": round(time.perf_counter() - started, 1),
        "outcomes": result["outcomes"],
        "ended_by_reason": ended,
        "rss_mb_after_warm_up": round(warm_rss, 1),
        "rss_mb_samples": [(i, round(v, 1)) for i, v in result["rss_mb"]],
        "rss_mb_end": round(end_rss, 1),
        "server_exit_code": server.returncode,
        "checks": checks,
    }
    print(json.dumps(report, indent=2))
    return 0 if all(checks.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
