"""Reasoning parsers (qwen3, deepseek_r1) on vLLM's own test cases, whole and streamed.

Each case is split whole (``extract``) and streamed one character at a time, in random
chunks and in vLLM's multi-token deltas; the concatenated reasoning and content pieces must
equal the whole split (an empty string standing for None), and no part of a tag may reach
either. Plain Python, no model.
"""

from __future__ import annotations

from collections.abc import Iterable

import pytest

from kvexport.errors import KvexportError
from kvexport.serving.reasoning import (
    REASONING_PARSERS,
    ReasoningParser,
    UnknownReasoningParserError,
    reasoning_parser,
)
from kvexport.testing import chunkings


def _stream(parser: ReasoningParser, pieces: Iterable[str]) -> tuple[str | None, str | None]:
    reasoning: list[str] = []
    content: list[str] = []
    for piece in pieces:
        step = parser.stream(piece)
        reasoning.append(step.reasoning)
        content.append(step.content)
    end = parser.finish()
    reasoning.append(end.reasoning)
    content.append(end.content)
    return "".join(reasoning) or None, "".join(content) or None


def _check(
    name: str, output: str, reasoning: str | None, content: str | None, *, thinking: bool = True
) -> None:
    assert reasoning_parser(name, thinking).extract(output) == (reasoning, content)
    for pieces in chunkings(output):
        streamed = _stream(reasoning_parser(name, thinking), pieces)
        assert streamed == (reasoning or None, content or None), pieces


# --- qwen3: vLLM tests/reasoning/test_qwen3_reasoning_parser.py (TEST_CASES) ---

TOOL_CALL_BODY = "<tool_call>\n<function=bash>\n<parameter=command>\ncat /etc/hosts\n</parameter>\n</function>\n</tool_call>"

QWEN3_CASES = [
    # WITHOUT_START_TOKEN: <think> in the prompt, only </think> in the output (typical)
    ("This is a reasoning section</think>This is the rest", "This is a reasoning section", "This is the rest"),
    # WITHOUT_START_TOKEN_COMPLETE_REASONING
    ("This is a reasoning section</think>", "This is a reasoning section", None),
    # WITH_THINK
    ("<think>This is a reasoning section</think>This is the rest", "This is a reasoning section", "This is the rest"),
    # WITHOUT_THINK: thinking enabled and no tags: cut short, all reasoning
    ("This is the rest", "This is the rest", None),
    # COMPLETE_REASONING
    ("<think>This is a reasoning section</think>", "This is a reasoning section", None),
    # MULTILINE_REASONING
    ("<think>This is a reasoning\nsection</think>This is the rest\nThat", "This is a reasoning\nsection", "This is the rest\nThat"),
    # ONLY_OPEN_TAG
    ("<think>This is a reasoning section", "This is a reasoning section", None),
    # TRUNCATED_NO_START_TOKEN
    ("This is a reasoning section", "This is a reasoning section", None),
    # TOOL_CALL_NO_THINK_END: <tool_call> without </think> ends the reasoning
    ("I need to read the file.\n\n" + TOOL_CALL_BODY, "I need to read the file.\n\n", TOOL_CALL_BODY),
    # TOOL_CALL_WITH_THINK_NO_END
    ("<think>I need to read the file.\n\n" + TOOL_CALL_BODY, "I need to read the file.\n\n", TOOL_CALL_BODY),
]  # fmt: skip


@pytest.mark.parametrize("output, reasoning, content", QWEN3_CASES)
def test_qwen3(output: str, reasoning: str | None, content: str | None) -> None:
    _check("qwen3", output, reasoning, content)


# MULTI_TOKEN_DELTA_CASES: deltas holding several tokens must not leak <think>
QWEN3_DELTAS = [
    (["<think>This is a reasoning section", "</think>", "This is the rest"], "This is a reasoning section", "This is the rest"),
    (["reasoning section", "</think>This is the rest"], "reasoning section", "This is the rest"),
    (["<think>reasoning</think>"], "reasoning", None),
    (["reasoning section", "</think>content"], "reasoning section", "content"),
    (["I need to read the file.\n\n", "<tool_call>\n<function=bash>"], "I need to read the file.\n\n", "<tool_call>\n<function=bash>"),
]  # fmt: skip


