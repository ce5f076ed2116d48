"""Greedy generation with the exported graphs and plain ONNX Runtime.

    python examples/greedy_onnxruntime.py out/gpt2 "The sky is" 20

Reads only the export directory: the manifest for the layer count, the dims and the cache
layout, and the tokenizer for text. It follows both layouts the manifest can name:

- ``concat`` (``--target portable``): each step feeds the previous step's ``present.*``
  back as ``past.*``;
- ``shared-buffer`` (the ort targets): one buffer per cache tensor, sized for prompt +
  new tokens, bound with IO binding as both ``past.*`` and ``present.*`` of both graphs;
  the graphs write the new rows in place.

A deployment pipeline can copy this loop as it is.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import onnxruntime as ort
from tokenizers import Tokenizer


def generate(directory: str, prompt_ids: list[int], new_tokens: int) -> list[int]:
    root = Path(directory)
    manifest = json.loads((root / "kvexport.json").read_text())
    dims = manifest["model"]["dims"]
    shared = manifest["cache"]["layout"] == "shared-buffer"
    dtype = np.float16 if manifest["dtype"] == "fp16" else np.float32
    sessions = {
        graph: ort.InferenceSession(str(root / f"{graph}.onnx"), providers=["CPUExecutionProvider"])
        for graph in ("prefill", "decode")
    }
    names = [(layer, kind) for layer in range(dims["num_layers"]) for kind in ("key", "value")]
    capacity = len(prompt_ids) + new_tokens  # the in-place buffers' max_sequence
    buffers = {
        name: ort.OrtValue.ortvalue_from_numpy(
            np.zeros((1, dims["num_kv_heads"], capacity, dims["head_dim"]), dtype)
        )
        for name in names
    }

    def run(graph: str, feeds: dict[str, np.ndarray], present: list[np.ndarray]) -> tuple[np.ndarray, list[np.ndarray]]:
        if not shared:  # concat: present.* come back as new arrays, fed back as past.*
            past = {f"past.{layer}.{kind}": p for (layer, kind), p in zip(names, present, strict=True)} if present else {}
            logits, *present = sessions[graph].run(None, {**feeds, **past})
            return logits, present
        binding = sessions[graph].io_binding()
        for name, value in feeds.items():
            binding.bind_cpu_input(name, value)
        binding.bind_output("logits", "cpu")  # first: outputs come back in binding order
        for layer, kind in names:  # one buffer, both past and present
            binding.bind_ortvalue_input(f"past.{layer}.{kind}", buffers[(layer, kind)])
            binding.bind_ortvalue_output(f"present.{layer}.{kind}", buffers[(layer, kind)])
        sessions[graph].run_with_iobinding(binding)
        return binding.copy_outputs_to_cpu()[0], present

    ids = np.array([prompt_ids], dtype=np.int64)  # [1, sequence]
    mask = np.ones_like(ids)
    logits, present = run(
        "prefill", {"input_ids": ids, "attention_mask": mask, "position_ids": mask.cumsum(-1) - 1}, []
    )
    generated: list[int] = []
    for _ in range(new_tokens):
        next_id = int(logits[0, -1].argmax())
        generated.append(next_id)
        if len(generated) == new_tokens:
            break
        position = np.array([[mask.sum()]], dtype=np.int64)
        mask = np.concatenate([mask, np.ones((1, 1), dtype=np.int64)], axis=1)
        feeds = {"input_ids": np.array([[next_id]], dtype=np.int64), "attention_mask": mask, "position_ids": position}
        logits, present = run("decode", feeds, present)
    return generated


def main(directory: str, prompt: str, new_tokens: int) -> None:
    tokenizer = Tokenizer.from_file(str(Path(directory) / "tokenizer.json"))
    generated = generate(directory, tokenizer.encode(prompt).ids, new_tokens)
    print(prompt + tokenizer.decode(generated))


if __name__ == "__main__":
    main(
        sys.argv[1],
        sys.argv[2] if len(sys.argv) > 2 else "The sky is",
        int(sys.argv[3]) if len(sys.argv) > 3 else 20,
    )
