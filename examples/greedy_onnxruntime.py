"""Greedy generation with the exported graphs and plain ONNX Runtime.

    python examples/greedy_onnxruntime.py out/gpt2 "The sky is" 20

Reads only the export directory: the manifest for the layer count and the tokenizer
for text. A deployment pipeline can copy this loop as it is.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import onnxruntime as ort
from tokenizers import Tokenizer


def main(directory: str, prompt: str, new_tokens: int) -> None:
    root = Path(directory)
    manifest = json.loads((root / "kvexport.json").read_text())
    n_layer = manifest["model"]["config"]["n_layer"]
    tokenizer = Tokenizer.from_file(str(root / "tokenizer.json"))
    prefill = ort.InferenceSession(str(root / "prefill.onnx"), providers=["CPUExecutionProvider"])
    decode = ort.InferenceSession(str(root / "decode.onnx"), providers=["CPUExecutionProvider"])
    past_names = [f"past.{layer}.{kind}" for layer in range(n_layer) for kind in ("key", "value")]

    ids = np.array([tokenizer.encode(prompt).ids], dtype=np.int64)  # [1, sequence]
    mask = np.ones_like(ids)
    logits, *present = prefill.run(
        None, {"input_ids": ids, "attention_mask": mask, "position_ids": mask.cumsum(-1) - 1}
    )
    generated: list[int] = []
    for _ in range(new_tokens):
        next_id = int(logits[0, -1].argmax())
        generated.append(next_id)
        position = np.array([[mask.sum()]], dtype=np.int64)
        mask = np.concatenate([mask, np.ones((1, 1), dtype=np.int64)], axis=1)
        feeds = {
            "input_ids": np.array([[next_id]], dtype=np.int64),
            "attention_mask": mask,
            "position_ids": position,
        }
        feeds.update(zip(past_names, present, strict=True))
        logits, *present = decode.run(None, feeds)
    print(prompt + tokenizer.decode(generated))


if __name__ == "__main__":
    main(
        sys.argv[1],
        sys.argv[2] if len(sys.argv) > 2 else "The sky is",
        int(sys.argv[3]) if len(sys.argv) > 3 else 20,
    )
