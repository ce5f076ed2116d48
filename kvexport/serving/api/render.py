"""What the HTTP app answers: choices as they stream, logprobs in vLLM's shapes, whole bodies and SSE chunks.

A :class:`Choice` follows one engine request (one choice of a response) and what it has
streamed; :class:`CompletionRender` and :class:`ChatRender` turn the choices into a
``text_completion`` / ``chat.completion`` body, or into SSE chunks as tokens come
(``text_completion`` / ``chat.completion.chunk``), with a usage chunk when asked and
``data: [DONE]`` at the end.
"""

from __future__ import annotations

import asyncio
import json
import sys
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response
from tokenizers import Tokenizer

from kvexport.serving.output import RequestState
from kvexport.serving.protocol import ChatCompletionRequest, CompletionRequest, SamplingFields
from kvexport.serving.request import Logprob, TokenEvent
from kvexport.serving.tool_use import ToolUse

LOWEST_LOGPROB = -9999.0  # what OpenAI and vLLM send for -inf
_STREAM_ERROR = {"message": "generation failed", "type": "server_error", "param": None, "code": None}


def error_response(status: int, message: str, kind: str = "invalid_request_error", param: str | None = None, code: str | None = None, headers: dict[str, str] | None = None) -> JSONResponse:
    """An error in OpenAI's shape: ``{"error": {"message", "type", "param", "code"}}``."""
    return JSONResponse(
        {"error": {"message": message, "type": kind, "param": param, "code": code}}, status_code=status, headers=headers
    )


class TokenNames:
    """Token ids to the strings the API shows (vLLM's ``decoded_token``, or ``token_id:N``)."""

    def __init__(self, tokenizer: Tokenizer | None, as_ids: bool) -> None:
        self.tokenizer = tokenizer
        self.as_ids = as_ids

    def __call__(self, token: int) -> str:
        """The string shown for ``token``."""
        if self.as_ids or self.tokenizer is None:
            return f"token_id:{token}"
        return str(self.tokenizer.decode([token], skip_special_tokens=False))


@dataclass
class Choice:
    """One choice being answered: its request, what it echoes, and what it has streamed so far."""

    index: int
    request: RequestState
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
            self.stop_reason = None if self.echo_only else event.stop_reason
            self.error = event.error
        self.text.append(text)
        self.tokens += tokens
        self.logprobs += logprobs
        return text, tokens, logprobs

    @property
    def generated(self) -> int:
        """Tokens generated for this choice (none for an echo alone)."""
        return 0 if self.echo_only else self.request.completion_tokens


def completion_logprobs(tokens: list[int], logprobs: list[Logprob | None], top: int, offset: int, name: TokenNames) -> dict[str, Any]:
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


def chat_logprobs(tokens: list[int], logprobs: list[Logprob | None], top: int, name: TokenNames) -> dict[str, Any]:
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


def prompt_logprobs(request: RequestState, name: TokenNames) -> list[dict[str, Any] | None]:
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




def cancel(choices: list[Choice]) -> None:
    """Cancel every choice's request (a no-op for those that ended)."""
    for choice in choices:
        choice.request.cancel()


async def events(choices: list[Choice]) -> AsyncIterator[tuple[Choice, TokenEvent]]:
    """Every choice's events as they come, interleaved; the requests are cancelled if the consumer goes away."""
    queue: asyncio.Queue[tuple[Choice, TokenEvent] | None] = asyncio.Queue()

    async def pump(choice: Choice) -> None:
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
        cancel(choices)  # a no-op for the requests that ended; frees the slots if the client left
        for task in tasks:
            task.cancel()


async def answer(choices: list[Choice], request: Request, whole: Callable[[], Response]) -> Response:
    """Wait for every choice, then answer at once; a client that disconnects first cancels them."""
    async def collect() -> None:
        async for choice, event in events(choices):
            choice.add(event)

    task = asyncio.ensure_future(collect())
    while not task.done():
        await asyncio.wait({task}, timeout=0.1)
        if not task.done() and await request.is_disconnected():
            cancel(choices)
    task.result()
    failed = next((c for c in choices if c.finish_reason == "error"), None)
    if failed is not None:
        return error_response(500, failed.error or "generation failed", kind="server_error")
    return whole()


