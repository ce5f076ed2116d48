"""ONNX Runtime execution of kvexport graphs: sessions, sampling, the Generator and speculative decoding."""

from kvexport.runtime.generator import GenerationRequest, GenerationStats, Generator
from kvexport.runtime.sampling import SamplingConfig, choose_tokens
from kvexport.runtime.session import Provider, cuda_available, open_session, resolve_provider
from kvexport.runtime.speculative import (
    DraftModel,
    PromptLookup,
    SpeculativeGenerator,
    SpeculativeStats,
)
from kvexport.runtime.text import TextStream

__all__ = [
    "DraftModel",
    "GenerationRequest",
    "GenerationStats",
    "Generator",
    "PromptLookup",
    "Provider",
    "SamplingConfig",
    "SpeculativeGenerator",
    "SpeculativeStats",
    "TextStream",
    "choose_tokens",
    "cuda_available",
    "open_session",
    "resolve_provider",
]
