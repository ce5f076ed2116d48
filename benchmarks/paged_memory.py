#!/usr/bin/env python
"""Memory of ``kvexport serve`` under many users: the paged cache beside the slot layout, one interleaved run.

Outside CI (issue #71, "many users"). For each setting, start ``kvexport serve EXPORT --slots
N`` with that setting's flags (127.0.0.1, a free port), and record:

- ready: seconds from the command to ``/health`` answering, and the RSS then (at rest, after
  the warm-up);
- under load: ``--concurrency`` streamed requests of ``--input-len`` random ids and
  ``--output-len`` new tokens (``serve_load.run_level``: output tok/s, TTFT and ITL), the peak
  RSS of the server while they ran (sampled every 0.1 s), and, paged, the most blocks in use
  (``/metrics``, sampled every 0.2 s) against the blocks the tokens in use need;
- ``default``: the export served with no flag at all, ready time and RSS at rest only.

    .venv/bin/python benchmarks/paged_memory.py /tmp/exp/smol-int8 --out /tmp/w/paged_memory.json

Settings run one after another, each alone on the cores; every server is stopped by its
process id.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).parent))
import roofline
import serve_load

# 64 x (512 + 128) tokens take 2,560 blocks of 16 (1.77 GiB of SmolLM2-135M's fp32 cache): a 2 GiB pool holds
# them; 64 slots of 1,024 tokens reserve 2.81 GiB
SETTINGS = {
    "paged 2 GiB, context 1024": ["--max-context", "1024", "--kv-memory", "2GiB"],
    "paged 2 GiB, context 8192": ["--max-context", "8192", "--kv-memory", "2GiB"],
    "paged 1 GiB, context 8192": ["--max-context", "8192", "--kv-memory", "1GiB"],
    "slots, context 1024": ["--max-context", "1024", "--kv-layout", "slots"],
}


def blocks_in_use(url: str) -> int:
    text = httpx.get(f"{url}/metrics", timeout=10).text
    found = re.search(r"^kvexport_kv_blocks_used\{[^}]*\} ([0-9.e+]+)$", text, re.M)
    return int(float(found.group(1))) if found else 0


def start(export: Path, flags: list[str]) -> tuple[str, subprocess.Popen[Any], float]:
    port = serve_load.free_port()
    command = [sys.executable, "-m", "kvexport.cli", "serve", str(export), "--port", str(port), *flags]
    started = time.perf_counter()
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    url = f"http://127.0.0.1:{port}"
    serve_load.wait_healthy(url, process, seconds=300)
    return url, process, time.perf_counter() - started


def stop(process: subprocess.Popen[Any]) -> str:
    process.terminate()
    _, err = process.communicate(timeout=60)
    return next((line for line in err.splitlines() if "serving " in line), "")


def measure(export: Path, flags: list[str], args: argparse.Namespace, vocab: int, load: bool) -> dict[str, Any]:
    url, process, ready = start(export, flags)
    row: dict[str, Any] = {"flags": flags, "ready_s": round(ready, 2), "rss_at_rest_mb": round(serve_load.tree_rss(process.pid) / 2**20, 1)}
    try:
        if load:
            peak_blocks, done = 0, threading.Event()

            def sample() -> None:
                nonlocal peak_blocks
                while not done.wait(0.2):
                    peak_blocks = max(peak_blocks, blocks_in_use(url))

            sampler = threading.Thread(target=sample, daemon=True)
            sampler.start()
            with serve_load.PeakRss(process.pid) as memory:
                level = asyncio.run(
                    serve_load.run_level(url, export.name, vocab, args.concurrency, args.concurrency, args.input_len, args.output_len, seed=5)
                )
            done.set()
            sampler.join()
            needed = args.concurrency * -(-(args.input_len + args.output_len) // 16)
            row.update(
                peak_rss_mb=round(memory.peak / 2**20, 1),
                output_throughput=round(level["output_throughput"], 1),
                ttft_p99_ms=round(level["ttft"]["p99_ms"]),
                itl_p99_ms=round(level["itl"]["p99_ms"], 1),
                completed=level["completed"],
                peak_blocks_used=peak_blocks,
                blocks_the_tokens_need=needed,
            )
    finally:
        row["start_line"] = stop(process)
    return row


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[1])
    parser.add_argument("export", type=Path)
    parser.add_argument("--slots", type=int, default=64)
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--input-len", type=int, default=512)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--out", type=Path, default=Path("paged_memory.json"))
    args = parser.parse_args(argv)
    vocab = json.loads((args.export / "kvexport.json").read_text())["model"]["dims"]["vocab_size"]
    isa = roofline.isa()
    rows = {"default (no flags)": measure(args.export, [], args, vocab, load=False)}
    for name, flags in SETTINGS.items():
        rows[name] = measure(args.export, ["--slots", str(args.slots), *flags], args, vocab, load=True)
        print(name, rows[name], file=sys.stderr, flush=True)
    result = {"export": str(args.export), "isa": isa, "input_len": args.input_len, "output_len": args.output_len,
              "concurrency": args.concurrency, "slots": args.slots, "settings": rows}
    args.out.write_text(json.dumps(result, indent=2))
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
