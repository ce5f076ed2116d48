"""Structured output: a request's JSON schema, regex, choice or grammar as a token mask, with llguidance.

A request names its constraint with OpenAI's ``response_format`` (``json_object``,
``json_schema``) or vLLM's ``structured_outputs`` (``json``, ``regex``, ``choice``,
``grammar``); :func:`from_request` turns either into a :class:`Constraint`: the
llguidance grammar text and the field to name in an error.

- The server's :class:`Grammars` builds llguidance's tokenizer once (lazily, in the thread
  of the first structured request, never the engine's) and checks each grammar when the
  request arrives, in the caller's thread: a bad schema, regex or grammar is a 400 that
  names the field. Checked grammars are remembered by their text.
- Each request gets its own ``LLMatcher``. The output processor chooses the request's
  token among those it allows next (the others' probability is 0, as if masked to -inf;
  the other controls act among them; the log-probabilities stay the model's own, as for
  every request), and feeds it each chosen token. It never fails open: a matcher in error
  ends the request with an error, never with unconstrained text.
- A constrained request is never decoded speculatively (its mask depends on every token
  before it); its tokens do not depend on what is batched with it, as for every request.

JSON is generated compactly (llguidance's ``whitespace_flexible`` off: no free whitespace
between tokens), where vLLM's default backends allow any whitespace. A small model given
free whitespace can spend its whole ``max_tokens`` on it; ``docs/serving.md`` lists this
among the differences from vLLM.
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from kvexport.serving.errors import ParameterError

if TYPE_CHECKING:
    from llguidance._lib import JsonCompileOptions
    from tokenizers import Tokenizer

# llguidance's options for every JSON schema: compact JSON (see the module docstring)
JSON_DEFAULTS: JsonCompileOptions = {"whitespace_flexible": False}
_REMEMBERED = 256  # checked grammars kept, by text
# vLLM's structured_outputs options, with the values that ask for what this server does: one
# backend (no fallback to disable), compact JSON always (the default's any whitespace is the
# documented difference), schemas as written, no whitespace pattern of the request's own
_OPTIONS: dict[str, tuple[Any, ...]] = {
    "disable_fallback": (None, False, True),
    "disable_any_whitespace": (None, False, True),
    "disable_additional_properties": (None, False),
    "whitespace_pattern": (None,),
}


@dataclass(frozen=True)
class Constraint:
    """One request's constraint: the llguidance grammar and the request field it came from."""

    field: str  # e.g. "response_format" or "structured_outputs.regex": named in errors
    grammar: str  # llguidance's grammar JSON
    # the text after which the grammar applies (a thinking model's "</think>"); None: from the first token
    after: str | None = None


def from_request(response_format: Any, structured_outputs: Any) -> Constraint | None:
    """The constraint a request's ``response_format`` or ``structured_outputs`` asks for, or None.

    Raises :class:`ParameterError` naming the field for a malformed one, for both at once,
    and for the parts that are not served (``structural_tag``).
    """
    from_format = _from_response_format(response_format)
    from_outputs = _from_structured_outputs(structured_outputs)
    if from_format is not None and from_outputs is not None:
        raise ParameterError(
            "response_format and structured_outputs: each sets the output's structure; send one of them",
            parameter="structured_outputs",
        )
    return from_format or from_outputs


def _from_response_format(value: Any) -> Constraint | None:
    from llguidance import LLMatcher

    if value is None:
        return None
    if not isinstance(value, dict) or not isinstance(value.get("type"), str):
        raise ParameterError("response_format: must be an object with a type (text, json_object or json_schema)", parameter="response_format")
    kind = value["type"]
    if kind == "text":
        return None
    if kind == "json_object":
        return Constraint("response_format", LLMatcher.grammar_from_json_schema({"type": "object"}, defaults=JSON_DEFAULTS))
    if kind == "json_schema":
        spec = value.get("json_schema")
        if not isinstance(spec, dict):
            raise ParameterError("response_format.json_schema: must be an object with name and schema", parameter="response_format")
        schema = spec.get("schema", spec.get("json_schema"))
        if not isinstance(schema, (dict, bool)):
            raise ParameterError("response_format.json_schema.schema: must be a JSON schema object", parameter="response_format")
        return Constraint("response_format", json_grammar(schema, "response_format"))
    raise ParameterError(f"response_format: type {kind!r} is not one of text, json_object, json_schema", parameter="response_format")


