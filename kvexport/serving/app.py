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

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
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
from starlette.exceptions import HTTPException

from kvexport.errors import KvexportError
from kvexport.serving.chat import ChatTemplate
from kvexport.serving.engine import Engine, EngineClosed, EngineFull, Logprob, TokenEvent
from kvexport.serving.engine import Request as EngineRequest
from kvexport.serving.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    SamplingFields,
    TokenizeRequest,
)

RETRY_AFTER_S = 1
_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
LOWEST_LOGPROB = -9999.0  # what OpenAI and vLLM send for -inf


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


class _Tokens:
    """Token ids to the strings the API shows (vLLM's ``decoded_token``, or ``token_id:N``)."""

    def __init__(self, engine: Engine, as_ids: bool) -> None:
        self.tokenizer = engine.tokenizer
        self.as_ids = as_ids

    def __call__(self, token: int) -> str:
        if self.as_ids or self.tokenizer is None:
            return f"token_id:{token}"
        return str(self.tokenizer.decode([token], skip_special_tokens=False))


@dataclass
class _Choice:
    """One choice being answered: its request, what it echoes, and what it has streamed so far."""

    index: int
    request: EngineRequest
    echo_text: str = ""  # the prompt, when echoed
    echo_ids: list[int] = field(default_factory=list)
    echo_only: bool = False  # echo with max_tokens 0: the generated token is dropped
    text: list[str] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)
    logprobs: list[Logprob | None] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    error: str | None = None
    echoed: bool = False

    def add(self, event: TokenEvent) -> tuple[str, list[int], list[Logprob | None]]:
        """Take one event; returns the text, tokens and logprobs it adds (the echo first)."""
        text, tokens, logprobs = "", [], []
        if not self.echoed:
            self.echoed = True
            text, tokens = self.echo_text, list(self.echo_ids)
            if self.echo_ids:
                logprobs = list(self.request.prompt_logprobs) or [None] * len(self.echo_ids)
        if event.token_id is not None and not self.echo_only:
            tokens.append(event.token_id)
            logprobs.append(event.logprob)
        if not self.echo_only:
            text += event.text
        if event.finish_reason is not None:
            self.finish_reason = "length" if self.echo_only and event.finish_reason != "error" else event.finish_reason
            self.stop_reason = event.stop_reason
            self.error = event.error
        self.text.append(text)
        self.tokens += tokens
        self.logprobs += logprobs
        return text, tokens, logprobs

    @property
    def generated(self) -> int:
        """Tokens generated for this choice (none for an echo alone)."""
        return 0 if self.echo_only else self.request.completion_tokens


def _completion_logprobs(tokens: list[int], logprobs: list[Logprob | None], top: int, offset: int, name: _Tokens) -> dict[str, Any]:
    """VLLM's completion ``logprobs``: each token's string, log-probability, top alternatives and text offset."""
    out: dict[str, Any] = {"text_offset": [], "token_logprobs": [], "tokens": [], "top_logprobs": []}
    for token, logprob in zip(tokens, logprobs, strict=True):
        text = name(token)
        out["text_offset"].append(offset)
        offset += len(text)
        out["tokens"].append(text)
        if logprob is None:
            out["token_logprobs"].append(None)
            out["top_logprobs"].append(None)
            continue
        out["token_logprobs"].append(max(logprob.logprob, LOWEST_LOGPROB))
        ranked = {text: max(logprob.logprob, LOWEST_LOGPROB)}  # the chosen token first, then the top ones
        for alternative, value in logprob.top[:top]:
            ranked.setdefault(name(alternative), max(value, LOWEST_LOGPROB))
        out["top_logprobs"].append(ranked)
    return out


def _chat_logprobs(tokens: list[int], logprobs: list[Logprob | None], top: int, name: _Tokens) -> dict[str, Any]:
    """VLLM's chat ``logprobs``: ``content``, one entry per token with its ``top_logprobs``."""
    content = []
    for token, logprob in zip(tokens, logprobs, strict=True):
        if logprob is None:
            continue
        ranked = {token: logprob.logprob}
        for alternative, value in logprob.top:
            ranked.setdefault(alternative, value)
        entries = [_chat_entry(name(t), v) for t, v in list(ranked.items())[:top]]
        content.append({**_chat_entry(name(token), logprob.logprob), "top_logprobs": entries})
    return {"content": content}


def _chat_entry(text: str, logprob: float) -> dict[str, Any]:
    return {"token": text, "logprob": max(logprob, LOWEST_LOGPROB), "bytes": list(text.encode("utf-8", errors="replace"))}


