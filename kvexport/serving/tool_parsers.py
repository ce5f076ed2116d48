"""Tool calls out of a model's text, as vLLM's tool parsers find them (``--tool-call-parser``).

A chat model asked to call a tool writes the call as text in its family's own form; a
parser turns that text back into OpenAI's ``tool_calls`` (``id``, ``type: "function"``,
``function.name``, ``function.arguments`` as a JSON string). The parsers, by name:

- ``hermes`` (Qwen2.5, Qwen3, Hermes): ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``,
  one block per call; the text before the first block is the content, text between or
  after blocks is dropped.
- ``llama3_json`` (Llama 3.x): ``{"name": ..., "parameters": {...}}`` (or ``"arguments"``),
  possibly after ``<|python_tag|>``, several separated by ``;``; the text around them is
  dropped (content is None when a call is found).
- ``mistral``: ``[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]``, or from Mistral's
  tokenizer v11 on ``[TOOL_CALLS]name{...}`` per call; the text before the first
  ``[TOOL_CALLS]`` is the content.
- ``pythonic`` (Llama 3.2 / 4 with vLLM's pythonic templates): the whole output is a
  Python list of calls, ``[get_weather(city='SF', metric='celsius'), ...]``, read with
  :mod:`ast`; only keyword arguments and literals (strings, numbers, booleans, None,
  lists, dicts) are accepted.

Two more read the forms a forced ``tool_choice`` makes the model write (its grammar, vLLM's
schemas; not chosen by name): :class:`RequiredToolParser`, a JSON list of ``{"name",
"parameters"}``, and :class:`NamedToolParser`, the named function's arguments object.

Output that does not parse as calls (invalid JSON inside ``<tool_call>``, a call without a
name, a pythonic list with an expression in it) is content, whole, as vLLM treats it.
``arguments`` is ``json.dumps(value, ensure_ascii=False)`` of the parsed arguments in
every parser (vLLM's llama parser keeps ASCII escapes; the others do not).

Each parser is also a streaming state (one per request): :meth:`ToolParser.stream` takes
the text a step produced and returns the content to send and the tool-call deltas;
:meth:`ToolParser.finish` flushes what was held back. No part of a tag (``<tool_c``)
ever reaches the content: text that may begin a tag is held until it can tell. A call's
``id`` and ``name`` are sent once, in its first delta, and its ``arguments`` in pieces
whose concatenation is exactly the string :meth:`ToolParser.extract` gives: the JSON
parsers re-serialize the arguments as they arrive, character by character, in
``json.dumps``'s form (a number or ``true`` is sent when it ends), one piece per call and
step. ``pythonic`` sends each
call whole when the list closes (a Python literal can't be turned into JSON before it
ends).

Where streaming and :meth:`~ToolParser.extract` can differ (both as in vLLM):

- a call whose text turns out malformed after its name was sent can't be taken back; the
  rest of the text goes to the content, where ``extract`` makes the whole output content;
- ``llama3_json`` and ``pythonic`` stream calls only when the output starts with them
  (after whitespace); ``extract`` of ``llama3_json`` also finds a call after prose;
- a key repeated inside ``arguments`` is streamed twice, where ``json.loads`` keeps the last.

Plain Python (``json``, ``re``, ``ast``); served through :mod:`kvexport.serving.tool_use` (``--tool-call-parser``).
"""

from __future__ import annotations

import ast
import json
import re
import secrets
import uuid
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal, NamedTuple

from kvexport.errors import KvexportError

IdFactory = Callable[[], str]


def make_tool_call_id() -> str:
    """A tool call's id as vLLM makes it: ``chatcmpl-tool-`` and 32 hex digits."""
    return f"chatcmpl-tool-{uuid.uuid4().hex}"


def make_mistral_tool_call_id() -> str:
    """A Mistral tool call's id: 9 letters and digits (Mistral's templates refuse others)."""
    alphabet = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789"
    return "".join(secrets.choice(alphabet) for _ in range(9))


@dataclass(frozen=True)
class ToolCall:
    """One call: OpenAI's ``{"id", "type": "function", "function": {"name", "arguments"}}``."""

    id: str
    name: str
    arguments: str  # a JSON text, as OpenAI's function.arguments
    type: Literal["function"] = "function"

    def to_openai(self) -> dict[str, Any]:
        """The call as it appears in a message's ``tool_calls``."""
        return {
            "id": self.id,
            "type": self.type,
            "function": {"name": self.name, "arguments": self.arguments},
        }


@dataclass(frozen=True)
class ExtractedToolCalls:
    """What a whole output holds: its calls and the content left to show (None: none)."""

    tools_called: bool
    tool_calls: list[ToolCall] = field(default_factory=list)
    content: str | None = None


@dataclass(frozen=True)
class ToolCallDelta:
    """A piece of the call at ``index``: ``id`` and ``name`` in its first piece only."""

    index: int
    id: str | None
    name: str | None
    arguments: str

    def to_openai(self) -> dict[str, Any]:
        """The piece as a streamed ``delta.tool_calls`` entry."""
        function: dict[str, str] = {"arguments": self.arguments}
        if self.name is not None:
            function["name"] = self.name
        entry: dict[str, Any] = {"index": self.index, "function": function}
        if self.id is not None:
            entry["id"] = self.id
            entry["type"] = "function"
        return entry