def usage(choices: list[Choice], first: list[Choice], details: bool) -> dict[str, Any]:
    """OpenAI's ``usage``: each prompt counted once (``first``: one choice per prompt), every choice's tokens.

    ``prompt_tokens_details`` (the prompt tokens the prefix cache served) is sent when
    ``details`` (``--enable-prompt-tokens-details``), else null, as vLLM sends it.
    """
    prompt = sum(c.request.prompt_tokens for c in first)
    completion = sum(c.generated for c in choices)
    cached = {"cached_tokens": sum(c.request.cached_tokens for c in first)} if details else None
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion, "prompt_tokens_details": cached}


def sse(body: dict[str, Any]) -> str:
    """One server-sent event carrying ``body``."""
    return f"data: {json.dumps(body)}\n\n"


class _Render:
    """A response's choices as one body or as SSE chunks; the subclasses give the shapes."""

    chunk_object = ""
    id_prefix = ""

    def __init__(
        self, model: str, choices: list[Choice], first: list[Choice], name: TokenNames, body: SamplingFields, details: bool
    ) -> None:
        self.model, self.choices, self.first, self.name = model, choices, first, name
        self.body = body
        self.details = details  # usage.prompt_tokens_details sent (--enable-prompt-tokens-details)
        self.id = f"{self.id_prefix}-{uuid.uuid4().hex}"
        self.created = int(time.time())
        self._echo_cut: set[int] = set()  # choices whose first streamed chunk (echo and all) has gone

    def whole(self) -> Response:
        """The whole response, once every choice has ended."""
        raise NotImplementedError

    def _piece(self, choice: Choice, text: str, tokens: list[int], logprobs: list[Logprob | None], done: bool) -> dict[str, Any] | None:
        """One choice's part of a chunk (None: no chunk for this event)."""
        raise NotImplementedError

    def _opening(self) -> list[str]:
        """Chunks sent before any token."""
        return []

    def _body(self, kind: str, choices: list[dict[str, Any]], counts: dict[str, Any] | None = None, extra: dict[str, Any] | None = None) -> dict[str, Any]:
        return {"id": self.id, "object": kind, "created": self.created, "model": self.model, "choices": choices, "usage": counts, **(extra or {})}

    def _chunk(self, choices: list[dict[str, Any]], counts: dict[str, Any] | None = None, extra: dict[str, Any] | None = None) -> str:
        return sse(self._body(self.chunk_object, choices, counts, extra))

    def _token_ids(self, ids: list[int]) -> list[int] | None:
        """``token_ids`` as vLLM sends them: the ids when ``return_token_ids`` asks, else null."""
        return list(ids) if self.body.return_token_ids else None

    def _new_ids(self, choice: Choice, tokens: list[int]) -> list[int]:
        """The generated ids among a chunk's ``tokens`` (the first chunk of an echo starts with the prompt's)."""
        if choice.index not in self._echo_cut:
            self._echo_cut.add(choice.index)
            return tokens[len(choice.echo_ids) :]
        return tokens

    def _usage_so_far(self) -> dict[str, Any]:
        """The usage as of the chunks sent (``continuous_usage_stats``): the tokens streamed, not the engine's count, which runs ahead."""
        prompt = sum(c.request.prompt_tokens for c in self.first)
        completion = sum(0 if c.echo_only else len(c.tokens) - (len(c.echo_ids) if c.echoed else 0) for c in self.choices)
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}

    async def stream(self) -> AsyncIterator[str]:
        """SSE chunks as tokens come, every choice interleaved; then the usage (when asked) and ``[DONE]``."""
        for chunk in self._opening():
            yield chunk
        async for choice, event in events(self.choices):
            if event.finish_reason == "cancelled":
                return
            if event.finish_reason == "error":  # vLLM's way: the error as a chunk, then [DONE]
                yield sse({"error": {**_STREAM_ERROR, "message": event.error or "generation failed"}})
                break
            text, tokens, logprobs = choice.add(event)
            done = event.finish_reason is not None
            if choice.echo_only and not done:
                continue
            piece = self._piece(choice, text, tokens, logprobs, done)
            if piece is None:  # nothing to send yet (a parser holds back what may be a tag)
                continue
            counts = self._usage_so_far() if self.body.continuous_usage() else None
            yield self._chunk([piece], counts)
        else:
            if self.body.include_usage():  # vLLM leaves an unsent prompt_tokens_details out of a chunk
                counts = {k: v for k, v in usage(self.choices, self.first, self.details).items() if v is not None}
                yield self._chunk([], counts)
        yield "data: [DONE]\n\n"


