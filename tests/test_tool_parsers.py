"""Tool-call parsers (hermes, llama3_json, mistral, pythonic) on vLLM's own test cases.

Each case's whole-output result is checked against vLLM's expected calls; then the same
text is streamed one character at a time, in random-sized chunks, and (where vLLM gives
them) in vLLM's own token pieces, and the streamed content and calls must equal what
``extract`` gives: ids and names once per call, arguments concatenating to the exact
string. Plain Python, no model.
"""

from __future__ import annotations

import itertools
import json
import random
from collections.abc import Callable, Iterable

import pytest

from kvexport.errors import KvexportError
from kvexport.serving.tool_parsers import (
    TOOL_PARSERS,
    ExtractedToolCalls,
    NamedToolParser,
    RequiredToolParser,
    ToolCall,
    ToolCallDelta,
    ToolParser,
    UnknownParserError,
    choose_tool_parser,
    make_tool_call_id,
    tool_parser,
)
from kvexport.testing import chunkings


def _ids() -> Callable[[], str]:
    counter = itertools.count()
    return lambda: f"call-{next(counter)}"


def _parser(name: str) -> ToolParser:
    """A registered parser by name, or a forced tool_choice's: ``required``, ``named:<function>``."""
    if name == "required":
        return RequiredToolParser(_ids())
    if name.startswith("named:"):
        return NamedToolParser(name.removeprefix("named:"), _ids())
    return tool_parser(name, _ids())


def _extract(name: str, text: str) -> ExtractedToolCalls:
    return _parser(name).extract(text)


def _stream(name: str, pieces: Iterable[str]) -> tuple[str | None, list[ToolCall]]:
    """Stream ``pieces``; check each call's id and name come once, first; give (content, calls)."""
    parser = _parser(name)
    content: list[str] = []
    deltas: list[ToolCallDelta] = []
    for piece in pieces:
        step = parser.stream(piece)
        indices = [delta.index for delta in step.tool_calls]
        assert len(indices) == len(set(indices)), "one piece per call and step"
        content.append(step.content)
        deltas += step.tool_calls
    end = parser.finish()
    content.append(end.content)
    deltas += end.tool_calls
    calls: dict[int, list[str]] = {}
    for delta in deltas:
        if delta.index not in calls:
            assert delta.index == len(calls), "calls are numbered in order"
            assert delta.id is not None and delta.name is not None, "the first piece names the call"
            calls[delta.index] = [delta.id, delta.name, delta.arguments]
        else:
            assert delta.id is None and delta.name is None, "id and name are sent once"
            calls[delta.index][2] += delta.arguments
    return "".join(content) or None, [ToolCall(*calls[index]) for index in sorted(calls)]


def _assert_streams_as_extract(name: str, text: str, tokens: list[str] | None = None) -> None:
    whole = _extract(name, text)
    for pieces in chunkings(text, tokens):
        assert "".join(pieces) == text
        content, calls = _stream(name, pieces)
        assert calls == whole.tool_calls, pieces
        assert content == (whole.content or None), pieces


def _assert_calls(
    result: ExtractedToolCalls, expected: list[tuple[str, str]], content: str | None
) -> None:
    assert result.tools_called is bool(expected)
    assert [(call.name, call.arguments) for call in result.tool_calls] == expected
    assert all(call.type == "function" for call in result.tool_calls)
    assert result.content == content


# --- hermes: vLLM tests/entrypoints/openai/tool_parsers/test_hermes_tool_parser.py ---