class StreamedDelta(NamedTuple):
    """What one streaming step gives: content to send and tool-call pieces."""

    content: str
    tool_calls: list[ToolCallDelta]


class UnknownParserError(KvexportError):
    """A parser name that is not registered."""


class _Malformed(Exception):
    """The text being read is not what the parser expects (internal)."""


def _refuse_constant(constant: str) -> Any:
    raise ValueError(f"{constant} is not JSON")


def _loads_strict(text: str) -> Any:
    """``json.loads`` without NaN and Infinity, which the streaming reader refuses as well."""
    return json.loads(text, parse_constant=_refuse_constant)


def _check_call(call: Any) -> None:
    """A parsed call is an object with a non-empty string name (ValueError otherwise)."""
    if not isinstance(call, dict) or not isinstance(call.get("name"), str) or not call["name"]:
        raise ValueError("not a call")


def _listed_calls(listed: Any, arguments: str) -> list[tuple[str, Any]]:
    """A JSON list of call objects as (name, arguments under the key ``arguments``); ValueError or KeyError when it is not one."""
    if not isinstance(listed, list) or not listed:
        raise ValueError("not a list of calls")
    calls = []
    for call in listed:
        _check_call(call)
        calls.append((call["name"], call[arguments]))
    return calls


def _dumps(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False)


_NUMBER = re.compile(r"-?(?:0|[1-9][0-9]*)(?:\.[0-9]+)?(?:[eE][+-]?[0-9]+)?")
_SIMPLE_ESCAPES = {
    '"': '"',
    "\\": "\\",
    "/": "/",
    "b": "\b",
    "f": "\f",
    "n": "\n",
    "r": "\r",
    "t": "\t",
}


