"""Tools and reasoning on ``/v1/chat/completions`` end to end, as vLLM serves them, with the ``openai`` SDK.

The server is the trained test checkpoint (tests/data/tiny-trained) with Qwen3's own chat
template (tests/data/templates/qwen3.jinja): it renders tools and thinking, and implies
the ``hermes`` tool-call parser and the ``qwen3`` reasoning parser. Its tool prompt (about
300 tokens) is longer than the checkpoint's 256 positions, so requests that generate keep
the prompt's last 128 tokens (``truncate_prompt_tokens``); rendering is checked whole
through ``/tokenize``, against transformers' ``apply_chat_template``. A trained model this
small never writes a call on its own: ``required`` and named calls are enforced by the
grammar, and ``auto`` reads calls the model was made to write by a regex.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import jsonschema
import pytest
from tokenizers import Tokenizer

from kvexport.serving.config import ApiConfig
from tests.conftest import TRAINED
from tests.test_examples import _example
from tests.test_serving import _server

ROOT = Path(__file__).parent.parent
QWEN3 = ROOT / "tests" / "data" / "templates" / "qwen3.jinja"
COMPACT = ROOT / "tests" / "data" / "templates" / "compact-tools.jinja"
TOKENIZER = Tokenizer.from_file(str(TRAINED / "tokenizer.json"))
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "days": {"type": "integer", "minimum": 1, "maximum": 7}},
            "required": ["city"],
        },
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "parameters": {"type": "object", "properties": {"zone": {"type": "string", "enum": ["UTC", "CET"]}}, "required": ["zone"]},
    },
}
TOOLS = [WEATHER, TIME]
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
FITS = {"truncate_prompt_tokens": 128}  # the prompt's last 128 tokens: the checkpoint has 256 positions
NO_THINKING = {**FITS, "chat_template_kwargs": {"enable_thinking": False}}
CALL_TEXT = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}\n</tool_call>'


@pytest.fixture(scope="module")
def qwen3_server(trained_exports: dict[str, Path]) -> Iterator[str]:
    api = ApiConfig(chat_template=str(QWEN3), enable_auto_tool_choice=True)
    with _server(trained_exports["none"], api, slots=4, max_context=256, max_queue=16) as (url, _):
        yield url


@pytest.fixture(scope="module")
def smollm2_server(smollm2_export: Path) -> Iterator[str]:
    """The real SmolLM2-135M-Instruct with Qwen3's tool template (ChatML, as SmolLM2's own), no reasoning parser."""
    api = ApiConfig(chat_template=str(QWEN3), reasoning_parser="none", enable_auto_tool_choice=True)
    with _server(smollm2_export, api, slots=1, max_context=1024, max_queue=4) as (url, _):
        yield url


def _client(url: str) -> Any:
    from openai import OpenAI

    return OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)


def _post(url: str, route: str, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(f"{url}{route}", json=body, timeout=60)


def _schema(name: str) -> dict[str, Any]:
    return next(t["function"]["parameters"] for t in TOOLS if t["function"]["name"] == name)  # type: ignore[index]


def _streamed(url: str, **request: Any) -> tuple[list[Any], Any]:
    """The raw chunks of a streamed chat, and the openai SDK's accumulated completion of the same request."""
    client = _client(url)
    chunks = list(client.chat.completions.create(model="trained", stream=True, **request))
    with client.chat.completions.stream(model="trained", **request) as stream:
        for _ in stream:
            pass
        final = stream.get_final_completion()
    return chunks, final


def _calls_of(chunks: list[Any]) -> dict[int, dict[str, Any]]:
    """``delta.tool_calls`` accumulated by index; asserts id and name come once, in the first piece."""
    calls: dict[int, dict[str, Any]] = {}
    for chunk in chunks:
        for choice in chunk.choices:
            for piece in choice.delta.tool_calls or ():
                if piece.index not in calls:
                    assert piece.id and piece.function.name, piece
                    calls[piece.index] = {"id": piece.id, "name": piece.function.name, "arguments": ""}
                else:
                    assert piece.id is None and piece.function.name is None, piece
                calls[piece.index]["arguments"] += piece.function.arguments or ""
    return calls


