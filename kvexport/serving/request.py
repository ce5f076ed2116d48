"""What a request is: its settings (:class:`SamplingParams`), the engine's state of it (:class:`Request`) and its events.

:meth:`Engine.submit <kvexport.serving.engine.Engine.submit>` makes two objects per
request, as vLLM v1 does: a :class:`Request` that the scheduler owns (waiting for a
slot, prefilling its prompt, running one token per decode step, finished), and a
:class:`~kvexport.serving.output.RequestState` that the output processor owns and the
caller iterates (``for`` or ``async for``) for :class:`TokenEvent` s, or cancels.

Plain Python: importing it loads neither ONNX Runtime nor the tokenizer.
"""

from __future__ import annotations

import dataclasses
import enum
import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from kvexport.drafting import DraftBudget
from kvexport.errors import KvexportError
from kvexport.serving.errors import ParameterError

if TYPE_CHECKING:
    from kvexport.runtime.sampling import SamplingConfig
    from kvexport.serving.structured import Constraint

MAX_LOGPROBS = 20  # vLLM's default max_logprobs
MAX_LOGPROB_TOKEN_IDS = 128  # vLLM's bound on logprob_token_ids
DEFAULT_MAX_TOKENS = 16  # vLLM's default max_tokens of a completion (also for max_tokens null)