class CompletionRender(_Render):
    """``text_completion`` bodies: whole, or streamed chunk by chunk."""

    chunk_object = "text_completion"
    id_prefix = "cmpl"

    def __init__(
        self, model: str, choices: list[Choice], first: list[Choice], name: TokenNames, body: CompletionRequest, details: bool
    ) -> None:
        super().__init__(model, choices, first, name, body, details)
        self.request = body
        self.offsets = [0] * len(choices)

    def _logprobs(self, tokens: list[int], logprobs: list[Logprob | None], offset: int) -> dict[str, Any] | None:
        if self.request.logprobs is None:
            return None
        top = self.request.logprobs  # each position's alternatives are cut where they are made; ids: every one (vLLM's)
        return completion_logprobs(tokens, logprobs, top if top >= 0 and not self.request.logprob_token_ids else sys.maxsize, offset, self.name)

    def _choice(
        self, choice: Choice, text: str, logprobs: dict[str, Any] | None, done: bool, token_ids: list[int], first: bool
    ) -> dict[str, Any]:
        """One choice with every key vLLM sends: the unasked ones null, as its response models serialize them."""
        asked = self.request.prompt_logprobs is not None and done
        return {
            "index": choice.index,
            "text": text,
            "logprobs": logprobs,
            "finish_reason": choice.finish_reason if done else None,
            "stop_reason": choice.stop_reason if done else None,
            "token_ids": self._token_ids(token_ids),
            "prompt_logprobs": prompt_logprobs(choice.request, self.name) if asked else None,
            "prompt_token_ids": self._token_ids(choice.request.prompt) if first else None,
        }

    def whole(self) -> Response:
        """The ``text_completion`` body."""
        choices = [
            self._choice(c, "".join(c.text), self._logprobs(c.tokens, c.logprobs, 0), True, [] if c.echo_only else c.request.output, True)
            for c in self.choices
        ]
        return JSONResponse(self._body("text_completion", choices, usage(self.choices, self.first, self.details)))

    def _piece(self, choice: Choice, text: str, tokens: list[int], logprobs: list[Logprob | None], done: bool) -> dict[str, Any]:
        shown = self._logprobs(tokens, logprobs, self.offsets[choice.index])
        if shown is not None and shown["tokens"]:  # offsets advance by the tokens' strings, as in a whole response
            self.offsets[choice.index] = shown["text_offset"][-1] + len(shown["tokens"][-1])
        first = choice.index not in self._echo_cut
        return self._choice(choice, text, shown, done, self._new_ids(choice, tokens), first)