def test_the_template_implies_hermes_and_qwen3_and_the_flags_override_it() -> None:
    from kvexport import KvexportError
    from kvexport.serving.chat import ChatTemplate
    from kvexport.serving.tool_use import ToolSettings

    qwen3 = ChatTemplate.find(TRAINED, QWEN3)
    compact = ChatTemplate.find(TRAINED, COMPACT)
    assert ToolSettings.resolve(ApiConfig(), qwen3) == ToolSettings("hermes", "qwen3", False)
    assert ToolSettings.resolve(ApiConfig(), compact) == ToolSettings("hermes", None, False)
    assert ToolSettings.resolve(ApiConfig(), None) == ToolSettings(None, None, False)
    chosen = ApiConfig(tool_call_parser="llama3_json", reasoning_parser="none", enable_auto_tool_choice=True)
    assert ToolSettings.resolve(chosen, qwen3) == ToolSettings("llama3_json", None, True)
    with pytest.raises(KvexportError, match=r"^--tool-call-parser qwen: unknown; use one of hermes, llama3_json, mistral, pythonic, none$"):
        ToolSettings.resolve(ApiConfig(tool_call_parser="qwen"), qwen3)
    with pytest.raises(KvexportError, match=r"^--enable-auto-tool-choice needs a tool-call parser, and the chat template implies none"):
        ToolSettings.resolve(ApiConfig(enable_auto_tool_choice=True), None)


@pytest.mark.parametrize(
    ("template", "parser"),
    [
        # a generation prompt that opens the think block (DeepSeek-R1's, QwQ's)
        ("{% for m in messages %}<｜User｜>{{ m.content }}{% endfor %}{% if add_generation_prompt %}<｜Assistant｜><think>\n{% endif %}",
         "deepseek_r1"),
        ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
         "{% if add_generation_prompt %}<|im_start|>assistant\n<think>\n{% endif %}", "qwen3"),
        # ChatML that only strips <think> from earlier turns: not a thinking model's
        ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content.split('</think>')[-1] }}<|im_end|>\n{% endfor %}"
         "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}", None),
    ],
)
def test_a_reasoning_parser_is_implied_only_by_a_thinking_models_template(tmp_path: Path, template: str, parser: str | None) -> None:
    from kvexport.serving.chat import ChatTemplate
    from kvexport.serving.tool_use import ToolSettings

    (tmp_path / "chat.jinja").write_text(template)
    assert ToolSettings.resolve(ApiConfig(), ChatTemplate.find(tmp_path, tmp_path / "chat.jinja")).reasoning_parser == parser


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_required_calls_always_parse_and_validate_streamed_and_not(qwen3_server: str, seed: int) -> None:
    request = {
        "messages": ASK, "tools": TOOLS, "tool_choice": "required", "parallel_tool_calls": False,
        "max_tokens": 48, "temperature": 1.0, "seed": seed, "extra_body": NO_THINKING,
    }
    whole = _client(qwen3_server).chat.completions.create(model="trained", **request)
    choice = whole.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content == ""
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.id.startswith("chatcmpl-tool-")
    jsonschema.validate(json.loads(call.function.arguments), _schema(call.function.name))
    chunks, final = _streamed(qwen3_server, **request)
    (streamed,) = _calls_of(chunks).values()
    # the same seed, the same call: streamed pieces concatenate to the whole call's arguments
    assert (streamed["name"], streamed["arguments"]) == (call.function.name, call.function.arguments)
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    (sdk_call,) = final.choices[0].message.tool_calls
    assert sdk_call.function.arguments == call.function.arguments


