"""The output processor: logits to tokens, log-probabilities, stops, text and stream events.

For each request with a row of logits it applies the request's logits processors and
samples (:mod:`kvexport.serving.processors`), records the log-probabilities it asked
for (of the model's own distribution), feeds the token to the request's text stream,
ends the request at EOS, a stop token, a stop string or ``max_tokens``, and pushes the
:class:`~kvexport.serving.request.TokenEvent` s. A request's tokens depend only on its
own logits, settings and random stream, never on the rows beside it.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

import numpy as np
from tokenizers import Tokenizer

from kvexport.runtime.text import TextStream
from kvexport.serving.processors import choose, controlled_scores, log_softmax, logprob_of
from kvexport.serving.request import Logprob, Request, TokenEvent


class OutputProcessor:
    """Turns each request's logits into its next token and events.

    Args:
        tokenizer: the export's tokenizer (None: token ids only, no text).
        eos_token_id: the export's EOS.
        on_token: told of each token (``first`` or not) as it is made.
        on_end: told when a request ends, with the finish reason.

    """

    def __init__(
        self,
        tokenizer: Tokenizer | None,
        eos_token_id: int | None,
        *,
        on_token: Callable[[Request, bool], None],
        on_end: Callable[[Request, str], None],
    ) -> None:
        self.tokenizer = tokenizer
        self.eos_token_id = eos_token_id
        self.on_token = on_token
        self.on_end = on_end

    def begin(self, request: Request) -> None:
        """Ready a newly admitted request: its text stream, and the tokens that end it (EOS unless ignored)."""
        params = request.params
        request.text = TextStream(self.tokenizer, params.stop, include_stop=params.include_stop_str_in_output)
        if self.eos_token_id is not None and not params.ignore_eos:
            request.stop_ids = (*params.stop_token_ids, self.eos_token_id)

    def prompt_logprobs(self, request: Request, logits: np.ndarray, start: int) -> None:
        """Record the prompt log-probabilities that ``logits`` [n, V] (positions ``start..``) give.

        The logits at position p are the model's distribution of prompt token p + 1; the
        first prompt token has none.
        """
        top = request.params.prompt_logprobs
        if top is None:
            return
        if start == 0:  # in place: the siblings of n > 1 share this list
            request.prompt_logprobs.append(None)
        prompt = request.prompt
        wanted = min(len(logits), len(prompt) - 1 - start)
        if wanted <= 0:
            return
        rows = log_softmax(logits[:wanted])
        for offset, row in enumerate(rows):
            request.prompt_logprobs.append(logprob_of(row, prompt[start + offset + 1], top))

    def choose_all(self, requests: Sequence[Request], logits: np.ndarray, rows: Sequence[int]) -> list[tuple[int, Logprob | None]]:
        """Each request's next token from its row ``rows[i]`` of ``logits`` [*, V], with its log-probability."""
        choices: list[tuple[int, Logprob | None]] = [(0, None)] * len(requests)
        plain = {i for i, r in enumerate(requests) if not r.sampling.do_sample and not _needs_row(r)}
        if plain:  # greedy rows with nothing else to do: one argmax over them all
            order = sorted(plain)
            tokens = logits[[rows[i] for i in order]].argmax(-1)
            for i, token in zip(order, tokens, strict=True):
                choices[i] = (int(token), None)
        for i, request in enumerate(requests):
            if i not in plain:
                choices[i] = self.choose_one(request, logits[rows[i]])
        return choices

    def choose_one(self, request: Request, row: np.ndarray) -> tuple[int, Logprob | None]:
        """One request's next token from its logits ``row`` [V], with its log-probability when asked."""
        params = request.params
        raw = row.astype(np.float32)
        scores = controlled_scores(raw, params, request.prompt, request.output, request.stop_ids) if params.controls_logits else raw
        token = choose(scores, params, request.sampling, request.rng)
        logprob = None
        if params.logprobs is not None:
            logprob = logprob_of(log_softmax(raw[None])[0], token, params.logprobs)
        return token, logprob

    def emit(self, request: Request, token: int, logprob: Logprob | None = None, *, first: bool = False) -> bool:
        """Stream a chosen token, or end the request at it; True when the request ended."""
        self.on_token(request, first)
        request.last_time = time.perf_counter()
        request.output.append(token)
        params = request.params
        generated = len(request.output)
        assert request.text is not None
        if generated >= params.min_tokens and token in request.stop_ids:
            reason = None if token == self.eos_token_id and not params.ignore_eos else token  # EOS first, as vLLM
            text = request.text.add(token)[0] if params.include_stop_str_in_output else ""
            self._end(request, TokenEvent(token, text + request.text.flush(), "stop", logprob=logprob, stop_reason=reason))
            return True
        text, stopped = request.text.add(token, check_stop=generated > params.min_tokens)
        if stopped:
            self._end(request, TokenEvent(token, text, "stop", logprob=logprob, stop_reason=request.text.matched))
            return True
        if generated >= params.max_tokens:
            self._end(request, TokenEvent(token, text + request.text.flush(), "length", logprob=logprob))
            return True
        request.push(TokenEvent(token, text, logprob=logprob))
        request.next_token = token
        return False

    def end(self, request: Request, reason: str, error: str | None = None) -> None:
        """End ``request`` with no token (``cancelled`` or ``error``)."""
        self._end(request, TokenEvent(None, "", reason, error))

    def _end(self, request: Request, event: TokenEvent) -> None:
        try:
            self.on_end(request, event.finish_reason or "")
        finally:  # the caller gets its last event even if a listener fails
            request.push(event)


def _needs_row(request: Request) -> bool:
    """Whether a request's token needs its own pass over its row (controls or log-probabilities)."""
    return request.params.controls_logits or request.params.logprobs is not None