HERMES_QUESTION = "5MW燃气轮机设计参数 空气流量 压气机压比 转速 燃烧室出口温度 压气机级数 支点布局"
HERMES_EXPECTED = [
    ("internet_search", json.dumps({"question": HERMES_QUESTION}, ensure_ascii=False))
]
# STREAM_FUNCTION_OUTPUT_SIMPLIFICATION, vLLM's token pieces of the call
HERMES_TOKENS = [
    "<tool_call>", "\n", '{"', "name", '":', ' "', "internet", "_search", '",', ' "', "arguments",
    '":', ' {"', "question", '":', ' "', "5", "MW", "燃气", "轮", "机", "设计", "参数", "", "",
    " 空", "气", "流量", "", "", " 压", "气", "机", "压", "比", "", "", " 转", "速", "", "",
    " 燃", "烧", "室", "出口", "温度", "", "", " 压", "气", "机", "级", "数", "", " 支", "点",
    "布局", '"}', "}\n", "</tool_call>", "",
]  # fmt: skip
HERMES_CALL_TEXT = "".join(HERMES_TOKENS)
# NO_STREAM_FUNCTION_OUTPUT's end (its reasoning shortened): the text before the call is content
HERMES_AFTER_THINKING = "总结下来，给出一个范例参数。\n</think>\n\n" + HERMES_CALL_TEXT + "\n\n "


def test_hermes_vllm_stream_case() -> None:
    _assert_calls(_extract("hermes", HERMES_CALL_TEXT), HERMES_EXPECTED, None)
    _assert_streams_as_extract("hermes", HERMES_CALL_TEXT, HERMES_TOKENS)


def test_hermes_vllm_no_stream_case() -> None:
    result = _extract("hermes", HERMES_AFTER_THINKING)
    _assert_calls(result, HERMES_EXPECTED, "总结下来，给出一个范例参数。\n</think>\n\n")
    assert result.tool_calls[0].id == "call-0"
    _assert_streams_as_extract("hermes", HERMES_AFTER_THINKING)


HERMES_CASES = [
    # the Qwen3 cases of vLLM's newer test_hermes_tool_parser.py:
    # test_hermes_parser_streaming_just_forward_text
    (
        "This is some prior text that has nothing to do with tool calling.",
        [],
        "This is some prior text that has nothing to do with tool calling.",
    ),
    # test_hermes_parser_streaming_failure_case_bug_19056, ..._non_streaming_tool_call_between_tags
    (
        '<tool_call>\n{"name": "final_answer", "arguments": {"trigger": true}}\n</tool_call>',
        [("final_answer", '{"trigger": true}')],
        None,
    ),
    # test_hermes_parser_non_streaming_tool_call_until_eos
    (
        '<tool_call>\n{"name": "final_answer", "arguments": {"trigger": true}}',
        [("final_answer", '{"trigger": true}')],
        None,
    ),
    # test_hermes_parser_streaming: vLLM streams the arguments' raw text ('{"location":"San
    # Francisco, ...'), where its extract gives json.dumps' form; here both give the latter
    (
        '<tool_call>{"name": "get_current_temperature","arguments": {"location":'
        '"San Francisco, California, United States", "unit": "celsius"}}</tool_call>',
        [
            (
                "get_current_temperature",
                '{"location": "San Francisco, California, United States", "unit": "celsius"}',
            )
        ],
        None,
    ),
    # ours: no call; several calls with text before, between and after (dropped, as vLLM's regex does)
    ("How can I help you today?", [], "How can I help you today?"),
    (
        'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Dallas", "unit": "fahrenheit"}}\n</tool_call>\n'
        '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>\nbye',
        [("get_weather", '{"city": "Dallas", "unit": "fahrenheit"}'), ("get_time", "{}")],
        "Let me check.\n",
    ),
    # the last block may lack its closing tag (vLLM's regex's second alternative)
    (
        '<tool_call>{"name": "f", "arguments": {"a": [1, 2.50, -3e2, true, null]}}',
        [("f", '{"a": [1, 2.5, -300.0, true, null]}')],
        None,
    ),
    # arguments before the name; escapes re-serialized as json.dumps(ensure_ascii=False) writes them
    (
        '<tool_call>{"arguments": {"s": "caf\\u00e9 \\ud83d\\ude00 \\"q\\" \\/ \\t"}, "name": "echo"}</tool_call>',
        [("echo", json.dumps({"s": 'café 😀 "q" / \t'}, ensure_ascii=False))],
        None,
    ),
    # an arguments value that is a string, as some models write it, is kept as the JSON string
    (
        '<tool_call>{"name": "f", "arguments": "{\\"a\\": 1}"}</tool_call>',
        [("f", '"{\\"a\\": 1}"')],
        None,
    ),
    # a tag-like prefix that is not a tag stays content
    ("a <tool_c b <tool", [], "a <tool_c b <tool"),
]


