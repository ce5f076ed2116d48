"""ONNX Runtime sessions for kvexport graphs."""

from kvexport.runtime.session import Provider, cuda_available, open_session, resolve_provider

__all__ = ["Provider", "cuda_available", "open_session", "resolve_provider"]