def _prompt_logprobs(request: EngineRequest, name: _Tokens) -> list[dict[str, Any] | None]:
    """VLLM's ``prompt_logprobs``: per prompt token, None for the first, else {token id: {logprob, rank, decoded_token}}."""
    out: list[dict[str, Any] | None] = []
    for logprob in request.prompt_logprobs:
        if logprob is None:
            out.append(None)
            continue
        entry = {str(logprob.token_id): {"logprob": logprob.logprob, "rank": logprob.rank, "decoded_token": name(logprob.token_id)}}
        for rank, (token, value) in enumerate(logprob.top, start=1):
            entry.setdefault(str(token), {"logprob": value, "rank": rank, "decoded_token": name(token)})
        out.append(entry)
    return out


def _param_of(message: str, body: SamplingFields, fallback: str) -> str:
    """The request field an engine message names first (``logit_bias: ...``, ``min_tokens 5: ...``)."""
    word = message.split(" ")[0].rstrip(":")
    return word if word in type(body).model_fields else fallback


def create_app(engine: Engine, model: str, *, replica: str | None = None, chat_template: ChatTemplate | None = None) -> FastAPI:
    """The FastAPI app serving ``engine`` under the model name ``model``.

    ``replica`` names this copy of the app in an ``x-kvexport-replica`` response header
    (a deployment with several replicas sets it); ``chat_template`` renders chat messages
    (without one, ``/v1/chat/completions`` answers 400 naming ``--chat-template``).
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

    def wrong_model(name: str | None) -> JSONResponse | None:
        if name is not None and name != model:
            return _error(404, f"the model `{name}` does not exist; this server serves `{model}`", param="model", code="model_not_found")
        return None

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
        problem = wrong_model(body.model) or _refusal(body)
        if problem is not None:
            return problem
        if body.max_tokens == 0 and not body.echo:
            return _error(400, "max_tokens: Input should be greater than or equal to 1", param="max_tokens")
        prompt_logprobs = body.prompt_logprobs if body.prompt_logprobs is not None else (body.logprobs if body.echo else None)
        echo_only = body.echo and body.max_tokens == 0
        choices: list[_Choice] = []

        def submit() -> None:
            for prompt in body.prompts():
                ids = engine.encode(prompt) if isinstance(prompt, str) else [int(t) for t in prompt]
                if body.truncate_prompt_tokens is not None:
                    ids = ids[-body.truncate_prompt_tokens :]
                wanted = 1 if echo_only else (body.max_tokens if body.max_tokens is not None else engine.capacity - len(ids))
                params = body.sampling_params(wanted, logprobs=body.logprobs, prompt_logprobs=prompt_logprobs)
                echo = (prompt if isinstance(prompt, str) and body.truncate_prompt_tokens is None else _decode(engine, ids)) if body.echo else ""
                for child in engine.submit_n(ids, params, body.n):
                    choices.append(_Choice(len(choices), child, echo, ids if body.echo else [], echo_only))

        refused = _submit(submit, choices, body, "prompt")
        if refused is not None:
            return refused
        first = [c for c in choices if c.request.after is None]
        for choice in choices:  # siblings echo the first's prompt logprobs (computed once)
            if choice.request.after is not None:
                choice.request.prompt_logprobs = choice.request.after.prompt_logprobs
        name = _Tokens(engine, body.return_tokens_as_token_ids)
        render = _CompletionRender(model, choices, first, name, body)
        if body.stream:
            return StreamingResponse(render.stream(), media_type="text/event-stream")
        return await _answer(choices, request, render.whole)

    @app.post("/v1/chat/completions", response_model=None)
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        problem = wrong_model(body.model) or _refusal(body)
        if problem is not None:
            return problem
        if chat_template is None:
            return _error(
                400,
                "this model has no chat template: start kvexport serve with --chat-template FILE (a Jinja template), "
                "or use /v1/completions",
                param="messages",
            )
        if body.top_logprobs is not None and not body.logprobs:
            return _error(400, "top_logprobs: needs logprobs: true", param="top_logprobs")
        choices: list[_Choice] = []

        def submit() -> None:
            messages = [{"role": m.role, "content": m.text()} for m in body.messages]
            ids = engine.encode(chat_template.render(messages, add_generation_prompt=body.add_generation_prompt))
            if body.truncate_prompt_tokens is not None:
                ids = ids[-body.truncate_prompt_tokens :]
            wanted = body.wanted_tokens()
            params = body.sampling_params(
                wanted if wanted is not None else engine.capacity - len(ids),
                logprobs=(body.top_logprobs or 0) if body.logprobs else None,
                prompt_logprobs=None,
            )
            for child in engine.submit_n(ids, params, body.n):
                choices.append(_Choice(len(choices), child))

        refused = _submit(submit, choices, body, "messages")
        if refused is not None:
            return refused
        render = _ChatRender(model, choices, _Tokens(engine, body.return_tokens_as_token_ids), body)
        if body.stream:
            return StreamingResponse(render.stream(), media_type="text/event-stream")
        return await _answer(choices, request, render.whole)

    @app.post("/tokenize", response_model=None)
    async def tokenize(body: TokenizeRequest) -> Response:
        problem = wrong_model(body.model)
        if problem is not None:
            return problem
        if (body.prompt is None) == (body.messages is None):
            return _error(400, "tokenize: send a prompt or messages (one of them)", param="prompt")
        text = body.prompt
        if body.messages is not None:
            if chat_template is None:
                return _error(400, "this model has no chat template: start kvexport serve with --chat-template FILE", param="messages")
            try:
                messages = [{"role": m.role, "content": m.text()} for m in body.messages]
                text = chat_template.render(messages, add_generation_prompt=body.add_generation_prompt)
            except KvexportError as exc:
                return _error(400, str(exc), param="messages")
        assert text is not None
        try:
            ids = engine.encode(text)
        except KvexportError as exc:
            return _error(400, str(exc), param="prompt")
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
            return _error(400, f"tokens: token id {outside[0]} is outside the vocabulary (0..{engine.vocab_size - 1})", param="tokens")
        if engine.tokenizer is None:
            return _error(400, f"{engine.directory} has no tokenizer; there is no text to give", param="tokens")
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
    return _error(400, message, param=message.split(":")[0].split(".")[0])


def _submit(submit: Callable[[], None], choices: list[_Choice], body: SamplingFields, fallback: str) -> JSONResponse | None:
    """Run ``submit``; on a refusal cancel what it had queued and answer in OpenAI's shape."""
    try:
        submit()
    except (EngineFull, EngineClosed) as exc:
        _cancel(choices)
        return _error(503, str(exc), kind="server_overloaded", headers={"Retry-After": str(RETRY_AFTER_S)})
    except KvexportError as exc:
        _cancel(choices)
        return _error(400, str(exc), param=_param_of(str(exc), body, fallback))
    return None


