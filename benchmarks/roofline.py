#!/usr/bin/env python
"""A serving step's roofline on this host: its ceilings, and where a c16 step's time goes against them.

Outside CI. Three parts, one run:

1. **The host.** Its ISA (AVX2, AVX-512, VNNI, AVX512-BF16, AMX) from ``/proc/cpuinfo``, and the
   ceilings of the best kernels here at SmolLM2-135M's product shapes ([576, 1536], [1536, 576])
   and 64 / 512 rows, on 2 threads: ONNX Runtime's fp32 ``MatMul`` and uint8 x int8
   ``MatMulInteger`` (MLAS: AMX or VNNI where the CPU has them), today's int8 blocks
   (``MatMulNBits``, accuracy level 4: Q8_0's arithmetic), kvexport's bf16 ``PromptMatMul`` (the
   path :func:`kvexport.runtime.kernels.prompt_gemm_path` picks), and torch's bf16 matmul (oneDNN;
   timed last, apart from ONNX Runtime's spinning threads); memory read bandwidth (one core:
   numpy's sum over 1 GiB; both: ONNX Runtime's ``ReduceSum``).
2. **A c16 step, per op.** On an export (``--export``, e.g. SmolLM2's int8), ONNX Runtime's profile
   of a prompt call (8 fresh 128-token prompts in one call, as the engine batches a burst) through
   the decoding session and through the prompt session (:func:`kvexport.runtime.session.open_prompt_session`),
   and of a 16-row decode call after 128 positions; node time by op type, and the products'
   rate against the ceilings.
3. **The engine.** 16 prompts of ``--prompt`` tokens at once, 32 new tokens each, greedy: the
   wall time, the model calls' time (``ModelOutput.seconds``) and the rest (the Python between
   calls), with the prompt session and without.

    .venv/bin/python benchmarks/roofline.py --export /tmp/smol-int8 [--results benchmarks/results]

Writes ``roofline-<name>.json``; prints the tables docs/benchmarks.md holds.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import onnx_ir as ir
import onnxruntime as ort
from onnx import TensorProto, helper, numpy_helper

from kvexport.bundle.manifest import read_manifest
from kvexport.passes import QuantizationConfig, QuantizeWeightsPass
from kvexport.passes.prompt_products import pack_bf16
from kvexport.passes.vocabulary import KVEXPORT_DOMAIN, MATMUL_NBITS, PROMPT_MATMUL
from kvexport.runtime.cache import SlotCache
from kvexport.runtime.kernels import library_path, prompt_gemm_path
from kvexport.runtime.session import open_prompt_session, open_session, session_options

SHAPES = (("gate/up", 576, 1536), ("down", 1536, 576))
ROWS = (64, 512)
ISA_FLAGS = ("avx2", "avx512f", "avx512_vnni", "avx512_bf16", "amx_tile", "amx_int8", "amx_bf16")


def isa() -> list[str]:
    """The instruction sets that matter here, as ``/proc/cpuinfo`` names them."""
    path = Path("/proc/cpuinfo")
    flags = set(path.read_text().split()) if path.exists() else set()
    return [flag for flag in ISA_FLAGS if flag in flags]


def _best(run: Callable[[], Any], repeats: int = 20) -> float:
    run()
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        run()
        times.append(time.perf_counter() - started)
    return min(times)


def _session(model: onnx.ModelProto) -> ort.InferenceSession:
    options = session_options(2, spinning=True)
    kernels = library_path()
    if kernels is not None:
        options.register_custom_ops_library(str(kernels))
    return ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])


def _product(kind: str, weight: np.ndarray) -> tuple[onnx.ModelProto, bool]:
    """One product of ``weight`` [K, N] as ``kind`` runs it; whether it takes uint8 activations."""
    k, n = weight.shape
    a_type, y_type, initializers = TensorProto.FLOAT, TensorProto.FLOAT, []
    opsets = [helper.make_opsetid("", 18), helper.make_opsetid("com.microsoft", 1), helper.make_opsetid(KVEXPORT_DOMAIN, 1)]
    if kind == "u8s8 MatMulInteger":
        a_type, y_type = TensorProto.UINT8, TensorProto.INT32
        initializers = [numpy_helper.from_array(np.clip(np.rint(weight * 100), -127, 127).astype(np.int8), "w")]
        node = helper.make_node("MatMulInteger", ["a", "w"], ["y"])
    elif kind == "bf16 PromptMatMul":
        packed = pack_bf16(weight)
        initializers = [helper.make_tensor("w", TensorProto.BFLOAT16, packed.shape, packed.tobytes(), raw=True)]
        node = helper.make_node(PROMPT_MATMUL, ["a", "w"], ["y"], domain=KVEXPORT_DOMAIN, K=k, N=n)
    else:
        initializers = [numpy_helper.from_array(weight, "w")]
        node = helper.make_node("MatMul", ["a", "w"], ["p"])
    outputs = [helper.make_tensor_value_info("y", y_type, ["m", n])]
    nodes = [node] if node.output[0] == "y" else [node, helper.make_node("Tanh", ["p"], ["y"])]  # Tanh: not a head
    graph = helper.make_graph(nodes, "product", [helper.make_tensor_value_info("a", a_type, ["m", k])], outputs, initializers)
    model = helper.make_model(graph, opset_imports=opsets, ir_version=10)
    if kind == "int8 blocks MatMulNBits":
        proto = ir.from_proto(model)
        QuantizeWeightsPass(QuantizationConfig(bits=8, block_size=32, symmetric=True, accuracy_level=4, head_bits=8))(proto)
        model = ir.to_proto(proto)
    return model, a_type == TensorProto.UINT8


def ceilings() -> dict[str, dict[str, float]]:
    """GFLOP/s (GOP/s for integers) of each kernel at each shape and row count, 2 threads."""
    rng = np.random.default_rng(0)
    kinds = ["fp32 MatMul", "u8s8 MatMulInteger", "int8 blocks MatMulNBits"]
    if library_path() is not None:
        kinds.append("bf16 PromptMatMul")
    table: dict[str, dict[str, float]] = {kind: {} for kind in [*kinds, "bf16 torch (oneDNN)"]}
    for name, k, n in SHAPES:
        weight = (rng.standard_normal((k, n)) * 0.05).astype(np.float32)
        for kind in kinds:
            model, integer = _product(kind, weight)
            session = _session(model)
            for rows in ROWS:
                a = rng.integers(0, 255, (rows, k)).astype(np.uint8) if integer else rng.standard_normal((rows, k)).astype(np.float32)
                seconds = _best(lambda session=session, a=a: session.run(None, {"a": a}))
                table[kind][f"{name} x{rows}"] = round(2 * rows * k * n / seconds / 1e9, 1)
            del session
    gc.collect()
    time.sleep(2)  # ONNX Runtime's threads stop spinning before torch's start
    try:
        import torch
    except ImportError:
        del table["bf16 torch (oneDNN)"]
        return table
    torch.set_num_threads(2)
    for name, k, n in SHAPES:
        w = torch.randn(k, n).bfloat16()
        for rows in ROWS:
            a = torch.randn(rows, k).bfloat16()
            seconds = _best(lambda a=a, w=w: a @ w)
            table["bf16 torch (oneDNN)"][f"{name} x{rows}"] = round(2 * rows * k * n / seconds / 1e9, 1)
    return table


def bandwidth() -> dict[str, float]:
    """Read bandwidth in GB/s: one core (numpy's sum over 1 GiB) and both (ONNX Runtime's ReduceSum over it)."""
    data = np.ones(1 << 28, np.float32)
    one = data.nbytes / _best(lambda: data.sum(), 5) / 1e9
    graph = helper.make_graph(
        [helper.make_node("ReduceSum", ["x"], ["y"], keepdims=0)], "sum",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [data.size])], [helper.make_tensor_value_info("y", TensorProto.FLOAT, [])],
    )
    session = _session(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)], ir_version=10))
    both = data.nbytes / _best(lambda: session.run(None, {"x": data}), 5) / 1e9
    return {"one core (numpy sum)": round(one, 1), "2 threads (ORT ReduceSum)": round(both, 1)}


def _by_op(events: list[dict[str, Any]], skip: int) -> dict[str, float]:
    """Node time by op type, ms per run, over the runs after the first ``skip``."""
    runs = sorted((e for e in events if e.get("cat") == "Session" and e.get("name") == "model_run"), key=lambda e: e["ts"])
    kept = runs[skip:]
    totals: dict[str, float] = {}
    for event in events:
        if event.get("cat") == "Node" and kept and event.get("ts", 0) >= kept[0]["ts"] and event["name"].endswith("_kernel_time"):
            op = event["args"].get("op_name", "?")
            totals[op] = totals.get(op, 0.0) + event["dur"] / 1000 / len(kept)
    return totals


def _block_weights(graph_path: Path, vocab: int) -> int:
    """Weights of the block products (every MatMulNBits but the head's), K x N summed."""
    graph = onnx.load(str(graph_path), load_external_data=False).graph
    total = 0
    for node in graph.node:
        if node.op_type == MATMUL_NBITS:
            attributes = {a.name: helper.get_attribute_value(a) for a in node.attribute}
            if attributes["N"] != vocab:
                total += attributes["K"] * attributes["N"]
    return total


def step_profile(export: Path) -> dict[str, Any]:
    """Per-op time of a prompt call (8 x 128, both sessions) and a 16-row decode call, and the products' rate."""
    manifest = read_manifest(export)
    graph = export / manifest.graphs["prefill"].file
    vocab = manifest.dims.vocab_size
    weights = _block_weights(graph, vocab)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, vocab, 128).tolist() for _ in range(8)]
    report: dict[str, Any] = {"block_weights": weights}
    with tempfile.TemporaryDirectory() as folder:
        for label, opener in (
            ("prompt 8x128, decoding session", lambda o: open_session(graph, "cpu", o)),
            ("prompt 8x128, prompt session", lambda o: open_prompt_session(graph, o, skip_width=vocab)),
            ("decode 16 rows after 128", lambda o: open_session(graph, "cpu", o)),
        ):
            options = session_options(2, spinning=True)
            options.enable_profiling = True
            options.profile_file_prefix = os.path.join(folder, label.split()[0])
            session = opener(options)
            if session is None:
                continue
            cache = SlotCache(manifest, "cpu", 16, 256)
            if label.startswith("decode"):
                for slot in range(16):
                    cache.run_piece(session, slot, prompts[slot % 8], 0)
                calls = 5
                for _ in range(calls + 1):
                    cache.run_rows(session, 0, [[int(t)] for t in rng.integers(0, vocab, 16)], 128)
                skip, tokens = 17, 16  # the 16 prompts and the first decode call
            else:
                calls = 3
                for _ in range(calls + 1):
                    cache.run_rows(session, 0, prompts, 0)
                skip, tokens = 1, 8 * 128
            by_op = _by_op(json.loads(Path(session.end_profiling()).read_text()), skip)
            total = sum(by_op.values())
            products = sum(ms for op, ms in by_op.items() if op in (MATMUL_NBITS, PROMPT_MATMUL))
            report[label] = {
                "ms": round(total, 2),
                "products_ms": round(products, 2),
                "products_gflop_s": round(2 * weights * tokens / (products / 1000) / 1e9, 1) if products else None,
                "by_op_ms": {op: round(ms, 2) for op, ms in sorted(by_op.items(), key=lambda item: -item[1])[:8]},
            }
            del session
            gc.collect()
    return report


