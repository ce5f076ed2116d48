"""The OpenAI-compatible HTTP app over an :class:`~kvexport.serving.Engine` (FastAPI).

Routes, with vLLM's and llama-server's conventions:

- ``POST /v1/completions``: ``prompt`` as a string or token ids, ``max_tokens``,
  ``temperature``, ``top_p``, ``top_k``, ``seed``, ``stop``, ``stream``,
  ``stream_options.include_usage``, ``ignore_eos``, ``n`` = 1. A streamed response is SSE
  ``data:`` chunks (``object: "text_completion"``, one per token), a usage chunk when
  asked, then ``data: [DONE]``.
- ``GET /v1/models``, ``GET /health``, ``GET /metrics`` (Prometheus text).

Errors have OpenAI's shape, ``{"error": {"message", "type", "param", "code"}}``: 400 for
malformed JSON, wrong types, out-of-range values and prompts longer than the context;
404 for an unknown model or route; 503 with ``Retry-After`` when the queue is full. A
client that disconnects cancels its request, which frees its slot within one step.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Histogram,
    generate_latest,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from pydantic import BaseModel, ConfigDict, Field
from starlette.exceptions import HTTPException

from kvexport.errors import KvexportError
from kvexport.serving.engine import (
    Engine,
    EngineClosed,
    EngineFull,
    RequestHandle,
    SamplingParams,
    TokenEvent,
)

RETRY_AFTER_S = 1
_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)


class StreamOptions(BaseModel):
    """``stream_options``: only ``include_usage``."""

    model_config = ConfigDict(extra="ignore", strict=True)
    include_usage: bool = False


class CompletionRequest(BaseModel):
    """The body of ``POST /v1/completions`` (fields this server does not use are ignored)."""

    model_config = ConfigDict(extra="ignore", strict=True)
    model: str | None = None
    prompt: str | list[int] | list[str] | list[list[int]]
    max_tokens: int | None = Field(default=16, ge=1)
    temperature: float | None = Field(default=1.0, ge=0.0, le=2.0)
    top_p: float | None = Field(default=1.0, gt=0.0, le=1.0)
    top_k: int | None = Field(default=None, ge=-1)
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = False
    n: int = 1
    echo: bool = False
    logprobs: int | None = None
    best_of: int | None = None


def _error(status: int, message: str, kind: str = "invalid_request_error", param: str | None = None, code: str | None = None, headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse(
        {"error": {"message": message, "type": kind, "param": param, "code": code}}, status_code=status, headers=headers
    )


class ServerMetrics:
    """Prometheus metrics of one app: the engine's gauges and counters, TTFT and inter-token histograms.

    It is an :class:`~kvexport.serving.engine.EngineListener` of the engine it serves.
    """

    def __init__(self, engine: Engine, model: str) -> None:
        self.registry = CollectorRegistry()
        self.engine = engine
        self.model = model
        self.ttft = Histogram(
            "kvexport_time_to_first_token_seconds", "Time from a request's arrival to its first token.",
            ["model"], buckets=_BUCKETS, registry=self.registry,
        )
        self.itl = Histogram(
            "kvexport_inter_token_latency_seconds", "Time between two tokens of one request.",
            ["model"], buckets=_BUCKETS, registry=self.registry,
        )
        self.requests = Counter(
            "kvexport_requests", "Requests ended, by finish reason.", ["model", "finish_reason"], registry=self.registry
        )
        self.registry.register(self)  # collect(): the engine's own numbers, read when scraped

    def on_first_token(self, seconds: float) -> None:
        """A request's time to first token."""
        self.ttft.labels(self.model).observe(seconds)

    def on_token(self, seconds: float) -> None:
        """The time between two tokens of one request."""
        self.itl.labels(self.model).observe(seconds)

    def on_finish(self, reason: str, prompt_tokens: int, completion_tokens: int) -> None:
        """A request ended."""
        self.requests.labels(self.model, reason).inc()

    def collect(self) -> Any:
        """The engine's gauges and token counters, as they are now."""
        stats = self.engine.stats()
        for name, help_text, value in (
            ("kvexport_requests_running", "Requests generating (prompt done).", stats.running),
            ("kvexport_requests_waiting", "Requests waiting for a slot.", stats.waiting),
            ("kvexport_requests_prefilling", "Requests whose prompt is being prefilled.", stats.prefilling),
            ("kvexport_slots_in_use", "Cache slots held by requests.", stats.slots_in_use),
            ("kvexport_slots_pinned", "Cache slots kept for registered prefixes.", stats.pinned),
            ("kvexport_slots", "Cache slots.", stats.slots),
        ):
            gauge = GaugeMetricFamily(name, help_text, labels=["model"])
            gauge.add_metric([self.model], value)
            yield gauge
        for name, help_text, value in (
            ("kvexport_prompt_tokens", "Prompt tokens prefilled.", stats.prompt_tokens),
            ("kvexport_prefix_cache_hits", "Requests that reused a cached prompt prefix.", stats.prefix_hits),
            ("kvexport_prefix_cache_tokens", "Prompt tokens reused from the prefix cache, not prefilled.", stats.cached_tokens),
            ("kvexport_generation_tokens", "Tokens generated.", stats.generated_tokens),
            ("kvexport_decode_steps", "Batched decode calls.", stats.steps),
        ):
            counter = CounterMetricFamily(name, help_text, labels=["model"])
            counter.add_metric([self.model], value)
            yield counter


