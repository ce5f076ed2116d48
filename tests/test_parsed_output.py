"""The reasoning parser and the tool parser chained as vLLM chains them, whole and streamed."""

from __future__ import annotations

import itertools
import random

import pytest

from kvexport.serving.parsed_output import OutputParser, ParsedOutput
from kvexport.serving.reasoning import reasoning_parser
from kvexport.serving.tool_parsers import ToolCall, tool_parser

CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
WEATHER = ToolCall("call-0", "get_weather", '{"city": "Paris"}')


def _parser(reasoning: str | None, tools: str | None) -> OutputParser:
    counter = itertools.count()
    return OutputParser(
        reasoning_parser(reasoning) if reasoning else None,
        tool_parser(tools, lambda: f"call-{next(counter)}") if tools else None,
    )


def _stream(parser: OutputParser, pieces: list[str]) -> ParsedOutput:
    reasoning, content, calls = [], [], {}
    for step in [*(parser.stream(piece) for piece in pieces), parser.finish()]:
        reasoning.append(step.reasoning)
        content.append(step.content)
        for delta in step.tool_calls:
            if delta.index not in calls:
                assert delta.id is not None and delta.name is not None
                calls[delta.index] = [delta.id, delta.name, ""]
            calls[delta.index][2] += delta.arguments
    return ParsedOutput(
        "".join(reasoning) or None,
        "".join(content) or None,
        [ToolCall(*calls[index]) for index in sorted(calls)],
    )


CASES = [
    # Qwen3 thinking, then a call: the newlines before the call are content, as vLLM's hermes keeps them
    ("qwen3", "hermes", "<think>Let me check.</think>\n\n" + CALL, ParsedOutput("Let me check.", "\n\n", [WEATHER])),
    # the template opened <think>; the call ends the thinking (vLLM's qwen3 rule)
    ("qwen3", "hermes", "I need the weather.\n\n" + CALL, ParsedOutput("I need the weather.\n\n", None, [WEATHER])),
    # Qwen3 answering without a call
    ("qwen3", "hermes", "Hmm.</think>It is sunny.", ParsedOutput("Hmm.", "It is sunny.", [])),
    # a call written while thinking (DeepSeek-R1 has no <tool_call> rule) stays reasoning
    ("deepseek_r1", "hermes", "I could " + CALL + "</think>No tool needed.", ParsedOutput("I could " + CALL, "No tool needed.", [])),
    # cut short while thinking: no content, no call
    ("deepseek_r1", "hermes", "<think>Still thinking", ParsedOutput("Still thinking", None, [])),
    (None, "hermes", "Sure. " + CALL, ParsedOutput(None, "Sure. ", [WEATHER])),
    ("qwen3", None, "<think>a</think>b", ParsedOutput("a", "b", [])),
    (None, None, "plain", ParsedOutput(None, "plain", [])),
]  # fmt: skip


@pytest.mark.parametrize("reasoning, tools, text, expected", CASES)
def test_chained_whole_and_streamed(
    reasoning: str | None, tools: str | None, text: str, expected: ParsedOutput
) -> None:
    assert _parser(reasoning, tools).extract(text) == expected
    rng = random.Random(len(text))
    cuts = sorted(rng.sample(range(1, len(text)), min(8, len(text) - 1)))
    chunked = [text[start:end] for start, end in zip([0, *cuts], [*cuts, len(text)], strict=True)]
    for pieces in (list(text), chunked, [text]):
        assert "".join(pieces) == text
        assert _stream(_parser(reasoning, tools), pieces) == expected, pieces

