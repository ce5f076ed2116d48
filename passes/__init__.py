"""Graph rewrite passes for GPT-2-style decoder graphs (``onnx_ir`` passes).

Each pass is an ``onnx_ir.passes`` pass: call it on an ``ir.Model`` and it returns a
``PassResult`` saying whether it changed the model; its ``counts`` say by how much.
:func:`build_pipeline` / :func:`run_pipeline` compose them the way ``kvexport gpt2``
and ``kvexport rewrite`` do.

``import passes`` is cheap: each public name loads its module (and onnx_ir, onnxscript)
on first use, so :mod:`passes.cache_names` and :mod:`passes.choices` serve the torch-
and onnx_ir-free runtime too.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from passes.cache_names import CacheSlot
    from passes.choices import Attention
    from passes.cleanup import CleanupPass
    from passes.errors import PassInputError
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
    from passes.quantize_cache import CacheQuantization, QuantizeCacheError, QuantizeCachePass
    from passes.quantize_weights import QuantizationConfig, QuantizeWeightsPass
    from passes.rename_cache import CacheNamingError, NoCacheError, RenameCachePass
    from passes.transposed_weight_gemm import TransposedWeightGemmPass

# public name -> the module that defines it (imported on first use)
_LAZY = {
    "Attention": "passes.choices",
    "CacheSlot": "passes.cache_names",
    "CleanupPass": "passes.cleanup",
    "FoldShapesPass": "passes.fold_shapes",
    "FuseAttentionPass": "passes.fuse_attention",
    "FuseOrtBlockPass": "passes.fuse_ort_block",
    "PassInputError": "passes.errors",
    "DEFAULT_REWRITE_PASSES": "passes.pipeline",
    "PASS_NAMES": "passes.pipeline",
    "PassReport": "passes.pipeline",
    "build_pipeline": "passes.pipeline",
    "run_pipeline": "passes.pipeline",
    "CacheQuantization": "passes.quantize_cache",
    "QuantizeCacheError": "passes.quantize_cache",
    "QuantizeCachePass": "passes.quantize_cache",
    "QuantizationConfig": "passes.quantize_weights",
    "QuantizeWeightsPass": "passes.quantize_weights",
    "CacheNamingError": "passes.rename_cache",
    "NoCacheError": "passes.rename_cache",
    "RenameCachePass": "passes.rename_cache",
    "TransposedWeightGemmPass": "passes.transposed_weight_gemm",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        value = getattr(importlib.import_module(_LAZY[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'passes' has no attribute {name!r}")


__all__ = [
    "DEFAULT_REWRITE_PASSES",
    "PASS_NAMES",
    "Attention",
    "CacheNamingError",
    "CacheQuantization",
    "CacheSlot",
    "CleanupPass",
    "FoldShapesPass",
    "FuseAttentionPass",
    "FuseOrtBlockPass",
    "NoCacheError",
    "PassInputError",
    "PassReport",
    "QuantizationConfig",
    "QuantizeCacheError",
    "QuantizeCachePass",
    "QuantizeWeightsPass",
    "RenameCachePass",
    "TransposedWeightGemmPass",
    "build_pipeline",
    "run_pipeline",
]