def _sampling(body: CompletionRequest) -> SamplingParams:
    stop = (body.stop,) if isinstance(body.stop, str) else tuple(body.stop or ())
    return SamplingParams(
        max_tokens=body.max_tokens if body.max_tokens is not None else 16,
        temperature=body.temperature if body.temperature is not None else 1.0,
        top_p=body.top_p if body.top_p is not None else 1.0,
        top_k=max(0, body.top_k or 0),
        seed=body.seed,
        stop=stop,
        ignore_eos=body.ignore_eos,
    )


def _single_prompt(body: CompletionRequest) -> str | list[int]:
    """The one prompt of the request; batched prompts are refused."""
    prompt = body.prompt
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
        if len(prompt) != 1:
            raise KvexportError("prompt: one prompt per request (a list of prompts is not supported); send them separately")
        return prompt[0]
    return prompt  # type: ignore[return-value]


def _unsupported(body: CompletionRequest) -> str | None:
    if body.n != 1:
        return "n: only n=1 is supported"
    if body.best_of not in (None, 1):
        return "best_of: only 1 is supported"
    if body.echo:
        return "echo: not supported"
    if body.logprobs is not None:
        return "logprobs: not supported"
    return None


def create_app(engine: Engine, model: str, *, replica: str | None = None) -> FastAPI:
    """The FastAPI app serving ``engine`` under the model name ``model``.

    ``replica`` names this copy of the app in an ``x-kvexport-replica`` response header
    (a deployment with several replicas sets it).
    """
    app = FastAPI(title="kvexport", docs_url=None, redoc_url=None, openapi_url=None)
    metrics = ServerMetrics(engine, model)
    engine.add_listener(metrics)
    app.state.engine, app.state.metrics, app.state.model = engine, metrics, model

    if replica is not None:
        @app.middleware("http")
        async def name_replica(request: Request, call_next: Any) -> Response:
            response: Response = await call_next(request)
            response.headers["x-kvexport-replica"] = replica
            return response

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        first = exc.errors()[0] if exc.errors() else {}
        if first.get("type") == "json_invalid" or tuple(first.get("loc", ())) == ("body",):
            return _error(400, "the request body is not valid JSON; send a JSON object")
        location = [str(part) for part in first.get("loc", ()) if part != "body"]
        param = location[0] if location else None
        where = ".".join(location) or "body"
        return _error(400, f"{where}: {first.get('msg', 'invalid value')}", param=param)

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, exc: HTTPException) -> JSONResponse:
        if exc.status_code == 404:
            return _error(404, f"no route {request.method} {request.url.path}; see /v1/completions, /v1/models", code="not_found")
        return _error(exc.status_code, str(exc.detail))

    @app.get("/health")
    async def health() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/metrics")
    async def prometheus() -> Response:
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {
            "object": "list",
            "data": [
                {
                    "id": model,
                    "object": "model",
                    "created": int(time.time()),
                    "owned_by": "kvexport",
                    "root": str(engine.directory),
                    "max_model_len": engine.capacity,
                }
            ],
        }

    @app.post("/v1/completions", response_model=None)
    async def completions(body: CompletionRequest, request: Request) -> Response:
        if body.model is not None and body.model != model:
            return _error(404, f"the model `{body.model}` does not exist; this server serves `{model}`", param="model", code="model_not_found")
        problem = _unsupported(body)
        if problem is not None:
            return _error(400, problem, param=problem.split(":")[0])
        try:
            handle = engine.submit(_single_prompt(body), _sampling(body))
        except (EngineFull, EngineClosed) as exc:
            return _error(503, str(exc), kind="server_overloaded", headers={"Retry-After": str(RETRY_AFTER_S)})
        except KvexportError as exc:
            return _error(400, str(exc), param="prompt")
        created = int(time.time())
        if body.stream:
            usage = body.stream_options is not None and body.stream_options.include_usage
            return StreamingResponse(_stream(handle, model, created, usage), media_type="text/event-stream")
        return await _complete(handle, model, created, request)

    return app


