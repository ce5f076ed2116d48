"""Run a kvexport export with onnxruntime-genai, the engine behind its C, C++, C# and Java APIs.

    pip install onnxruntime-genai        # in its own environment: it needs the CPU onnxruntime
    python examples/genai_generate.py out/gpt2-ort "The sky is" 20

Exports with the in-place cache (``--target ort-cpu`` / ``ort-cuda``) carry
``genai_config.json`` and ``tokenizer_config.json``, so the directory loads as it is with
``og.Model(dir)``. The same directory works from the other languages' bindings, e.g. C#
(``Microsoft.ML.OnnxRuntimeGenAI``: ``new Model(dir)``, ``new Tokenizer(model)``,
``new Generator(model, generatorParams)``) or Java (``ai.onnxruntime.genai.Model``).

``--ids=464,6766,318`` in place of the prompt passes token ids instead of text and prints JSON (tokens and decode
ms/token), which is how the tests compare it with kvexport's Generator.
"""

from __future__ import annotations

import json
import sys
import time

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


def main(argv: list[str]) -> None:
    directory, prompt = argv[1], argv[2] if len(argv) > 2 else "The sky is"
    new_tokens = int(argv[3]) if len(argv) > 3 else 20
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