@pytest.mark.parametrize("deltas, reasoning, content", QWEN3_DELTAS)
def test_qwen3_multi_token_deltas(deltas: list[str], reasoning: str, content: str | None) -> None:
    assert _stream(reasoning_parser("qwen3"), deltas) == (reasoning, content)


# THINKING_DISABLED_CASES: enable_thinking=False, output without </think> is all content
@pytest.mark.parametrize(
    "output",
    [
        "This is plain content",
        "Some output without think tokens",
        "I need to read the file.\n\n" + TOOL_CALL_BODY,
    ],
)
def test_qwen3_thinking_disabled(output: str) -> None:
    _check("qwen3", output, None, output, thinking=False)


# --- deepseek_r1: vLLM tests/reasoning/test_deepseekr1_reasoning_parser.py (TEST_CASES) ---

DEEPSEEK_CASES = [
    # SIMPLE_REASONING
    ("This is a reasoning section</think>This is the rest", "This is a reasoning section", "This is the rest"),
    # COMPLETE_REASONING
    ("This is a reasoning section</think>", "This is a reasoning section", None),
    # NO_CONTENT
    ("This is content", "This is content", None),
    # MULTIPLE_LINES
    ("This\nThat</think>This is the rest\nThat", "This\nThat", "This is the rest\nThat"),
    # SHORTEST_REASONING_NO_STREAMING (streamed: reasoning None, i.e. nothing sent)
    ("</think>This is the rest", "", "This is the rest"),
    # REASONING_WITH_THINK
    ("<think>This is a reasoning section</think>This is the rest", "This is a reasoning section", "This is the rest"),
    # COMPLETE_REASONING_WITH_THINK
    ("<think>This is a reasoning section</think>", "This is a reasoning section", None),
    # MULTIPLE_LINES_WITH_THINK
    ("<think>This\nThat</think>This is the rest\nThat", "This\nThat", "This is the rest\nThat"),
    # THINK_NO_END
    ("<think>This is a reasoning section", "This is a reasoning section", None),
    # EMPTY (streamed: EMPTY_STREAMING, reasoning None)
    ("", "", None),
    # NEW_LINE: the newline before <think> is dropped; vLLM's streaming keeps it in the reasoning
    # (NEW_LINE_STREAMING), this one holds leading whitespace until it can tell
    ("\n<think>This is a reasoning section</think>\nThis is the rest", "This is a reasoning section", "\nThis is the rest"),
    # ours: a </think> cut across chunks never shows in either
    ("abc</thi", "abc</thi", None),
    # ours: qwen3's <tool_call> rule is not deepseek_r1's
    ("x" + TOOL_CALL_BODY, "x" + TOOL_CALL_BODY, None),
]  # fmt: skip


@pytest.mark.parametrize("output, reasoning, content", DEEPSEEK_CASES)
def test_deepseek_r1(output: str, reasoning: str | None, content: str | None) -> None:
    _check("deepseek_r1", output, reasoning, content)


def test_no_partial_tag_is_sent() -> None:
    parser = reasoning_parser("deepseek_r1")
    sent = [parser.stream(char) for char in "think</thin"]
    assert "".join(step.reasoning for step in sent) == "think"
    assert "".join(step.content for step in sent) == ""
    assert parser.stream("k>ok") == ("", "ok")
    parser = reasoning_parser("qwen3")
    assert parser.stream("<thi") == ("", "")
    assert parser.stream("nk>a<tool") == ("a", "")


def test_registry_and_refusal() -> None:
    assert sorted(REASONING_PARSERS) == ["deepseek_r1", "qwen3"]
    with pytest.raises(UnknownReasoningParserError) as raised:
        reasoning_parser("granite")
    assert str(raised.value) == "unknown reasoning parser 'granite'; known: deepseek_r1, qwen3"
    assert isinstance(raised.value, KvexportError)