def _usage(handle: RequestHandle) -> dict[str, Any]:
    return {
        "prompt_tokens": handle.prompt_tokens,
        "completion_tokens": handle.completion_tokens,
        "total_tokens": handle.prompt_tokens + handle.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": handle.cached_tokens},
    }


def _chunk(handle: RequestHandle, model: str, created: int, choices: list[dict[str, Any]], usage: dict[str, Any] | None = None) -> str:
    body = {"id": handle.id, "object": "text_completion", "created": created, "model": model, "choices": choices, "usage": usage}
    return f"data: {json.dumps(body)}\n\n"


async def _stream(handle: RequestHandle, model: str, created: int, include_usage: bool) -> AsyncIterator[str]:
    """SSE chunks, one per token; the request is cancelled if the client goes away."""
    try:
        async for event in handle:
            if event.finish_reason == "error":
                error = {"message": event.error or "generation failed", "type": "server_error", "param": None, "code": None}
                yield f"data: {json.dumps({'error': error})}\n\n"
                break
            if event.finish_reason == "cancelled":
                return
            choice = {"index": 0, "text": event.text, "logprobs": None, "finish_reason": event.finish_reason}
            yield _chunk(handle, model, created, [choice])
        if include_usage:
            yield _chunk(handle, model, created, [], _usage(handle))
        yield "data: [DONE]\n\n"
    finally:
        handle.cancel()  # a no-op once the request has ended; frees the slot if the client left


async def _complete(handle: RequestHandle, model: str, created: int, request: Request) -> Response:
    """The whole completion as one response; a client that disconnects first cancels it."""
    async def collect() -> list[TokenEvent]:
        return [event async for event in handle]

    task = asyncio.ensure_future(collect())
    while not task.done():
        await asyncio.wait({task}, timeout=0.1)
        if not task.done() and await request.is_disconnected():
            handle.cancel()
    events = task.result()
    last = events[-1]
    if last.finish_reason == "error":
        return _error(500, last.error or "generation failed", kind="server_error")
    text = "".join(event.text for event in events)
    choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": last.finish_reason}
    return JSONResponse(
        {
            "id": handle.id,
            "object": "text_completion",
            "created": created,
            "model": model,
            "choices": [choice],
            "usage": _usage(handle),
        }
    )