class _JsonReader:
    """Reads one JSON value character by character and writes it out as ``json.dumps`` would.

    ``out`` only grows: a string's characters are written as they are read (escapes
    decoded and re-escaped), a number or literal when the character after it arrives.
    For a top-level object, ``members`` maps each key to the ``[start, end)`` of its value
    in ``out`` (``end`` None while the value is being read); a repeated key keeps its last
    value, as ``json.loads`` does. Raises :class:`_Malformed` at the first character that
    can't continue valid JSON.
    """

    def __init__(self) -> None:
        self.out = ""
        self.done = False
        self.members: dict[str, list[int | None]] = {}
        # frames: [kind ("{" or "["), state, last key]
        self._stack: list[list[Any]] = []
        self._token: str | None = None  # "str", "num", "lit"
        self._buffer = ""  # a number's or literal's characters
        self._is_key = False
        self._key = ""
        self._escape: str | None = None
        self._high_surrogate: str | None = None

    def feed(self, char: str) -> None:
        """Read one character."""
        if self.done:
            raise _Malformed("text after the value")
        if self._token == "str":
            self._string_char(char)
            return
        if self._token == "num":
            if char in "0123456789+-.eE":
                self._buffer += char
                return
            self._end_number()
        elif self._token == "lit":
            if char.isalpha():
                self._buffer += char
                if len(self._buffer) > 5:
                    raise _Malformed(self._buffer)
                return
            self._end_literal()
        if self.done:
            if char in " \t\n\r":
                return
            raise _Malformed("text after the value")
        self._structural(char)

    def end(self) -> None:
        """The text ended: a number or literal at the very end is complete (a bare top-level one)."""
        if self._token == "num":
            self._end_number()
        elif self._token == "lit":
            self._end_literal()
        if not self.done:
            raise _Malformed("the value is not complete")

    def _expecting_value(self) -> bool:
        if not self._stack:
            return not self.done
        kind, state = self._stack[-1][0], self._stack[-1][1]
        return state == "value" or (kind == "[" and state == "value_or_end")

    def _structural(self, char: str) -> None:
        if char in " \t\n\r":
            return
        if self._expecting_value():
            if char == "]" and self._stack and self._stack[-1][1] == "value_or_end":
                self._close("[")
                return
            self._start_value(char)
            return
        frame = self._stack[-1]
        kind, state = frame[0], frame[1]
        if state in ("key_or_end", "key") and char == '"':
            self._token, self._is_key, self._key = "str", True, ""
            self.out += '"'
        elif state == "key_or_end" and char == "}":
            self._close("{")
        elif state == "colon" and char == ":":
            self.out += ": "
            frame[1] = "value"
        elif state == "comma_or_end" and char == ",":
            self.out += ", "
            frame[1] = "key" if kind == "{" else "value"
        elif state == "comma_or_end" and char == ("}" if kind == "{" else "]"):
            self._close(kind)
        else:
            raise _Malformed(char)

    def _start_value(self, char: str) -> None:
        if char == "{" or char == "[":
            self._value_started()
            self.out += char
            self._stack.append([char, "key_or_end" if char == "{" else "value_or_end", None])
        elif char == '"':
            self._value_started()
            self.out += '"'
            self._token, self._is_key = "str", False
        elif char == "-" or char.isdigit():
            self._value_started()
            self._token, self._buffer = "num", char
        elif char in "tfn":
            self._value_started()
            self._token, self._buffer = "lit", char
        else:
            raise _Malformed(char)

    def _value_started(self) -> None:
        if len(self._stack) == 1 and self._stack[0][0] == "{":
            self.members[self._stack[0][2]] = [len(self.out), None]

    def _value_ended(self) -> None:
        if not self._stack:
            self.done = True
            return
        frame = self._stack[-1]
        frame[1] = "comma_or_end"
        if len(self._stack) == 1 and frame[0] == "{":
            self.members[frame[2]][1] = len(self.out)

    def _close(self, kind: str) -> None:
        self.out += "}" if kind == "{" else "]"
        self._stack.pop()
        self._value_ended()

    def _end_number(self) -> None:
        text, self._token, self._buffer = self._buffer, None, ""
        if not _NUMBER.fullmatch(text):
            raise _Malformed(text)
        self.out += _dumps(json.loads(text))
        self._value_ended()

    def _end_literal(self) -> None:
        text, self._token, self._buffer = self._buffer, None, ""
        if text not in ("true", "false", "null"):
            raise _Malformed(text)
        self.out += text
        self._value_ended()

    def _string_char(self, char: str) -> None:
        if self._escape is not None:
            self._escape += char
            if self._escape[0] in _SIMPLE_ESCAPES:
                decoded = _SIMPLE_ESCAPES[self._escape[0]]
            elif self._escape[0] == "u":
                if len(self._escape) > 1 and char not in "0123456789abcdefABCDEF":
                    raise _Malformed("\\" + self._escape)
                if len(self._escape) < 5:
                    return
                decoded = chr(int(self._escape[1:], 16))
            else:
                raise _Malformed("\\" + self._escape)
            self._escape = None
            self._decoded(decoded, escaped=True)
        elif char == "\\":
            self._escape = ""
        elif char == '"':
            self._flush_surrogate()
            self.out += '"'
            self._token = None
            if self._is_key:
                frame = self._stack[-1]
                frame[1], frame[2] = "colon", self._key
            else:
                self._value_ended()
        elif ord(char) < 0x20:
            raise _Malformed("a control character in a string")
        else:
            self._decoded(char, escaped=False)

    def _decoded(self, char: str, *, escaped: bool) -> None:
        """One decoded character of a string; an escaped surrogate pair becomes one character, as in ``json.loads``."""
        if self._high_surrogate is not None:
            high, self._high_surrogate = self._high_surrogate, None
            if escaped and 0xDC00 <= ord(char) <= 0xDFFF:
                combined = 0x10000 + ((ord(high) - 0xD800) << 10) + (ord(char) - 0xDC00)
                self._write(chr(combined))
                return
            self._write(high)
        if escaped and 0xD800 <= ord(char) <= 0xDBFF:
            self._high_surrogate = char
            return
        self._write(char)

    def _flush_surrogate(self) -> None:
        if self._high_surrogate is not None:
            self._write(self._high_surrogate)
            self._high_surrogate = None

    def _write(self, char: str) -> None:
        if self._is_key:
            self._key += char
        self.out += _dumps(char)[1:-1]


class _CallReader:
    """Reads one call object (``{"name": ..., "arguments": ...}``) and gives its deltas as they come.

    The call's first delta (id, name and the arguments read so far) goes out once the name
    is complete and its arguments have begun, so a call without arguments is refused
    before anything of it is sent. Arguments before the name wait for it.
    """

    def __init__(
        self,
        index: int,
        new_id: IdFactory,
        argument_keys: tuple[str, ...],
        name: str | None = None,
    ) -> None:
        self.index = index
        self.reader = _JsonReader()
        self.sent = False
        self._new_id = new_id
        self._argument_keys = argument_keys
        self._name = name
        self._whole_is_arguments = name is not None  # name{...}: the object is the arguments
        self._arguments_sent = 0

    def feed(self, char: str) -> list[ToolCallDelta]:
        """Read one character of the call."""
        self.reader.feed(char)
        members = self.reader.members
        if (
            not self._whole_is_arguments
            and self._name is None
            and "name" in members
            and members["name"][1] is not None
        ):
            start, end = members["name"]
            name = json.loads(self.reader.out[start:end])
            if not isinstance(name, str) or not name:
                raise _Malformed("the call's name is not a string")
            self._name = name
        span = self._arguments_span()
        if self._name is None or span is None:
            if self.reader.done:
                raise _Malformed("a call needs a name and arguments")
            return []
        start, end = span
        arguments = self.reader.out[start : len(self.reader.out) if end is None else end]
        piece = arguments[self._arguments_sent :]
        self._arguments_sent = len(arguments)
        if not self.sent:
            self.sent = True
            return [ToolCallDelta(self.index, self._new_id(), self._name, piece)]
        return [ToolCallDelta(self.index, None, None, piece)] if piece else []

    def _arguments_span(self) -> tuple[int, int | None] | None:
        if self._whole_is_arguments:
            return 0, None
        present = [key for key in self._argument_keys if key in self.reader.members]
        if len(present) > 1:
            raise _Malformed("both " + " and ".join(present))
        if not present:
            return None
        start, end = self.reader.members[present[0]]
        assert start is not None
        return start, end