@pytest.mark.parametrize("text, expected, content", HERMES_CASES)
def test_hermes(text: str, expected: list[tuple[str, str]], content: str | None) -> None:
    _assert_calls(_extract("hermes", text), expected, content)
    _assert_streams_as_extract("hermes", text)


def test_hermes_invalid_json_until_eos() -> None:
    # test_hermes_parser_non_streaming_tool_call_invalid_json: missing closing brace
    text = '<tool_call>\n{"name": "final_answer", "arguments": {"trigger": true}'
    _assert_calls(_extract("hermes", text), [], text)


HERMES_MALFORMED = [
    "<tool_call>not json</tool_call>",  # vLLM: invalid JSON inside <tool_call> is content
    'Sure. <tool_call>{"name": "f"}</tool_call>',  # no arguments
    '<tool_call>{"arguments": {}}</tool_call>',  # no name
    '<tool_call>{"name": 3, "arguments": {}}</tool_call>',
    "<tool_call></tool_call>",
    '<tool_call>{"name": "f", "arguments": NaN}</tool_call>',
    "<tool_call>",
]


@pytest.mark.parametrize("text", HERMES_MALFORMED)
def test_hermes_malformed_is_content(text: str) -> None:
    _assert_calls(_extract("hermes", text), [], text)
    _assert_streams_as_extract("hermes", text)


@pytest.mark.parametrize(
    "text, sent, rest",
    [
        (
            '<tool_call>{"name": "f", "arguments": {"a": oops}}</tool_call>',
            '{"a": ',
            "oops}}</tool_call>",
        ),
        (
            '<tool_call>{"name": "f", "arguments": {"a": 01}}</tool_call>',
            '{"a": ',
            "}}</tool_call>",
        ),
    ],
)
def test_a_call_broken_after_its_name_was_sent_leaves_the_rest_as_content(
    text: str, sent: str, rest: str
) -> None:
    # streaming can't take back the name; extract (as vLLM's) makes the whole output content
    assert _extract("hermes", text).content == text
    content, calls = _stream("hermes", list(text))
    assert [(call.name, call.arguments) for call in calls] == [("f", sent)]
    assert content == rest


def test_no_partial_tag_reaches_the_content() -> None:
    parser = tool_parser("hermes", _ids())
    sent = "".join(parser.stream(char).content for char in "Hi <tool_c")
    assert sent == "Hi "
    assert parser.stream("all>").content == ""
    parser = tool_parser("mistral", _ids())
    assert "".join(parser.stream(char).content for char in "ok [TOOL_") == "ok "


# --- llama3_json: vLLM tests/entrypoints/openai/tool_parsers/test_llama3_json_tool_parser.py ---

