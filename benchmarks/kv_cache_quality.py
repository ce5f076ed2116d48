#!/usr/bin/env python
"""Quality of a quantized KV cache on the trained test model: each cache beside the fp32 cache.

For fp32 and int8 weights, an export with the fp32 cache, then copies of it with an int8
and an int4 cache, each with per-channel scales (kvexport's rule) and per-tensor scales (the
alternative), all calibrated on the default text (``kvexport.export.calibration``). Each is judged
by ``verify --text`` on the held-out text: perplexity, its change against PyTorch fp32 and
against the same weights with the fp32 cache, top-1 agreement and mean KL against PyTorch.

    .venv/bin/python benchmarks/kv_cache_quality.py [--work /tmp/kvq] [--results benchmarks/results]

Writes ``kv_cache_quality-tiny-trained.json``. Offline; about two minutes on 2 cores.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from kvexport import export_gpt2, verify  # noqa: E402
from kvexport.export.calibration import copy_with_quantized_cache  # noqa: E402
from kvexport.export.quantization import QUANTIZATION_SCHEMES  # noqa: E402
from kvexport.passes.quantize_cache import CacheQuantization  # noqa: E402

TRAINED = ROOT / "tests" / "data" / "tiny-trained"
HELDOUT = TRAINED / "heldout.txt"


def _quality(export: Path) -> dict[str, Any]:
    report = verify(export, steps=2, text=HELDOUT, text_tokens=100_000, record=False)
    assert report.text is not None
    return {
        "ok": report.ok,
        "perplexity": round(report.text.perplexity_onnx, 4),
        "perplexity_delta_pct_vs_torch": round(report.text.perplexity_delta_pct, 3),
        "top1_agreement": round(report.text.top1_agreement, 4),
        "mean_kl": float(f"{report.text.mean_kl:.3g}"),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--work", type=Path, default=Path("/tmp/kvq"))
    parser.add_argument("--results", type=Path, default=ROOT / "benchmarks" / "results")
    args = parser.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    args.work.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    rows: dict[str, dict[str, Any]] = {}
    for weights in ("none", "int8"):
        knobs = QUANTIZATION_SCHEMES.get(weights)  # int8: the blocks these results were measured with
        base = export_gpt2(args.work / f"{weights}-fp32", str(TRAINED), target="ort-cpu", quantize=weights, quantization=knobs, force=True).out_dir
        reference = rows[f"weights {weights}, cache fp32"] = _quality(base)
        for bits in (8, 4):
            for per_channel in (True, False):
                label = f"weights {weights}, cache int{bits} {'per-channel' if per_channel else 'per-tensor'}"
                out = args.work / label.replace(", ", "-").replace(" ", "-")
                copy_with_quantized_cache(base, out, CacheQuantization(bits=bits, per_channel=per_channel))
                row = _quality(out)
                row["perplexity_delta_pct_vs_fp32_cache"] = round(100 * (row["perplexity"] / reference["perplexity"] - 1), 3)
                rows[label] = row
                print(f"{label:<45} {row}", flush=True)
    result = {"model": "tests/data/tiny-trained", "text": "heldout.txt", "rows": rows, "seconds": round(time.perf_counter() - started, 1), "date": time.strftime("%Y-%m-%d")}
    args.results.mkdir(parents=True, exist_ok=True)
    (args.results / "kv_cache_quality-tiny-trained.json").write_text(json.dumps(result, indent=2) + "\n")
    print(f"{'export':<45} {'ppl':>8} {'vs torch %':>10} {'vs fp32 cache %':>15} {'top-1':>7} {'mean KL':>9}")
    for label, row in rows.items():
        print(
            f"{label:<45} {row['perplexity']:>8.3f} {row['perplexity_delta_pct_vs_torch']:>+10.2f} "
            f"{row.get('perplexity_delta_pct_vs_fp32_cache', 0.0):>+15.2f} {row['top1_agreement']:>7.3f} {row['mean_kl']:>9.2e}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
