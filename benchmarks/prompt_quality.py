#!/usr/bin/env python
"""What the engine's serving paths cost in quality on real weights, as it serves: a prompt, then decode steps.

Outside CI. On windows of held-out text (``kvexport.testing.heldout_text``), each window's first
``--prompt`` tokens run as one prompt piece and the rest token by token through decode calls (the
engine's :class:`~kvexport.serving.runner.ModelRunner`), so the prompt's cache shapes every later
step. Each export's logits at the decode positions are judged against the fp32 export's (fp32
cache), the same way: perplexity delta, top-1 agreement and mean KL. The fp32 export runs again
over an fp16 paged cache (the cache alone); each quantized export runs with its prompts through its
own blocks (``--prompt-products off``), in bf16 (``auto``), then over an fp16 paged cache
(``--kv-cache-dtype fp16``), and with its decode calls' products in bf16 too (a many-row decode call).
``--pools fp16,q8`` runs the paged rows once a pool dtype (q8: int8 codes and a scale a position and head).

    .venv/bin/python benchmarks/prompt_quality.py --fp32 /tmp/smol-fp32 --export int8=/tmp/smol-int8 [--windows 8]

Writes ``benchmarks/results/prompt_quality-<name>.json``.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

from kvexport.runtime.kernels import prompt_gemm_path
from kvexport.runtime.opened import open_export
from kvexport.serving.blocks import BlockManager, blocks_for
from kvexport.serving.runner import ModelRunner
from kvexport.testing import heldout_text


def _log_softmax(logits: np.ndarray) -> np.ndarray:
    shifted = logits.astype(np.float64) - logits.max(axis=-1, keepdims=True)
    return shifted - np.log(np.exp(shifted).sum(axis=-1, keepdims=True))


def served_logits(
    export: Path, windows: list[list[int]], prompt: int, products: bool, pool: str | None = None, bf16_decode: bool = False
) -> tuple[np.ndarray, str]:
    """Log-probabilities at each window's decode positions [windows * (len - prompt), V], and the prompt path.

    ``pool``: a paged cache of that dtype (None: the export's, in a slot); ``bf16_decode``: decode calls through the prompt session.
    """
    opened = open_export(export, "cpu")
    length = len(windows[0])
    blocks = blocks_for(length) + 2 if pool is not None else None
    runner = ModelRunner(
        opened, 1, length, intra_op_threads=2, prompt_products=products, paged_blocks=blocks, pool_dtype=pool or "fp32",
        bf16_decode_rows=1 if bf16_decode else 0,
    )
    if blocks is not None:
        BlockManager(blocks, runner.cache.tables).grow(0, length)  # type: ignore[attr-defined]
    rows = []
    for window in windows:
        rows.append(runner.run_piece(0, window[:prompt], 0)[-1])
        for position in range(prompt, length - 1):
            rows.append(np.array(runner.decode([window[position]], [position])[0], np.float32))
    path = runner.prompt_products if runner.prompt_session is not None else "the export's blocks"
    return _log_softmax(np.stack(rows)), path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--fp32", type=Path, required=True, help="The fp32 ort-cpu export: the reference.")
    parser.add_argument("--export", action="append", default=[], metavar="LABEL=DIR", help="A quantized export to judge (repeatable).")
    parser.add_argument("--windows", type=int, default=8)
    parser.add_argument("--length", type=int, default=512)
    parser.add_argument("--prompt", type=int, default=256)
    parser.add_argument("--name", default="smollm2-135m")
    parser.add_argument("--pools", default="fp16", help="comma-separated paged pool dtypes to judge (fp16, q8, fp32)")
    parser.add_argument("--results", type=Path, default=Path("benchmarks/results"))
    args = parser.parse_args(argv)
    tokenizer = open_export(args.fp32, "cpu").tokenizer.tokenizer
    assert tokenizer is not None
    ids = tokenizer.encode(heldout_text(chars=args.windows * args.length * 6)).ids  # ~4 characters a token: enough text
    if len(ids) < args.windows * args.length:
        parser.error(f"the held-out text has {len(ids)} tokens: fewer than {args.windows} windows of {args.length}")
    windows = [ids[i * args.length : (i + 1) * args.length] for i in range(args.windows)]
    targets = np.array([w[p + 1] for w in windows for p in range(args.prompt - 1, args.length - 1)])
    reference, _ = served_logits(args.fp32, windows, args.prompt, False)
    ref_nll = -reference[np.arange(len(targets)), targets].mean()
    report: dict[str, Any] = {
        "date": time.strftime("%Y-%m-%d"), "prompt_gemm_path": prompt_gemm_path(), "tokens_scored": len(targets),
        "fp32_perplexity": round(float(np.exp(ref_nll)), 4), "rows": {},
    }
    print(f"fp32: perplexity {np.exp(ref_nll):.4f} over {len(targets)} tokens ({args.windows} windows, prompts of {args.prompt})")
    pools = args.pools.split(",")
    runs = [(f"fp32, {pool} paged cache", args.fp32, False, pool, False) for pool in pools]
    for label, _, folder in (item.partition("=") for item in args.export):
        runs += [
            (f"{label}, prompts through the blocks", Path(folder), False, None, False),
            (f"{label}, prompts in bf16", Path(folder), True, None, False),
        ]
        for pool in pools:
            runs += [
                (f"{label}, prompts in bf16, {pool} paged cache", Path(folder), True, pool, False),
                (f"{label}, prompts and decode in bf16, {pool} paged cache", Path(folder), True, pool, True),
            ]
    for key, folder, products, pool, bf16_decode in runs:
        logprobs, path = served_logits(folder, windows, args.prompt, products, pool, bf16_decode)
        nll = -logprobs[np.arange(len(targets)), targets].mean()
        kl = (np.exp(reference) * (reference - logprobs)).sum(axis=-1).mean()
        row = {
            "prompt_path": path,
            "cache": pool or "fp32",
            "decode_products": "bf16" if bf16_decode else "the export's",
            "perplexity_delta_pct": round(100 * (np.exp(nll - ref_nll) - 1), 3),
            "top1_vs_fp32_pct": round(100 * float((logprobs.argmax(-1) == reference.argmax(-1)).mean()), 2),
            "mean_kl": round(float(kl), 5),
        }
        report["rows"][key] = row
        print(f"{key}: {row}", flush=True)
    args.results.mkdir(parents=True, exist_ok=True)
    written = args.results / f"prompt_quality-{args.name}.json"
    written.write_text(json.dumps(report, indent=2))
    print(f"wrote {written}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
