"""The OpenAI-compatible HTTP app over an :class:`~kvexport.serving.Engine` (FastAPI).

Routes, with vLLM's request and response shapes (``vllm/entrypoints/openai``):

- ``POST /v1/completions``: a prompt (text or token ids) or a list of them, ``n`` choices
  each (choice index = prompt × n + i), ``echo``, ``logprobs`` (``tokens``,
  ``token_logprobs``, ``top_logprobs``, ``text_offset``; with ``echo`` the prompt's come
  first, the first prompt token's ``null``), ``prompt_logprobs``, every sampling control
  of :mod:`kvexport.serving.protocol`, and SSE streaming (one chunk per token, each with
  its own tokens' logprobs; a usage chunk when asked; then ``data: [DONE]``).
- ``POST /v1/chat/completions``: ``messages`` rendered by the chat template
  (:mod:`kvexport.serving.chat`), the same controls, ``logprobs`` / ``top_logprobs`` in
  the chat shape, streamed ``chat.completion.chunk`` deltas.
- ``POST /tokenize``, ``POST /detokenize``, ``GET /tokenizer_info``; ``GET /v1/models``,
  ``GET /health``, ``GET /metrics`` (Prometheus text).
- ``GET /``: the playground, one HTML page with no external assets (``playground.html``):
  a prompt, max tokens, temperature, the tokens as they stream with TTFT and tokens/s, a
  chat mode when there is a chat template and a key field when there is an API key.

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
queue is full. A client that disconnects cancels its requests, which frees their slots
within one step.
"""

from __future__ import annotations

import hmac
import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import HTMLResponse, JSONResponse, Response, StreamingResponse
from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Histogram,
    generate_latest,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from starlette.exceptions import HTTPException

from kvexport.errors import KvexportError
from kvexport.serving.chat import ChatTemplate
from kvexport.serving.engine import Engine, EngineClosed, EngineFull
from kvexport.serving.protocol import (
    ChatCompletionRequest,
    ChatMessage,
    CompletionRequest,
    DetokenizeRequest,
    SamplingFields,
    TokenizeRequest,
)
from kvexport.serving.responses import (
    ChatRender,
    Choice,
    CompletionRender,
    TokenNames,
    answer,
    cancel,
    error_response,
)

RETRY_AFTER_S = 1
# the routes an API key guards (vLLM's --api-key guards /v1; the tokenizer routes read the model too)
_KEYED_PREFIXES = ("/v1", "/tokenize", "/detokenize", "/tokenizer_info")
API_KEY_ENV = "KVEXPORT_API_KEY"


PLAYGROUND = Path(__file__).with_name("playground.html")


def playground_page(model: str, *, chat: bool, api_key: bool) -> str:
    """The playground's HTML (no external assets), told the model name and whether chat and a key apply."""
    config = json.dumps({"model": model, "chat": chat, "api_key": api_key}).replace("<", "\\u003c")
    return PLAYGROUND.read_text(encoding="utf-8").replace("__SERVER_CONFIG__", config)


def needs_key(path: str) -> bool:
    """Whether ``path`` is guarded by the API key: ``/v1/*`` and the tokenizer routes; not ``/health``, ``/metrics``, ``/``."""
    return any(path == prefix or path.startswith(prefix + "/") for prefix in _KEYED_PREFIXES)


def key_matches(header: str | None, api_key: str) -> bool:
    """Whether an ``Authorization`` header carries ``Bearer <api_key>``, compared in constant time."""
    scheme, _, given = (header or "").partition(" ")
    return scheme.lower() == "bearer" and hmac.compare_digest(given.strip().encode(), api_key.encode())
DEFAULT_MAX_TOKENS = 16  # completions: also for max_tokens null, as vLLM normalizes it
_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)


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


def _param_of(message: str, body: SamplingFields, fallback: str) -> str:
    """The request field an engine message names first (``logit_bias: ...``, ``min_tokens 5: ...``)."""
    word = message.split(" ")[0].rstrip(":")
    return word if word in type(body).model_fields else fallback