def _merged(deltas: list[ToolCallDelta]) -> list[ToolCallDelta]:
    """One piece per call and step: a step's consecutive pieces of the same call joined."""
    merged: list[ToolCallDelta] = []
    for delta in deltas:
        if merged and merged[-1].index == delta.index:
            last = merged[-1]
            merged[-1] = ToolCallDelta(
                last.index, last.id, last.name, last.arguments + delta.arguments
            )
        else:
            merged.append(delta)
    return merged


def held_tag_prefix(text: str, tags: tuple[str, ...]) -> int:
    """How many characters at the end of ``text`` may begin one of ``tags`` (to hold back while streaming)."""
    longest = 0
    for tag in tags:
        for size in range(min(len(tag) - 1, len(text)), longest, -1):
            if text.endswith(tag[:size]):
                longest = size
                break
    return longest


class ToolParser(ABC):
    """Tool calls of one model family: :meth:`extract` for a whole output, :meth:`stream` step by step.

    One instance per request (the streaming state is the request's). ``new_id`` makes
    each call's id (tests pass a counter to make them deterministic).
    """

    name: ClassVar[str]

    def __init__(self, new_id: IdFactory | None = None) -> None:
        self.new_id: IdFactory = new_id or self.default_id
        self._calls = 0

    @staticmethod
    def default_id() -> str:
        """The id of a call when no factory is given."""
        return make_tool_call_id()

    @abstractmethod
    def extract(self, text: str) -> ExtractedToolCalls:
        """The calls in a whole output, and the content left."""

    @abstractmethod
    def stream(self, delta_text: str) -> StreamedDelta:
        """Read the text one step produced; give the content to send and the call pieces."""

    @abstractmethod
    def finish(self) -> StreamedDelta:
        """The output ended: send what was held back."""

    def _call(self, name: str, arguments: Any) -> ToolCall:
        return ToolCall(self.new_id(), name, _dumps(arguments))


_Phase = Literal["text", "calls", "call", "tail", "content"]


