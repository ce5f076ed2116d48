"""kvexport: GPT-2 to deployment-ready ONNX prefill / decode graphs with a KV cache.

Library entry points:

- :func:`export_model` (and :func:`export_gpt2`) writes ``prefill.onnx``, ``decode.onnx``,
  shared weights, the manifest and the tokenizer to a directory, as :class:`ExportChoices`
  asks (the options of ``kvexport export``, declared once).
- :func:`verify` proves an export directory matches PyTorch and returns a report.
- :func:`import_decoder` turns a one-graph decoder another tool made (Optimum's) into
  such a directory.
- :class:`Generator` runs an export with ONNX Runtime (the cache stays on the device).
- :class:`Engine` serves many requests at once over one in-place cache (continuous
  batching, a prefix cache), with every setting in one :class:`EngineConfig`;
  ``kvexport serve`` puts an OpenAI-compatible HTTP server in front of it.
- :class:`SpeculativeGenerator` decodes one sequence speculatively, with drafts from
  :class:`PromptLookup` or a smaller export (:class:`DraftModel`).

``import kvexport`` is cheap and imports neither torch nor transformers: each name is
loaded on first use. Only export and verify need torch and transformers, which the
``export`` extra adds (``pip install 'kvexport[export]'``); without it those names raise
:class:`KvexportError` with that command. A serving image that runs exports with the
Generator needs onnxruntime, onnx, numpy and tokenizers alone.
"""

from __future__ import annotations

import importlib
from importlib.metadata import PackageNotFoundError, version
from typing import TYPE_CHECKING, Any

from kvexport.errors import ExportError, KvexportError, ManifestError, ProviderError

try:
    __version__ = version("kvexport")
except PackageNotFoundError:  # pragma: no cover - running from a tree that was never installed
    __version__ = "0+unknown"

if TYPE_CHECKING:
    from kvexport.bundle.manifest import Manifest, read_manifest
    from kvexport.export.choices import ExportChoices
    from kvexport.export.exporter import ExportResult, export_gpt2, export_model
    from kvexport.export.importer import import_decoder
    from kvexport.export.options import ExportOptions
    from kvexport.runtime.generator import Generator
    from kvexport.runtime.speculative import DraftModel, PromptLookup, SpeculativeGenerator
    from kvexport.serving.config import EngineConfig
    from kvexport.serving.engine import Engine
    from kvexport.serving.request import SamplingParams
    from kvexport.tools.verify import VerifyReport, verify

# public name -> the module that defines it (imported on first use)
_LAZY = {
    "Engine": "kvexport.serving.engine",
    "EngineConfig": "kvexport.serving.config",
    "ExportChoices": "kvexport.export.choices",
    "ExportOptions": "kvexport.export.options",
    "SamplingParams": "kvexport.serving.request",
    "ExportResult": "kvexport.export.exporter",
    "export_gpt2": "kvexport.export.exporter",
    "export_model": "kvexport.export.exporter",
    "Generator": "kvexport.runtime.generator",
    "DraftModel": "kvexport.runtime.speculative",
    "PromptLookup": "kvexport.runtime.speculative",
    "SpeculativeGenerator": "kvexport.runtime.speculative",
    "import_decoder": "kvexport.export.importer",
    "Manifest": "kvexport.bundle.manifest",
    "read_manifest": "kvexport.bundle.manifest",
    "VerifyReport": "kvexport.tools.verify",
    "verify": "kvexport.tools.verify",
}


# the names that need the ``export`` extra (torch, transformers)
_NEEDS_EXPORT_EXTRA = {"ExportResult": "kvexport.ExportResult", "export_gpt2": "kvexport.export_gpt2", "export_model": "kvexport.export_model", "VerifyReport": "kvexport.VerifyReport", "verify": "kvexport.verify"}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        if name in _NEEDS_EXPORT_EXTRA:
            from kvexport.extras import require_export_extra

            require_export_extra(_NEEDS_EXPORT_EXTRA[name])
        value = getattr(importlib.import_module(_LAZY[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'kvexport' has no attribute {name!r}")


__all__ = [
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
]