def create_app(
    engine: Engine,
    model: str,
    *,
    replica: str | None = None,
    chat_template: ChatTemplate | None = None,
    api_key: str | None = None,
) -> FastAPI:
    """The FastAPI app serving ``engine`` under the model name ``model``.

    ``replica`` names this copy of the app in an ``x-kvexport-replica`` response header
    (a deployment with several replicas sets it); ``chat_template`` renders chat messages
    (without one, ``/v1/chat/completions`` answers 400 naming ``--chat-template``);
    ``api_key``, when set, is required on every ``/v1`` and tokenizer route as
    ``Authorization: Bearer KEY`` (see :func:`key_matches`).
    """
    app = FastAPI(title="kvexport", docs_url=None, redoc_url=None, openapi_url=None)

    if api_key is not None:
        @app.middleware("http")
        async def require_key(request: Request, call_next: Any) -> Response:
            if needs_key(request.url.path) and not key_matches(request.headers.get("authorization"), api_key):
                return error_response(
                    401,
                    "missing or wrong API key: send the server's --api-key as 'Authorization: Bearer KEY'",
                    code="invalid_api_key",
                )
            response: Response = await call_next(request)
            return response
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
            return error_response(400, "the request body is not valid JSON; send a JSON object")
        location = [str(part) for part in first.get("loc", ()) if part != "body"]
        param = location[0] if location else None
        where = ".".join(location) or "body"
        return error_response(400, f"{where}: {first.get('msg', 'invalid value')}", param=param)

    @app.exception_handler(HTTPException)
    async def httperror_response(request: Request, exc: HTTPException) -> JSONResponse:
        if exc.status_code == 404:
            return error_response(404, f"no route {request.method} {request.url.path}; see /v1/completions, /v1/models", code="not_found")
        return error_response(exc.status_code, str(exc.detail))

    def chat_prompt(messages: list[ChatMessage], add_generation_prompt: bool) -> str:
        """The prompt text of ``messages`` (chat and /tokenize); one line when there is no template."""
        if chat_template is None:
            raise KvexportError(
                "this model has no chat template: start kvexport serve with --chat-template FILE (a Jinja template), "
                "or use /v1/completions"
            )
        return chat_template.render([m.for_template() for m in messages], add_generation_prompt=add_generation_prompt)

    def wrong_model(name: str | None) -> JSONResponse | None:
        if name is not None and name != model:
            return error_response(404, f"the model `{name}` does not exist; this server serves `{model}`", param="model", code="model_not_found")
        return None

    @app.get("/health")
    async def health() -> dict[str, str]:
        return {"status": "ok"}

    page = playground_page(model, chat=chat_template is not None, api_key=api_key is not None)

    @app.get("/", response_class=HTMLResponse)
    async def playground() -> HTMLResponse:
        return HTMLResponse(page)

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
        problem = wrong_model(body.model) or _refusal(body)
        if problem is not None:
            return problem
        if body.max_tokens == 0 and not body.echo:
            return error_response(400, "max_tokens: Input should be greater than or equal to 1", param="max_tokens")
        prompt_logprobs = body.prompt_logprobs if body.prompt_logprobs is not None else (body.logprobs if body.echo else None)
        echo_only = body.echo and body.max_tokens == 0
        choices: list[Choice] = []

        def submit() -> None:
            engine.check_fits(len(body.prompts()) * body.n)
            for prompt in body.prompts():
                ids = engine.encode(prompt) if isinstance(prompt, str) else [int(t) for t in prompt]
                if body.truncate_prompt_tokens is not None:
                    ids = ids[-body.truncate_prompt_tokens :]
                wanted = 1 if echo_only else (body.max_tokens if body.max_tokens is not None else DEFAULT_MAX_TOKENS)
                params = body.sampling_params(wanted, logprobs=body.logprobs, prompt_logprobs=prompt_logprobs)
                echo = (prompt if isinstance(prompt, str) and body.truncate_prompt_tokens is None else _decode(engine, ids)) if body.echo else ""
                for child in engine.submit_n(ids, params, body.n):
                    choices.append(Choice(len(choices), child, echo, ids if body.echo else [], echo_only))

        refused = _submit(submit, choices, body, "prompt")
        if refused is not None:
            return refused
        first = choices[:: body.n]  # one choice per prompt: each prompt's n choices are together
        name = TokenNames(engine, body.return_tokens_as_token_ids)
        render = CompletionRender(model, choices, first, name, body)
        if body.stream:
            return StreamingResponse(render.stream(), media_type="text/event-stream")
        return await answer(choices, request, render.whole)

    @app.post("/v1/chat/completions", response_model=None)
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        problem = wrong_model(body.model) or _refusal(body)
        if problem is not None:
            return problem
        if body.top_logprobs is not None and not body.logprobs:
            return error_response(400, "top_logprobs: needs logprobs: true", param="top_logprobs")
        choices: list[Choice] = []

        def submit() -> None:
            ids = engine.encode(chat_prompt(body.messages, body.add_generation_prompt))
            if body.truncate_prompt_tokens is not None:
                ids = ids[-body.truncate_prompt_tokens :]
            wanted = body.wanted_tokens()
            params = body.sampling_params(
                wanted if wanted is not None else max(1, engine.capacity - len(ids)),
                logprobs=(body.top_logprobs or 0) if body.logprobs else None,
                prompt_logprobs=None,
            )
            for child in engine.submit_n(ids, params, body.n):
                choices.append(Choice(len(choices), child))

        refused = _submit(submit, choices, body, "messages")
        if refused is not None:
            return refused
        render = ChatRender(model, choices, TokenNames(engine, body.return_tokens_as_token_ids), body)
        if body.stream:
            return StreamingResponse(render.stream(), media_type="text/event-stream")
        return await answer(choices, request, render.whole)

    @app.post("/tokenize", response_model=None)
    async def tokenize(body: TokenizeRequest) -> Response:
        problem = wrong_model(body.model)
        if problem is not None:
            return problem
        if (body.prompt is None) == (body.messages is None):
            return error_response(400, "tokenize: send a prompt or messages (one of them)", param="prompt")
        text = body.prompt
        if body.messages is not None:
            try:
                text = chat_prompt(body.messages, body.add_generation_prompt)
            except KvexportError as exc:
                return error_response(400, str(exc), param="messages")
        assert text is not None
        try:
            ids = engine.encode(text)
        except KvexportError as exc:
            return error_response(400, str(exc), param="prompt")
        tokenizer = engine.tokenizer
        strings = [tokenizer.id_to_token(t) for t in ids] if body.return_token_strs and tokenizer is not None else None
        return JSONResponse({"count": len(ids), "max_model_len": engine.capacity, "tokens": ids, "token_strs": strings})

    @app.post("/detokenize", response_model=None)
    async def detokenize(body: DetokenizeRequest) -> Response:
        problem = wrong_model(body.model)
        if problem is not None:
            return problem
        outside = [t for t in body.tokens if not 0 <= t < engine.vocab_size]
        if outside:
            return error_response(400, f"tokens: token id {outside[0]} is outside the vocabulary (0..{engine.vocab_size - 1})", param="tokens")
        if engine.tokenizer is None:
            return error_response(400, f"{engine.directory} has no tokenizer; there is no text to give", param="tokens")
        return JSONResponse({"prompt": _decode(engine, body.tokens)})

    @app.get("/tokenizer_info")
    async def tokenizer_info() -> dict[str, Any]:
        eos = engine.eos_token_id
        eos_text = engine.tokenizer.id_to_token(eos) if engine.tokenizer is not None and eos is not None else None
        return {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "eos_token": eos_text,
            "eos_token_id": eos,
            "bos_token": eos_text,
            "model_max_length": engine.capacity,
            "vocab_size": engine.vocab_size,
            "add_bos_token": False,
            "chat_template": None if chat_template is None else chat_template.source,
        }

    return app


def _decode(engine: Engine, ids: list[int]) -> str:
    return "" if engine.tokenizer is None else str(engine.tokenizer.decode(ids))


def _refusal(body: SamplingFields) -> JSONResponse | None:
    message = body.refused()
    if message is None:
        return None
    return error_response(400, message, param=message.split(":")[0].split(".")[0])


def _submit(submit: Callable[[], None], choices: list[Choice], body: SamplingFields, fallback: str) -> JSONResponse | None:
    """Run ``submit``; on a refusal cancel what it had queued and answer in OpenAI's shape."""
    try:
        submit()
    except (EngineFull, EngineClosed) as exc:
        cancel(choices)
        return error_response(503, str(exc), kind="server_overloaded", headers={"Retry-After": str(RETRY_AFTER_S)})
    except KvexportError as exc:
        cancel(choices)
        return error_response(400, str(exc), param=_param_of(str(exc), body, fallback))
    return None
