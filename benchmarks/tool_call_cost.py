#!/usr/bin/env python
"""What a required tool call costs: time per token with ``tool_choice: "required"`` against the same request without, and the first-token delay of compiling the tools' grammar.

Outside CI. Over HTTP (``kvexport serve``'s app on uvicorn in a thread, one slot, so each
request runs alone) on an in-place export with a chat template that renders tools. Five
interleaved rounds of:

- ``plain``: the question alone, streamed, 48 tokens at most;
- ``tools none``: the same with the tools in the prompt (``tool_choice: "none"``), so the
  prompt is the required one's;
- ``required``: the same, ``tool_choice: "required"`` (one call, ``parallel_tool_calls: false``);
- ``required, new tools``: the same with the tools renamed, so their grammar was never seen.

Each gives its time to first token and its decode ms per token (the mean gap between
tokens after the first; ``logprobs`` gives every token its chunk). Prints the medians; writes
``tool_call_cost.json`` (or the third argument).

    .venv/bin/python benchmarks/tool_call_cost.py out/smollm2 tests/data/templates/qwen3.jinja
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import httpx

from kvexport.serving import Engine
from kvexport.serving.config import ApiConfig
from kvexport.testing import app_in_thread

QUESTION = [{"role": "user", "content": "What is the weather in Paris, and what time is it there?"}]


def tools(suffix: str) -> list[dict[str, Any]]:
    """Two tools; ``suffix`` renames them (a grammar never compiled)."""
    return [
        {"type": "function", "function": {"name": f"get_weather{suffix}", "description": "The weather in a city", "parameters": {
            "type": "object", "required": ["city"],
            "properties": {"city": {"type": "string"}, "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}}}}},
        {"type": "function", "function": {"name": f"get_time{suffix}", "description": "The time in a time zone", "parameters": {
            "type": "object", "required": ["zone"], "properties": {"zone": {"type": "string"}}}}},
    ]


def timed(url: str, body: dict[str, Any]) -> tuple[float, float, int]:
    """(TTFT ms, decode ms per token, tokens) of one streamed chat request.

    ``logprobs`` is asked for so that every token has its chunk, even while the tool-call
    parser holds text back (a call's first piece waits for its name).
    """
    request = {"messages": QUESTION, "max_tokens": 48, "temperature": 0, "stream": True, "logprobs": True, **body}
    start, stamps = time.perf_counter(), []
    with httpx.stream("POST", f"{url}/v1/chat/completions", json=request, timeout=300) as response:
        response.raise_for_status()
        for line in response.iter_lines():
            if not line.startswith("data: {"):
                continue
            choice = (json.loads(line[6:]).get("choices") or [{}])[0]
            for _ in (choice.get("logprobs") or {}).get("content") or ():
                stamps.append(time.perf_counter())
    ttft = (stamps[0] - start) * 1000
    per_token = (stamps[-1] - stamps[0]) * 1000 / max(1, len(stamps) - 1)
    return ttft, per_token, len(stamps)


def main() -> int:
    export, template = Path(sys.argv[1]), Path(sys.argv[2])
    out_path = Path(sys.argv[3]) if len(sys.argv) > 3 else Path("tool_call_cost.json")
    api = ApiConfig(chat_template=str(template), reasoning_parser="none", name="model")
    samples: dict[str, list[float]] = {}
    with Engine(export, slots=1, max_context=1024, prefix_cache=False) as engine:
        with app_in_thread(engine, api) as url:
            timed(url, {"tools": tools(""), "tool_choice": "required", "parallel_tool_calls": False})  # llguidance's tokenizer, once
            for round_ in range(5):
                cases = {
                    "plain": {},
                    "tools none": {"tools": tools(""), "tool_choice": "none", "min_tokens": 24},
                    "required": {"tools": tools(""), "tool_choice": "required", "parallel_tool_calls": False},
                    "required new tools": {"tools": tools(f"_{round_}"), "tool_choice": "required", "parallel_tool_calls": False},
                }
                for name, body in cases.items():
                    ttft, per_token, count = timed(url, body)
                    samples.setdefault(f"{name} ttft ms", []).append(ttft)
                    samples.setdefault(f"{name} ms/token", []).append(per_token)
                    samples.setdefault(f"{name} tokens", []).append(count)
    summary = {key: round(statistics.median(values), 2) for key, values in samples.items()}
    print(json.dumps(summary, indent=1))
    out_path.write_text(json.dumps({"export": str(export), "template": str(template), "median": summary, "samples": samples}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