def engine_split(export: Path, prompt_tokens: int) -> dict[str, Any]:
    """16 prompts at once, 32 new tokens each: wall time, the model calls' time and the rest, per prompt mode."""
    from kvexport.serving.config import EngineConfig
    from kvexport.serving.engine import Engine
    from kvexport.serving.request import SamplingParams

    results: dict[str, Any] = {}
    vocab = read_manifest(export).dims.vocab_size
    for mode in ("off", "auto"):
        engine = Engine(export, EngineConfig(slots=16, max_context=1024, prompt_products=mode, warm_up=2))
        calls: list[float] = []
        execute = engine.runner.execute

        def timed(*args: Any, execute: Any = execute, calls: list[float] = calls, **kwargs: Any) -> Any:
            output = execute(*args, **kwargs)
            calls.append(output.seconds)
            return output

        engine.runner.execute = timed  # type: ignore[method-assign]
        rng = np.random.default_rng(1)
        params = SamplingParams(max_tokens=32, temperature=0, ignore_eos=True)
        started = time.perf_counter()
        states = engine.submit_all([(rng.integers(100, vocab, prompt_tokens).tolist(), params) for _ in range(16)])
        firsts: list[float] = []

        def read(state: Any, firsts: list[float] = firsts, started: float = started) -> None:
            first = True
            for _ in state:
                if first:
                    firsts.append(time.perf_counter() - started)
                    first = False

        threads = [threading.Thread(target=read, args=(state,)) for state in states]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        wall = time.perf_counter() - started
        engine.close()
        results[mode] = {
            "prompt_path": engine.runner.prompt_products,
            "wall_s": round(wall, 3),
            "calls_s": round(sum(calls), 3),
            "python_share": round(1 - sum(calls) / wall, 3),
            "last_first_token_s": round(max(firsts), 3),
            "output_tok_s": round(16 * 32 / wall, 1),
        }
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--export", type=Path, required=True, help="An in-place ort-cpu export with int8/int4 blocks (SmolLM2's).")
    parser.add_argument("--name", default="smollm2-135m-int8", help="The results file's suffix.")
    parser.add_argument("--prompt", type=int, default=512, help="Prompt tokens of the engine's 16 requests [default: 512].")
    parser.add_argument("--results", type=Path, default=Path("benchmarks/results"))
    args = parser.parse_args(argv)
    report: dict[str, Any] = {
        "machine": {"cpu": platform.processor() or platform.machine(), "isa": isa(), "threads": 2, "onnxruntime": ort.__version__,
                    "prompt_gemm_path": prompt_gemm_path(), "date": time.strftime("%Y-%m-%d")},
    }
    print(f"ISA: {', '.join(report['machine']['isa'])}; prompt product path: {report['machine']['prompt_gemm_path']}")
    report["ceilings_gflop_s"] = ceilings()
    for kind, row in report["ceilings_gflop_s"].items():
        print(f"{kind:<26} " + "  ".join(f"{shape} {value:>7.0f}" for shape, value in row.items()))
    report["bandwidth_gb_s"] = bandwidth()
    print(f"bandwidth GB/s: {report['bandwidth_gb_s']}")
    report["step"] = step_profile(args.export)
    for label, row in report["step"].items():
        if isinstance(row, dict):
            print(f"{label}: {row['ms']} ms, products {row['products_ms']} ms ({row['products_gflop_s']} GFLOP/s); {row['by_op_ms']}")
    report["engine_c16"] = engine_split(args.export, args.prompt)
    for mode, row in report["engine_c16"].items():
        print(f"engine, 16 x {args.prompt} prompts, prompt products {mode}: {row}")
    args.results.mkdir(parents=True, exist_ok=True)
    written = args.results / f"roofline-{args.name}.json"
    written.write_text(json.dumps(report, indent=2))
    print(f"wrote {written}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
