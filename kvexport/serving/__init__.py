"""Serving above the runtime: the continuous-batching engine and the OpenAI-compatible HTTP app.

Nothing in :mod:`kvexport.runtime` imports this package. The engine needs only the base
install; the HTTP app needs the ``serve`` extra (FastAPI, uvicorn, prometheus-client,
jinja2).
"""

from kvexport.serving.config import EngineConfig
from kvexport.serving.engine import Engine, EngineClosed, EngineStats
from kvexport.serving.request import Logprob, Request, RequestHandle, SamplingParams, TokenEvent
from kvexport.serving.scheduler import EngineFull

__all__ = [
    "Engine",
    "EngineClosed",
    "EngineConfig",
    "EngineFull",
    "EngineStats",
    "Logprob",
    "Request",
    "RequestHandle",
    "SamplingParams",
    "TokenEvent",
]