def test_a_named_function_is_called_with_valid_arguments_and_stops(qwen3_server: str) -> None:
    named = {"type": "function", "function": {"name": "get_time"}}
    request = {"messages": ASK, "tools": TOOLS, "tool_choice": named, "max_tokens": 32, "temperature": 0, "extra_body": NO_THINKING}
    whole = _client(qwen3_server).chat.completions.create(model="trained", **request)
    choice = whole.choices[0]
    (call,) = choice.message.tool_calls
    assert call.function.name == "get_time" and choice.finish_reason == "stop"  # as OpenAI and vLLM: a named call stops
    jsonschema.validate(json.loads(call.function.arguments), _schema("get_time"))
    chunks, _ = _streamed(qwen3_server, **request)
    assert list(_calls_of(chunks).values()) == [{"id": _calls_of(chunks)[0]["id"], "name": "get_time", "arguments": call.function.arguments}]


def test_auto_reads_the_call_the_model_wrote_and_no_tag_reaches_the_content(qwen3_server: str) -> None:
    forced = {**NO_THINKING, "structured_outputs": {"regex": r"Sure\. " + CALL_TEXT.replace("{", r"\{").replace("}", r"\}")}}
    request = {"messages": ASK, "tools": TOOLS, "max_tokens": 64, "temperature": 0, "extra_body": forced}
    choice = _client(qwen3_server).chat.completions.create(model="trained", **request).choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content == "Sure. "
    (call,) = choice.message.tool_calls
    assert (call.function.name, json.loads(call.function.arguments)) == ("get_weather", {"city": "Paris", "days": 2})
    chunks, final = _streamed(qwen3_server, **request)
    content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert content == "Sure. " and "<" not in content
    assert [(c["name"], c["arguments"]) for c in _calls_of(chunks).values()] == [("get_weather", call.function.arguments)]
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    assert final.choices[0].message.tool_calls[0].function.arguments == call.function.arguments


@pytest.mark.parametrize(("parallel", "calls"), [(True, 2), (False, 1)])
def test_parallel_tool_calls_false_gives_at_most_one_call(qwen3_server: str, parallel: bool, calls: int) -> None:
    two = (CALL_TEXT + "\n" + CALL_TEXT.replace("Paris", "Lyon")).replace("{", r"\{").replace("}", r"\}")
    request = {
        "messages": ASK, "tools": TOOLS, "parallel_tool_calls": parallel, "max_tokens": 112, "temperature": 0,
        "extra_body": {**NO_THINKING, "structured_outputs": {"regex": two}},
    }
    message = _client(qwen3_server).chat.completions.create(model="trained", **request).choices[0].message
    assert [json.loads(c.function.arguments)["city"] for c in message.tool_calls] == ["Paris", "Lyon"][:calls]
    chunks, _ = _streamed(qwen3_server, **request)
    assert len(_calls_of(chunks)) == calls


def test_tool_choice_none_gives_text(qwen3_server: str) -> None:
    forced = {**NO_THINKING, "structured_outputs": {"regex": CALL_TEXT.replace("{", r"\{").replace("}", r"\}")}}
    request = {"messages": ASK, "tools": TOOLS, "tool_choice": "none", "max_tokens": 64, "temperature": 0, "extra_body": forced}
    choice = _client(qwen3_server).chat.completions.create(model="trained", **request).choices[0]
    assert not choice.message.tool_calls and choice.message.content == CALL_TEXT and choice.finish_reason == "stop"


