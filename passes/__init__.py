"""Graph rewrite passes for GPT-2-style decoder graphs (``onnx_ir`` passes).

Each pass is an ``onnx_ir.passes`` pass: call it on an ``ir.Model`` and it returns a
``PassResult`` saying whether it changed the model; its ``counts`` say by how much.
:func:`build_pipeline` / :func:`run_pipeline` compose them the way ``kvexport gpt2``
and ``kvexport rewrite`` do.
"""

from passes.cleanup import CleanupPass
from passes.fold_shapes import FoldShapesPass
from passes.fuse_attention import FuseAttentionPass
from passes.fuse_ort_block import FuseOrtBlockPass
from passes.pipeline import (
    DEFAULT_REWRITE_PASSES,
    PASS_NAMES,
    PassReport,
    build_pipeline,
    run_pipeline,
)
from passes.quantize_weights import QuantizationConfig, QuantizeWeightsPass
from passes.rename_cache import CacheNamingError, NoCacheError, RenameCachePass
from passes.transposed_weight_gemm import TransposedWeightGemmPass

__all__ = [
    "DEFAULT_REWRITE_PASSES",
    "PASS_NAMES",
    "CacheNamingError",
    "CleanupPass",
    "FoldShapesPass",
    "FuseAttentionPass",
    "FuseOrtBlockPass",
    "NoCacheError",
    "PassReport",
    "QuantizationConfig",
    "QuantizeWeightsPass",
    "RenameCachePass",
    "TransposedWeightGemmPass",
    "build_pipeline",
    "run_pipeline",
]