class ChatRender(_Render):
    """``chat.completion`` bodies, and ``chat.completion.chunk`` deltas when streamed."""

    chunk_object = "chat.completion.chunk"
    id_prefix = "chatcmpl"

    def __init__(
        self,
        model: str,
        choices: list[Choice],
        name: TokenNames,
        body: ChatCompletionRequest,
        details: bool,
        echo: str,
        use: ToolUse,
    ) -> None:
        super().__init__(model, choices, choices[:1], name, body, details)
        self.request = body
        self.echo = echo  # the text echo puts before each reply (no tokens or logprobs of its own, as vLLM's)
        self.use = use
        # each choice's reasoning and tool-call parser (None: its text is all content)
        self.parsers = {c.index: use.output_parser() for c in choices}
        self.called: set[int] = set()  # choices that streamed a tool call

    def _message(self, choice: Choice) -> dict[str, Any]:
        """A whole choice's message: its content, and the ``reasoning`` and ``tool_calls`` its parser finds (vLLM's fields)."""
        text = "".join(choice.text)
        parser = self.parsers[choice.index]
        if parser is None:
            return {"role": "assistant", "content": self.echo + text, "reasoning": None, "tool_calls": []}
        parsed = parser.extract(text)
        content = self.use.content(parsed.content, bool(parsed.tool_calls))
        return {
            "role": "assistant",
            "content": self.echo + (content or "") if self.echo else content,
            "reasoning": parsed.reasoning if self.request.include_reasoning else None,
            "tool_calls": [call.to_openai() for call in parsed.tool_calls],
        }


    def _logprobs(self, tokens: list[int], logprobs: list[Logprob | None]) -> dict[str, Any] | None:
        if not self.request.logprobs:
            return None
        ids = self.request.logprob_token_ids
        top = len(ids) + 1 if ids else self.request.top_logprobs or 0  # the chosen token and every id asked for (vLLM's)
        return chat_logprobs(tokens, logprobs, top if top >= 0 else sys.maxsize, self.name)

    def whole(self) -> Response:
        """The ``chat.completion`` body."""
        choices = []
        for c in self.choices:
            message = self._message(c)
            choices.append({
                "index": c.index,
                "message": message,
                "logprobs": self._logprobs(c.tokens, c.logprobs),
                "finish_reason": self.use.finish_reason(c.finish_reason, bool(message["tool_calls"])),
                "stop_reason": c.stop_reason,
                "token_ids": self._token_ids(c.request.output),
            })
        # vLLM's top-level prompt fields: null unless asked
        first = self.choices[0].request
        asked = self.request.prompt_logprobs is not None
        prompt = {"prompt_logprobs": prompt_logprobs(first, self.name) if asked else None, "prompt_token_ids": self._token_ids(first.prompt)}
        return JSONResponse(self._body("chat.completion", choices, usage(self.choices, self.first, self.details), prompt))

    def _opening(self) -> list[str]:
        # the role first, as OpenAI and vLLM send it; with return_token_ids the prompt's ids come with the first
        ids = self._token_ids(self.choices[0].request.prompt)
        counts = self._usage_so_far() if self.body.continuous_usage() else None
        chunks = [
            self._chunk(
                [{"index": c.index, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}],
                counts,
                extra={"prompt_token_ids": ids} if ids is not None and i == 0 else None,
            )
            for i, c in enumerate(self.choices)
        ]
        if self.echo:  # then the echoed text, a chunk per choice
            chunks += [
                self._chunk([{"index": c.index, "delta": {"content": self.echo}, "logprobs": None, "finish_reason": None}], counts)
                for c in self.choices
            ]
        return chunks

    def _piece(self, choice: Choice, text: str, tokens: list[int], logprobs: list[Logprob | None], done: bool) -> dict[str, Any] | None:
        delta = self._delta(choice, text, done)
        shown = self._logprobs(tokens, logprobs)
        if delta is None and shown is None and not done and not self.body.return_token_ids:
            return None  # nothing the client asked for comes with this token
        piece = {
            "index": choice.index,
            "delta": delta or {},
            "logprobs": shown,
            "finish_reason": self.use.finish_reason(choice.finish_reason, choice.index in self.called) if done else None,
            "stop_reason": choice.stop_reason if done else None,
        }
        if self.body.return_token_ids:
            piece["token_ids"] = list(tokens)
        return piece

    def _delta(self, choice: Choice, text: str, done: bool) -> dict[str, Any] | None:
        """A chunk's ``delta``: the text as content, or what the choice's parser lets out of it (None: nothing yet)."""
        parser = self.parsers[choice.index]
        if parser is None:
            return {"content": text} if text or not done else None
        step = parser.stream(text)
        reasoning, content, calls = step.reasoning, step.content, step.tool_calls
        if done:
            end = parser.finish()
            reasoning, content, calls = reasoning + end.reasoning, content + end.content, calls + end.tool_calls
        delta: dict[str, Any] = {}
        if reasoning and self.request.include_reasoning:
            delta["reasoning"] = reasoning
        if content:
            delta["content"] = content
        if calls:
            self.called.add(choice.index)
            delta["tool_calls"] = [call.to_openai() for call in calls]
        return delta or None