def _from_structured_outputs(value: Any) -> Constraint | None:
    from llguidance import LLMatcher

    if value is None:
        return None
    if not isinstance(value, dict):
        raise ParameterError("structured_outputs: must be an object with one of json, regex, choice, grammar", parameter="structured_outputs")
    if value.get("structural_tag") is not None:
        raise ParameterError("structured_outputs.structural_tag: not served by kvexport serve; use json, regex, choice or grammar", parameter="structured_outputs")
    set_keys = [key for key in ("json", "regex", "choice", "grammar", "json_object") if value.get(key) not in (None, False)]
    unknown = sorted(set(value) - {"json", "regex", "choice", "grammar", "json_object", "structural_tag", *_OPTIONS})
    if unknown:
        raise ParameterError(f"structured_outputs: unknown key {unknown[0]!r}; use one of json, regex, choice, grammar", parameter="structured_outputs")
    for option, honoured in _OPTIONS.items():  # vLLM's options: taken where what this server does is what they ask, else refused
        if value.get(option) not in honoured:
            raise ParameterError(
                f"structured_outputs.{option}: {value[option]!r} is not served by kvexport serve; leave it out",
                parameter="structured_outputs",
            )
    if len(set_keys) != 1:
        raise ParameterError(
            "structured_outputs: set exactly one of json, regex, choice, grammar" + (f" (got {', '.join(set_keys)})" if set_keys else ""),
            parameter="structured_outputs",
        )
    key = set_keys[0]
    field = f"structured_outputs.{key}"
    body = value[key]
    if key == "json_object":
        return Constraint(field, LLMatcher.grammar_from_json_schema({"type": "object"}, defaults=JSON_DEFAULTS))
    if key == "json":
        if isinstance(body, str):  # vLLM takes the schema as an object or as its JSON text
            try:
                body = json.loads(body)
            except json.JSONDecodeError as exc:
                raise ParameterError(f"{field}: not valid JSON ({exc.msg})", parameter="structured_outputs") from None
        if not isinstance(body, (dict, bool)):
            raise ParameterError(f"{field}: must be a JSON schema object", parameter="structured_outputs")
        return Constraint(field, json_grammar(body, "structured_outputs"))
    if key == "regex":
        if not isinstance(body, str):
            raise ParameterError(f"{field}: must be a string", parameter="structured_outputs")
        return Constraint(field, LLMatcher.grammar_from_regex(body))
    if key == "choice":
        if not isinstance(body, list) or not body or not all(isinstance(c, str) for c in body):
            raise ParameterError(f"{field}: must be a non-empty list of strings", parameter="structured_outputs")
        return Constraint(field, LLMatcher.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in body)))
    if not isinstance(body, str) or not body.strip():  # grammar: Lark, or GBNF (llama.cpp's, as xgrammar takes it)
        raise ParameterError(f"{field}: must be a non-empty grammar (Lark or GBNF)", parameter="structured_outputs")
    if "::=" in body:
        from llguidance.gbnf_to_lark import gbnf_to_lark

        try:
            body = gbnf_to_lark(body)
        except Exception as exc:  # llguidance raises plain exceptions for a bad grammar
            raise ParameterError(f"{field}: not a valid GBNF grammar ({_first_line(exc)})", parameter="structured_outputs") from None
    return Constraint(field, LLMatcher.grammar_from_lark(body))