@dataclass(frozen=True)
class SamplingParams:
    """One request's settings, with vLLM's meanings (its ``SamplingParams``).

    ``temperature`` 0 is greedy; ``top_k`` 0 and ``top_p`` 1 disable those filters;
    ``min_p`` drops tokens less likely than that fraction of the likeliest. ``stop`` ends the
    text before the first stop string it would contain (``include_stop_str_in_output`` keeps
    it), ``stop_token_ids`` end it at any of those tokens, and EOS ends it unless
    ``ignore_eos``; none of them can end it before ``min_tokens`` tokens.

    Penalties, as vLLM and OpenAI define them: ``presence_penalty`` is subtracted once from
    every token already generated, ``frequency_penalty`` once per time it was generated
    (both -2..2); ``repetition_penalty`` (> 0, 1 is off) divides the positive logits and
    multiplies the negative ones of every token in the prompt or the output (Hugging
    Face's ``RepetitionPenaltyLogitsProcessor``). ``logit_bias`` adds its value (-100..100)
    to a token's logit; -100 bans the token. ``allowed_token_ids`` keeps only those tokens.

    ``logprobs`` asks for each generated token's log-probability and that many of the most
    likely alternatives (0..20 by default, the server's ``max_logprobs``; -1: every token);
    ``prompt_logprobs`` the same for each prompt token after the
    first (it needs an ``--all-logits`` export). Log-probabilities are of the model's own
    distribution, before any of the controls above, as vLLM reports them by default.
    ``logprob_token_ids`` (vLLM's, at most 128 ids) puts those tokens' log-probabilities in
    place of the most likely alternatives (it needs ``logprobs`` set).
    """

    max_tokens: int = DEFAULT_MAX_TOKENS
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    min_tokens: int = 0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] = field(default_factory=dict)
    allowed_token_ids: tuple[int, ...] | None = None
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    logprob_token_ids: tuple[int, ...] | None = None
    # structured output: the grammar the tokens must follow (kvexport.serving.structured)
    structured: Constraint | None = None

    def sampling(self) -> SamplingConfig:
        """The runtime's sampling settings (greedy for temperature 0)."""
        # here, not at the top: the runtime package loads ONNX Runtime, and the scheduler imports this module
        from kvexport.runtime.sampling import SamplingConfig

        if self.temperature == 0:
            return SamplingConfig(do_sample=False)
        return SamplingConfig(True, self.temperature, self.top_k, self.top_p, self.seed)

    @property
    def controls_logits(self) -> bool:
        """Whether any control beyond temperature, top-k and top-p changes the logits."""
        return bool(
            self.min_p
            or self.min_tokens
            or self.presence_penalty
            or self.frequency_penalty
            or self.repetition_penalty != 1.0
            or self.logit_bias
            or self.allowed_token_ids is not None
            or self.structured is not None
        )

    def validate(self, vocab_size: int | None = None, max_logprobs: int = MAX_LOGPROBS) -> None:
        """One line for an out-of-range setting (token ids too, given ``vocab_size``), naming it (:class:`ParameterError`).

        ``max_logprobs`` is the server's bound on ``logprobs`` and ``prompt_logprobs`` (-1:
        the vocabulary's size; a request's -1 asks for the whole vocabulary).
        """
        if isinstance(self.max_tokens, bool) or not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise ParameterError(f"max_tokens {self.max_tokens!r}: must be a positive integer", parameter="max_tokens")
        if self.temperature < 0:
            raise ParameterError(f"temperature {self.temperature}: must be >= 0 (0 is greedy)", parameter="temperature")
        sampling = dataclasses.replace(self.sampling(), do_sample=True, temperature=self.temperature or 1.0)
        for name in ("top_k", "top_p"):  # the runtime's own checks, one field at a time so the error names it
            try:
                dataclasses.replace(sampling, **{"top_k": 0, "top_p": 1.0, name: getattr(sampling, name)}).validate()
            except KvexportError as exc:
                raise ParameterError(str(exc), parameter=name) from None
        if not 0 <= self.min_p <= 1:
            raise ParameterError(f"min_p {self.min_p}: must be in [0, 1] (0 disables it)", parameter="min_p")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2 <= getattr(self, name) <= 2:
                raise ParameterError(f"{name} {getattr(self, name)}: must be in [-2, 2]", parameter=name)
        if self.repetition_penalty <= 0:
            raise ParameterError(
                f"repetition_penalty {self.repetition_penalty}: must be > 0 (1 disables it)", parameter="repetition_penalty"
            )
        if not 0 <= self.min_tokens <= self.max_tokens:
            raise ParameterError(
                f"min_tokens {self.min_tokens}: must be in [0, max_tokens] (max_tokens is {self.max_tokens})", parameter="min_tokens"
            )
        most = max_logprobs if max_logprobs >= 0 else vocab_size
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is None:
                continue
            if value < -1:
                raise ParameterError(f"{name} {value}: must be -1 (every token) or at least 0", parameter=name)
            asked = vocab_size if value == -1 else value
            if asked is not None and most is not None and asked > most:
                raise ParameterError(
                    f"{name} {value}: this server returns at most {most} (start it with --max-logprobs N, or -1 for the "
                    "whole vocabulary, which a request asks for with -1)",
                    parameter=name,
                )
        if self.logprob_token_ids is not None:
            if self.logprobs is None:
                raise ParameterError(
                    "logprob_token_ids: needs logprobs set (a number on completions, true on chat)", parameter="logprob_token_ids"
                )
            if not 0 < len(self.logprob_token_ids) <= MAX_LOGPROB_TOKEN_IDS:
                raise ParameterError(
                    f"logprob_token_ids: {len(self.logprob_token_ids)} ids; give 1 to {MAX_LOGPROB_TOKEN_IDS}", parameter="logprob_token_ids"
                )
        for token, bias in self.logit_bias.items():
            if not -100 <= bias <= 100:
                raise ParameterError(f"logit_bias: the bias {bias} of token {token} must be in [-100, 100]", parameter="logit_bias")
        if any(not s for s in self.stop):
            raise ParameterError("stop: an empty stop string would stop at once; leave it out", parameter="stop")
        if self.allowed_token_ids is not None and not self.allowed_token_ids:
            raise ParameterError("allowed_token_ids: an empty list allows no token; leave it out", parameter="allowed_token_ids")
        banned = {token for token, bias in self.logit_bias.items() if bias <= -100}
        if self.allowed_token_ids is not None and set(self.allowed_token_ids) <= banned:
            raise ParameterError(
                "logit_bias: it bans every token allowed_token_ids allows; nothing could be generated", parameter="logit_bias"
            )
        if vocab_size is not None:
            for name, tokens in (
                ("logit_bias", list(self.logit_bias)),
                ("stop_token_ids", list(self.stop_token_ids)),
                ("allowed_token_ids", list(self.allowed_token_ids or ())),
                ("logprob_token_ids", list(self.logprob_token_ids or ())),
            ):
                outside = [t for t in tokens if not 0 <= t < vocab_size]
                if outside:
                    from kvexport.runtime.opened import out_of_vocabulary

                    raise ParameterError(f"{name}: {out_of_vocabulary(outside, vocab_size)}", parameter=name)


