"""The output processor: logits to tokens, log-probabilities, stops, text and stream events.

For each request with a row of logits it applies the request's logits processors and
samples (:mod:`kvexport.runtime.sampling`, the one sampler), records the log-probabilities it asked
for (of the model's own distribution), feeds the token to the request's text stream and
decides whether the request ends (EOS, a stop token, a stop string or ``max_tokens``).
A request's tokens depend only on its own logits, settings and random stream, never on
the rows beside it.

It owns each request's client side, a :class:`RequestState` (vLLM's ``RequestState``):
the caller's stream of :class:`~kvexport.serving.request.TokenEvent` s, the text, the
random stream and the log-probabilities. It never calls back into the engine: each call
returns an :class:`OutputBatch` (the tokens each request took, the requests that ended
and why, the latencies), which the engine hands to the scheduler before
:meth:`OutputProcessor.publish` gives the callers their events.
"""

from __future__ import annotations

import asyncio
import collections
import threading
import time
from collections.abc import AsyncIterator, Iterable, Iterator, Sequence
from dataclasses import dataclass, field

import numpy as np
from tokenizers import Tokenizer

from kvexport.runtime.sampling import SamplingConfig, choose, controlled_scores, log_softmax
from kvexport.runtime.text import TextStream
from kvexport.serving.errors import ParameterError
from kvexport.serving.request import Logprob, SamplingParams, TokenEvent
from kvexport.serving.structured import Constraint, Grammars, Matcher


class RequestState:
    """One request's client side: iterate it (``for`` or ``async for``) for its :class:`TokenEvent` s.

    Thread-safe for its caller. :meth:`cancel` ends it within one engine step and frees its
    slot. ``prompt_logprobs`` (when asked for) is filled before the first event; the first
    prompt token has none. The output processor fills it; the engine thread alone writes.
    """

    def __init__(
        self,
        request_id: str,
        prompt: list[int],
        params: SamplingParams,
        *,
        cancelled: threading.Event | None = None,
        prompt_logprobs: list[Logprob | None] | None = None,
    ) -> None:
        self.id = request_id
        self.prompt = prompt
        self.params = params
        self.submitted = time.perf_counter()
        self.sampling: SamplingConfig = params.sampling()
        # any integer seed, negative ones too (vLLM takes any int64); numpy's wants it unsigned
        self.rng = np.random.default_rng(None if params.seed is None else params.seed % 2**64)
        self.output: list[int] = []
        self.text: TextStream | None = None
        self.stop_ids: tuple[int, ...] = params.stop_token_ids  # and EOS unless ignored
        self.last_time = 0.0
        # the siblings of n > 1 share the first's list: the same prompt, filled once
        self.prompt_logprobs: list[Logprob | None] = [] if prompt_logprobs is None else prompt_logprobs
        self.cached_tokens = 0  # prompt tokens whose rows came from the prefix cache
        self.matcher: Matcher | None = None  # structured output: where the request is in its grammar
        self.gate: str | None = None  # the text the output must hold before the grammar applies (None: it applies)
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None
        self._events: collections.deque[TokenEvent] = collections.deque()
        self._lock = threading.Lock()
        self._ready = threading.Condition(self._lock)
        self._waker: tuple[asyncio.AbstractEventLoop, asyncio.Event] | None = None
        self._cancelled = cancelled if cancelled is not None else threading.Event()

    @property
    def prompt_tokens(self) -> int:
        """Tokens in the prompt."""
        return len(self.prompt)

    @property
    def completion_tokens(self) -> int:
        """Tokens generated so far."""
        return len(self.output)

    @property
    def cancelled(self) -> bool:
        """Whether :meth:`cancel` was called."""
        return self._cancelled.is_set()

    def cancel(self) -> None:
        """Stop generating; the stream ends with ``finish_reason="cancelled"`` (if it had not ended)."""
        self._cancelled.set()

    def push(self, event: TokenEvent) -> None:
        """Hand the caller an event (the engine thread)."""
        with self._lock:
            self._events.append(event)
            if event.finish_reason is not None:
                self.finish_reason = event.finish_reason
                self.stop_reason = event.stop_reason
            self._ready.notify_all()
            waker = self._waker
        if waker is not None:
            loop, ready = waker
            try:
                loop.call_soon_threadsafe(ready.set)
            except RuntimeError:  # the consumer's loop is closed: nobody is listening
                pass

    def __iter__(self) -> Iterator[TokenEvent]:
        while True:
            with self._lock:
                while not self._events:
                    self._ready.wait()
                event = self._events.popleft()
            yield event
            if event.finish_reason is not None:
                return

    async def __aiter__(self) -> AsyncIterator[TokenEvent]:
        ready = asyncio.Event()
        with self._lock:
            self._waker = (asyncio.get_running_loop(), ready)
        while True:
            with self._lock:
                event = self._events.popleft() if self._events else None
                if event is None:
                    ready.clear()
            if event is None:
                await ready.wait()
                continue
            yield event
            if event.finish_reason is not None:
                return

    def result(self) -> tuple[list[int], str, str]:
        """Wait for the end: (token ids, text, finish reason)."""
        tokens, pieces, reason = [], [], ""
        for event in self:
            if event.token_id is not None:
                tokens.append(event.token_id)
            pieces.append(event.text)
            reason = event.finish_reason or reason
        return tokens, "".join(pieces), reason