class _JsonCallsParser(ToolParser):
    """The streaming frame shared by the JSON parsers: text, calls read by :class:`_CallReader`, and the text between.

    A subclass reads the text before the calls (``_text``, which opens them), the frame
    around and between calls (``_frame``) and what follows them (``_tail``). The phase
    moves ``text`` → ``calls`` (the frame) ⇄ ``call`` (inside one) → ``tail`` (the rest is
    dropped), or to ``content`` from anywhere the text turns out malformed (the rest is
    content).
    """

    argument_keys: ClassVar[tuple[str, ...]] = ("arguments",)

    def __init__(self, new_id: IdFactory | None = None) -> None:
        super().__init__(new_id)
        self._state: _Phase = "text"
        self._pending = ""  # text held back: a possible tag, or the frame between calls
        self._frame_raw = ""  # the text since the calls opened, for malformed calls
        self._call_raw = ""  # the current call's text, for a malformed call after others
        self._sent_any = False
        self._reader: _CallReader | None = None
        self._opened: list[ToolCallDelta] = []  # a call's pieces from its opening "{"

    def stream(self, delta_text: str) -> StreamedDelta:
        """Read the text one step produced."""
        content: list[str] = []
        calls: list[ToolCallDelta] = []
        for char in delta_text:
            self._step(char, content, calls)
        return StreamedDelta("".join(content), _merged(calls))

    def finish(self) -> StreamedDelta:
        """The output ended: an incomplete tag is content; an incomplete call is content if none of it was sent."""
        content: list[str] = []
        calls: list[ToolCallDelta] = []
        if self._state == "text":
            content.append(self._pending)
        elif self._state in ("calls", "call"):
            reader = self._reader
            if reader is not None and not reader.reader.done:
                self._malformed(content, at_end=True)
            elif self._state == "calls" and not self._may_end_here():
                self._malformed(content, at_end=True)
        self._pending = ""
        return StreamedDelta("".join(content), calls)

    def _step(self, char: str, content: list[str], calls: list[ToolCallDelta]) -> None:
        if self._state == "content":
            content.append(char)
        elif self._state == "tail":
            self._tail(char)
        elif self._state == "text":
            self._text(char, content)
        else:
            self._frame_raw += char
            self._call_raw += char
            try:
                if self._state == "call":
                    assert self._reader is not None
                    pieces = self._reader.feed(char)
                    self._sent_any = self._sent_any or bool(pieces)
                    calls += pieces
                    if self._reader.reader.done:
                        self._state = "calls"
                        self._pending = ""
                else:
                    self._frame(char)
            except _Malformed:
                self._malformed(content)
        calls += self._opened
        self._sent_any = self._sent_any or bool(self._opened)
        self._opened = []

    def _start_call(self, name: str | None = None) -> None:
        """A call begins (its ``{`` still to come); ``name`` when it came before (``name{...}``)."""
        self._reader = _CallReader(self._calls, self.new_id, self.argument_keys, name)
        self._calls += 1
        self._state = "call"

    def _open_call(self, name: str | None = None) -> None:
        """A call begins at the ``{`` just read; its first pieces are sent with the step's."""
        self._start_call(name)
        assert self._reader is not None
        self._call_raw = "{"
        self._opened = self._reader.feed("{")

    def _open_calls(self, raw: str) -> None:
        """The calls' frame opened with ``raw`` (a tag, or the first call's ``{``)."""
        self._frame_raw = self._call_raw = raw

    def _malformed(self, content: list[str], *, at_end: bool = False) -> None:
        """The calls can't be read: the text is content from the last thing not yet sent.

        Nothing sent yet: everything since the calls opened (so the whole output is content,
        as ``extract`` says); a call not begun: that call's text; a call half sent: the
        rest, from the character that broke it.
        """
        if not self._sent_any:
            content.append(self._frame_raw)
        elif self._reader is not None and not self._reader.sent:
            content.append(self._call_raw)
        elif not at_end:
            content.append(self._call_raw[-1:])
        self._state = "content"

    @abstractmethod
    def _text(self, char: str, content: list[str]) -> None:
        """A character before the calls."""

    def _text_until(self, char: str, content: list[str], tag: str) -> bool:
        """A character of the content before ``tag``: whatever cannot begin ``tag`` goes to ``content``.

        True once ``tag`` is read: the calls' frame is open and ``_pending`` empty.
        """
        self._pending += char
        if self._pending.endswith(tag):
            content.append(self._pending[: -len(tag)])
            self._open_calls(tag)
            self._pending = ""
            return True
        held = held_tag_prefix(self._pending, (tag,))
        content.append(self._pending[: len(self._pending) - held])
        self._pending = self._pending[len(self._pending) - held :]
        return False

    @abstractmethod
    def _frame(self, char: str) -> None:
        """A character between calls (``_pending`` holds the frame text read so far)."""

    def _in_call_list(self, char: str, *, wants_call: bool) -> bool:
        """A character (not whitespace) inside a JSON list of calls, after its ``[``; True when a call must come next.

        ``{`` opens a call where one is wanted, ``,`` comes between calls and ``]`` after the
        last (the rest is the tail); anything else is malformed.
        """
        if wants_call:
            if char != "{":
                raise _Malformed("no call in the list")
            self._open_call()
            return False
        if char == ",":
            return True
        if char == "]":
            self._state = "tail"
            return False
        raise _Malformed(char)

    def _tail(self, char: str) -> None:
        """A character after the calls: dropped, as vLLM's ``extract`` drops it."""

    def _may_end_here(self) -> bool:
        """Whether the output may end between two calls as it does."""
        return True


class HermesToolParser(_JsonCallsParser):
    """``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``, as vLLM's ``hermes``."""

    name = "hermes"
    START = "<tool_call>"
    END = "</tool_call>"
    _BLOCK = re.compile(r"<tool_call>(.*?)</tool_call>|<tool_call>(.*)", re.DOTALL)

    def extract(self, text: str) -> ExtractedToolCalls:
        """Every ``<tool_call>`` block (the last may lack its closing tag); the text before the first is the content."""
        if self.START not in text:
            return ExtractedToolCalls(False, [], text)
        try:
            calls = []
            for closed, unclosed in self._BLOCK.findall(text):
                call = _loads_strict(closed or unclosed)
                _check_call(call)
                calls.append((call["name"], call["arguments"]))
        except (ValueError, KeyError):
            return ExtractedToolCalls(False, [], text)
        content = text[: text.find(self.START)]
        return ExtractedToolCalls(True, [self._call(n, a) for n, a in calls], content or None)

    def _text(self, char: str, content: list[str]) -> None:
        if self._text_until(char, content, self.START):
            self._start_call()

    def _frame(self, char: str) -> None:
        # after a call: whitespace, then </tool_call>
        self._pending += char
        stripped = self._pending.lstrip()
        if self.END.startswith(stripped):
            if stripped == self.END:
                self._state, self._pending = "tail", ""
            return
        raise _Malformed("text after the call inside <tool_call>")

    def _tail(self, char: str) -> None:
        # between blocks: text is dropped until the next <tool_call>
        self._pending = (self._pending + char)[-len(self.START) :]
        if self._pending == self.START:
            self._call_raw = self.START
            self._pending = ""
            self._start_call()