def _cancel(choices: list[_Choice]) -> None:
    for choice in choices:
        choice.request.cancel()


async def _events(choices: list[_Choice]) -> AsyncIterator[tuple[_Choice, TokenEvent]]:
    """Every choice's events as they come, interleaved; the requests are cancelled if the consumer goes away."""
    queue: asyncio.Queue[tuple[_Choice, TokenEvent] | None] = asyncio.Queue()

    async def pump(choice: _Choice) -> None:
        async for event in choice.request:
            await queue.put((choice, event))
        await queue.put(None)

    tasks = [asyncio.ensure_future(pump(choice)) for choice in choices]
    try:
        remaining = len(tasks)
        while remaining:
            item = await queue.get()
            if item is None:
                remaining -= 1
                continue
            yield item
    finally:
        _cancel(choices)  # a no-op for the requests that ended; frees the slots if the client left
        for task in tasks:
            task.cancel()


async def _answer(choices: list[_Choice], request: Request, whole: Callable[[], Response]) -> Response:
    """Wait for every choice, then answer at once; a client that disconnects first cancels them."""
    async def collect() -> None:
        async for choice, event in _events(choices):
            choice.add(event)

    task = asyncio.ensure_future(collect())
    while not task.done():
        await asyncio.wait({task}, timeout=0.1)
        if not task.done() and await request.is_disconnected():
            _cancel(choices)
    task.result()
    failed = next((c for c in choices if c.finish_reason == "error"), None)
    if failed is not None:
        return _error(500, failed.error or "generation failed", kind="server_error")
    return whole()


def _usage(choices: list[_Choice], first: list[_Choice]) -> dict[str, Any]:
    prompt = sum(c.request.prompt_tokens for c in first)
    completion = sum(c.generated for c in choices)
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": sum(c.request.cached_tokens for c in first)},
    }


def _sse(body: dict[str, Any]) -> str:
    return f"data: {json.dumps(body)}\n\n"


_STREAM_ERROR = {"message": "generation failed", "type": "server_error", "param": None, "code": None}


