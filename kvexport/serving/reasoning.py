"""A thinking model's reasoning apart from its answer, as vLLM's reasoning parsers split them (``--reasoning-parser``).

The model thinks inside ``<think>…</think>`` and answers after it; the server returns the
thinking as the message's ``reasoning`` (vLLM's name) and the answer as ``content``. The
parsers, by name:

- ``deepseek_r1``: the template opens ``<think>`` in the prompt, so the output usually
  starts inside it: everything up to ``</think>`` is reasoning, the rest content. A
  leading ``<think>`` (after whitespace) is dropped. No ``</think>``: all reasoning (the
  output was cut short), content None.
- ``qwen3``: the same, and a ``<tool_call>`` before any ``</think>`` also ends the
  reasoning (the call and what follows are content, for the tool parser), as vLLM's
  current ``qwen3`` parser does. With thinking disabled (``enable_thinking=False`` in
  the template's arguments: the prompt already holds an empty think block), there is no
  reasoning: all text is content.

vLLM's ``extract`` drops any text before the first ``<think>`` wherever it is; here only
whitespace before a leading ``<think>`` is dropped, so that streaming (which can't take
text back) gives exactly what :meth:`ReasoningParser.extract` gives: the concatenated
reasoning and content pieces equal its result (an empty string standing for None).
Streaming holds back text that may begin a tag, so no part of ``</think>`` reaches either.

Plain Python; served through :mod:`kvexport.serving.tool_use` (``--reasoning-parser``).
"""

from __future__ import annotations

from typing import ClassVar, Literal, NamedTuple

from kvexport.errors import KvexportError
from kvexport.serving.tool_parsers import held_tag_prefix


class ReasoningDelta(NamedTuple):
    """What one streaming step gives: reasoning to send and content to send."""

    reasoning: str
    content: str


class UnknownReasoningParserError(KvexportError):
    """A reasoning parser name that is not registered."""


class ReasoningParser:
    """``<think>reasoning</think>content``: :meth:`extract` for a whole output, :meth:`stream` step by step.

    One instance per request. ``thinking=False`` says the prompt closed the think block
    (all output is content). A subclass names its tags and the markers that end the
    reasoning while staying in the content (``implicit_ends``).
    """

    name: ClassVar[str]
    start: ClassVar[str] = "<think>"
    end: ClassVar[str] = "</think>"
    implicit_ends: ClassVar[tuple[str, ...]] = ()

    def __init__(self, thinking: bool = True) -> None:
        self.thinking = thinking
        self._state: Literal["start", "reasoning", "content"] = "start" if thinking else "content"
        self._pending = ""

    def extract(self, text: str) -> tuple[str | None, str | None]:
        """``(reasoning, content)`` of a whole output; None where there is none."""
        if not self.thinking:
            return None, text
        stripped = text.lstrip()
        if stripped.startswith(self.start):
            text = stripped[len(self.start) :]
        ends = [(text.find(tag), tag) for tag in (self.end, *self.implicit_ends) if tag in text]
        if not ends:
            return text, None
        position, tag = min(ends)
        reasoning = text[:position]
        content = text[position + len(self.end) :] if tag == self.end else text[position:]
        return reasoning, content or None

    def stream(self, delta_text: str) -> ReasoningDelta:
        """Read the text one step produced; give the reasoning and content to send."""
        reasoning: list[str] = []
        content: list[str] = []
        for char in delta_text:
            self._step(char, reasoning, content)
        return ReasoningDelta("".join(reasoning), "".join(content))

    def finish(self) -> ReasoningDelta:
        """The output ended: what was held back was text, after all."""
        pending, self._pending = self._pending, ""
        if self._state == "content":
            return ReasoningDelta("", pending)
        return ReasoningDelta(pending, "")

    def _step(self, char: str, reasoning: list[str], content: list[str]) -> None:
        if self._state == "content":
            content.append(char)
            return
        self._pending += char
        if self._state == "start":
            stripped = self._pending.lstrip()
            if stripped == self.start:
                self._pending, self._state = "", "reasoning"
                return
            if not stripped or self.start.startswith(stripped):
                return
            self._state = "reasoning"  # no opening tag: the prompt opened it
        if self._pending.endswith(self.end):
            reasoning.append(self._pending[: -len(self.end)])
            self._pending, self._state = "", "content"
            return
        for tag in self.implicit_ends:
            if self._pending.endswith(tag):
                reasoning.append(self._pending[: -len(tag)])
                content.append(tag)
                self._pending, self._state = "", "content"
                return
        held = held_tag_prefix(self._pending, (self.end, *self.implicit_ends))
        reasoning.append(self._pending[: len(self._pending) - held])
        self._pending = self._pending[len(self._pending) - held :]


class DeepSeekR1ReasoningParser(ReasoningParser):
    """DeepSeek-R1 and its distills, as vLLM's ``deepseek_r1``."""

    name = "deepseek_r1"


class Qwen3ReasoningParser(ReasoningParser):
    """Qwen3 (and QwQ, Qwen3.5), as vLLM's ``qwen3``: a ``<tool_call>`` also ends the reasoning."""

    name = "qwen3"
    implicit_ends = ("<tool_call>",)


REASONING_PARSERS: dict[str, type[ReasoningParser]] = {
    parser.name: parser for parser in (DeepSeekR1ReasoningParser, Qwen3ReasoningParser)
}


def reasoning_parser(name: str, thinking: bool = True) -> ReasoningParser:
    """A fresh parser (one per request) by its vLLM name; an unknown name is refused, naming the known ones."""
    if name not in REASONING_PARSERS:
        raise UnknownReasoningParserError(
            f"unknown reasoning parser {name!r}; known: {', '.join(sorted(REASONING_PARSERS))}"
        )
    return REASONING_PARSERS[name](thinking)


def choose_reasoning_parser(chat_template: str, *, reads_thinking_flag: bool, generation_prompt: str) -> str | None:
    """The reasoning parser an export's chat template implies, or None when the model does not think.

    A thinking model's template either opens ``<think>`` in its generation prompt
    (``generation_prompt``: what it renders for one user message; DeepSeek-R1, QwQ) or
    writes ``<think>`` and reads ``enable_thinking`` (``reads_thinking_flag``; Qwen3). A
    template that only mentions ``<think>`` (to strip it from earlier turns, say) implies
    none. The parser is ``qwen3`` when the template is ChatML (``<|im_start|>``), else
    ``deepseek_r1``.
    """
    opens = generation_prompt.rstrip().endswith("<think>")
    if not opens and not ("<think>" in chat_template and reads_thinking_flag):
        return None
    return "qwen3" if "<|im_start|>" in chat_template else "deepseek_r1"