class Llama3JsonToolParser(_JsonCallsParser):
    """``{"name": ..., "parameters": {...}}; {...}``, possibly after ``<|python_tag|>``, as vLLM's ``llama3_json``."""

    name = "llama3_json"
    PYTHON_TAG = "<|python_tag|>"
    argument_keys = ("arguments", "parameters")

    def extract(self, text: str) -> ExtractedToolCalls:
        """The calls from ``<|python_tag|>`` or the first ``{`` on, separated by ``;``; the text around them is dropped."""
        if self.PYTHON_TAG in text:
            start = text.index(self.PYTHON_TAG) + len(self.PYTHON_TAG)
        elif "{" in text:
            start = text.index("{")
        else:
            return ExtractedToolCalls(False, [], text)
        decoder = json.JSONDecoder(parse_constant=_refuse_constant)
        calls = []
        position = start
        try:
            while True:
                position = _skip_space(text, position)
                call, position = decoder.raw_decode(text, position)
                _check_call(call)
                if "arguments" in call and "parameters" in call:
                    raise ValueError("both arguments and parameters")
                calls.append(
                    (call["name"], call["arguments"] if "arguments" in call else call["parameters"])
                )
                after = _skip_space(text, position)
                if not text.startswith(";", after):
                    break
                following = _skip_space(text, after + 1)
                if not text.startswith("{", following):
                    break
                position = following
        except (ValueError, KeyError):
            return ExtractedToolCalls(False, [], text)
        return ExtractedToolCalls(True, [self._call(n, a) for n, a in calls], None)

    def _text(self, char: str, content: list[str]) -> None:
        # before anything but whitespace: calls if the output opens with <|python_tag|> or {
        self._pending += char
        stripped = self._pending.lstrip()
        if not stripped:
            return
        if stripped == self.PYTHON_TAG:
            self._open_calls(self._pending)
            self._pending = ""
            self._state = "calls"
        elif stripped == "{":
            self._open_calls(self._pending)
            self._pending = ""
            self._open_call()
        elif not self.PYTHON_TAG.startswith(stripped):
            content.append(self._pending)
            self._pending = ""
            self._state = "content"

    def _frame(self, char: str) -> None:
        # between calls: whitespace, ";", whitespace, then "{"; anything else ends the calls
        self._pending += char
        stripped = self._pending.strip()
        if not self._call_count_started():
            if stripped == "{":
                self._begin_next()
            elif stripped:
                raise _Malformed("no call after <|python_tag|>")
            return
        if stripped in ("", ";"):
            return
        if stripped.startswith(";") and stripped[1:].strip() == "{":
            self._begin_next()
            return
        self._state, self._pending = "tail", ""

    def _call_count_started(self) -> bool:
        return self._calls > 0

    def _begin_next(self) -> None:
        self._pending = ""
        self._open_call()

    def _may_end_here(self) -> bool:
        return self._calls > 0


class MistralToolParser(_JsonCallsParser):
    """Mistral's calls, as vLLM's ``mistral``, in both of its tokenizers' forms.

    Before tokenizer v11: ``[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]``; from
    v11 (Mistral Small 3.2 and later): ``[TOOL_CALLS]name{...arguments...}``, repeated for
    each call. The text before the first ``[TOOL_CALLS]`` is the content; text after the
    calls is dropped.
    """

    name = "mistral"
    BOT = "[TOOL_CALLS]"
    _NAME = re.compile(r"[A-Za-z0-9_.\-]+")

    def __init__(self, new_id: IdFactory | None = None) -> None:
        super().__init__(new_id)
        self._list: Literal["before", "want_call", "after_call", "name", "after_v11", "want_name"]
        self._list = (
            "before"  # the list form: want_call, after_call; v11: name, after_v11, want_name
        )
        self._name = ""

    @staticmethod
    def default_id() -> str:
        """Mistral's 9-character id."""
        return make_mistral_tool_call_id()

    def extract(self, text: str) -> ExtractedToolCalls:
        """The JSON list after ``[TOOL_CALLS]``; the text before it is the content."""
        if self.BOT not in text:
            return ExtractedToolCalls(False, [], text)
        before, _, after = text.partition(self.BOT)
        decoder = json.JSONDecoder(parse_constant=_refuse_constant)
        if not after.lstrip().startswith("["):
            try:
                calls = self._extract_v11(after, decoder)
            except ValueError:
                return ExtractedToolCalls(False, [], text)
            return ExtractedToolCalls(True, [self._call(n, a) for n, a in calls], before or None)
        try:
            calls = _listed_calls(decoder.raw_decode(after, _skip_space(after, 0))[0], "arguments")
        except (ValueError, KeyError):
            return ExtractedToolCalls(False, [], text)
        return ExtractedToolCalls(True, [self._call(n, a) for n, a in calls], before or None)

    def _extract_v11(self, after: str, decoder: json.JSONDecoder) -> list[tuple[str, Any]]:
        """``name{...}``, repeated after ``[TOOL_CALLS]``."""
        calls = []
        position = _skip_space(after, 0)
        while True:
            named = self._NAME.match(after, position)
            if named is None or not after.startswith("{", named.end()):
                raise ValueError("not name{arguments}")
            arguments, position = decoder.raw_decode(after, named.end())
            calls.append((named.group(), arguments))
            position = _skip_space(after, position)
            if not after.startswith(self.BOT, position):
                return calls
            position = _skip_space(after, position + len(self.BOT))

    def _text(self, char: str, content: list[str]) -> None:
        if self._text_until(char, content, self.BOT):
            self._state = "calls"

    def _frame(self, char: str) -> None:
        # "[" before the first call, "," between calls, "]" after the last
        if self._list == "name" and char == "{":
            self._open_call(self._name)
            self._list = "after_v11"
            return
        if self._list == "name" and self._NAME.fullmatch(char):
            self._name += char
            return
        if self._list == "after_v11" and char not in " \t\n\r":
            # another [TOOL_CALLS] and call, or the end of the calls
            self._pending += char
            if self._pending == self.BOT:
                self._list, self._pending = "want_name", ""
            elif not self.BOT.startswith(self._pending):
                self._state, self._pending = "tail", ""
            return
        if char in " \t\n\r" and self._list != "name":
            return
        if self._list in ("before", "want_name") and self._NAME.fullmatch(char):
            self._list, self._name = "name", char
        elif self._list == "before":
            if char != "[":
                raise _Malformed("no list after [TOOL_CALLS]")
            self._list = "want_call"
        elif self._list in ("name", "want_name"):
            raise _Malformed("not name{arguments} after [TOOL_CALLS]")
        else:
            self._list = "want_call" if self._in_call_list(char, wants_call=self._list == "want_call") else "after_call"

    def _may_end_here(self) -> bool:
        return self._list == "after_v11"  # a list not closed, or a name without arguments, is not


