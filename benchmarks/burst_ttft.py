#!/usr/bin/env python
"""Bursts against one ``kvexport serve``: each wave's time to first tokens, level by level from a cold start.

Outside CI. For each ``--variant LABEL=ARGS`` (extra ``kvexport serve`` arguments; ``default=``
for none) a fresh server on 127.0.0.1 takes ``--levels`` levels, one after another, of
``2 x --slots`` streamed requests (``--input-len`` random ids, ``--output-len`` new tokens,
greedy) with at most ``--slots`` in flight: the first wave arrives at once, the second as the
first one's requests end. For each level it records the TTFT of both waves (min / median /
max, ms) and the p99 over all, so the first level shows what a start leaves cold::

    .venv/bin/python benchmarks/burst_ttft.py /tmp/gpt2-int8 --variant default= --variant "no-warm-up=--warm-up 0" \\
        --results benchmarks/results/burst_ttft-gpt2-amx.json

Writes the JSON to ``--results`` and prints a line per level.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import numpy as np

sys.path.insert(0, str(Path(__file__).parent))
from serve_load import ISA_FLAGS, free_port, one_request, split_settings, wait_healthy

from kvexport.runtime.session import cpu_flags

KVEXPORT = Path(sys.executable).with_name("kvexport")


async def _level(url: str, model: str, args: argparse.Namespace, seed: int) -> dict[str, Any]:
    rng = np.random.default_rng(seed)
    prompts = [rng.integers(100, args.vocab - 100, args.input_len).tolist() for _ in range(2 * args.slots)]
    limit = asyncio.Semaphore(args.slots)
    ttfts: dict[int, float] = {}
    async with httpx.AsyncClient(timeout=300) as client:

        async def one(index: int, prompt: list[int]) -> None:
            async with limit:
                result = await one_request(client, url, model, prompt, args.output_len)
                ttfts[index] = result.ttft * 1000

        await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts)))

    def wave(values: list[float]) -> dict[str, float]:
        return {"min_ms": min(values), "median_ms": float(np.median(values)), "max_ms": max(values)}

    first = [ttfts[i] for i in range(args.slots)]
    second = [ttfts[i] for i in range(args.slots, 2 * args.slots)]
    return {"wave_1": wave(first), "wave_2": wave(second), "p99_ms": float(np.percentile(first + second, 99))}


def run_variant(export: Path, extra: list[str], args: argparse.Namespace) -> list[dict[str, Any]]:
    """A fresh server with ``extra`` arguments, ``--levels`` levels from its start.

    Items of ``extra`` written ``NAME=VALUE`` with an upper-case name set that environment
    variable for the server (``KVEXPORT_PROMPT_ATTENTION=gqa``), as in serve_load.py.
    """
    port = free_port()
    settings, arguments = split_settings(extra)
    command = [str(KVEXPORT), "serve", str(export), "--host", "127.0.0.1", "--port", str(port),
               "--slots", str(args.slots), "--max-context", str(args.context), *arguments]
    env = {**os.environ, **settings}
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(url, process)
        model = httpx.get(f"{url}/v1/models").json()["data"][0]["id"]
        return [asyncio.run(_level(url, model, args, seed)) for seed in range(args.levels)]
    finally:
        process.terminate()
        process.wait(timeout=60)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("export", type=Path)
    parser.add_argument("--variant", action="append", default=[], metavar="LABEL=ARGS")
    parser.add_argument("--slots", type=int, default=16)
    parser.add_argument("--context", type=int, default=320)
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--levels", type=int, default=4)
    parser.add_argument("--results", type=Path)
    args = parser.parse_args()
    args.vocab = json.loads((args.export / "kvexport.json").read_text())["model"]["dims"]["vocab_size"]
    variants = args.variant or ["default="]
    runs: dict[str, Any] = {}
    for variant in variants:
        label, _, extra = variant.partition("=")
        runs[label] = run_variant(args.export, extra.split(), args)
        for index, level in enumerate(runs[label]):
            one, two = level["wave_1"], level["wave_2"]
            print(f"{label} level {index}: wave 1 TTFT {one['min_ms']:.0f}/{one['median_ms']:.0f}/{one['max_ms']:.0f} ms, "
                  f"wave 2 {two['min_ms']:.0f}/{two['median_ms']:.0f}/{two['max_ms']:.0f} ms, p99 {level['p99_ms']:.0f} ms")
    record = {
        "export": str(args.export), "slots": args.slots, "context": args.context, "input_len": args.input_len,
        "output_len": args.output_len, "machine": {
            "cpu": platform.processor() or platform.machine(),
            "isa": sorted(cpu_flags() & ISA_FLAGS),
            "date": time.strftime("%Y-%m-%d"),
        },
        "runs": runs,
    }
    if args.results is not None:
        args.results.write_text(json.dumps(record, indent=1) + "\n")
        print(f"wrote {args.results}")


if __name__ == "__main__":
    main()
