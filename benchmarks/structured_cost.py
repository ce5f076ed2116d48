#!/usr/bin/env python
"""Structured output's cost: decode ms per engine step with and without a constraint, and TTFT of a new schema.

Outside CI. On an in-place export with a tokenizer, in one engine (16 slots), three
interleaved rounds: 1 and 16 concurrent sampled requests of 48 tokens, plain and
constrained by the regex ``[a-z ]*`` (never complete, so every request runs its 48 tokens);
then the first token of a request whose JSON schema was never seen, the same schema again,
and no schema. Last, over HTTP (the app on uvicorn in a thread): the inter-token gaps of 4
streamed plain requests while 12 one-token requests arrive one after another, each with a
40-property JSON schema never seen, against the same with 12 one-token plain requests
(the schemas' compiling is the only difference). Prints the medians; writes
``structured_cost.json`` (or the second argument).

    .venv/bin/kvexport gpt2 --random-init --target ort-cpu --quantize int8 --out /tmp/gpt2-int8
    .venv/bin/python benchmarks/structured_cost.py /tmp/gpt2-int8
"""

from __future__ import annotations

import json
import statistics
import sys
import threading
import time
from pathlib import Path
from typing import Any

import httpx

from kvexport.serving import Engine, SamplingParams
from kvexport.serving.structured import Constraint, from_request
from kvexport.testing import app_in_thread

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


def _schema(i: int) -> dict[str, Any]:
    fields = {f"f{i}_{j}": {"type": "string", "pattern": "[a-z]{3,9}@[a-z]+\\.(com|org)", "maxLength": 40} for j in range(40)}
    return {"type": "object", "properties": fields, "required": [f"f{i}_0"]}


def gaps_while_others_arrive(url: str, schemas: bool, round_: int) -> list[float]:
    """Inter-token gaps (ms) of 4 streamed plain requests while 12 one-token requests arrive, with new schemas or plain."""
    gaps: list[float] = []

    def stream(seed: int) -> None:
        body = {"prompt": PROMPT, "max_tokens": 96, "temperature": 1.0, "seed": seed, "ignore_eos": True, "stream": True}
        last = None
        with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=120) as response:
            for line in response.iter_lines():
                if line.startswith("data: {"):
                    now = time.perf_counter()
                    if last is not None:
                        gaps.append((now - last) * 1000)
                    last = now

    streams = [threading.Thread(target=stream, args=(seed,)) for seed in range(4)]
    for thread in streams:
        thread.start()
    time.sleep(0.3)  # the streams are decoding
    for i in range(12):
        body: dict[str, Any] = {"prompt": PROMPT, "max_tokens": 1, "temperature": 0}
        if schemas:
            body["response_format"] = {"type": "json_schema", "json_schema": {"name": "x", "schema": _schema(1000 * round_ + i)}}
        httpx.post(f"{url}/v1/completions", json=body, timeout=60).raise_for_status()
    for thread in streams:
        thread.join()
    return gaps


def interference(export: Path) -> dict[str, list[float]]:
    """p99 and largest inter-token gap of running streams while schemas compile, against plain arrivals; 3 rounds each."""
    samples: dict[str, list[float]] = {}
    with Engine(export, slots=16, max_context=256) as engine:
        with app_in_thread(engine) as url:
            for round_ in range(3):
                for name, schemas in (("plain arrivals", False), ("schema arrivals", True)):
                    gaps = sorted(gaps_while_others_arrive(url, schemas, round_))
                    samples.setdefault(f"itl p99 ms, {name}", []).append(gaps[int(0.99 * (len(gaps) - 1))])
                    samples.setdefault(f"itl max ms, {name}", []).append(gaps[-1])
    return samples


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
    samples.update(interference(export))
    summary = {key: round(statistics.median(values), 3) for key, values in samples.items()}
    print(json.dumps(summary, indent=1))
    out_path.write_text(json.dumps({"export": str(export), "median": summary, "samples": samples}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