RequestHandle = RequestState  # what Engine.submit returns, by the name earlier releases gave it


@dataclass(frozen=True)
class Finished:
    """A request that ended, and why (``stop``, ``length``, ``cancelled`` or ``error``)."""

    request_id: str
    reason: str
    prompt_tokens: int
    completion_tokens: int


@dataclass
class OutputBatch:
    """What the output processor made of some logits (or of an abort): data for the engine and the scheduler.

    ``tokens``: per request id, the tokens it took, in order (the last is the one the next
    decode step feeds, unless the request ended). ``finished``: the requests that ended.
    ``first_token_s`` / ``token_s``: time to first token and between tokens, one per token.
    ``events``: what :meth:`OutputProcessor.publish` hands the callers.
    """

    tokens: dict[str, list[int]] = field(default_factory=dict)
    finished: list[Finished] = field(default_factory=list)
    first_token_s: list[float] = field(default_factory=list)
    token_s: list[float] = field(default_factory=list)
    events: list[tuple[RequestState, TokenEvent]] = field(default_factory=list)

    def extend(self, other: OutputBatch) -> None:
        """Take ``other``'s outputs after this batch's."""
        for request_id, tokens in other.tokens.items():
            self.tokens.setdefault(request_id, []).extend(tokens)
        self.finished += other.finished
        self.first_token_s += other.first_token_s
        self.token_s += other.token_s
        self.events += other.events

    @property
    def generated(self) -> int:
        """Tokens made."""
        return len(self.first_token_s) + len(self.token_s)