def test_thinking_is_the_reasoning_field_and_enable_thinking_false_turns_it_off(qwen3_server: str) -> None:
    client = _client(qwen3_server)
    plain = {"messages": ASK, "max_tokens": 12, "temperature": 0}
    thinking = client.chat.completions.create(model="trained", **plain, extra_body=FITS).choices[0]
    # no </think> within the budget: all of it is reasoning, none is content (vLLM's qwen3 parser)
    assert thinking.message.reasoning and thinking.message.content is None and thinking.finish_reason == "length"
    chunks = list(client.chat.completions.create(model="trained", stream=True, **plain, extra_body=FITS))
    assert "".join(getattr(c.choices[0].delta, "reasoning", None) or "" for c in chunks if c.choices) == thinking.message.reasoning
    hidden = client.chat.completions.create(model="trained", **plain, extra_body={**FITS, "include_reasoning": False}).choices[0]
    assert hidden.message.reasoning is None and hidden.message.content is None  # vLLM's include_reasoning: false
    chunks = list(client.chat.completions.create(model="trained", stream=True, **plain, extra_body={**FITS, "include_reasoning": False}))
    assert not any(getattr(c.choices[0].delta, "reasoning", None) for c in chunks if c.choices)
    answer = client.chat.completions.create(model="trained", **plain, extra_body={**NO_THINKING, "min_tokens": 12}).choices[0]
    assert answer.message.content.strip() and getattr(answer.message, "reasoning", None) is None
    # the prompt with thinking off ends in Qwen3's empty think block
    rendered = _post(qwen3_server, "/tokenize", {"messages": ASK, "chat_template_kwargs": {"enable_thinking": False}}).json()
    assert TOKENIZER.decode(rendered["tokens"]).endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")


def test_a_tool_conversation_renders_as_transformers_renders_it(qwen3_server: str) -> None:
    from transformers import PreTrainedTokenizerFast

    arguments = {"city": "Paris", "days": 2}
    conversation: list[dict[str, Any]] = [
        {"role": "system", "content": "You answer briefly."},
        *ASK,
        {"role": "assistant", "content": "", "reasoning": "The user wants weather.",
         "tool_calls": [{"id": "call-1", "type": "function", "function": {"name": "get_weather", "arguments": json.dumps(arguments)}}]},
        {"role": "tool", "tool_call_id": "call-1", "content": '{"sky": "clear"}'},
    ]
    served = _post(qwen3_server, "/tokenize", {"messages": conversation, "tools": TOOLS}).json()
    reference = PreTrainedTokenizerFast(tokenizer_file=str(TRAINED / "tokenizer.json"))
    # transformers takes the arguments as an object and the reasoning as reasoning_content
    theirs = [dict(m) for m in conversation]
    theirs[2] = {**theirs[2], "reasoning_content": theirs[2].pop("reasoning"),
                 "tool_calls": [{"type": "function", "function": {"name": "get_weather", "arguments": arguments}}]}
    want = reference.apply_chat_template(theirs, tools=TOOLS, chat_template=QWEN3.read_text(), add_generation_prompt=True, tokenize=False)
    assert "<tool_response>" in want and '{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}' in want
    assert "<think>\nThe user wants weather.\n</think>" in want
    assert served["tokens"] == TOKENIZER.encode(want).ids
    # the chat route renders the same prompt (its last 128 tokens, kept by truncate_prompt_tokens)
    body = {"messages": conversation, "tools": TOOLS, "max_tokens": 1, "return_token_ids": True, **FITS}
    chat = _post(qwen3_server, "/v1/chat/completions", body).json()
    assert chat["prompt_token_ids"] == served["tokens"][-128:]


