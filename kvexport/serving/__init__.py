"""Serving above the runtime: the continuous-batching engine and the OpenAI-compatible HTTP app.

Nothing in :mod:`kvexport.runtime` imports this package. The engine needs only the base
install; the HTTP app needs the ``serve`` extra (FastAPI, uvicorn, prometheus-client,
jinja2). The names below load on first use, so importing a plain part (the scheduler, the
config) does not load ONNX Runtime.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kvexport.serving.config import EngineConfig
    from kvexport.serving.engine import Engine, EngineClosed, EngineStats
    from kvexport.serving.output import RequestHandle, RequestState
    from kvexport.serving.request import Logprob, Request, SamplingParams, TokenEvent
    from kvexport.serving.scheduler import EngineFull

# public name -> the module that defines it (imported on first use)
_LAZY = {
    "Engine": "kvexport.serving.engine",
    "EngineClosed": "kvexport.serving.engine",
    "EngineConfig": "kvexport.serving.config",
    "EngineFull": "kvexport.serving.scheduler",
    "EngineStats": "kvexport.serving.engine",
    "Logprob": "kvexport.serving.request",
    "Request": "kvexport.serving.request",
    "RequestHandle": "kvexport.serving.output",
    "RequestState": "kvexport.serving.output",
    "SamplingParams": "kvexport.serving.request",
    "TokenEvent": "kvexport.serving.request",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        value = getattr(importlib.import_module(_LAZY[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'kvexport.serving' has no attribute {name!r}")


__all__ = [
    "Engine",
    "EngineClosed",
    "EngineConfig",
    "EngineFull",
    "EngineStats",
    "Logprob",
    "Request",
    "RequestHandle",
    "RequestState",
    "SamplingParams",
    "TokenEvent",
]