@dataclass(frozen=True)
class Logprob:
    """One position's log-probabilities: the chosen (or given) token's, and the most likely tokens'."""

    token_id: int
    logprob: float
    rank: int = 1  # 1 + how many tokens are likelier
    top: tuple[tuple[int, float], ...] = ()  # (token id, log-probability), most likely first


@dataclass(frozen=True)
class TokenEvent:
    """What a request's stream yields: a token (or the end) and the text it adds.

    ``text`` may be empty while a multi-byte character or a possible stop string is not
    complete yet; it is released later. The last event has a ``finish_reason``: ``stop``
    (EOS, a stop string or a stop token; ``stop_reason`` says which string or token id,
    None for EOS), ``length`` (``max_tokens``), ``cancelled`` or ``error``. ``logprob`` is
    the token's, when the request asked for ``logprobs``.
    """

    token_id: int | None
    text: str
    finish_reason: str | None = None
    error: str | None = None
    logprob: Logprob | None = None
    stop_reason: int | str | None = None


class Status(enum.Enum):
    """Where a request is in its life."""

    WAITING = "waiting"
    PREFILLING = "prefilling"
    RUNNING = "running"
    FINISHED = "finished"


class Request:
    """The engine's state of one request, owned by the :class:`~kvexport.serving.scheduler.Scheduler`.

    Where the request is (waiting, prefilling, running, finished), its slot, how much of
    it the cache holds and the token the next decode step feeds. Only the scheduler changes
    it, from the plans it makes and the outputs the engine hands it. The client's side (its
    stream of events, text, log-probabilities) is a
    :class:`~kvexport.serving.output.RequestState`; the two share only the id, the prompt,
    the settings and the cancel flag.
    """

    def __init__(
        self,
        request_id: str,
        prompt: list[int],
        params: SamplingParams,
        *,
        after: Request | None = None,
        cancelled: threading.Event | None = None,
    ) -> None:
        self.id = request_id
        self.prompt = prompt
        self.params = params
        self.submitted = time.perf_counter()
        self.after = after  # admitted once this one's prompt is cached (n > 1: one prefill)
        self.status = Status.WAITING
        self.slot = -1
        self.prefilled = 0  # prompt tokens in the cache so far
        self.length = 0  # tokens in the cache
        self.next_token = 0  # the token the next decode step feeds
        self.output: list[int] = []
        self.cached_tokens = 0  # prompt tokens whose rows came from the prefix cache
        self.resume: list[int] | None = None  # preempted after its first token: what the cache must hold again
        self.draft_budget: DraftBudget | None = None
        self._cancelled = cancelled if cancelled is not None else threading.Event()

    @property
    def cancelled(self) -> bool:
        """Whether the caller cancelled it."""
        return self._cancelled.is_set()

    @property
    def context(self) -> list[int]:
        """What its prefill runs: the prompt, or after a preemption the prompt and the tokens generated before the pending one."""
        return self.resume if self.resume is not None else self.prompt

    @property
    def wants_whole_prompt(self) -> bool:
        """Whether every prompt position must run (prompt log-probabilities): no cached prefix."""
        return self.params.prompt_logprobs is not None

    @property
    def greedy(self) -> bool:
        """Whether its tokens are the argmax (temperature 0)."""
        return self.params.temperature == 0

    def cancel(self) -> None:
        """Ask the engine to end it within one step (the caller's :meth:`RequestState.cancel` sets the same flag)."""
        self._cancelled.set()
