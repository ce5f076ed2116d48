#!/usr/bin/env python
"""The first requests after a start: TTFT of requests 1-4 to a fresh ``kvexport serve``, with and without its warm-up.

Outside CI. For each setting (``--warm-up 2``, the default, and ``--warm-up 0``) and each of
``--rounds`` rounds: start ``kvexport serve`` on the export, send four requests one after the
other (a ``--input-len`` prompt of random ids, ``--output-len`` new tokens, streamed), record
each one's TTFT, stop the server by its process id. The settings alternate round by round,
so a drifting host treats them alike.

    .venv/bin/python benchmarks/first_requests.py /tmp/llama/hf-gpt2/kvexport-int8 --rounds 3

Servers listen on 127.0.0.1 only.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
from pathlib import Path

import httpx
import numpy as np

sys.path.insert(0, str(Path(__file__).parent))
import serve_load


async def four_requests(url: str, model: str, vocab: int, input_len: int, output_len: int, seed: int) -> list[float]:
    rng = np.random.default_rng(seed)
    async with httpx.AsyncClient(timeout=120) as client:
        ttfts = []
        for _ in range(4):
            prompt = rng.integers(0, vocab, input_len).tolist()
            result = await serve_load.one_request(client, url, model, prompt, output_len)
            ttfts.append(1000 * result.ttft)
    return ttfts


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("export", type=Path)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=16)
    parser.add_argument("--work", type=Path, default=Path("/tmp/first-requests"))
    args = parser.parse_args(argv)
    args.work.mkdir(parents=True, exist_ok=True)
    vocab = json.loads((args.export / "kvexport.json").read_text())["model"]["dims"]["vocab_size"]
    results: dict[str, list[list[float]]] = {"--warm-up 2": [], "--warm-up 0": []}
    for round_ in range(args.rounds):
        for setting in results:
            url, process = serve_load.start_kvexport(args.export, 4, 320, args.work / "serve.log", tuple(setting.split()))
            try:
                results[setting].append(asyncio.run(four_requests(url, args.export.name, vocab, args.input_len, args.output_len, round_)))
            finally:
                serve_load.stop_servers({setting: (url, process, "")})
    print(f"{'setting':<14} {'TTFT 1st':>9} {'2nd':>7} {'3rd':>7} {'4th':>7}  (ms, median over rounds)")
    for setting, rounds in results.items():
        medians = [statistics.median(r[i] for r in rounds) for i in range(4)]
        print(f"{setting:<14} " + " ".join(f"{m:>7.0f}" for m in medians))
    (args.work / "first_requests.json").write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
