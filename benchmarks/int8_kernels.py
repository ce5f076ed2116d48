#!/usr/bin/env python
"""ONNX Runtime's int8 matmul kernels at GPT-2 124M's and SmolLM2-135M's shapes, as the quantize_weights pass writes them.

Outside CI. One ``MatMul`` per shape (the block projections and the LM head), quantized by
the ``quantize_weights`` pass four ways: 8-bit blocks of 32 with int8 activations
(``MatMulNBits``, ``--blocks``); per channel with 7-bit int8 weights (the uint8 x int8
``MatMulIntegerToFloat``, GPT-2's ``--quantize int8``); per channel with full 8-bit weights
stored as uint8 (uint8 x uint8, the Llama families'); and those 8-bit weights as int8 for
the uint8 x int8 kernel, which is exact only on VNNI hosts (their kernel sums in int32).
Each is timed at 1, 16 and 128 rows (a decode step, a 16-row engine step, a prompt) on 2
threads, interleaved, with its error against the float product; the times are relative to
the blocks':

    .venv/bin/python benchmarks/int8_kernels.py [--model gpt2|smollm2]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import numpy as np
import onnx
import onnx_ir as ir
import onnxruntime as ort

from kvexport.passes import QuantizationConfig, QuantizeWeightsPass, SignedChannelsPass

SHAPES = {
    "gpt2": (("qkv", 768, 2304), ("proj", 768, 768), ("fc", 768, 3072), ("fc-proj", 3072, 768), ("head", 768, 50257)),
    "smollm2": (("q", 576, 576), ("kv", 576, 192), ("gate", 576, 1536), ("down", 1536, 576), ("head", 576, 49152)),
}
KINDS = {
    "blocks": QuantizationConfig(bits=8, block_size=32, accuracy_level=4, head_bits=8),
    "pc7 u8s8": QuantizationConfig(bits=8, head_bits=8, per_channel=True, channel_bits=7),
    "pc8 u8u8": QuantizationConfig(bits=8, head_bits=8, per_channel=True, channel_bits=8),
    "pc8 u8s8": QuantizationConfig(bits=8, head_bits=8, per_channel=True, channel_bits=8),  # then SignedChannelsPass
}
SIGNED = {"pc8 u8s8"}


def session(weight: np.ndarray, config: QuantizationConfig, make_signed: bool = False) -> ort.InferenceSession:
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
    if make_signed:
        SignedChannelsPass()(model)  # what the runtime does on VNNI hosts
    options = ort.SessionOptions()
    options.intra_op_num_threads = 2
    options.add_session_config_entry("session.intra_op.allow_spinning", "1")
    return ort.InferenceSession(ir.to_proto(model).SerializeToString(), options, providers=["CPUExecutionProvider"])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=sorted(SHAPES), default="gpt2")
    args = parser.parse_args(argv)
    rng = np.random.default_rng(0)
    others = [kind for kind in KINDS if kind != "blocks"]
    print(f"{'shape':<8} {'rows':>4} {'blocks us':>10} " + " ".join(f"{kind + ' x':>10}" for kind in others) + "  rel err " + " / ".join(KINDS))
    for name, k, n in SHAPES[args.model]:
        weight = (rng.standard_normal((k, n)) * 0.02).astype(np.float32)
        sessions = {kind: session(weight, config, kind in SIGNED) for kind, config in KINDS.items()}
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
            medians = {kind: statistics.median(values) for kind, values in times.items()}
            ratios = " ".join(f"{medians[kind] / medians['blocks']:>10.2f}" for kind in others)
            print(
                f"{name:<8} {rows:>4} {medians['blocks']:>10.1f} {ratios}  " + " / ".join(f"{errors[kind]:.4f}" for kind in KINDS),
                flush=True,
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
