#!/usr/bin/env python
"""The engine's calls one by one, for each way CPU sessions may run a prompt's attention.

Outside CI. For an in-place export, a ``ModelRunner`` (the serving engine's: one session,
``--slots`` rows of ``--capacity`` tokens) times fresh prompts sharing a call
(``run_rows``: ROWSxTOKENS), a piece after a past at batch 1 and decode steps, with
``KVEXPORT_PROMPT_ATTENTION`` set to each of ``--modes`` in turn (``products``, the
default: :class:`kvexport.passes.PromptAttentionPass`; ``gqa``: the op as exported)::

    .venv/bin/python benchmarks/prompt_calls.py /tmp/gpt2-int8 --results benchmarks/results/prompt_calls-gpt2-amx.json

Prints a line per mode (median ms of ``--repeats`` calls after two warm-up calls) and
writes the JSON to ``--results``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).parents[1]))
sys.path.insert(0, str(Path(__file__).parent))
from serve_load import ISA_FLAGS

from kvexport.runtime.opened import open_export
from kvexport.runtime.session import PROMPT_ATTENTION_VARIABLE, cpu_flags
from kvexport.serving.runner import ModelRunner

CALLS = ("16x128", "16x256", "16x64", "4x256", "4x128", "2x128", "1x128", "1x512")


def _median_ms(call: Callable[[], object], repeats: int) -> float:
    for _ in range(2):
        call()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        call()
        times.append(time.perf_counter() - start)
    return round(float(np.median(times)) * 1e3, 2)


def measure(export: Path, mode: str, args: argparse.Namespace) -> dict[str, float]:
    """Each call's median time with the prompt attention run by ``mode``."""
    os.environ[PROMPT_ATTENTION_VARIABLE] = mode
    runner = ModelRunner(open_export(export), args.slots, args.capacity)
    rng = np.random.default_rng(0)
    vocab = runner.vocab_size
    result: dict[str, float] = {}
    for call in args.calls:
        rows, tokens = (int(part) for part in call.split("x"))
        pieces = [list(rng.integers(0, vocab, tokens)) for _ in range(rows)]
        result[call] = _median_ms(lambda pieces=pieces: runner.run_rows(0, pieces), args.repeats)
    half = args.capacity // 4
    runner.run_piece(0, list(rng.integers(0, vocab, half)), 0)
    after = list(rng.integers(0, vocab, half))
    result[f"1x{half} after {half}"] = _median_ms(lambda: runner.run_piece(0, after, half), args.repeats)
    runner.run_rows(0, [list(rng.integers(0, vocab, half)) for _ in range(args.slots)])
    for rows in (1, 4, args.slots):
        result[f"decode {rows}"] = _median_ms(lambda rows=rows: runner.decode([1] * rows, [half] * rows), args.repeats * 4)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("export", type=Path, help="An in-place (--target ort-cpu) export")
    parser.add_argument("--modes", nargs="+", default=["gqa", "products"])
    parser.add_argument("--calls", nargs="+", default=list(CALLS), metavar="ROWSxTOKENS")
    parser.add_argument("--slots", type=int, default=16)
    parser.add_argument("--capacity", type=int, default=640)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--results", type=Path)
    args = parser.parse_args()
    results = {mode: measure(args.export, mode, args) for mode in args.modes}
    for mode, times in results.items():
        print(f"{mode}: " + "  ".join(f"{call} {ms}" for call, ms in times.items()))
    machine = {"cpu": platform.machine(), "isa": sorted(cpu_flags() & ISA_FLAGS)}
    if args.results is not None:
        payload = {"export": str(args.export), "slots": args.slots, "capacity": args.capacity, "machine": machine, "median_ms": results}
        args.results.write_text(json.dumps(payload, indent=1) + "\n")
        print(f"wrote {args.results}")


if __name__ == "__main__":
    main()