LLAMA_CASES = [
    # test_extract_tool_calls_simple: text around the call is dropped, content None
    (
        'Here is the result: {"name": "getOpenIncidentsTool", "parameters": {}} Would you like to know more?',
        [("getOpenIncidentsTool", "{}")],
        None,
    ),
    # test_extract_tool_calls_with_arguments
    (
        '{"name": "searchTool", "parameters": {"query": "test query", "limit": 10}}',
        [("searchTool", '{"query": "test query", "limit": 10}')],
        None,
    ),
    # test_extract_tool_calls_no_json
    (
        "This is just some text without any tool calls",
        [],
        "This is just some text without any tool calls",
    ),
    # test_extract_tool_calls_invalid_json
    (
        '{"name": "invalidTool", "parameters": {invalid json}',
        [],
        '{"name": "invalidTool", "parameters": {invalid json}',
    ),
    # test_extract_tool_calls_with_arguments_key
    (
        '{"name": "searchTool", "arguments": {"query": "test"}}',
        [("searchTool", '{"query": "test"}')],
        None,
    ),
    # test_extract_tool_calls_multiple_json
    (
        '{"name": "searchTool", "parameters": {"query": "test1"}}; '
        '{"name": "getOpenIncidentsTool", "parameters": {}}; '
        '{"name": "searchTool", "parameters": {"query": "test2"}}',
        [
            ("searchTool", '{"query": "test1"}'),
            ("getOpenIncidentsTool", "{}"),
            ("searchTool", '{"query": "test2"}'),
        ],
        None,
    ),
    # test_extract_tool_calls_multiple_json_with_whitespace
    (
        '{"name": "searchTool", "parameters": {"query": "test1"}} ; '
        '{"name": "getOpenIncidentsTool", "parameters": {}} ; '
        '{"name": "searchTool", "parameters": {"query": "test2"}}',
        [
            ("searchTool", '{"query": "test1"}'),
            ("getOpenIncidentsTool", "{}"),
            ("searchTool", '{"query": "test2"}'),
        ],
        None,
    ),
    # test_extract_tool_calls_multiple_json_with_surrounding_text
    (
        "Here are the results: "
        '{"name": "searchTool", "parameters": {"query": "test1"}}; '
        '{"name": "getOpenIncidentsTool", "parameters": {}}; '
        '{"name": "searchTool", "parameters": {"query": "test2"}} '
        "Would you like to know more?",
        [
            ("searchTool", '{"query": "test1"}'),
            ("getOpenIncidentsTool", "{}"),
            ("searchTool", '{"query": "test2"}'),
        ],
        None,
    ),
    # test_extract_tool_calls_deeply_nested_json
    (
        '{"name": "complexTool", "parameters": {"level1": {"level2": {"level3": {"level4": {"value": "deep"}}}}}}',
        [("complexTool", '{"level1": {"level2": {"level3": {"level4": {"value": "deep"}}}}}')],
        None,
    ),
    # test_extract_tool_calls_multiple_with_deep_nesting
    (
        '{"name": "simpleTool", "parameters": {"value": "test"}}; '
        '{"name": "complexTool", "parameters": {"config": {"database": {"connection": {"pool": {"size": 10}}}}}}',
        [
            ("simpleTool", '{"value": "test"}'),
            ("complexTool", '{"config": {"database": {"connection": {"pool": {"size": 10}}}}}'),
        ],
        None,
    ),
    # test_extract_tool_calls_with_quotes_and_brackets_in_string
    (
        '{"name": "searchTool", "parameters": {"query": "test {value} [complex]","nested": {"inner": "more {brackets}"}}}',
        [
            (
                "searchTool",
                '{"query": "test {value} [complex]", "nested": {"inner": "more {brackets}"}}',
            )
        ],
        None,
    ),
    # test_extract_tool_calls_with_escaped_quotes_in_nested_json
    (
        '{"name": "parserTool", "parameters": {"text": "He said \\"Hello {world}\\""}}',
        [("parserTool", '{"text": "He said \\"Hello {world}\\""}')],
        None,
    ),
    # ours: after <|python_tag|>, as Llama 3.1 writes a call
    (
        '<|python_tag|>{"name": "get_weather", "parameters": {"city": "SF"}}',
        [("get_weather", '{"city": "SF"}')],
        None,
    ),
]


@pytest.mark.parametrize("text, expected, content", LLAMA_CASES)
def test_llama3_json(text: str, expected: list[tuple[str, str]], content: str | None) -> None:
    _assert_calls(_extract("llama3_json", text), expected, content)
    # vLLM streams calls only when the output opens with them (extract finds them after prose
    # too); the invalid case's name goes out before the JSON breaks
    opens_with_calls = text.startswith(("{", "<|python_tag|>"))
    if (opens_with_calls or not expected) and "invalid json" not in text:
        _assert_streams_as_extract("llama3_json", text)


def test_llama3_json_prose_first_streams_as_content() -> None:
    text = LLAMA_CASES[0][0]
    content, calls = _stream("llama3_json", list(text))
    assert calls == [] and content == text


