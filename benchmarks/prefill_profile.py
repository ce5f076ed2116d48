#!/usr/bin/env python
"""Where prefill time goes: ONNX Runtime's profile by op type, per scheme and prompt length, against the CPU's peak.

Outside CI. For each in-place export of GPT-2 124M (fp32, int8 blocks, int8 per-channel,
int4; the exports ``benchmarks/llama_cpp_compare.py`` makes, reused when present), or for
the exports named by ``--export LABEL=DIR`` (any family), and each case, the prompt runs
as the engine runs it today, at batch 1 into a slot of the in-place cache
(``SlotCache.run_piece``):

- ``128`` and ``512``: one prompt of that many tokens;
- ``16x128``: sixteen 128-token prompts one after the other into sixteen slots (2048
  tokens, a burst at concurrency 16).

Each case is timed best of ``--repeats`` on a session without profiling, then run again on
a profiled session, whose node events are summed by op type (the first run is dropped).
The peak is measured by a tight kernel on the same threads: ONNX Runtime's fp32 ``MatMul``
and its uint8 x int8, uint8 x uint8 and int8 x int8 ``MatMulInteger`` at [512, 768] x [768, 3072].
Throughput counts 2 x the non-embedding weights x tokens (the LM head runs on the last
position only; ``--non-embedding``, GPT-2 124M's by default).

    .venv/bin/python benchmarks/prefill_profile.py --work /tmp/llama --results benchmarks/results
    .venv/bin/python benchmarks/prefill_profile.py --name smollm2-135m --non-embedding 106168320 \
        --export "int8 blocks=/tmp/smol-blocks" --export "int8 pc=/tmp/smol-pc" [--int8-kernels u8u8,u8s8]

Writes ``prefill_profile-<name>.json`` (``gpt2`` by default); prints one table per export.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import platform
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import onnxruntime as ort

sys.path.insert(0, str(Path(__file__).parent))
import llama_cpp_compare as llama

from kvexport.bundle.manifest import read_manifest
from kvexport.runtime.cache import SlotCache
from kvexport.runtime.session import open_session, session_options

CASES = {"128": (1, 128), "512": (1, 512), "16x128": (16, 128)}
NON_EMBEDDING = 85_000_000  # GPT-2 124M's weights outside the embeddings


def _session(export: Path, profile: str | None) -> ort.InferenceSession:
    options = session_options(spinning=True)
    if profile is not None:
        options.enable_profiling = True
        options.profile_file_prefix = profile
    return open_session(export / read_manifest(export).graphs["prefill"].file, "cpu", options)


def _run_case(session: ort.InferenceSession, cache: SlotCache, prompts: int, length: int, vocab: int) -> None:
    rng = np.random.default_rng(0)
    for slot in range(prompts):
        cache.run_piece(session, slot, rng.integers(0, vocab, length).tolist(), 0)


def profile_export(export: Path, repeats: int, non_embedding: int = NON_EMBEDDING) -> dict[str, Any]:
    manifest = read_manifest(export)
    vocab = manifest.dims.vocab_size
    rows: dict[str, Any] = {}
    for case, (prompts, length) in CASES.items():
        cache = SlotCache(manifest, "cpu", prompts, length)
        plain = _session(export, None)
        _run_case(plain, cache, prompts, length, vocab)  # warm-up
        times = []
        for _ in range(repeats):
            started = time.perf_counter()
            _run_case(plain, cache, prompts, length, vocab)
            times.append(time.perf_counter() - started)
        best = min(times)
        del plain
        with tempfile.TemporaryDirectory() as folder:
            profiled = _session(export, os.path.join(folder, "prefill"))
            for _ in range(3):
                _run_case(profiled, cache, prompts, length, vocab)
            events = json.loads(Path(profiled.end_profiling()).read_text())
        by_op = _by_op(events, runs_to_skip=prompts)
        profiled_ms = sum(by_op.values())
        tokens = prompts * length
        rows[case] = {
            "tokens": tokens,
            "ms": round(1000 * best, 2),
            "ms_per_token": round(1000 * best / tokens, 4),
            "gflop_s": round(2 * non_embedding * tokens / best / 1e9, 1),
            "by_op_ms": {op: round(ms, 2) for op, ms in sorted(by_op.items(), key=lambda item: -item[1])},
            "by_op_share": {op: round(ms / profiled_ms, 3) for op, ms in sorted(by_op.items(), key=lambda item: -item[1])},
        }
    return rows


def _by_op(events: list[dict[str, Any]], runs_to_skip: int) -> dict[str, float]:
    """Node time by op type (ms per pass over the case), over the runs after the first ``runs_to_skip``."""
    runs = sorted((e for e in events if e.get("cat") == "Session" and e.get("name") == "model_run"), key=lambda e: e["ts"])
    kept = runs[runs_to_skip:]
    if not kept:
        return {}
    start = kept[0]["ts"]
    totals: collections.Counter[str] = collections.Counter()
    for event in events:
        if event.get("cat") == "Node" and event.get("ts", 0) >= start and event["name"].endswith("_kernel_time"):
            totals[event["args"].get("op_name", "?")] += event["dur"] / 1000
    passes = len(kept) / runs_to_skip
    return {op: ms / passes for op, ms in totals.items()}


def peak_gflops(repeats: int = 20) -> dict[str, float]:
    """ONNX Runtime's fp32 MatMul and uint8 / int8 x int8 and uint8 x uint8 MatMulInteger at [512, 768] x [768, 3072], on this session's threads."""
    m, k, n = 512, 768, 3072
    rng = np.random.default_rng(0)
    graphs = {
        "fp32 MatMul": (onnx.TensorProto.FLOAT, onnx.TensorProto.FLOAT, "MatMul", rng.standard_normal((k, n)).astype(np.float32), rng.standard_normal((m, k)).astype(np.float32)),
        "u8 x s8 MatMulInteger": (onnx.TensorProto.UINT8, onnx.TensorProto.INT32, "MatMulInteger", rng.integers(-127, 127, (k, n)).astype(np.int8), rng.integers(0, 255, (m, k)).astype(np.uint8)),
        "u8 x u8 MatMulInteger": (onnx.TensorProto.UINT8, onnx.TensorProto.INT32, "MatMulInteger", rng.integers(0, 255, (k, n)).astype(np.uint8), rng.integers(0, 255, (m, k)).astype(np.uint8)),
        "s8 x s8 MatMulInteger": (onnx.TensorProto.INT8, onnx.TensorProto.INT32, "MatMulInteger", rng.integers(-127, 127, (k, n)).astype(np.int8), rng.integers(-127, 127, (m, k)).astype(np.int8)),
    }
    peaks = {}
    for name, (in_type, out_type, op, weight, activations) in graphs.items():
        graph = onnx.helper.make_graph(
            [onnx.helper.make_node(op, ["A", "W"], ["Y"])],
            "peak",
            [onnx.helper.make_tensor_value_info("A", in_type, [m, k])],
            [onnx.helper.make_tensor_value_info("Y", out_type, [m, n])],
            [onnx.numpy_helper.from_array(weight, "W")],
        )
        model = onnx.helper.make_model(graph, opset_imports=[onnx.helper.make_opsetid("", 18)], ir_version=10)
        session = ort.InferenceSession(model.SerializeToString(), session_options(spinning=True), providers=["CPUExecutionProvider"])
        session.run(None, {"A": activations})
        times = []
        for _ in range(repeats):
            started = time.perf_counter()
            session.run(None, {"A": activations})
            times.append(time.perf_counter() - started)
        best = min(times)
        peaks[name] = round(2 * m * k * n / best / 1e9, 1)
    return peaks


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--work", type=Path, default=Path("/tmp/llama"))
    parser.add_argument("--results", type=Path, default=Path("benchmarks/results"))
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--export", action="append", default=[], metavar="LABEL=DIR", help="Profile this export (repeatable) instead of GPT-2's.")
    parser.add_argument("--name", default="gpt2", help="The results file's suffix [default: gpt2].")
    parser.add_argument(
        "--int8-kernels", default="",
        help="Profile each export once per KVEXPORT_INT8_KERNEL value in this comma list (e.g. u8u8,u8s8), "
        "labelled 'LABEL (VALUE)' [default: once, as the environment says].",
    )
    parser.add_argument("--non-embedding", type=int, default=NON_EMBEDDING, help="Weights outside the embeddings and the head, for GFLOP/s.")
    args = parser.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    if args.export:
        exports = {label: Path(folder) for label, _, folder in (item.partition("=") for item in args.export)}
    else:
        exports = llama.kvexport_exports("gpt2", True, args.work / "hf-gpt2", [], int8_per_channel=True)
    flags = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    report: dict[str, Any] = {
        "machine": {
            "cpu": platform.processor() or platform.machine(),
            "avx512_vnni": "avx512_vnni" in flags,
            "avx2": " avx2" in flags,
            "threads": "ONNX Runtime's default (2 cores)",
            "onnxruntime": ort.__version__,
            "date": time.strftime("%Y-%m-%d"),
        },
        "peak_gflop_s": peak_gflops(),
        "exports": {},
    }
    print(f"peak: {report['peak_gflop_s']}")
    kernels = [kernel for kernel in args.int8_kernels.split(",") if kernel] or [None]
    runs = [(label if kernel is None else f"{label} ({kernel})", export, kernel) for label, export in exports.items() for kernel in kernels]
    for label, export, kernel in runs:
        if kernel is not None:  # read by open_session: how 8-bit per-channel weights run
            os.environ["KVEXPORT_INT8_KERNEL"] = kernel
        rows = profile_export(export, args.repeats, args.non_embedding)
        report["exports"][label] = rows
        print(f"\n{label}")
        print(f"{'case':<8} {'ms':>8} {'ms/token':>9} {'GFLOP/s':>8}  top ops (share of node time)")
        for case, row in rows.items():
            top = ", ".join(f"{op} {100 * share:.0f}%" for op, share in list(row["by_op_share"].items())[:4])
            print(f"{case:<8} {row['ms']:>8.1f} {row['ms_per_token']:>9.3f} {row['gflop_s']:>8.1f}  {top}")
    args.results.mkdir(parents=True, exist_ok=True)
    written = args.results / f"prefill_profile-{args.name}.json"
    written.write_text(json.dumps(report, indent=2))
    print(f"wrote {written}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
