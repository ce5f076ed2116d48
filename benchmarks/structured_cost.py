#!/usr/bin/env python
"""Structured output's cost: decode ms per engine step with and without a constraint, and TTFT of a new schema.

Outside CI. On an in-place export with a tokenizer, in one engine (16 slots), three
interleaved rounds: 1 and 16 concurrent sampled requests of 48 tokens, plain and
constrained by the regex ``[a-z ]*`` (never complete, so every request runs its 48 tokens);
then the first token of a request whose JSON schema was never seen, the same schema again,
and no schema. Prints the medians; writes ``structured_cost.json`` (or the second argument).

    .venv/bin/kvexport gpt2 --random-init --target ort-cpu --quantize int8 --out /tmp/gpt2-int8
    .venv/bin/python benchmarks/structured_cost.py /tmp/gpt2-int8
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from pathlib import Path

from kvexport.serving import Engine, SamplingParams
from kvexport.serving.structured import Constraint, from_request

PROMPT = "The help topic"


def step_ms(engine: Engine, concurrency: int, constraint: Constraint | None) -> float:
    """Wall time per engine step while ``concurrency`` requests of 48 sampled tokens run."""
    params = [SamplingParams(max_tokens=48, temperature=1.0, seed=i, ignore_eos=True, structured=constraint) for i in range(concurrency)]
    start, before = time.perf_counter(), engine.stats().steps
    for handle in [engine.submit(PROMPT, p) for p in params]:
        handle.result()
    return (time.perf_counter() - start) * 1000 / (engine.stats().steps - before)


def first_token_ms(engine: Engine, constraint: Constraint | None) -> float:
    start = time.perf_counter()
    next(iter(engine.submit(PROMPT, SamplingParams(max_tokens=1, temperature=0, structured=constraint))))
    return (time.perf_counter() - start) * 1000


def main() -> int:
    export = Path(sys.argv[1])
    out_path = Path(sys.argv[2]) if len(sys.argv) > 2 else Path("structured_cost.json")
    regex = from_request(None, {"regex": "[a-z ]*"})
    samples: dict[str, list[float]] = {}
    with Engine(export, slots=16, max_context=256) as engine:
        assert engine.output.grammars is not None, "the export has no tokenizer"
        engine.output.grammars.tokenizer  # noqa: B018 - built once, before timing
        for concurrency in (1, 16):
            for _ in range(3):
                for name, constraint in (("plain", None), ("regex", regex)):
                    samples.setdefault(f"c{concurrency} {name}", []).append(step_ms(engine, concurrency, constraint))
        for i in range(5):  # a schema never seen, the same again, and none
            schema = {"type": "object", "properties": {f"k{i}": {"type": "integer"}, "v": {"type": "string", "maxLength": 5}}, "required": [f"k{i}"]}
            constraint = from_request(None, {"json": schema})
            samples.setdefault("ttft new schema", []).append(first_token_ms(engine, constraint))
            samples.setdefault("ttft seen schema", []).append(first_token_ms(engine, constraint))
            samples.setdefault("ttft plain", []).append(first_token_ms(engine, None))
    summary = {key: round(statistics.median(values), 3) for key, values in samples.items()}
    print(json.dumps(summary, indent=1))
    out_path.write_text(json.dumps({"export": str(export), "median": summary, "samples": samples}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
