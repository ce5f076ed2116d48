#!/usr/bin/env python
"""Memory and decode speed of the fp32, int8 and int4 KV caches, on the same weights, one run.

For each base export (an in-place ``--target ort-cpu`` export, e.g. GPT-2 124M random init
with fp32 or per-channel int8 weights), copies with an int8 and an int4 cache are made
(``kvexport.export.calibration.quantize_export_cache``, the default calibration). Then, each in a
process of its own so no other session's threads compete for the cores:

- memory: the serving engine with ``--slots 16 --max-context 1024``, its process PSS after
  start, and the cache buffers' bytes (scales included: they live in the graph);
- speed: the engine's decode call (``ModelRunner.decode``, 16 slots of 1024 tokens, the mask
  as wide as the capacity) at 1 and 16 rows, each row at context 128, 512 and 1000: the
  median of ``--steps`` calls, best of ``--rounds`` rounds that alternate the cache types.

    .venv/bin/python benchmarks/kv_cache_speed.py /tmp/llama/hf-gpt2/kvexport-none /tmp/llama/hf-gpt2/kvexport-int8-pc

Writes ``kv_cache_speed-gpt2.json`` under ``--results``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

CONTEXTS = (128, 512, 1000)
ROWS = (1, 16)

_MEMORY = """
import json, sys
from kvexport.tools.bench import pss_mb
from kvexport.serving import Engine
engine = Engine(sys.argv[1], slots=16, max_context=1024)
cache = engine.runner.cache
started = pss_mb()
for index in range(len(cache.past)):  # every cache page resident, as a full engine has them
    cache.banks.host_view(0, index, (cache.slots, *cache.row_shape))[...] = 0
cache_bytes = cache.row_bytes * cache.slots * len(cache.past)
print(json.dumps({"pss_mb_started": started, "pss_mb": pss_mb(), "cache_mb": cache_bytes / 2**20}))
engine.close()
"""

_SPEED = """
import json, sys, time
import numpy as np
from kvexport.runtime.opened import open_export
from kvexport.serving.runner import ModelRunner
runner = ModelRunner(open_export(sys.argv[1], "cpu"), 16, 1024)
out = {}
for context in json.loads(sys.argv[2]):
    for rows in json.loads(sys.argv[3]):
        tokens, positions = [0] * rows, [context] * rows
        for _ in range(3):
            runner.decode(tokens, positions)
        times = []
        for _ in range(int(sys.argv[4])):
            started = time.perf_counter()
            runner.decode(tokens, positions)
            times.append(time.perf_counter() - started)
        out[f"{rows}x{context}"] = 1000 * float(np.median(times))
print(json.dumps(out))
"""


def _python(code: str, *args: str) -> dict[str, Any]:
    result = subprocess.run([sys.executable, "-c", code, *args], check=True, capture_output=True, text=True, cwd=ROOT)
    return json.loads(result.stdout.strip().splitlines()[-1])


def cache_variants(base: Path, work: Path) -> dict[str, Path]:
    """The base export (fp32 cache) and its copies with an int8 and an int4 cache."""
    from kvexport.export.calibration import copy_with_quantized_cache
    from kvexport.passes.quantize_cache import CacheQuantization

    variants = {"fp32": base}
    for bits in (8, 4):
        variants[f"int{bits}"] = copy_with_quantized_cache(base, work / f"{base.name}-kv-int{bits}", CacheQuantization(bits=bits))
    return variants


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("exports", nargs="+", type=Path)
    parser.add_argument("--work", type=Path, default=Path("/tmp/kv-speed"))
    parser.add_argument("--results", type=Path, default=ROOT / "benchmarks" / "results")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=30)
    args = parser.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    args.work.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    report: dict[str, Any] = {"date": time.strftime("%Y-%m-%d"), "contexts": CONTEXTS, "rows": ROWS, "exports": {}}
    for base in args.exports:
        variants = cache_variants(base, args.work)
        memory = {kind: _python(_MEMORY, str(path)) for kind, path in variants.items()}
        samples: dict[str, list[dict[str, float]]] = {kind: [] for kind in variants}
        for _ in range(args.rounds):
            for kind, path in variants.items():
                samples[kind].append(_python(_SPEED, str(path), json.dumps(CONTEXTS), json.dumps(ROWS), str(args.steps)))
        speed = {kind: {cell: round(min(s[cell] for s in runs), 2) for cell in runs[0]} for kind, runs in samples.items()}
        report["exports"][base.name] = {"memory": memory, "decode_step_ms": speed}
        print(f"\n{base.name}")
        print(f"{'cache':<6} {'PSS MB':>8} {'cache MB':>9}  " + "  ".join(f"{cell:>8}" for cell in speed["fp32"]))
        for kind in variants:
            cells = "  ".join(f"{speed[kind][cell]:>8.2f}" for cell in speed["fp32"])
            print(f"{kind:<6} {memory[kind]['pss_mb']:>8.0f} {memory[kind]['cache_mb']:>9.1f}  {cells}")
    report["seconds"] = round(time.perf_counter() - started, 1)
    args.results.mkdir(parents=True, exist_ok=True)
    (args.results / "kv_cache_speed-gpt2.json").write_text(json.dumps(report, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