def test_llama3_json_rejects_both_keys() -> None:
    text = '{"name": "f", "arguments": {}, "parameters": {}}'
    assert _extract("llama3_json", text).tools_called is False


# --- mistral: vLLM tests/tool_use/test_mistral_tool_parser.py ---

MISTRAL_CASES = [
    # test_extract_tool_calls_no_tools
    ("This is a test", [], "This is a test"),
    # test_extract_tool_calls: single_tool_add, single_tool_weather, argument_before_name,
    # argument_before_name_and_name_in_argument
    (
        '[TOOL_CALLS][{"name": "add", "arguments":{"a": 3.5, "b": 4}}]',
        [("add", json.dumps({"a": 3.5, "b": 4}))],
        None,
    ),
    (
        '[TOOL_CALLS] [{"name": "get_current_weather", "arguments":{"city": "San Francisco", "state": "CA", "unit": "celsius"}}]',
        [
            (
                "get_current_weather",
                json.dumps({"city": "San Francisco", "state": "CA", "unit": "celsius"}),
            )
        ],
        None,
    ),
    (
        '[TOOL_CALLS] [{"arguments":{"city": "San Francisco", "state": "CA", "unit": "celsius"}, "name": "get_current_weather"}]',
        [
            (
                "get_current_weather",
                json.dumps({"city": "San Francisco", "state": "CA", "unit": "celsius"}),
            )
        ],
        None,
    ),
    (
        '[TOOL_CALLS] [{"arguments":{"name": "John Doe"}, "name": "get_age"}]',
        [("get_age", json.dumps({"name": "John Doe"}))],
        None,
    ),
    # test_extract_tool_calls_streaming: single_tool_add, single_tool_add_strings
    (
        '[TOOL_CALLS]  [ {"name":"add" , "arguments" : {"a": 3, "b": 4} } ]',
        [("add", json.dumps({"a": 3, "b": 4}))],
        None,
    ),
    (
        '[TOOL_CALLS] [{"name": "add", "arguments":{"a": "3", "b": "4"}}]',
        [("add", json.dumps({"a": "3", "b": "4"}))],
        None,
    ),
    # test_extract_tool_calls_v11_tokenizer: single_tool_add, single_tool_weather
    ('[TOOL_CALLS]add{"a": 3.5, "b": 4}', [("add", json.dumps({"a": 3.5, "b": 4}))], None),
    (
        '[TOOL_CALLS]get_current_weather{"city": "San Francisco", "state": "CA", "unit": "celsius"}',
        [
            (
                "get_current_weather",
                json.dumps({"city": "San Francisco", "state": "CA", "unit": "celsius"}),
            )
        ],
        None,
    ),
    # ours: v11, two calls, content before, text after dropped
    (
        'Sure.[TOOL_CALLS]add{"a": 1}[TOOL_CALLS]get_age{"name": "Jo"} bye',
        [("add", '{"a": 1}'), ("get_age", '{"name": "Jo"}')],
        "Sure.",
    ),
    ("[TOOL_CALLS]add", [], "[TOOL_CALLS]add"),
    ("[TOOL_CALLS]add {}", [], "[TOOL_CALLS]add {}"),
    # ours: two calls, content before the tag
    (
        'Calling.[TOOL_CALLS][{"name": "add", "arguments": {"a": 3.5, "b": 4}}, {"name": "get_age", "arguments": {"name": "Jo"}}]',
        [("add", json.dumps({"a": 3.5, "b": 4})), ("get_age", json.dumps({"name": "Jo"}))],
        "Calling.",
    ),
    # ours: malformed
    ("[TOOL_CALLS] not a list", [], "[TOOL_CALLS] not a list"),
    ("[TOOL_CALLS][]", [], "[TOOL_CALLS][]"),
    ('[TOOL_CALLS][{"name": "add"', [], '[TOOL_CALLS][{"name": "add"'),
]


@pytest.mark.parametrize("text, expected, content", MISTRAL_CASES)
def test_mistral(text: str, expected: list[tuple[str, str]], content: str | None) -> None:
    _assert_calls(_extract("mistral", text), expected, content)
    _assert_streams_as_extract("mistral", text)


