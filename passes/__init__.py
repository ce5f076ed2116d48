"""Graph rewrite passes for GPT-2-style decoder graphs (``onnx_ir`` passes).

Each pass is an ``onnx_ir.passes`` pass: call it on an ``ir.Model`` and it returns a
``PassResult`` saying whether it changed the model; its ``counts`` say by how much.
"""

from passes.cleanup import CleanupPass
from passes.transposed_weight_gemm import TransposedWeightGemmPass

__all__ = ["CleanupPass", "TransposedWeightGemmPass"]
