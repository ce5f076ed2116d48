"""The request bodies of the OpenAI-compatible API, with vLLM's fields and meanings.

Every field a body may carry is one of three kinds:

- **served**: a field of the models below, honoured with vLLM's meaning;
- **refused**: a field vLLM knows that this server does not serve (``suffix``,
  ``best_of``, beam search, the older ``guided_*`` fields, tools, ...): a value other than its
  neutral default is a 400 that names it (:func:`refused_field`);
- **unknown** to vLLM too: ignored, as vLLM ignores it (it logs them; so does this server).

Types are strict (``"10"`` is not an integer) and out-of-range values are a 400 in
OpenAI's error shape.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterable
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from kvexport.serving.errors import ParameterError
from kvexport.serving.request import DEFAULT_MAX_TOKENS, SamplingParams
from kvexport.serving.structured import from_request

LOG = logging.getLogger("kvexport.serving")

# vLLM's fields that are not served here, each with the values that mean "not used"
_REFUSED: dict[str, tuple[Any, ...]] = {
    "suffix": (None,),
    "best_of": (None,),
    "use_beam_search": (None, False),
    "length_penalty": (None, 1, 1.0),
    "bad_words": (None, []),
    "guided_json": (None,),
    "guided_regex": (None,),
    "guided_choice": (None,),
    "guided_grammar": (None,),
    "guided_decoding_backend": (None,),
    "guided_whitespace_pattern": (None,),
    "logits_processors": (None, []),
    "priority": (None, 0),
    "cache_salt": (None,),
    "kv_transfer_params": (None,),
    "vllm_xargs": (None,),
    "prompt_embeds": (None,),
    "skip_special_tokens": (None, True),
    "spaces_between_special_tokens": (None, True),
    "tools": (None, []),
    "tool_choice": (None, "none"),
    "functions": (None, []),
    "function_call": (None, "none"),
    "parallel_tool_calls": (None, True, False),
    "documents": (None, []),
    "chat_template": (None,),
    "chat_template_kwargs": (None, {}),
    "reasoning_effort": (None,),
    "mm_processor_kwargs": (None, {}),
    "audio": (None,),
    "modalities": (None, ["text"]),
    "prediction": (None,),
    "repetition_detection": (None,),
    "thinking_token_budget": (None,),
    "watermarking": (None,),
    "stream_interval": (None, 1),
    "return_token_offsets": (None, False),
    "include_reasoning": (None,),
    "return_prompt_text": (None, False),
}

# the fields vLLM knows beyond those two (so they are not logged as unknown)
_KNOWN_ELSEWHERE = {"user", "metadata", "store", "service_tier", "request_id", "add_special_tokens"}


class StreamOptions(BaseModel):
    """``stream_options``: ``include_usage`` (a last chunk with the usage), ``continuous_usage_stats`` (the usage so far on every chunk)."""

    model_config = ConfigDict(extra="allow", strict=True)
    include_usage: bool = False
    continuous_usage_stats: bool = False


class SamplingFields(BaseModel):
    """The sampling controls both routes take (vLLM's ``SamplingParams`` fields)."""

    model_config = ConfigDict(extra="allow", strict=True)
    model: str | None = None
    temperature: float | None = Field(default=1.0, ge=0.0, le=2.0)
    top_p: float | None = Field(default=1.0, gt=0.0, le=1.0)
    top_k: int | None = Field(default=None, ge=-1)
    min_p: float | None = Field(default=0.0, ge=0.0, le=1.0)
    seed: int | None = Field(default=None, ge=-(2**63), le=2**63 - 1)  # vLLM's range: a 64-bit signed integer
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    min_tokens: int = Field(default=0, ge=0)
    presence_penalty: float | None = Field(default=0.0, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(default=0.0, ge=-2.0, le=2.0)
    repetition_penalty: float | None = Field(default=1.0, gt=0.0)
    logit_bias: dict[str, float] | None = None
    allowed_token_ids: list[int] | None = None
    n: int = Field(default=1, ge=1, le=128)
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    add_special_tokens: bool = True
    return_tokens_as_token_ids: bool | None = None  # None: the server's --return-tokens-as-token-ids
    truncate_prompt_tokens: int | None = Field(default=None, ge=1)
    truncation_side: Literal["left", "right"] | None = None  # vLLM's: "left" (the default) keeps the last N tokens, "right" the first N
    # vLLM's: these tokens' log-probabilities in place of the top alternatives (needs logprobs)
    logprob_token_ids: list[int] | None = None
    # vLLM's: the prompt's and each choice's token ids in the response (``prompt_token_ids``, ``token_ids``)
    return_token_ids: bool | None = None
    # structured output (kvexport.serving.structured): OpenAI's and vLLM's ways to ask for it
    response_format: dict[str, Any] | None = None
    structured_outputs: dict[str, Any] | None = None

    def sampling_params(self, max_tokens: int, *, logprobs: int | None, prompt_logprobs: int | None) -> SamplingParams:
        """The engine's settings for one choice of this request."""
        stop = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())
        return SamplingParams(
            max_tokens=max_tokens,
            temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p,
            top_k=max(0, self.top_k or 0),
            min_p=self.min_p or 0.0,
            seed=self.seed,
            stop=stop,
            stop_token_ids=tuple(self.stop_token_ids or ()),
            include_stop_str_in_output=self.include_stop_str_in_output,
            ignore_eos=self.ignore_eos,
            min_tokens=self.min_tokens,
            presence_penalty=self.presence_penalty or 0.0,
            frequency_penalty=self.frequency_penalty or 0.0,
            repetition_penalty=1.0 if self.repetition_penalty is None else self.repetition_penalty,
            logit_bias=_logit_bias(self.logit_bias),
            allowed_token_ids=None if self.allowed_token_ids is None else tuple(self.allowed_token_ids),
            logprobs=logprobs,
            prompt_logprobs=prompt_logprobs,
            logprob_token_ids=tuple(self.logprob_token_ids) if self.logprob_token_ids else None,
            structured=from_request(self.response_format, self.structured_outputs),
        )

    def truncated(self, ids: list[int]) -> list[int]:
        """The prompt ``ids`` cut to ``truncate_prompt_tokens``: its last tokens, or its first with ``truncation_side: right``."""
        keep = self.truncate_prompt_tokens
        if keep is None:
            return ids
        return ids[:keep] if self.truncation_side == "right" else ids[-keep:]

    def include_usage(self) -> bool:
        """Whether a streamed response ends with a usage chunk."""
        return self.stream_options is not None and self.stream_options.include_usage

    def continuous_usage(self) -> bool:
        """Whether every streamed chunk carries the usage so far (vLLM's ``continuous_usage_stats``, with ``include_usage``)."""
        return self.include_usage() and self.stream_options is not None and self.stream_options.continuous_usage_stats

    def refused(self) -> ParameterError | None:
        """The first field this server refuses, as a one-line error naming it, or None; unknown fields are logged."""
        extra = dict(self.model_extra or {})
        if self.stream_options is not None:
            if not self.stream:
                return ParameterError("stream_options: only for a streamed request (stream: true)", parameter="stream_options")
        refused = _first_refused(extra, _REFUSED)
        if refused is not None:
            return refused
        unknown = sorted(set(extra) - set(_REFUSED) - _KNOWN_ELSEWHERE)
        if unknown:
            LOG.warning("ignored request fields (unknown to vLLM's API too): %s", ", ".join(unknown))
        return None


class CompletionRequest(SamplingFields):
    """The body of ``POST /v1/completions``."""

    prompt: str | list[int] | list[str] | list[list[int]] | None = None  # None: refused in vLLM's words (refused())
    max_tokens: int | None = Field(default=DEFAULT_MAX_TOKENS, ge=0)
    echo: bool = False
    logprobs: int | None = Field(default=None, ge=-1)  # the bound is the server's --max-logprobs
    prompt_logprobs: int | None = Field(default=None, ge=-1)  # the bound is the server's --max-logprobs

    def refused(self) -> ParameterError | None:
        """No prompt is vLLM's 400 (it also takes ``prompt_embeds``, which are not served here), then the common refusals."""
        if self.prompt is None and not (self.model_extra or {}).get("prompt_embeds"):
            return ParameterError("Either prompt or prompt_embeds must be provided and non-empty.", parameter="prompt")
        return super().refused()

    def prompts(self) -> list[str | list[int]]:
        """The request's prompts: one, or each of a list (after :meth:`refused`, so there is one)."""
        prompt = self.prompt
        assert prompt is not None
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
            return list(prompt)
        return [prompt]  # type: ignore[list-item]


class ChatMessage(BaseModel):
    """One message of a chat: its role, its text (a string, or a list of text parts), a name, and any other key.

    As vLLM does, any role (``developer``, ``tool``, ...) and any other key
    (``tool_call_id``, ``tool_calls``, ...) go to the chat template as they came: the
    template decides what they mean, and one that cannot render them refuses in one line.
    """

    model_config = ConfigDict(extra="allow", strict=True)
    role: str = Field(min_length=1)
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None

    def for_template(self) -> dict[str, Any]:
        """What the chat template sees: role, text content, the name when given, and every other key.

        As vLLM prepares them: an assistant's ``tool_calls`` carry their arguments as objects
        (templates ``tojson`` them; the API sends JSON text), and ``reasoning`` (vLLM's field,
        sent back from an earlier reply) is also ``reasoning_content``, the name templates read.
        """
        message: dict[str, Any] = {**(self.model_extra or {}), "role": self.role, "content": self.text()}
        if self.name is not None:
            message["name"] = self.name
        if message.get("reasoning") is not None:
            message.setdefault("reasoning_content", message["reasoning"])
        calls = message.pop("tool_calls", None)
        if calls is not None and not isinstance(calls, list):
            raise ParameterError(f"messages: a {self.role} message's tool_calls must be a list of calls", parameter="messages")
        if calls:  # an empty list is left out, as vLLM leaves it
            message["tool_calls"] = [_call_for_template(call, index) for index, call in enumerate(calls)]
        return message

    def text(self) -> str:
        """The message's text; a part that is not text is refused."""
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        pieces = []
        for part in self.content:
            if part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise ParameterError(
                    f"messages: a content part of type {part.get('type')!r} is not served; send text parts", parameter="messages"
                )
            pieces.append(part["text"])
        return "".join(pieces)


def _call_for_template(call: Any, index: int) -> Any:
    """An assistant message's tool call with its ``function.arguments`` JSON text read as an object (one line if it is not JSON)."""
    if not isinstance(call, dict) or not isinstance(call.get("function"), dict) or not isinstance(call["function"].get("name"), str):
        raise ParameterError(f"messages: tool_calls[{index}] must be an object with a function that has a name", parameter="messages")
    arguments = call["function"].get("arguments")
    if arguments is None or arguments == "":  # no arguments: an empty object, as vLLM reads them
        return {**call, "function": {**call["function"], "arguments": {}}}
    if not isinstance(arguments, str):
        return call
    try:
        parsed = json.loads(arguments)
    except json.JSONDecodeError as exc:
        raise ParameterError(f"messages: tool_calls[{index}].function.arguments is not valid JSON ({exc.msg})", parameter="messages") from None
    return {**call, "function": {**call["function"], "arguments": parsed}}


class ChatCompletionRequest(SamplingFields):
    """The body of ``POST /v1/chat/completions``."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(default=None, ge=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=-1)  # the bound is the server's --max-logprobs
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    # vLLM's: the reply starts with the last message's text when that message has the reply's role
    echo: bool = False
    prompt_logprobs: int | None = Field(default=None, ge=-1)  # the bound is the server's --max-logprobs
    # tools and thinking (kvexport.serving.tool_use): checked there, with vLLM's meanings and messages
    tools: Any = None
    tool_choice: Any = None
    parallel_tool_calls: bool | None = True
    chat_template_kwargs: dict[str, Any] | None = None
    include_reasoning: bool = True  # vLLM's: false leaves the reasoning out of the reply (it is still generated)

    def wanted_tokens(self) -> int | None:
        """``max_completion_tokens``, else ``max_tokens`` (None: the rest of the context)."""
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


class TokenizeRequest(BaseModel):
    """``POST /tokenize``: a ``prompt``, or chat ``messages`` rendered by the chat template."""

    model_config = ConfigDict(extra="allow", strict=True)
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    return_token_strs: bool = False
    # rendered as the chat route renders them (kvexport.serving.tool_use)
    tools: Any = None
    chat_template_kwargs: dict[str, Any] | None = None

    def refused(self) -> ParameterError | None:
        """A chat field the chat route refuses is refused here too, naming it (never taken and ignored)."""
        return _first_refused(self.model_extra or {}, _CHAT_ONLY)


# the chat fields /tokenize would have to render with: refused there as the chat route refuses them
_CHAT_ONLY = ("documents", "chat_template", "mm_processor_kwargs")


class DetokenizeRequest(BaseModel):
    """``POST /detokenize``: token ids to text."""

    model_config = ConfigDict(extra="allow", strict=True)
    model: str | None = None
    tokens: list[int]


def _first_refused(extra: dict[str, Any], names: Iterable[str]) -> ParameterError | None:
    """The first of ``extra``'s fields among ``names`` whose value is not its neutral default (``_REFUSED``), as one line naming it."""
    for name, value in extra.items():
        if name in names and value not in _REFUSED[name]:
            return ParameterError(f"{name}: not served by kvexport serve; leave it out", parameter=name)
    return None


def _logit_bias(bias: dict[str, float] | None) -> dict[int, float]:
    """JSON's string keys as token ids, or one line naming the key that is not one."""
    parsed: dict[int, float] = {}
    bad: list[str] = []
    for key, value in (bias or {}).items():
        try:
            parsed[int(key)] = float(value)
        except ValueError:
            bad.append(repr(key))
    if bad:  # every bad key at once, so one answer tells the client all it must fix
        which = f"the key {bad[0]} is not a token id" if len(bad) == 1 else f"the keys {', '.join(bad)} are not token ids"
        raise ParameterError(f"logit_bias: {which}", parameter="logit_bias")
    return parsed
