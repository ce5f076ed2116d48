"""Guard the public names that deployment pipelines import."""

from __future__ import annotations

import kvexport
import passes


def test_kvexport_public_names() -> None:
    assert set(kvexport.__all__) == {
        "ExportError",
        "ExportResult",
        "KvexportError",
        "Manifest",
        "ManifestError",
        "ProviderError",
        "VerifyReport",
        "__version__",
        "export_gpt2",
        "read_manifest",
        "verify",
    }
    for name in kvexport.__all__:
        assert getattr(kvexport, name) is not None


def test_passes_public_names() -> None:
    assert set(passes.__all__) == {
        "DEFAULT_REWRITE_PASSES",
        "PASS_NAMES",
        "CacheNamingError",
        "CleanupPass",
        "FoldShapesPass",
        "FuseAttentionPass",
        "FuseOrtBlockPass",
        "NoCacheError",
        "PassReport",
        "RenameCachePass",
        "TransposedWeightGemmPass",
        "build_pipeline",
        "run_pipeline",
    }
    for name in passes.__all__:
        assert getattr(passes, name) is not None
