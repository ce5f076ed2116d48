"""A chat reply's text split into reasoning, content and tool calls: the reasoning parser first, the tool parser on what it leaves.

vLLM runs the two the same way: the reasoning parser takes the model's text, and only the
content it gives (after ``</think>``, or from a ``<tool_call>`` that ended the thinking)
goes to the tool parser, so a call written while thinking is reasoning, not a call.
Either parser may be absent. One :class:`OutputParser` per choice of a chat request
(:mod:`kvexport.serving.tool_use` makes them); plain Python.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvexport.serving.reasoning import ReasoningParser
from kvexport.serving.tool_parsers import ToolCall, ToolCallDelta, ToolParser


@dataclass(frozen=True)
class ParsedOutput:
    """A whole reply: ``reasoning`` and ``content`` None where there is none, as vLLM's message fields."""

    reasoning: str | None
    content: str | None
    tool_calls: list[ToolCall] = field(default_factory=list)


@dataclass(frozen=True)
class ParsedDelta:
    """What one streaming step gives: reasoning, content and call pieces to send."""

    reasoning: str = ""
    content: str = ""
    tool_calls: list[ToolCallDelta] = field(default_factory=list)


class OutputParser:
    """The reasoning parser, then the tool parser on its content (either may be None)."""

    def __init__(self, reasoning: ReasoningParser | None, tools: ToolParser | None, max_calls: int | None = None) -> None:
        self.reasoning = reasoning
        self.tools = tools
        self.max_calls = max_calls  # calls past this many are dropped (``parallel_tool_calls: false``: 1), as vLLM drops them

    def extract(self, text: str) -> ParsedOutput:
        """Split a whole reply."""
        reasoning, content = (
            (None, text) if self.reasoning is None else self.reasoning.extract(text)
        )
        if self.tools is None or content is None:
            return ParsedOutput(reasoning, content)
        extracted = self.tools.extract(content)
        return ParsedOutput(reasoning, extracted.content, extracted.tool_calls[: self.max_calls])

    def stream(self, delta_text: str) -> ParsedDelta:
        """Read the text one step produced."""
        if self.reasoning is None:
            return self._tools(delta_text, "", final=False)
        step = self.reasoning.stream(delta_text)
        return self._tools(step.content, step.reasoning, final=False)

    def finish(self) -> ParsedDelta:
        """The reply ended: flush both parsers, the reasoning parser's rest through the tool parser."""
        if self.reasoning is None:
            return self._tools("", "", final=True)
        step = self.reasoning.finish()
        return self._tools(step.content, step.reasoning, final=True)

    def _tools(self, content: str, reasoning: str, *, final: bool) -> ParsedDelta:
        if self.tools is None:
            return ParsedDelta(reasoning, content)
        step = self.tools.stream(content)
        calls = step.tool_calls
        text = step.content
        if final:
            end = self.tools.finish()
            calls, text = calls + end.tool_calls, text + end.content
        if self.max_calls is not None:
            calls = [call for call in calls if call.index < self.max_calls]
        return ParsedDelta(reasoning, text, calls)