@pytest.mark.parametrize(
    ("body", "message", "param"),
    [
        ({"tool_choice": "required"}, "When using `tool_choice`, `tools` must be set.", "tool_choice"),
        ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
         "The tool specified in `tool_choice` does not match any of the specified `tools`", "tool_choice"),
        ({"tools": TOOLS, "tool_choice": "sometimes"},
         'Invalid value for `tool_choice`: sometimes! Only named tools, "none", "auto" or "required" are supported.', "tool_choice"),
        ({"tools": [], "tool_choice": "required"},
         "`tools` must not be an empty array. Either provide at least one tool or omit the field entirely.", "tools"),
        ({"tools": [{"type": "retrieval"}]}, 'tools[0]: only tools of type "function" are served', "tools"),
        ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {"a": {"type": "strin"}}}}}],
          "tool_choice": "required"}, "tools: Invalid type: strin", "tools"),
        ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}},
         'tool_choice: "required" sets the output\'s structure; leave out response_format', "tool_choice"),
        ({"chat_template_kwargs": {"messages": []}}, "chat_template_kwargs: messages is a request field of its own; set it there",
         "chat_template_kwargs"),
        ({"messages": [*ASK, {"role": "assistant", "tool_calls": [{"type": "function", "function": {"name": "f", "arguments": "{"}}]}]},
         "messages: tool_calls[0].function.arguments is not valid JSON (Expecting property name enclosed in double quotes)", "messages"),
        ({"messages": [*ASK, {"role": "assistant", "tool_calls": {"type": "function"}}]},
         "messages: a assistant message's tool_calls must be a list of calls", "messages"),
        ({"messages": [*ASK, {"role": "assistant", "tool_calls": [{"type": "function", "function": {"name": 5}}]}]},
         "messages: tool_calls[0] must be an object with a function that has a name", "messages"),
        ({"chat_template_kwargs": {"range": 1}},  # Qwen3's template calls range(): now a number
         "the chat template failed on these messages: TypeError: 'int' object is not callable", "messages"),
    ],
)
def test_bad_tool_requests_are_a_400_naming_the_field(qwen3_server: str, body: dict[str, Any], message: str, param: str) -> None:
    response = _post(qwen3_server, "/v1/chat/completions", {"messages": ASK, "max_tokens": 4, **body})
    assert response.status_code == 400, response.text
    assert response.json()["error"]["message"] == message and response.json()["error"]["param"] == param


def test_auto_needs_the_flag_and_a_parser_as_vllms_does_and_required_needs_neither() -> None:
    from kvexport.serving.chat import ChatTemplate
    from kvexport.serving.errors import ParameterError
    from kvexport.serving.tool_use import ToolSettings, ToolUse

    template = ChatTemplate.find(TRAINED, COMPACT)
    for settings in (ToolSettings("hermes", None, False), ToolSettings(None, None, True)):
        with pytest.raises(ParameterError, match='^"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser to be set$'):
            ToolUse.of(TOOLS, None, True, None, settings, template)  # tools without tool_choice: "auto", as vLLM reads them
    forced = ToolUse.of(TOOLS, "required", True, None, ToolSettings(), template)
    parser = forced.output_parser()
    assert parser is not None and parser.extract('[{"name": "get_time", "parameters": {"zone": "UTC"}}]').tool_calls[0].name == "get_time"


def test_the_agent_example_calls_the_function_and_answers(smollm2_server: str) -> None:
    """examples/agent_tools.py on a real model: a required first call, the tool's result sent back, then a text answer."""
    done = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "agent_tools.py"), "What is the weather in Paris?", "--base-url",
         f"{smollm2_server}/v1", "--first-choice", "required", "--max-tokens", "64"],
        capture_output=True, text=True, timeout=120, check=False,
    )
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    # the answer's text may run over lines: the fp32 export (and the bf16 prompts) answer "<tool_response>\n{...}"
    assert lines[0].startswith("call: get_weather(") and lines[1].startswith("tool result: {") and lines[2].startswith("answer: ")
    arguments = json.loads(lines[0][len("call: get_weather(") : -1])
    jsonschema.validate(arguments, _example("agent_tools").WEATHER_TOOL["function"]["parameters"])
    assert json.loads(lines[1][len("tool result: ") :])["city"] == arguments["city"]  # the function ran on the model's arguments


