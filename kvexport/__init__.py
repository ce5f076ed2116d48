"""kvexport: GPT-2 to deployment-ready ONNX prefill / decode graphs with a KV cache.

Library entry points:

- :func:`export_gpt2` writes ``prefill.onnx``, ``decode.onnx``, shared weights, the
  manifest and the tokenizer to a directory.
- :func:`verify` proves an export directory matches PyTorch and returns a report.
"""

__version__ = "0.1.0"

from kvexport.errors import ExportError, KvexportError, ManifestError, ProviderError
from kvexport.export import ExportResult, export_gpt2
from kvexport.manifest import Manifest, read_manifest
from kvexport.verify import VerifyReport, verify

__all__ = [
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
]
