#!/usr/bin/env python
"""One decode call of many rows over the paged cache beside the slot layout, in process (issue #71).

Outside CI. For each layout (``--layouts``: ``slots``, ``paged`` an fp32 pool, ``paged-fp16``; a
``+bf16`` suffix runs the call's block products in bf16 through the prompt session, on AMX), in
rounds of alternating order: a ``ModelRunner`` of ``--rows`` slots of ``--context`` tokens (paged: a
pool of the blocks the rows need, handed out a row at a time, as admission does), each row
prefilled with a ``--prompt`` of random ids, then ``--steps`` decode calls over every row; the
median and the least call time after the first ten.

    .venv/bin/python benchmarks/paged_decode.py /tmp/exp/smol-int8 --rounds 3 --layouts slots,paged,paged-fp16

Prints one JSON object (with the host's ISA).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).parent))
import roofline

from kvexport.runtime.opened import open_export
from kvexport.serving.blocks import BlockManager, blocks_for
from kvexport.serving.runner import ModelRunner


def decode_times(export: Path, layout: str, rows: int, context: int, prompt: int, steps: int) -> list[float]:
    opened = open_export(export, "cpu")
    pool = rows * blocks_for(context) + 2
    layout, _, products = layout.partition("+")
    paged = layout.startswith("paged")
    runner = ModelRunner(
        opened, rows, context, paged_blocks=pool if paged else None, pool_dtype=layout.partition("-")[2] or "fp32",
        prompt_products=products == "bf16", bf16_decode_rows=1 if products == "bf16" else 0,
    )
    if paged:
        manager = BlockManager(pool, runner.cache.tables)  # type: ignore[attr-defined]
        for row in range(rows):
            manager.grow(row, prompt + steps + 1)
    rng = np.random.default_rng(0)
    for row in range(rows):
        runner.run_piece(row, rng.integers(5, opened.manifest.dims.vocab_size, prompt).tolist(), 0)
    times = []
    for step in range(steps):
        started = time.perf_counter()
        runner.decode([5] * rows, [prompt + step] * rows)
        times.append(time.perf_counter() - started)
    return times[10:]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[1])
    parser.add_argument("export", type=Path)
    parser.add_argument("--rows", type=int, default=16)
    parser.add_argument("--context", type=int, default=1024)
    parser.add_argument("--prompt", type=int, default=512)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--layouts", default="slots,paged", help="comma-separated: slots, paged, paged-fp16; +bf16 after one: bf16 products")
    args = parser.parse_args(argv)
    layouts = args.layouts.split(",")
    result: dict[str, object] = {"isa": roofline.isa(), "rows": args.rows, "prompt": args.prompt, "rounds": {}}
    for round_index in range(args.rounds):
        for layout in layouts if round_index % 2 == 0 else layouts[::-1]:
            times = decode_times(args.export, layout, args.rows, args.context, args.prompt, args.steps)
            row = {"median_ms": round(1000 * statistics.median(times), 2), "least_ms": round(1000 * min(times), 2)}
            result["rounds"].setdefault(layout, []).append(row)  # type: ignore[attr-defined]
            print(layout, row, file=sys.stderr, flush=True)
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