def json_grammar(schema: Any, parameter: str) -> str:
    """Llguidance's grammar for a JSON schema (compact JSON); a schema it can't read is a :class:`ParameterError` naming ``parameter``."""
    from llguidance import LLMatcher

    try:
        grammar: str = LLMatcher.grammar_from_json_schema(schema, defaults=JSON_DEFAULTS)
    except Exception as exc:  # not JSON: llguidance raises plain exceptions
        raise ParameterError(f"{parameter}: invalid JSON schema ({_first_line(exc)})", parameter=parameter) from None
    return grammar


def _first_line(error: object) -> str:
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__


class Grammars:
    """llguidance's tokenizer for one export, built once, and the grammars checked against it.

    Args:
        tokenizer: the export's tokenizer (serialized for llguidance on first use, not at start-up).
        vocab_size: the model's vocabulary (the logits' width; it may exceed the tokenizer's).
        eos_token_id: the token a finished grammar allows (the export's first EOS).

    """

    def __init__(self, tokenizer: Tokenizer, vocab_size: int, eos_token_id: int) -> None:
        self._source = tokenizer
        self.vocab_size = vocab_size
        self.eos_token_id = eos_token_id
        self._tokenizer: Any = None
        self._lock = threading.Lock()
        self._checked: OrderedDict[str, str] = OrderedDict()  # grammar text -> error ("" when good)

    @property
    def tokenizer(self) -> Any:
        """The ``LLTokenizer`` (built on first use, under a lock: about a second for 50k tokens)."""
        with self._lock:
            if self._tokenizer is None:
                from llguidance import LLTokenizer

                self._tokenizer = LLTokenizer(self._source.to_str(), n_vocab=self.vocab_size, eos_token=self.eos_token_id)
            return self._tokenizer

    def check(self, constraint: Constraint) -> None:
        """A grammar llguidance cannot use is a :class:`ParameterError` naming the request field."""
        from llguidance import LLMatcher

        tokenizer = self.tokenizer
        with self._lock:
            error = self._checked.get(constraint.grammar)
        if error is None:
            error = LLMatcher.validate_grammar(constraint.grammar, tokenizer)
            with self._lock:
                self._checked[constraint.grammar] = error
                while len(self._checked) > _REMEMBERED:
                    self._checked.popitem(last=False)
        if error:
            parameter = constraint.field.split(".")[0]
            raise ParameterError(f"{constraint.field}: {_first_line(error)}", parameter=parameter)

    def matcher(self, constraint: Constraint) -> Matcher:
        """A fresh matcher for one request (its grammar checked already)."""
        from llguidance import LLMatcher

        return Matcher(LLMatcher(self.tokenizer, constraint.grammar), self.vocab_size)


class Matcher:
    """One request's place in its grammar: the mask of the tokens allowed next, and each token taken."""

    def __init__(self, matcher: Any, vocab_size: int) -> None:
        import llguidance.numpy as llg_numpy

        self._matcher = matcher
        self._numpy = llg_numpy
        self.vocab_size = vocab_size
        self._bitmask = llg_numpy.allocate_token_bitmask(1, vocab_size)

    @property
    def error(self) -> str | None:
        """Why the matcher cannot go on (None while it can)."""
        return str(self._matcher.get_error()) or "the constraint failed" if self._matcher.is_error() else None

    def allowed(self) -> np.ndarray:
        """The token ids the grammar allows next, ascending (int64)."""
        self._numpy.fill_next_token_bitmask(self._matcher, self._bitmask, 0)
        bits = np.unpackbits(self._bitmask.view(np.uint8), bitorder="little", count=self.vocab_size)
        return np.flatnonzero(bits)

    def mask(self, scores: np.ndarray) -> np.ndarray:
        """``scores`` [V] with every token the grammar does not allow next at -inf (a new array)."""
        masked = np.full_like(scores, -np.inf)
        allowed = self.allowed()
        masked[allowed] = scores[allowed]
        return masked

    def take(self, token: int) -> bool:
        """Advance past ``token``; False when the grammar does not allow it (the matcher is then in error)."""
        return bool(self._matcher.consume_token(token)) and not self._matcher.is_error()

    @property
    def finished(self) -> bool:
        """Whether the grammar is complete and allows nothing more."""
        return bool(self._matcher.is_stopped())
