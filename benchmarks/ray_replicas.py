#!/usr/bin/env python
"""``kvexport serve`` embedded beside ``--replicas 1`` and ``--replicas 2`` on Ray Serve, one run.

Outside CI. Each system is started in turn (each replica count its own local Ray cluster,
on 127.0.0.1), warmed up, sent the same bounded load with ``serve_load.py``'s client
(vLLM's metric definitions), and stopped by its process id with SIGTERM:

    .venv/bin/python benchmarks/ray_replicas.py --export /tmp/llama/hf-gpt2/kvexport-int8

Replicas multiply slots, not cores: on one 2-core machine two replicas share the same cores
(each engine's ONNX Runtime threads compete), so no gain is expected here; on a cluster each
replica brings its own machine. Writes ``ray_replicas.json`` under ``--work``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import signal
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
import serve_load


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--export", type=Path, required=True, help="An in-place export directory.")
    parser.add_argument("--work", type=Path, default=Path("/tmp/llama"))
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--slots", type=int, default=16)
    parser.add_argument("--context", type=int, default=320)
    args = parser.parse_args(argv)
    args.work.mkdir(parents=True, exist_ok=True)
    vocab = json.loads((args.export / "kvexport.json").read_text())["model"]["dims"]["vocab_size"]
    model = args.export.resolve().name
    systems = {"embedded": (), "ray, 1 replica": ("--replicas", "1"), "ray, 2 replicas": ("--replicas", "2")}
    rows = {}
    for system, extra in systems.items():
        log = args.work / f"ray_replicas-{system.replace(' ', '').replace(',', '-')}.log"
        url, process = serve_load.start_kvexport(args.export, args.slots, args.context, log, extra)
        try:
            asyncio.run(serve_load.run_level(url, model, vocab, 2, 2, 16, 4, seed=99))  # warm every replica up
            rows[system] = asyncio.run(
                serve_load.run_level(url, model, vocab, args.concurrency, args.requests, args.input_len, args.output_len, seed=1)
            )
        finally:
            process.send_signal(signal.SIGTERM)
            process.wait(120)
        row = rows[system]
        print(
            f"{system:<16} {row['output_throughput']:7.1f} tok/s  TTFT p99 {row['ttft']['p99_ms']:6.0f} ms  "
            f"TPOT median {row['tpot']['median_ms']:6.1f} ms  completed {row['completed']}/{args.requests}",
            flush=True,
        )
    (args.work / "ray_replicas.json").write_text(json.dumps({"export": str(args.export), **vars(args), "rows": rows}, default=str, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
