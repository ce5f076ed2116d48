"""Resident memory over repeated generation: does a long-running Generator leak?

    python benchmarks/long_run_rss.py out/gpt2 --calls 50 --tokens 200

Prints RSS after the first call and after every tenth, and the growth from the first.
"""

from __future__ import annotations

import argparse

import numpy as np

from kvexport.runtime import Generator
from kvexport.tools.bench import rss_mb


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("directory")
    parser.add_argument("--calls", type=int, default=50)
    parser.add_argument("--tokens", type=int, default=200)
    parser.add_argument("--share-weights", action="store_true")
    args = parser.parse_args()
    generator = Generator(args.directory, share_weights=args.share_weights)
    prompt = np.random.default_rng(0).integers(0, generator.vocab_size, (1, 16))
    first = 0.0
    for call in range(1, args.calls + 1):
        generator.generate(prompt, args.tokens, do_sample=True, seed=call, eos_token_id=-1)
        if call == 1:
            first = rss_mb()
            print(f"call 1: RSS {first:.1f} MiB")
        elif call % 10 == 0 or call == args.calls:
            print(f"call {call}: RSS {rss_mb():.1f} MiB (growth {rss_mb() - first:+.1f} MiB)")
    print(
        f"{args.calls} calls x {args.tokens} tokens: growth {rss_mb() - first:+.1f} MiB after the first call"
    )


if __name__ == "__main__":
    main()