def test_a_call_without_arguments_is_sent_back_as_an_empty_object(qwen3_server: str) -> None:
    call = {"id": "c", "type": "function", "function": {"name": "get_time", "arguments": ""}}
    body = {"messages": [*ASK, {"role": "assistant", "tool_calls": [call]}], "tools": TOOLS}
    rendered = TOKENIZER.decode(_post(qwen3_server, "/tokenize", body).json()["tokens"])
    assert '{"name": "get_time", "arguments": {}}' in rendered


def test_the_gate_applies_the_grammar_only_after_its_text(trained_exports: dict[str, Path]) -> None:
    """A constraint with ``after`` leaves the tokens up to that text free, then follows its grammar."""
    from llguidance import LLMatcher

    from kvexport.serving import Engine, SamplingParams
    from kvexport.serving.structured import Constraint

    engine = Engine(trained_exports["none"], slots=1, max_context=128)
    try:
        prompt = "The for statement"
        _, free, _ = engine.submit(prompt, SamplingParams(max_tokens=12, temperature=0)).result()
        gate = free.split()[2]
        regex = Constraint("structured_outputs.regex", LLMatcher.grammar_from_regex("[0-9]{3}"), after=gate)
        engine.output.check_structured(regex)
        _, gated, reason = engine.submit(prompt, SamplingParams(max_tokens=40, temperature=0, structured=regex)).result()
        before = free[: free.index(gate) + len(gate)]
        # free up to the gate's text, then the grammar's three digits and the end
        assert gated.startswith(before) and reason == "stop", (free, gated)
        assert gated[len(before) :].isdigit() and len(gated) - len(before) == 3, (free, gated)
    finally:
        engine.close()


def test_serve_refuses_an_unknown_parser_by_name(trained_exports: dict[str, Path]) -> None:
    from click.testing import CliRunner

    from kvexport.cli import main

    result = CliRunner().invoke(main, ["serve", str(trained_exports["none"]), "--port", "0", "--tool-call-parser", "qwen"])
    assert result.exit_code == 2 and "Invalid value for '--tool-call-parser': 'qwen' is not one of" in result.output
    assert "Traceback" not in result.output


def test_text_past_the_gate_in_the_same_token_follows_the_grammar(trained_exports: dict[str, Path]) -> None:
    """A gate that ends inside a token: the rest of that token's text is the grammar's first text, never outside it."""
    import re

    from llguidance import LLMatcher

    from kvexport.serving import Engine, SamplingParams
    from kvexport.serving.structured import Constraint

    engine = Engine(trained_exports["none"], slots=1, max_context=128)
    try:
        prompt = "The for statement"
        ids, free, _ = engine.submit(prompt, SamplingParams(max_tokens=12, temperature=0)).result()
        # the output up to one letter before the end of a token that ends in a letter: that token completes the
        # gate's text and carries one letter past it
        texts = [TOKENIZER.decode(ids[: i + 1]) for i in range(len(ids))]
        ending = next(i for i in range(1, len(ids)) if texts[i][-2:].isalpha() and len(texts[i]) - len(texts[i - 1]) >= 2)
        gate = texts[ending][:-1]
        fits = Constraint("structured_outputs.regex", LLMatcher.grammar_from_regex("[a-zA-Z]{1,3}[0-9]{3}"), after=gate)
        breaks = Constraint("structured_outputs.regex", LLMatcher.grammar_from_regex("[0-9]{3}"), after=gate)
        for constraint in (fits, breaks):
            engine.output.check_structured(constraint)
        _, kept, reason = engine.submit(prompt, SamplingParams(max_tokens=40, temperature=0, structured=fits)).result()
        assert kept.startswith(gate) and reason == "stop", (free, kept)
        assert re.fullmatch("[a-zA-Z]{1,3}[0-9]{3}", kept[len(gate) :]), (free, kept)
        # the rest of the word can't begin three digits: the request ends in an error, never unconstrained
        _, _, reason = engine.submit(prompt, SamplingParams(max_tokens=40, temperature=0, structured=breaks)).result()
        assert reason == "error"
    finally:
        engine.close()
