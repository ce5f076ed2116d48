#!/usr/bin/env python
"""ONNX Runtime's two int8 matmul kernels at GPT-2 124M's shapes: MatMulNBits blocks vs DynamicQuantizeMatMul.

Outside CI. One ``MatMul`` per shape (the block projections and the LM head), quantized by
the ``quantize_weights`` pass both ways (8-bit blocks of 32 with int8 activations, as
``--quantize int8``; per channel, as ``--quantize int8 --per-channel``), each timed at 1,
16 and 128 rows (a decode step, a 16-row engine step, a prompt) on 2 threads, interleaved,
with each one's error against the float product:

    .venv/bin/python benchmarks/int8_kernels.py
"""

from __future__ import annotations

import statistics
import sys
import time

import numpy as np
import onnx
import onnx_ir as ir
import onnxruntime as ort

from kvexport.passes import QuantizationConfig, QuantizeWeightsPass

SHAPES = (("qkv", 768, 2304), ("proj", 768, 768), ("fc", 768, 3072), ("fc-proj", 3072, 768), ("head", 768, 50257))
KINDS = {
    "blocks": QuantizationConfig(bits=8, block_size=32, accuracy_level=4, head_bits=8),
    "per-channel": QuantizationConfig(bits=8, head_bits=8, per_channel=True),
}


def session(weight: np.ndarray, config: QuantizationConfig) -> ort.InferenceSession:
    """A one-MatMul graph with ``weight``, quantized by the pass with ``config``."""
    k, n = weight.shape
    graph = onnx.helper.make_graph(
        [onnx.helper.make_node("MatMul", ["A", "W"], ["Y"])],
        "matmul",
        [onnx.helper.make_tensor_value_info("A", onnx.TensorProto.FLOAT, ["M", k])],
        [onnx.helper.make_tensor_value_info("Y", onnx.TensorProto.FLOAT, ["M", n])],
        [onnx.numpy_helper.from_array(weight, "W")],
    )
    model = ir.from_proto(onnx.helper.make_model(graph, opset_imports=[onnx.helper.make_opsetid("", 18)], ir_version=10))
    QuantizeWeightsPass(config)(model)
    options = ort.SessionOptions()
    options.intra_op_num_threads = 2
    options.add_session_config_entry("session.intra_op.allow_spinning", "1")
    return ort.InferenceSession(ir.to_proto(model).SerializeToString(), options, providers=["CPUExecutionProvider"])


def main() -> int:
    rng = np.random.default_rng(0)
    print(f"{'shape':<8} {'rows':>4} {'blocks us':>10} {'per-channel us':>15} {'ratio':>6} {'rel err blocks':>15} {'per-channel':>12}")
    for name, k, n in SHAPES:
        weight = (rng.standard_normal((k, n)) * 0.02).astype(np.float32)
        sessions = {kind: session(weight, config) for kind, config in KINDS.items()}
        for rows in (1, 16, 128):
            a = rng.standard_normal((rows, k)).astype(np.float32)
            reference = a @ weight
            times: dict[str, list[float]] = {kind: [] for kind in sessions}
            errors = {}
            repeats = 20 if n > 10_000 else 200
            for kind, sess in sessions.items():
                got = sess.run(None, {"A": a})[0]
                errors[kind] = float(np.linalg.norm(got - reference) / np.linalg.norm(reference))
            for _ in range(3):  # interleaved rounds
                for kind, sess in sessions.items():
                    started = time.perf_counter()
                    for _ in range(repeats):
                        sess.run(None, {"A": a})
                    times[kind].append(1e6 * (time.perf_counter() - started) / repeats)
            blocks, channels = (statistics.median(times[kind]) for kind in KINDS)
            print(
                f"{name:<8} {rows:>4} {blocks:>10.1f} {channels:>15.1f} {channels / blocks:>6.2f} "
                f"{errors['blocks']:>15.4f} {errors['per-channel']:>12.4f}",
                flush=True,
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
