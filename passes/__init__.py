"""Graph rewrite passes for GPT-2-style decoder graphs (``onnx_ir`` passes).

Each pass is an ``onnx_ir.passes`` pass: call it on an ``ir.Model`` and it returns a
``PassResult`` saying whether it changed the model; its ``counts`` say by how much.
:func:`build_pipeline` / :func:`run_pipeline` compose them the way ``kvexport gpt2``
and ``kvexport rewrite`` do.

Installed as ``kvexport.passes`` (the folder stays at the repository's top level; every
import inside it is relative, so it imports nothing of the rest of kvexport).
``import kvexport.passes`` is cheap: each public name loads its module (and onnx_ir,
onnxscript) on first use, so :mod:`kvexport.passes.cache_names`,
:mod:`kvexport.passes.choices` and :mod:`kvexport.passes.vocabulary` serve the torch- and
onnx_ir-free runtime too.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .cache_attention import CacheAttentionPass
    from .cache_names import CacheSlot
    from .choices import Attention
    from .cleanup import CleanupPass
    from .errors import PassInputError
    from .fold_shapes import FoldShapesPass
    from .fuse_attention import FuseAttentionPass
    from .fuse_ort_block import FuseOrtBlockPass
    from .pack_projections import PackProjectionsPass
    from .paged_cache import PagedCachePass
    from .pipeline import (
        DEFAULT_REWRITE_PASSES,
        PASS_NAMES,
        PassReport,
        build_pipeline,
        run_pipeline,
    )
    from .prompt_attention import PromptAttentionPass
    from .prompt_products import PromptProductsPass
    from .quantize_cache import CacheQuantization, QuantizeCacheError, QuantizeCachePass
    from .quantize_weights import QuantizationConfig, QuantizeWeightsPass, SignedChannelsPass
    from .rename_cache import CacheNamingError, NoCacheError, RenameCachePass
    from .transposed_weight_gemm import TransposedWeightGemmPass

# public name -> the module that defines it (imported on first use)
_LAZY = {
    "Attention": ".choices",
    "CacheSlot": ".cache_names",
    "CleanupPass": ".cleanup",
    "FoldShapesPass": ".fold_shapes",
    "FuseAttentionPass": ".fuse_attention",
    "FuseOrtBlockPass": ".fuse_ort_block",
    "PackProjectionsPass": ".pack_projections",
    "PagedCachePass": ".paged_cache",
    "PassInputError": ".errors",
    "DEFAULT_REWRITE_PASSES": ".pipeline",
    "PASS_NAMES": ".pipeline",
    "PassReport": ".pipeline",
    "build_pipeline": ".pipeline",
    "run_pipeline": ".pipeline",
    "CacheAttentionPass": ".cache_attention",
    "CacheQuantization": ".quantize_cache",
    "QuantizeCacheError": ".quantize_cache",
    "QuantizeCachePass": ".quantize_cache",
    "QuantizationConfig": ".quantize_weights",
    "PromptAttentionPass": ".prompt_attention",
    "PromptProductsPass": ".prompt_products",
    "QuantizeWeightsPass": ".quantize_weights",
    "SignedChannelsPass": ".quantize_weights",
    "CacheNamingError": ".rename_cache",
    "NoCacheError": ".rename_cache",
    "RenameCachePass": ".rename_cache",
    "TransposedWeightGemmPass": ".transposed_weight_gemm",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        value = getattr(importlib.import_module(_LAZY[name], __name__), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "DEFAULT_REWRITE_PASSES",
    "PASS_NAMES",
    "Attention",
    "CacheAttentionPass",
    "CacheNamingError",
    "CacheQuantization",
    "CacheSlot",
    "CleanupPass",
    "FoldShapesPass",
    "FuseAttentionPass",
    "FuseOrtBlockPass",
    "NoCacheError",
    "PackProjectionsPass",
    "PagedCachePass",
    "PassInputError",
    "PassReport",
    "PromptAttentionPass",
    "PromptProductsPass",
    "QuantizationConfig",
    "QuantizeCacheError",
    "QuantizeCachePass",
    "QuantizeWeightsPass",
    "RenameCachePass",
    "SignedChannelsPass",
    "TransposedWeightGemmPass",
    "build_pipeline",
    "run_pipeline",
]