def test_mistral_ids_are_nine_characters() -> None:
    # vLLM's assert_tool_calls: len(tool_call.id) == 9
    result = tool_parser("mistral").extract(MISTRAL_CASES[1][0])
    assert len(result.tool_calls[0].id) == 9 and result.tool_calls[0].id.isalnum()


# --- pythonic: vLLM tests/entrypoints/openai/tool_parsers/test_pythonic_tool_parser.py ---

SIMPLE = (
    "get_weather(city='San Francisco', metric='celsius')",
    ("get_weather", '{"city": "San Francisco", "metric": "celsius"}'),
)
MORE_TYPES = (
    "register_user(name='John Doe', age=37, address={'city': 'San Francisco', 'state': 'CA'}, "
    "role=None, passed_test=True, aliases=['John', 'Johnny'])",
    (
        "register_user",
        '{"name": "John Doe", "age": 37, "address": {"city": "San Francisco", "state": "CA"}, '
        '"role": null, "passed_test": true, "aliases": ["John", "Johnny"]}',
    ),
)
PARAMETERLESS = ("get_weather()", ("get_weather", "{}"))
EMPTY_DICT = (
    "do_something_cool(additional_data={})",
    ("do_something_cool", '{"additional_data": {}}'),
)
EMPTY_LIST = ("do_something_cool(steps=[])", ("do_something_cool", '{"steps": []}'))
ESCAPED = (
    r"get_weather(city='Martha\'s Vineyard', metric='\"cool units\"')",
    ("get_weather", '{"city": "Martha\'s Vineyard", "metric": "\\"cool units\\""}'),
)

PYTHONIC_CASES = [
    *[
        (f"[{output}]", [call])
        for output, call in (SIMPLE, MORE_TYPES, PARAMETERLESS, EMPTY_DICT, EMPTY_LIST, ESCAPED)
    ],
    (f"[{SIMPLE[0]}, {MORE_TYPES[0]}]", [SIMPLE[1], MORE_TYPES[1]]),  # parallel_calls
    ("  [f(x=-1, y=2.5)]\n", [("f", '{"x": -1, "y": 2.5}')]),  # ours: negatives, whitespace
]


@pytest.mark.parametrize("text, expected", PYTHONIC_CASES)
def test_pythonic(text: str, expected: list[tuple[str, str]]) -> None:
    _assert_calls(_extract("pythonic", text), expected, None)
    _assert_streams_as_extract("pythonic", text)


PYTHONIC_CONTENT = [
    "How can I help you today?",  # test_no_tool_call
    "hello world[A(A=" + "\t)A(A=,\t" * 2,  # test_regex_timeout_handling's input: content
    "[1, 2, 3]",  # ours: a list that is not calls
    "[f(x=open('/etc/passwd'))]",  # ours: only literals
    "[f('positional')]",
    "[f(x=1)] and more",
    "[f(x=1",
]


@pytest.mark.parametrize("text", PYTHONIC_CONTENT)
def test_pythonic_content(text: str) -> None:
    _assert_calls(_extract("pythonic", text), [], text)
    content, calls = _stream("pythonic", list(text))
    if text.endswith("and more"):
        # the list closed and was sent; the prose after it is dropped (extract: all content)
        assert [call.name for call in calls] == ["f"] and content is None
    else:
        assert calls == [] and content == text


def test_pythonic_large_steps() -> None:
    # test_streaming_tool_call_with_large_steps
    pieces = [
        "[get_weather(city='San",
        f" Francisco', metric='celsius'), {PARAMETERLESS[0]}, {EMPTY_LIST[0]}]",
    ]
    content, calls = _stream("pythonic", pieces)
    assert content is None
    assert [(call.name, call.arguments) for call in calls] == [
        SIMPLE[1],
        PARAMETERLESS[1],
        EMPTY_LIST[1],
    ]


# --- registry, ids, template rule ---


