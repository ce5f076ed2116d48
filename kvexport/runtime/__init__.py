"""ONNX Runtime execution of kvexport graphs: sessions, sampling and the Generator."""

from kvexport.runtime.generator import GenerationRequest, GenerationStats, Generator
from kvexport.runtime.sampling import SamplingConfig, choose_tokens
from kvexport.runtime.session import Provider, cuda_available, open_session, resolve_provider

__all__ = [
    "GenerationRequest",
    "GenerationStats",
    "Generator",
    "Provider",
    "SamplingConfig",
    "choose_tokens",
    "cuda_available",
    "open_session",
    "resolve_provider",
]
