"""Run a kvexport export with onnxruntime-genai, the engine behind its C, C++, C# and Java APIs.

    pip install onnxruntime-genai        # in its own environment: it needs the CPU onnxruntime
    python examples/genai_generate.py out/gpt2-ort "The sky is" 20

Exports with the in-place cache (``--target ort-cpu`` / ``ort-cuda``) carry
``genai_config.json`` and ``tokenizer_config.json``, so the directory loads as it is with
``og.Model(dir)``. The same directory works from the other languages' bindings, e.g. C#
(``Microsoft.ML.OnnxRuntimeGenAI``: ``new Model(dir)``, ``new Tokenizer(model)``,
``new Generator(model, generatorParams)``) or Java (``ai.onnxruntime.genai.Model``).

``--ids=464,6766,318`` in place of the prompt passes token ids instead of text and prints JSON (tokens and decode
ms/token), which is how the tests compare it with kvexport's Generator. ``--ids=464,6766,318;40,1101`` passes a
batch of prompts of different lengths: onnxruntime-genai takes them right-padded with the pad id, and each row's
own length reaches the graph through the attention mask (``seqlens_k`` is the row's last 1, and prefill's logits
come from each row's last real token).
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import numpy as np
import onnxruntime_genai as og


def generate(directory: str, prompt_ids: list[int], new_tokens: int) -> tuple[list[int], float]:
    model = og.Model(directory)
    params = og.GeneratorParams(model)
    params.set_search_options(max_length=len(prompt_ids) + new_tokens, do_sample=False)
    generator = og.Generator(model, params)
    generator.append_tokens(prompt_ids)  # the prompt runs here, through the decoder graph
    tokens: list[int] = []
    steps: list[float] = []
    while not generator.is_done() and len(tokens) < new_tokens:
        started = time.perf_counter()
        generator.generate_next_token()
        steps.append(time.perf_counter() - started)
        tokens.append(int(generator.get_next_tokens()[0]))
    decode_ms = 1000 * sorted(steps[1:])[len(steps[1:]) // 2] if len(steps) > 1 else 0.0
    return tokens, decode_ms


def generate_batch(directory: str, prompts: list[list[int]], new_tokens: int) -> list[list[int]]:
    """Greedy tokens for a batch of prompts in one generator (rows that finish get the pad id)."""
    model = og.Model(directory)
    pad = json.loads((Path(directory) / "genai_config.json").read_text())["model"]["pad_token_id"]
    width = max(len(p) for p in prompts)
    padded = np.full((len(prompts), width), pad, dtype=np.int32)
    for row, prompt in enumerate(prompts):
        padded[row, : len(prompt)] = prompt  # right padding, onnxruntime-genai's convention
    params = og.GeneratorParams(model)
    params.set_search_options(max_length=width + new_tokens, do_sample=False, batch_size=len(prompts))
    generator = og.Generator(model, params)
    generator.append_tokens(padded)
    rows: list[list[int]] = [[] for _ in prompts]
    while not generator.is_done() and len(rows[0]) < new_tokens:
        generator.generate_next_token()
        for row, token in enumerate(generator.get_next_tokens()):
            rows[row].append(int(token))
    return rows


def main(argv: list[str]) -> None:
    directory, prompt = argv[1], argv[2] if len(argv) > 2 else "The sky is"
    new_tokens = int(argv[3]) if len(argv) > 3 else 20
    if prompt.startswith("--ids=") and ";" in prompt:
        batch = [[int(t) for t in row.split(",")] for row in prompt[6:].split(";")]
        print(json.dumps({"tokens": generate_batch(directory, batch, new_tokens)}))
        return
    if prompt.startswith("--ids="):
        tokens, decode_ms = generate(directory, [int(t) for t in prompt[6:].split(",")], new_tokens)
        print(json.dumps({"tokens": tokens, "decode_ms_per_token": decode_ms}))
        return
    tokenizer = og.Tokenizer(og.Model(directory))
    tokens, decode_ms = generate(directory, list(tokenizer.encode(prompt)), new_tokens)
    print(prompt + tokenizer.decode(tokens))
    print(f"decode {decode_ms:.2f} ms/token", file=sys.stderr)


if __name__ == "__main__":
    main(sys.argv)
