"""The OpenAI-compatible HTTP app over an :class:`~kvexport.serving.Engine` (FastAPI): it only assembles.

The routes live in :mod:`kvexport.serving.api` (one module per group, with vLLM's request
and response shapes, ``vllm/entrypoints/openai``) and ``/metrics`` in
:mod:`kvexport.serving.metrics`; this module builds the app around them: the API key,
the replica header and the error handlers.

With an API key (``--api-key`` or ``KVEXPORT_API_KEY``) every ``/v1`` route and the
tokenizer routes need ``Authorization: Bearer KEY`` (compared in constant time) and answer
401 in OpenAI's error shape without it; ``/health``, ``/metrics`` and ``/`` stay open
(``/metrics`` shows counts and latencies, no request text).

Log-probabilities are of the model's own distribution, before temperature, penalties
and the other controls (vLLM's default, ``raw_logprobs``). Prompt log-probabilities
(``echo`` with ``logprobs``, or ``prompt_logprobs``) need an ``--all-logits`` export: a
last-position-only prefill graph has no logits for the prompt, and such a request is
refused with one line naming ``--all-logits``.

Errors have OpenAI's shape, ``{"error": {"message", "type", "param", "code"}}``: 400 for
malformed JSON, wrong types, out-of-range values, fields not served and prompts longer
than the context; 404 for an unknown model or route; 503 with ``Retry-After`` when the
queue is full. ``param`` is the field the error is about, carried from where it was
raised. A client that disconnects cancels its requests, which frees their slots within
one step.
"""

from __future__ import annotations

import hmac
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException

from kvexport.serving import metrics
from kvexport.serving.api import chat, completions, models, tokenize
from kvexport.serving.api.common import Served
from kvexport.serving.api.models import playground_page
from kvexport.serving.api.render import error_response
from kvexport.serving.config import ApiConfig
from kvexport.serving.engine import Engine
from kvexport.serving.tool_use import chat_settings

# the routes an API key guards (vLLM's --api-key guards /v1; the tokenizer routes read the model too)
_KEYED_PREFIXES = ("/v1", "/tokenize", "/detokenize", "/tokenizer_info")
API_KEY_ENV = "KVEXPORT_API_KEY"


def needs_key(path: str) -> bool:
    """Whether ``path`` is guarded by the API key: ``/v1/*`` and the tokenizer routes; not ``/health``, ``/metrics``, ``/``."""
    return any(path == prefix or path.startswith(prefix + "/") for prefix in _KEYED_PREFIXES)


def key_matches(header: str | None, api_key: str) -> bool:
    """Whether an ``Authorization`` header carries ``Bearer <api_key>``, compared in constant time."""
    scheme, _, given = (header or "").partition(" ")
    return scheme.lower() == "bearer" and hmac.compare_digest(given.strip().encode(), api_key.encode())


def create_app(engine: Engine, api: ApiConfig | None = None, *, replica: str | None = None) -> FastAPI:
    """The FastAPI app serving ``engine`` as ``api`` says (:class:`~kvexport.serving.config.ApiConfig`).

    The model answers to ``api.name`` (default: the export directory's name); chat
    messages are rendered by ``api.chat_template`` or the export's own template (without
    either, ``/v1/chat/completions`` answers 400 naming ``--chat-template``); ``api.api_key``,
    when set, is required on every ``/v1`` and tokenizer route as ``Authorization: Bearer KEY``
    (see :func:`key_matches`). ``replica`` names this copy of the app in an
    ``x-kvexport-replica`` response header (a deployment with several replicas sets it).
    """
    if isinstance(api, str):  # the signature before ApiConfig: create_app(engine, "name")
        raise TypeError(f"create_app(engine, api): api is an ApiConfig; name the model with ApiConfig(name={api!r})")
    api = api or ApiConfig()
    model = api.model_name(engine.directory)
    template, tools = chat_settings(engine.directory, api)
    app = FastAPI(title="kvexport", docs_url=None, redoc_url=None, openapi_url=None)
    page = playground_page(
        model,
        chat=template is not None,
        api_key=api.api_key is not None,
        tools=template is not None and template.reads("tools"),
        auto_tools=tools.serves_auto,
    )
    app.state.served = Served(engine, model, template, page, api, tools)
    app.state.metrics = metrics.ServerMetrics(engine, model)
    engine.add_listener(app.state.metrics)
    if api.api_key is not None:
        _require_key(app, api.api_key)
    if replica is not None:
        _name_replica(app, replica)
    _handle_errors(app)
    for router in (models.router, metrics.router, completions.router, chat.router, tokenize.router):
        app.include_router(router)
    return app


def _require_key(app: FastAPI, api_key: str) -> None:
    @app.middleware("http")
    async def require_key(request: Request, call_next: Any) -> Response:
        if needs_key(request.url.path) and not key_matches(request.headers.get("authorization"), api_key):
            return error_response(
                401, "missing or wrong API key: send the server's --api-key as 'Authorization: Bearer KEY'", code="invalid_api_key"
            )
        response: Response = await call_next(request)
        return response


def _name_replica(app: FastAPI, replica: str) -> None:
    @app.middleware("http")
    async def name_replica(request: Request, call_next: Any) -> Response:
        response: Response = await call_next(request)
        response.headers["x-kvexport-replica"] = replica
        return response


def _handle_errors(app: FastAPI) -> None:
    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        first = exc.errors()[0] if exc.errors() else {}
        if first.get("type") == "json_invalid" or tuple(first.get("loc", ())) == ("body",):
            return error_response(400, "the request body is not valid JSON; send a JSON object")
        location = [str(part) for part in first.get("loc", ()) if part != "body"]
        param = location[0] if location else None
        where = ".".join(location) or "body"
        # pydantic's error type closes the line (greater_than_equal, ...), as vLLM's messages carry it
        kind = f" ({first['type']})" if first.get("type") else ""
        return error_response(400, f"{where}: {first.get('msg', 'invalid value')}{kind}", param=param)

    @app.exception_handler(HTTPException)
    async def httperror_response(request: Request, exc: HTTPException) -> JSONResponse:
        if exc.status_code == 404:
            return error_response(404, f"no route {request.method} {request.url.path}; see /v1/completions, /v1/models", code="not_found")
        return error_response(exc.status_code, str(exc.detail))