class _CompletionRender:
    """``text_completion`` bodies: whole, or streamed chunk by chunk."""

    def __init__(self, model: str, choices: list[_Choice], first: list[_Choice], name: _Tokens, body: CompletionRequest) -> None:
        self.model, self.choices, self.first, self.name, self.body = model, choices, first, name, body
        self.id = f"cmpl-{uuid.uuid4().hex}"
        self.created = int(time.time())

    def _body(self, choices: list[dict[str, Any]], usage: dict[str, Any] | None = None) -> dict[str, Any]:
        return {"id": self.id, "object": "text_completion", "created": self.created, "model": self.model, "choices": choices, "usage": usage}

    def _logprobs(self, tokens: list[int], logprobs: list[Logprob | None], offset: int) -> dict[str, Any] | None:
        if self.body.logprobs is None:
            return None
        return _completion_logprobs(tokens, logprobs, self.body.logprobs, offset, self.name)

    def _choice(self, choice: _Choice, text: str, logprobs: dict[str, Any] | None, done: bool) -> dict[str, Any]:
        out: dict[str, Any] = {
            "index": choice.index,
            "text": text,
            "logprobs": logprobs,
            "finish_reason": choice.finish_reason if done else None,
            "stop_reason": choice.stop_reason if done else None,
        }
        if self.body.prompt_logprobs is not None and (done or not self.body.stream):
            out["prompt_logprobs"] = _prompt_logprobs(choice.request.after or choice.request, self.name)
        return out

    def whole(self) -> Response:
        choices = [self._choice(c, "".join(c.text), self._logprobs(c.tokens, c.logprobs, 0), True) for c in self.choices]
        return JSONResponse(self._body(choices, _usage(self.choices, self.first)))

    async def stream(self) -> AsyncIterator[str]:
        offsets = [0] * len(self.choices)
        async for choice, event in _events(self.choices):
            if event.finish_reason == "cancelled":
                return
            if event.finish_reason == "error":
                yield _sse({"error": {**_STREAM_ERROR, "message": event.error or "generation failed"}})
                return
            text, tokens, logprobs = choice.add(event)
            done = event.finish_reason is not None
            if choice.echo_only and not done:
                continue
            payload = self._choice(choice, text, self._logprobs(tokens, logprobs, offsets[choice.index]), done)
            offsets[choice.index] += len(text)
            yield _sse(self._body([payload]))
        if self.body.include_usage():
            yield _sse(self._body([], _usage(self.choices, self.first)))
        yield "data: [DONE]\n\n"


class _ChatRender:
    """``chat.completion`` bodies, and ``chat.completion.chunk`` deltas when streamed."""

    def __init__(self, model: str, choices: list[_Choice], name: _Tokens, body: ChatCompletionRequest) -> None:
        self.model, self.choices, self.name, self.body = model, choices, name, body
        self.id = f"chatcmpl-{uuid.uuid4().hex}"
        self.created = int(time.time())

    def _logprobs(self, tokens: list[int], logprobs: list[Logprob | None]) -> dict[str, Any] | None:
        if not self.body.logprobs:
            return None
        return _chat_logprobs(tokens, logprobs, self.body.top_logprobs or 0, self.name)

    def whole(self) -> Response:
        choices = [
            {
                "index": c.index,
                "message": {"role": "assistant", "content": "".join(c.text)},
                "logprobs": self._logprobs(c.tokens, c.logprobs),
                "finish_reason": c.finish_reason,
                "stop_reason": c.stop_reason,
            }
            for c in self.choices
        ]
        body = {"id": self.id, "object": "chat.completion", "created": self.created, "model": self.model, "choices": choices}
        return JSONResponse({**body, "usage": _usage(self.choices, self.choices[:1])})

    def _chunk(self, choices: list[dict[str, Any]], usage: dict[str, Any] | None = None) -> str:
        return _sse({"id": self.id, "object": "chat.completion.chunk", "created": self.created, "model": self.model, "choices": choices, "usage": usage})

    async def stream(self) -> AsyncIterator[str]:
        for choice in self.choices:  # the role first, as OpenAI and vLLM send it
            yield self._chunk([{"index": choice.index, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}])
        async for choice, event in _events(self.choices):
            if event.finish_reason == "cancelled":
                return
            if event.finish_reason == "error":
                yield _sse({"error": {**_STREAM_ERROR, "message": event.error or "generation failed"}})
                return
            text, tokens, logprobs = choice.add(event)
            done = event.finish_reason is not None
            yield self._chunk([
                {
                    "index": choice.index,
                    "delta": {"content": text} if text or not done else {},
                    "logprobs": self._logprobs(tokens, logprobs),
                    "finish_reason": choice.finish_reason if done else None,
                    "stop_reason": choice.stop_reason if done else None,
                }
            ])
        if self.body.include_usage():
            yield self._chunk([], _usage(self.choices, self.choices[:1]))
        yield "data: [DONE]\n\n"