class OutputProcessor:
    """Turns each request's logits into its next token and events (see the module docstring).

    Args:
        tokenizer: the export's tokenizer (None: token ids only, no text).
        eos_token_ids: the tokens that end a generation (the export's EOS tokens).

    """

    def __init__(self, tokenizer: Tokenizer | None, eos_token_ids: tuple[int, ...], vocab_size: int | None = None) -> None:
        self.tokenizer = tokenizer
        self.eos_token_ids = eos_token_ids
        self.states: dict[str, RequestState] = {}  # the requests whose stream has not ended
        # structured output's tokenizer and checked grammars (None: no tokenizer, so no structured output)
        self.grammars: Grammars | None = None
        if tokenizer is not None and vocab_size is not None:
            self.grammars = Grammars(tokenizer, vocab_size, eos_token_ids[0] if eos_token_ids else 0)

    def check_structured(self, constraint: Constraint) -> None:
        """A constraint this export cannot follow is a :class:`ParameterError` naming its field (in the caller's thread)."""
        if self.grammars is None:
            raise ParameterError(
                f"{constraint.field}: structured output needs the export's tokenizer, and this export has none",
                parameter=constraint.field.split(".")[0],
            )
        self.grammars.check(constraint)

    def prepare(self, state: RequestState) -> None:
        """Give a new request its text stream, the tokens that end it (EOS unless ignored) and its grammar's matcher.

        In the caller's thread, before :meth:`add_request` and outside the engine's lock: a
        matcher takes milliseconds to build (llguidance releases the GIL meanwhile), and the
        engine's loop must not wait for it.
        """
        params = state.params
        state.text = TextStream(self.tokenizer, params.stop, include_stop=params.include_stop_str_in_output)
        if self.eos_token_ids and not params.ignore_eos:
            state.stop_ids = (*params.stop_token_ids, *self.eos_token_ids)
        if params.structured is not None:  # checked already (check_structured): the grammar compiles
            assert self.grammars is not None
            state.matcher = self.grammars.matcher(params.structured)
            state.gate = params.structured.after

    def add_request(self, state: RequestState) -> None:
        """Take a new request, prepared already (:meth:`prepare`)."""
        self.states[state.id] = state

    def admitted(self, request_id: str, cached_tokens: int) -> None:
        """The request got a slot, with ``cached_tokens`` of its prompt already cached there."""
        self.states[request_id].cached_tokens = cached_tokens

    def sampling_of(self, request_id: str) -> tuple[SamplingConfig, np.random.Generator]:
        """A request's sampling settings and random stream (a speculative round draws from them)."""
        state = self.states[request_id]
        return state.sampling, state.rng

    def prompt_logprobs(self, request_id: str, logits: np.ndarray, start: int) -> None:
        """Record the prompt log-probabilities that ``logits`` [n, V] (positions ``start..``) give.

        The logits at position p are the model's distribution of prompt token p + 1; the
        first prompt token has none.
        """
        state = self.states[request_id]
        top = state.params.prompt_logprobs
        if top is None:
            return
        if start == 0:  # in place: the siblings of n > 1 share this list (a prompt run again, preempted, starts it again)
            state.prompt_logprobs[:] = [None]
        prompt = state.prompt
        wanted = min(len(logits), len(prompt) - 1 - start)
        if wanted <= 0:
            return
        rows = log_softmax(logits[:wanted])
        for offset, row in enumerate(rows):
            state.prompt_logprobs.append(logprob_of(row, prompt[start + offset + 1], top))

    def first_token(self, request_id: str, row: np.ndarray) -> OutputBatch:
        """The first token of a request whose prompt's last chunk gave logits ``row`` [V]."""
        state = self.states[request_id]
        token, logprob = self._choose_one(state, row)
        batch = OutputBatch()
        self._emit(batch, state, token, logprob, first=True)
        return batch

    def decoded(self, request_ids: Sequence[str], logits: np.ndarray, rows: Sequence[int]) -> OutputBatch:
        """Each request's next token from its row ``rows[i]`` of ``logits`` [*, V]."""
        states = [self.states[request_id] for request_id in request_ids]
        choices: list[tuple[int, Logprob | None]] = [(0, None)] * len(states)
        plain = {i for i, state in enumerate(states) if not state.sampling.do_sample and not _needs_row(state)}
        if plain:  # greedy rows with nothing else to do: one argmax over them all
            order = sorted(plain)
            tokens = logits[[rows[i] for i in order]].argmax(-1)
            for i, token in zip(order, tokens, strict=True):
                choices[i] = (int(token), None)
        for i, state in enumerate(states):
            if i not in plain:
                choices[i] = self._choose_one(state, logits[rows[i]])
        batch = OutputBatch()
        for state, (token, logprob) in zip(states, choices, strict=True):
            self._emit(batch, state, token, logprob)
        return batch

    def accepted(self, request_id: str, tokens: Sequence[int]) -> OutputBatch:
        """Tokens chosen elsewhere (a speculative round's kept drafts and the next), up to the one that ends the request."""
        state = self.states[request_id]
        batch = OutputBatch()
        for token in tokens:
            if self._emit(batch, state, token, None):
                break
        return batch

    def abort(self, request_ids: Iterable[str], reason: str, error: str | None = None) -> OutputBatch:
        """End these requests with no token (``cancelled`` or ``error``); ids whose stream ended already are skipped."""
        batch = OutputBatch()
        for request_id in request_ids:
            state = self.states.get(request_id)
            if state is not None:
                self._end(batch, state, TokenEvent(None, "", reason, error))
        return batch

    def publish(self, batch: OutputBatch) -> None:
        """Hand each caller its events; a stream that ended is forgotten."""
        for state, event in batch.events:
            if event.finish_reason is not None:
                self.states.pop(state.id, None)
            state.push(event)

    def _choose_one(self, state: RequestState, row: np.ndarray) -> tuple[int, Logprob | None]:
        """One request's next token from its logits ``row`` [V], with its log-probability when asked."""
        params = state.params
        raw = row.astype(np.float32)
        scores = controlled_scores(raw, params, state.prompt, state.output, state.stop_ids) if params.controls_logits else raw
        if state.matcher is None or state.gate is not None:
            token = choose(scores, params, state.sampling, state.rng)
        else:  # the grammar: choose among the tokens it allows (the others' probability is 0, as if masked to -inf)
            allowed = state.matcher.allowed()
            token = int(allowed[choose(scores[allowed], params, state.sampling, state.rng)])
        logprob = None
        if params.logprobs is not None:
            logprob = logprob_of(log_softmax(raw[None])[0], token, params.logprobs, params.logprob_token_ids)
        return token, logprob

    def _emit(self, batch: OutputBatch, state: RequestState, token: int, logprob: Logprob | None, *, first: bool = False) -> bool:
        """Record a chosen token and its event, or the end at it; True when the request ended."""
        now = time.perf_counter()
        if first:
            batch.first_token_s.append(now - state.submitted)
        else:
            batch.token_s.append(now - state.last_time)
        state.last_time = now
        state.output.append(token)
        batch.tokens.setdefault(state.id, []).append(token)
        params = state.params
        # never fails open: a token the grammar refuses (or text past the gate that breaks it) ends the request
        if state.gate is not None:
            refused = not self._open_gate(state)  # the token that completes the gate's text is outside the grammar
        else:
            refused = state.matcher is not None and not state.matcher.take(token)
        if refused:
            assert state.matcher is not None
            state.output.pop()
            self._end(batch, state, TokenEvent(None, "", "error", f"structured output: {state.matcher.error}"))
            return True
        generated = len(state.output)
        assert state.text is not None
        if generated >= params.min_tokens and token in state.stop_ids:
            reason = None if token in self.eos_token_ids and not params.ignore_eos else token  # EOS first, as vLLM
            text = state.text.add(token)[0] if params.include_stop_str_in_output else ""
            self._end(batch, state, TokenEvent(token, text + state.text.flush(), "stop", logprob=logprob, stop_reason=reason))
            return True
        text, stopped = state.text.add(token, check_stop=generated > params.min_tokens)
        if stopped:
            self._end(batch, state, TokenEvent(token, text, "stop", logprob=logprob, stop_reason=state.text.matched))
            return True
        if generated >= params.max_tokens:
            self._end(batch, state, TokenEvent(token, text + state.text.flush(), "length", logprob=logprob))
            return True
        if state.matcher is not None and state.gate is None and state.matcher.finished:  # the grammar is complete (EOS ignored, or none)
            self._end(batch, state, TokenEvent(token, text + state.text.flush(), "stop", logprob=logprob))
            return True
        batch.events.append((state, TokenEvent(token, text, logprob=logprob)))
        return False

    def _open_gate(self, state: RequestState) -> bool:
        """Open the grammar once the output holds its gate's text (``</think>``); False when what followed it breaks the grammar.

        The last few tokens' text is searched, so the gate opens however the model spelled
        the text in tokens. The token that completes it may carry text past it: leading
        whitespace is left outside the grammar (the parsers skip it), and the rest is given
        to the grammar as tokens, so the output after the gate follows the grammar whole.
        """
        gate, matcher = state.gate, state.matcher
        assert gate is not None and matcher is not None and self.tokenizer is not None
        tail = self.tokenizer.decode(state.output[-_GATE_TOKENS:], skip_special_tokens=False)
        at = tail.find(gate)  # searched at every token until found: this token completed it
        if at < 0:
            return True
        state.gate = None
        rest = tail[at + len(gate) :].lstrip()
        return not rest or all(matcher.take(t) for t in self.tokenizer.encode(rest, add_special_tokens=False).ids)

    def _end(self, batch: OutputBatch, state: RequestState, event: TokenEvent) -> None:
        assert event.finish_reason is not None
        batch.finished.append(Finished(state.id, event.finish_reason, state.prompt_tokens, state.completion_tokens))
        batch.events.append((state, event))


_GATE_TOKENS = 16  # tokens searched for a grammar's gate text: more than any tokenizer splits "</think>" into


def logprob_of(logprobs: np.ndarray, token: int, top: int, ids: tuple[int, ...] | None = None) -> Logprob:
    """The :class:`Logprob` of ``token`` in one row of log-probabilities, with the ``top`` likeliest tokens, or ``ids``' in their order."""
    if top < 0:  # -1: every token
        top = logprobs.shape[-1]
    if ids:
        alternatives = tuple((int(t), float(logprobs[t])) for t in ids)
    elif top:
        best = np.argpartition(-logprobs, top - 1)[:top]
        best = best[np.argsort(-logprobs[best], kind="stable")]
        alternatives = tuple((int(t), float(logprobs[t])) for t in best)
    else:
        alternatives = ()
    rank = int((logprobs > logprobs[token]).sum()) + 1
    return Logprob(int(token), float(logprobs[token]), rank, alternatives)


def _needs_row(state: RequestState) -> bool:
    """Whether a request's token needs its own pass over its row (controls or log-probabilities)."""
    return state.params.controls_logits or state.params.logprobs is not None
