"""Guard the public names that deployment pipelines import."""

from __future__ import annotations

import kvexport
import kvexport.passes as passes


def test_kvexport_public_names() -> None:
    assert set(kvexport.__all__) == {
        "DraftModel",
        "Engine",
        "EngineConfig",
        "ExportChoices",
        "ExportError",
        "ExportOptions",
        "ExportResult",
        "Generator",
        "KvexportError",
        "Manifest",
        "ManifestError",
        "PromptLookup",
        "ProviderError",
        "SamplingParams",
        "SpeculativeGenerator",
        "VerifyReport",
        "__version__",
        "export_gpt2",
        "export_model",
        "import_decoder",
        "read_manifest",
        "verify",
    }
    _documented(kvexport)


def test_passes_public_names() -> None:
    assert set(passes.__all__) == {
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
        "PromptAttentionPass",
        "PromptProductsPass",
        "PassReport",
        "QuantizationConfig",
        "QuantizeCacheError",
        "QuantizeCachePass",
        "QuantizeWeightsPass",
        "RenameCachePass",
        "SignedChannelsPass",
        "TransposedWeightGemmPass",
        "build_pipeline",
        "run_pipeline",
    }
    _documented(passes)


def _documented(module: object) -> None:
    """Every public class and function carries its own docstring (the API is documented)."""
    for name in module.__all__:  # type: ignore[attr-defined]
        value = getattr(module, name)
        if isinstance(value, type) or callable(value):
            assert value.__doc__ and value.__doc__.strip(), f"{name} has no docstring"
            assert value.__doc__ is not type.__doc__ and value.__doc__ is not object.__doc__, name