def test_registry_names() -> None:
    assert sorted(TOOL_PARSERS) == ["hermes", "llama3_json", "mistral", "pythonic"]
    assert all(isinstance(tool_parser(name), ToolParser) for name in TOOL_PARSERS)


def test_unknown_parser_is_refused_naming_the_known_ones() -> None:
    with pytest.raises(UnknownParserError) as raised:
        tool_parser("qwen3_coder")
    assert (
        str(raised.value)
        == "unknown tool-call parser 'qwen3_coder'; known: hermes, llama3_json, mistral, pythonic"
    )
    assert isinstance(raised.value, KvexportError)


def test_default_ids_look_like_vllms() -> None:
    made = make_tool_call_id()
    assert made.startswith("chatcmpl-tool-") and len(made) == len("chatcmpl-tool-") + 32
    result = tool_parser("hermes").extract(HERMES_CALL_TEXT)
    assert result.tool_calls[0].id.startswith("chatcmpl-tool-")
    assert result.tool_calls[0].to_openai() == {
        "id": result.tool_calls[0].id,
        "type": "function",
        "function": {"name": "internet_search", "arguments": HERMES_EXPECTED[0][1]},
    }
    assert ToolCallDelta(0, "x", "f", "{").to_openai() == {
        "index": 0, "id": "x", "type": "function", "function": {"name": "f", "arguments": "{"},
    }  # fmt: skip
    assert ToolCallDelta(0, None, None, "}").to_openai() == {
        "index": 0,
        "function": {"arguments": "}"},
    }


QWEN_TEMPLATE = '{%- if tools %}...<tools>\n{%- endfor %}\n</tools>...<tool_call>\\n{\\"name\\": ...}\\n</tool_call>'
LLAMA31_TEMPLATE = (
    "<|start_header_id|>assistant<|end_header_id|>\\n\\n{{- '<|python_tag|>' + tool_call.name }}"
    "{{- '{\"name\": \"' + tool_call.name + '\", ' }}{{- '\"parameters\": ' }}"
)
LLAMA32_TEMPLATE = '<|start_header_id|>assistant<|end_header_id|>{{- \'{"name": "\' + tool_call.name + \'", "parameters": \' }}'
MISTRAL_TEMPLATE = "{%- if message.tool_calls %}{{- '[TOOL_CALLS][' }}...{{- '[/TOOL_CALLS]' }}"
# lines of vLLM's examples/tool_chat_template_llama3.2_pythonic.jinja and tool_chat_template_llama3.1_json.jinja
VLLM_PYTHONIC_TEMPLATE = (
    '{{- "<|start_header_id|>system<|end_header_id|>\\n\\n" }}\n'
    "{{- 'Respond in the format [func_name1(params_name1=params_value1, params_name2=params_value2...), func_name2(params)] ' }}\n"
    "{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n[' -}}"
)
VLLM_LLAMA31_JSON_TEMPLATE = (
    '{{- \'Respond in the format {"name": function name, "parameters": dictionary of argument name and its value}. \' }}\n'
    "{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' -}}\n"
    "{{- '{\"name\": \"' + tool_call.name|trim + '\", ' }}\n"
    "{{- '\"parameters\": ' }}"
)
SMOLLM_TEMPLATE = "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n{% endfor %}"


@pytest.mark.parametrize(
    "template, expected",
    [
        (QWEN_TEMPLATE, "hermes"),
        (LLAMA31_TEMPLATE, "llama3_json"),
        (LLAMA32_TEMPLATE, "llama3_json"),
        (MISTRAL_TEMPLATE, "mistral"),
        (VLLM_PYTHONIC_TEMPLATE, "pythonic"),
        (VLLM_LLAMA31_JSON_TEMPLATE, "llama3_json"),
        (SMOLLM_TEMPLATE, None),
        ("", None),
    ],
)
def test_choose_tool_parser(template: str, expected: str | None) -> None:
    assert choose_tool_parser(template) == expected


# --- the streaming JSON reader against json.dumps(json.loads(...)) on random JSON ---