def _skip_space(text: str, position: int) -> int:
    while position < len(text) and text[position] in " \t\n\r":
        position += 1
    return position


def _literal(node: ast.expr) -> Any:
    """A pythonic call's argument value: only literals, as vLLM's pythonic parser allows."""
    if isinstance(node, ast.Constant) and (
        node.value is None or isinstance(node.value, (str, int, float, bool))
    ):
        return node.value
    if (
        isinstance(node, ast.UnaryOp)
        and isinstance(node.op, ast.USub)
        and isinstance(node.operand, ast.Constant)
    ):
        value = node.operand.value
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return -value
    if isinstance(node, ast.List):
        return [_literal(item) for item in node.elts]
    if isinstance(node, ast.Dict):
        keys = []
        for key in node.keys:
            if not (isinstance(key, ast.Constant) and isinstance(key.value, str)):
                raise ValueError("a dict key that is not a string")
            keys.append(key.value)
        return {key: _literal(value) for key, value in zip(keys, node.values, strict=True)}
    raise ValueError(f"not a literal: {ast.dump(node)}")


class PythonicToolParser(ToolParser):
    """``[get_weather(city='SF', metric='celsius'), ...]``, as vLLM's ``pythonic``: the whole output is the list."""

    name = "pythonic"

    def __init__(self, new_id: IdFactory | None = None) -> None:
        super().__init__(new_id)
        self._state: Literal["start", "list", "content", "tail"] = "start"
        self._buffer = ""
        self._depth = 0
        self._quote: str | None = None
        self._escaped = False

    def extract(self, text: str) -> ExtractedToolCalls:
        """The calls if the whole output (stripped) is a list of calls with literal keyword arguments."""
        try:
            parsed = self._parse(text)
        except (ValueError, SyntaxError, RecursionError):
            return ExtractedToolCalls(False, [], text)
        return ExtractedToolCalls(True, [self._call(n, a) for n, a in parsed], None)

    @staticmethod
    def _parse(text: str) -> list[tuple[str, dict[str, Any]]]:
        stripped = text.strip()
        if not (stripped.startswith("[") and stripped.endswith("]")):
            raise ValueError("not a list")
        tree = ast.parse(stripped, mode="eval").body
        if not isinstance(tree, ast.List) or not tree.elts:
            raise ValueError("not a list of calls")
        calls = []
        for call in tree.elts:
            if not isinstance(call, ast.Call) or not isinstance(call.func, ast.Name) or call.args:
                raise ValueError("not a call with keyword arguments")
            arguments = {}
            for keyword in call.keywords:
                if keyword.arg is None:
                    raise ValueError("**kwargs in a call")
                arguments[keyword.arg] = _literal(keyword.value)
            calls.append((call.func.id, arguments))
        return calls

    def stream(self, delta_text: str) -> StreamedDelta:
        """Hold the list until it closes, then send its calls (or, if it is not one, the text as content)."""
        content: list[str] = []
        calls: list[ToolCallDelta] = []
        for char in delta_text:
            if self._state == "content":
                content.append(char)
            elif self._state == "start":
                self._buffer += char
                if char in " \t\n\r":
                    continue
                if char == "[":
                    self._state, self._depth = "list", 1
                else:
                    content.append(self._buffer)
                    self._buffer, self._state = "", "content"
            elif self._state == "list":
                self._buffer += char
                if self._scan(char):
                    self._close(content, calls)
        return StreamedDelta("".join(content), calls)

    def finish(self) -> StreamedDelta:
        """An unclosed list, or whitespace only, is content."""
        content = self._buffer if self._state in ("start", "list") else ""
        self._buffer = ""
        return StreamedDelta(content, [])

    def _scan(self, char: str) -> bool:
        """Follow brackets outside string literals; True when the outer list closes."""
        if self._quote is not None:
            if self._escaped:
                self._escaped = False
            elif char == "\\":
                self._escaped = True
            elif char == self._quote:
                self._quote = None
            return False
        if char in "'\"":
            self._quote = char
        elif char in "([{":
            self._depth += 1
        elif char in ")]}":
            self._depth -= 1
        return self._depth == 0

    def _close(self, content: list[str], calls: list[ToolCallDelta]) -> None:
        try:
            parsed = self._parse(self._buffer)
        except (ValueError, SyntaxError, RecursionError):
            content.append(self._buffer)
            self._buffer, self._state = "", "content"
            return
        for index, (name, arguments) in enumerate(parsed):
            calls.append(ToolCallDelta(index, self.new_id(), name, _dumps(arguments)))
        self._buffer, self._state = "", "tail"


