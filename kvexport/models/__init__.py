"""Model loading and the exportable prefill / decode wrappers."""

from kvexport.models.gpt2 import (
    PRESETS,
    DecodeModule,
    ModelDims,
    ModelSource,
    PrefillModule,
    load_gpt2,
    weights_fingerprint,
)

__all__ = [
    "PRESETS",
    "DecodeModule",
    "ModelDims",
    "ModelSource",
    "PrefillModule",
    "load_gpt2",
    "weights_fingerprint",
]