def _random_json(rng: random.Random, depth: int = 0) -> str:
    """A random JSON text with free whitespace, escapes, numbers in odd spellings."""
    space = lambda: rng.choice(["", "", " ", "\n  ", "\t"])  # noqa: E731
    kind = rng.choice(["obj", "arr", "str", "num", "lit"] if depth < 4 else ["str", "num", "lit"])
    if kind == "obj":
        members = [
            f"{space()}{_random_string(rng)}{space()}:{space()}{_random_json(rng, depth + 1)}{space()}"
            for _ in range(rng.randint(0, 4))
        ]
        return "{" + ",".join(members) + space() + "}"
    if kind == "arr":
        items = [
            f"{space()}{_random_json(rng, depth + 1)}{space()}" for _ in range(rng.randint(0, 4))
        ]
        return "[" + ",".join(items) + space() + "]"
    if kind == "str":
        return _random_string(rng)
    if kind == "num":
        return rng.choice(
            ["0", "-0", "12", "-3.250", "1e5", "1E-2", "2.5e+3", "10.0", "123456789012345678901"]
        )
    return rng.choice(["true", "false", "null"])


def _random_string(rng: random.Random) -> str:
    pieces = ["a", "Z", " ", "é", "燃", "😀", "\\n", "\\t", '\\"', "\\\\", "\\/", "\\u00e9", "\\u0001",
              "\\ud83d\\ude00", "\\ud800", "\\u2028", "{", "}", "<", "\\b", "\\f"]  # fmt: skip
    return '"' + "".join(rng.choice(pieces) for _ in range(rng.randint(0, 6))) + '"'


def _has_repeated_key(text: str) -> bool:
    repeated = False

    def pairs(items: list[tuple[str, object]]) -> dict[str, object]:
        nonlocal repeated
        repeated = repeated or len({key for key, _ in items}) < len(items)
        return dict(items)

    json.loads(text, object_pairs_hook=pairs)
    return repeated


@pytest.mark.parametrize("seed", range(60))
def test_streamed_arguments_equal_json_dumps(seed: int) -> None:
    rng = random.Random(seed)
    arguments = _random_json(rng)
    while _has_repeated_key(arguments):  # json.loads keeps the last; the stream sent both
        arguments = _random_json(rng)
    text = f'<tool_call>\n{{"name": "f", "arguments": {arguments}}}\n</tool_call>'
    expected = json.dumps(json.loads(arguments), ensure_ascii=False)
    _assert_calls(_extract("hermes", text), [("f", expected)], None)
    _assert_streams_as_extract("hermes", text)


# tool_choice "required" and a named function: the grammar's forms (vLLM's), not a model's own
@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ('[{"name":"get_weather","parameters":{"city":"Paris","days":3}}]', [("get_weather", '{"city": "Paris", "days": 3}')]),
        (' [{"name": "a", "parameters": {}}, {"name": "b", "parameters": {"x": [1, 2.5, null]}}]',
         [("a", "{}"), ("b", '{"x": [1, 2.5, null]}')]),
        ('[{"name":"a","parameters":{"s":"\\u00e9\\n"}}]', [("a", '{"s": "é\\n"}')]),
    ],
)
def test_required_reads_the_listed_calls_whole_and_streamed(text: str, expected: list[tuple[str, str]]) -> None:
    _assert_calls(_extract("required", text), expected, None)
    _assert_streams_as_extract("required", text)


@pytest.mark.parametrize("text", ['{"name": "a"}', "[]", "[1]", '[{"name": "a", "parameters": {}}', "plain text"])
def test_required_output_that_is_not_a_list_of_calls_is_content(text: str) -> None:
    _assert_calls(_extract("required", text), [], text)


def test_a_named_function_reads_its_arguments_object_whole_and_streamed() -> None:
    text = '{"zone":"CET","hours":[1,2]}'
    _assert_calls(_extract("named:get_time", text), [("get_time", '{"zone": "CET", "hours": [1, 2]}')], None)
    _assert_streams_as_extract("named:get_time", text)
    _assert_calls(_extract("named:get_time", "[1]"), [], "[1]")
