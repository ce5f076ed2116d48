#!/usr/bin/env python
"""What the mixed step saves: a prompt chunk and a 16-row decode call in one call, against the two calls.

Outside CI. GPT-2 124M (random weights) as in-place ort-cpu exports (int8 per channel,
int8 blocks, int4; the exports ``benchmarks/llama_cpp_compare.py`` makes, reused when
present), one :class:`~kvexport.serving.runner.ModelRunner` each, as the engine opens it
(spinning threads, the mixed session beside the prefill one). Sixteen slots hold 128-token
prompts and decode; slot 16 takes a chunk of ``N`` prompt tokens. Both sessions take
turns on one thread pool, as the engine's do. Per chunk size, in
interleaved rounds (each case once per round, the order rotating):

- ``separate``: ``run_piece`` (the chunk at batch 1), then ``decode`` (16 rows): today's step;
- ``mixed``: ``mixed`` (both in one call);
- ``chunk`` and ``decode`` alone, for the parts.

Reports the median of each, ``mixed / separate`` and the decode rows' added cost in the
mixed call (``mixed - chunk``, against ``decode``).

    .venv/bin/python benchmarks/mixed_step.py --work /tmp/llama --results benchmarks/results

Writes ``mixed_step-gpt2-<isa>.json``.
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
from typing import Any

import numpy as np
import onnxruntime as ort

sys.path.insert(0, str(Path(__file__).parent))
import llama_cpp_compare as llama

from kvexport.runtime.opened import open_export
from kvexport.serving.runner import ModelRunner

ROWS, CONTEXT, CAPACITY = 16, 128, 640


def isa() -> str:
    """``avx512-vnni``, ``avx2`` or the machine, from /proc/cpuinfo's flags."""
    flags = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    return "avx512-vnni" if "avx512_vnni" in flags else "avx2" if " avx2" in flags else platform.machine()


def _cases(runner: ModelRunner, chunk: list[int], tokens: list[int], positions: list[int]) -> dict[str, Callable[[], object]]:
    return {
        "separate": lambda: (runner.run_piece(ROWS, chunk, 0), runner.decode(tokens, positions)),
        "mixed": lambda: runner.mixed(ROWS, chunk, 0, tokens, positions),
        "chunk": lambda: runner.run_piece(ROWS, chunk, 0),
        "decode": lambda: runner.decode(tokens, positions),
    }


def measure(export: Path, chunks: list[int], rounds: int) -> dict[str, Any]:
    runner = ModelRunner(open_export(export, "cpu"), ROWS + 1, CAPACITY, mixed=True)
    assert runner.mixed_session is not None, runner.unmixed_because
    rng = np.random.default_rng(0)
    vocab = runner.vocab_size
    for slot in range(ROWS):
        runner.run_piece(slot, rng.integers(0, vocab, CONTEXT).tolist(), 0)
    tokens, positions = rng.integers(0, vocab, ROWS).tolist(), [CONTEXT] * ROWS
    results: dict[str, Any] = {}
    for size in chunks:
        cases = _cases(runner, rng.integers(0, vocab, size).tolist(), tokens, positions)
        times: dict[str, list[float]] = {name: [] for name in cases}
        for case in cases.values():  # warm each shape
            case()
        for round_index in range(rounds):
            names = list(cases)
            names = names[round_index % len(names) :] + names[: round_index % len(names)]
            for name in names:
                started = time.perf_counter()
                cases[name]()
                times[name].append(1000 * (time.perf_counter() - started))
        median = {name: float(np.median(values)) for name, values in times.items()}
        results[str(size)] = {
            "ms": median,
            "mixed_over_separate": median["mixed"] / median["separate"],
            "decode_rows_added_ms": median["mixed"] - median["chunk"],
        }
        print(
            f"  chunk {size:>4}: separate {median['separate']:7.1f} ms, mixed {median['mixed']:7.1f} ms "
            f"({median['mixed'] / median['separate']:.2f}x); chunk {median['chunk']:6.1f}, decode {median['decode']:5.1f}, "
            f"rows added in the mixed call {median['mixed'] - median['chunk']:5.1f}"
        )
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--work", type=Path, default=Path("/tmp/llama"))
    parser.add_argument("--results", type=Path, default=Path("benchmarks/results"))
    parser.add_argument("--chunks", default="16,64,128,256")
    parser.add_argument("--rounds", type=int, default=15)
    args = parser.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    exports = llama.kvexport_exports("gpt2", True, args.work / "hf-gpt2", [], int8_per_channel=True)
    report: dict[str, Any] = {
        "machine": {"isa": isa(), "onnxruntime": ort.__version__, "date": time.strftime("%Y-%m-%d")},
        "rows": ROWS,
        "context": CONTEXT,
        "exports": {},
    }
    for label in ("int8 pc", "int8", "int4"):
        print(label)
        report["exports"][label] = measure(exports[label], [int(c) for c in args.chunks.split(",")], args.rounds)
    args.results.mkdir(parents=True, exist_ok=True)
    out = args.results / f"mixed_step-gpt2-{isa()}.json"
    out.write_text(json.dumps(report, indent=2))
    print(f"wrote {out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