class _ForcedParser(_JsonCallsParser):
    """The calls of a forced ``tool_choice``: the output is JSON and nothing else (its grammar says so), opening at once."""

    opening: ClassVar[str]

    def _text(self, char: str, content: list[str]) -> None:
        # whitespace, then the opening character; anything else is content (a grammar-free output)
        self._pending += char
        stripped = self._pending.lstrip()
        if not stripped:
            return
        if stripped != self.opening:
            content.append(self._pending)
            self._pending, self._state = "", "content"
            return
        self._open_calls(self._pending)
        self._pending = ""
        self._opened_with()

    @abstractmethod
    def _opened_with(self) -> None:
        """The opening character was read."""


class RequiredToolParser(_ForcedParser):
    """``tool_choice: "required"``: a JSON list of ``{"name": ..., "parameters": {...}}``, as vLLM's grammar asks for it."""

    name = "required"
    opening = "["
    argument_keys = ("parameters",)

    def __init__(self, new_id: IdFactory | None = None) -> None:
        super().__init__(new_id)
        self._wants_call = True  # a call must come next (after "[" or ",")

    def extract(self, text: str) -> ExtractedToolCalls:
        """The listed calls; output that is not such a list is content, whole."""
        try:
            calls = _listed_calls(_loads_strict(text), "parameters")
        except (ValueError, KeyError):
            return ExtractedToolCalls(False, [], text)
        return ExtractedToolCalls(True, [self._call(n, a) for n, a in calls], None)

    def _opened_with(self) -> None:
        self._state = "calls"

    def _frame(self, char: str) -> None:
        if char not in " \t\n\r":
            self._wants_call = self._in_call_list(char, wants_call=self._wants_call)

    def _may_end_here(self) -> bool:
        return False  # a list not closed


class NamedToolParser(_ForcedParser):
    """A named ``tool_choice``: the output is the function's arguments object, as vLLM's grammar asks for it."""

    name = "named"
    opening = "{"

    def __init__(self, function: str, new_id: IdFactory | None = None) -> None:
        super().__init__(new_id)
        self.function = function

    def extract(self, text: str) -> ExtractedToolCalls:
        """One call of the named function; output that is not a JSON object is content, whole."""
        try:
            arguments = _loads_strict(text)
            if not isinstance(arguments, dict):
                raise ValueError("not an object")
        except ValueError:
            return ExtractedToolCalls(False, [], text)
        return ExtractedToolCalls(True, [self._call(self.function, arguments)], None)

    def _opened_with(self) -> None:
        self._open_call(self.function)

    def _frame(self, char: str) -> None:
        if char not in " \t\n\r":
            self._state = "tail"


TOOL_PARSERS: dict[str, type[ToolParser]] = {
    parser.name: parser
    for parser in (HermesToolParser, Llama3JsonToolParser, MistralToolParser, PythonicToolParser)
}


def tool_parser(name: str, new_id: IdFactory | None = None) -> ToolParser:
    """A fresh parser (one per request) by its vLLM name; an unknown name is refused, naming the known ones."""
    if name not in TOOL_PARSERS:
        raise UnknownParserError(
            f"unknown tool-call parser {name!r}; known: {', '.join(sorted(TOOL_PARSERS))}"
        )
    return TOOL_PARSERS[name](new_id)


def choose_tool_parser(chat_template: str) -> str | None:
    """The parser an export's chat template implies, or None when the template does not tell.

    The rule, first match wins: ``[TOOL_CALLS]`` → ``mistral``; ``<tool_call>`` →
    ``hermes`` (Qwen2.5, Qwen3, Hermes); the ``[func_name1(`` format that vLLM's pythonic
    templates ask for → ``pythonic``; ``<|python_tag|>``, or Llama 3's header tokens with a
    ``"parameters"`` call form → ``llama3_json``.
    """
    if "[TOOL_CALLS]" in chat_template:
        return "mistral"
    if "<tool_call>" in chat_template:
        return "hermes"
    if "[func_name1(" in chat_template:
        return "pythonic"
    if "<|python_tag|>" in chat_template:
        return "llama3_json"
    if "<|start_header_id|>" in chat_template and '"parameters"' in chat_template:
        return "llama3_json"
    return None
