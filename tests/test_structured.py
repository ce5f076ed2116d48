"""Structured output (``response_format``, vLLM's ``structured_outputs``) with llguidance, on the trained GPT-2.

Every sampled output must parse and validate against its schema (``jsonschema``), match its
regex, be one of its choices or parse by its grammar, over many seeds at temperature 1; the
greedy output must equal a reference loop that masks PyTorch's logits with the same
matcher; and a constrained request batched with others must get what it gets alone.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import jsonschema
import numpy as np
import pytest
import torch

from kvexport.serving import Engine, SamplingParams
from kvexport.serving.config import ApiConfig
from kvexport.serving.errors import ParameterError
from kvexport.serving.structured import Constraint, from_request
from tests.conftest import TRAINED
from tests.test_serving import _server

# bounded schemas: every complete output is short, so sampling at temperature 1 ends well within max_tokens
SCHEMAS: dict[str, dict[str, Any]] = {
    "nested": {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 6},
            "inner": {"type": "object", "properties": {"ok": {"type": "boolean"}, "n": {"type": "integer", "minimum": 0, "maximum": 99}},
                      "required": ["ok", "n"], "additionalProperties": False},
        },
        "required": ["name", "inner"],
        "additionalProperties": False,
    },
    "array_enum": {
        "type": "object",
        "properties": {"tags": {"type": "array", "items": {"enum": ["red", "green", "blue"]}, "minItems": 1, "maxItems": 3}},
        "required": ["tags"],
        "additionalProperties": False,
    },
    "bounded_number_optional": {
        "type": "object",
        "properties": {"score": {"type": "integer", "minimum": -5, "maximum": 5}, "note": {"type": "string", "maxLength": 4}},
        "required": ["score"],
        "additionalProperties": False,
    },
}
PROMPT = "The help topic"


def _constraint(**structured_outputs: Any) -> Constraint:
    found = from_request(None, structured_outputs)
    assert found is not None
    return found


def _text(engine: Engine, params: SamplingParams, prompt: str = PROMPT) -> tuple[str, str]:
    _, text, reason = engine.submit(prompt, params).result()
    return text, reason


@pytest.fixture(scope="module")
def engine(trained_exports: dict[str, Path]) -> Iterator[Engine]:
    with Engine(trained_exports["none"], slots=8, max_context=256) as running:
        yield running


@pytest.mark.parametrize("name", sorted(SCHEMAS))
def test_sampled_json_validates_against_its_schema(engine: Engine, name: str) -> None:
    schema = SCHEMAS[name]
    constraint = _constraint(json=schema)
    outputs = []
    for seed in range(12):
        params = SamplingParams(max_tokens=120, temperature=1.0, seed=seed, structured=constraint)
        text, reason = _text(engine, params)
        assert reason == "stop", (seed, text)
        value = json.loads(text)
        jsonschema.validate(value, schema)
        outputs.append(text)
    assert len(set(outputs)) > 1  # it sampled, within the schema


def test_regex_choice_and_grammar_hold_over_seeds(engine: Engine) -> None:
    cases = {
        "regex": (_constraint(regex=r"[a-c]{2,5}-[0-9]{1,3}"), lambda t: re.fullmatch(r"[a-c]{2,5}-[0-9]{1,3}", t)),
        "choice": (_constraint(choice=["yes", "no", "maybe so"]), lambda t: t in ("yes", "no", "maybe so")),
        "lark": (_constraint(grammar='start: "(" item ("," item)* ")"\nitem: /[xyz]/'), lambda t: re.fullmatch(r"\([xyz](,[xyz])*\)", t)),
        "gbnf": (_constraint(grammar='root ::= "<" [0-9] [0-9]? ">"'), lambda t: re.fullmatch(r"<[0-9]{1,2}>", t)),
    }
    for name, (constraint, holds) in cases.items():
        for seed in range(8):
            # odd seeds add the other controls: top-k beyond the grammar's few tokens, min-p, a penalty
            controls = {"top_k": 40, "min_p": 0.05, "presence_penalty": 0.5} if seed % 2 else {}
            text, reason = _text(engine, SamplingParams(max_tokens=60, temperature=1.0, seed=seed, structured=constraint, **controls))
            assert reason == "stop" and holds(text), (name, seed, text)


def test_greedy_output_equals_pytorch_masked_by_the_same_grammar(engine: Engine) -> None:
    from llguidance import LLMatcher
    from transformers import GPT2LMHeadModel

    model = GPT2LMHeadModel.from_pretrained(TRAINED).eval()
    constraint = _constraint(json=SCHEMAS["nested"])
    grammars = engine.output.grammars
    assert grammars is not None
    ids = engine.encode(PROMPT)
    # the reference: PyTorch's logits, the matcher's mask, argmax, until the grammar ends (EOS)
    from kvexport.serving.structured import Matcher

    matcher = Matcher(LLMatcher(grammars.tokenizer, constraint.grammar), model.config.vocab_size)
    want: list[int] = []
    with torch.no_grad():
        while len(want) < 120:
            logits = model(torch.tensor([ids + want])).logits[0, -1].float().numpy().copy()
            token = int(np.argmax(matcher.mask(logits)))
            want.append(token)
            assert matcher.take(token)
            if token == grammars.eos_token_id:
                break
    assert want[-1] == grammars.eos_token_id  # the grammar ended, and allowed EOS alone
    tokens, text, reason = engine.submit(ids, SamplingParams(max_tokens=120, temperature=0, structured=constraint)).result()
    assert reason == "stop" and tokens == want[:-1]  # the result leaves the EOS out
    jsonschema.validate(json.loads(text), SCHEMAS["nested"])


def test_sixteen_structured_and_plain_requests_get_what_each_gets_alone(engine: Engine) -> None:
    constraints = [None, _constraint(json=SCHEMAS["array_enum"]), _constraint(regex=r"[0-9]{3}"), _constraint(choice=["a", "bb"])]
    requests = [
        SamplingParams(max_tokens=40, temperature=1.0, seed=i, structured=constraints[i % 4], ignore_eos=constraints[i % 4] is None)
        for i in range(16)
    ]
    alone = [engine.submit(PROMPT, params).result()[0] for params in requests]
    together = [handle.result()[0] for handle in [engine.submit(PROMPT, params) for params in requests]]
    assert together == alone


def test_n_samples_and_logprobs_with_a_constraint(engine: Engine) -> None:
    constraint = _constraint(choice=["alpha", "beta", "gamma"])
    params = SamplingParams(max_tokens=20, temperature=1.0, seed=3, structured=constraint, logprobs=2)
    states = engine.submit_n(PROMPT, params, 4)
    for state in states:
        events = list(state)
        text = "".join(e.text for e in events)
        assert text in ("alpha", "beta", "gamma")
        assert all(e.logprob is not None for e in events if e.token_id is not None)


def test_bad_constraints_are_one_line_naming_the_field(engine: Engine) -> None:
    with pytest.raises(ParameterError, match=r"structured_outputs\.regex: .*") as raised:
        engine.submit(PROMPT, SamplingParams(max_tokens=5, structured=_constraint(regex="[a-")))
    assert raised.value.parameter == "structured_outputs"
    bad_schema = from_request({"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object", "properties": {"a": {"type": 5}}}}}, None)
    assert bad_schema is not None
    with pytest.raises(ParameterError, match="response_format: ") as raised:
        engine.submit(PROMPT, SamplingParams(max_tokens=5, structured=bad_schema))
    assert raised.value.parameter == "response_format"
    with pytest.raises(ParameterError, match="structured_outputs.structural_tag: not served"):
        from_request(None, {"structural_tag": "{}"})
    with pytest.raises(ParameterError, match="set exactly one of json, regex, choice, grammar"):
        from_request(None, {"regex": "a", "choice": ["a"]})
    # vLLM's options are taken where they ask for what is done, and refused by name where they would be ignored
    assert from_request(None, {"regex": "a", "disable_any_whitespace": True, "disable_fallback": True}) is not None
    for option, value in (("whitespace_pattern", "[ ]?"), ("disable_additional_properties", True)):
        with pytest.raises(ParameterError, match=rf"^structured_outputs\.{option}: .* is not served by kvexport serve"):
            from_request(None, {"json": {"type": "object"}, option: value})
    assert engine.stats().running == 0  # nothing left pending


@pytest.fixture(scope="module")
def chat_server(trained_exports: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    path = tmp_path_factory.mktemp("template") / "chat.jinja"
    path.write_text("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}assistant:")
    with _server(trained_exports["none"], ApiConfig(chat_template=str(path)), slots=4, max_context=256) as (url, _):
        yield url


def test_the_openai_clients_response_format_and_parse_work(chat_server: str) -> None:
    from openai import OpenAI
    from pydantic import BaseModel, Field

    class Topic(BaseModel):
        title: str = Field(max_length=6)
        pages: int = Field(ge=1, le=9)

    client = OpenAI(base_url=f"{chat_server}/v1", api_key="unused", max_retries=0)
    messages = [{"role": "user", "content": "Describe the help topic."}]
    parsed = client.chat.completions.parse(model="trained", messages=messages, response_format=Topic, max_tokens=80, seed=1)  # type: ignore[arg-type]
    topic = parsed.choices[0].message.parsed
    assert isinstance(topic, Topic) and 1 <= topic.pages <= 9
    done = client.completions.create(
        model="trained", prompt=PROMPT, max_tokens=60, seed=2, extra_body={"response_format": {"type": "json_object"}}
    )
    assert isinstance(json.loads(done.choices[0].text), dict)
    streamed = client.completions.create(
        model="trained", prompt=PROMPT, max_tokens=60, seed=2, stream=True, extra_body={"structured_outputs": {"choice": ["on", "off"]}}
    )
    assert "".join(c.choices[0].text for c in streamed if c.choices) in ("on", "off")


@pytest.mark.parametrize(
    ("body", "param", "message"),
    [
        ({"structured_outputs": {"regex": "(unclosed"}}, "structured_outputs", "structured_outputs.regex: "),
        ({"structured_outputs": {"grammar": "start: missing_rule"}}, "structured_outputs", "structured_outputs.grammar: "),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}}}, "response_format", "response_format"),
        ({"response_format": {"type": "xml"}}, "response_format", "response_format: type 'xml'"),
    ],
)
def test_a_bad_constraint_over_http_is_a_400_naming_the_field(chat_server: str, body: dict[str, Any], param: str, message: str) -> None:
    answer = httpx.post(f"{chat_server}/v1/completions", json={"prompt": PROMPT, "max_tokens": 5, **body}, timeout=30)
    assert answer.status_code == 400, answer.text
    error = answer.json()["error"]
    assert error["param"] == param and error["message"].startswith(message), error


def test_a_token_the_grammar_refuses_ends_the_request_with_an_error_never_unconstrained(trained_exports: dict[str, Path]) -> None:
    """A token chosen elsewhere (as a speculative round would) that breaks the grammar: the request fails closed."""
    from tokenizers import Tokenizer

    from kvexport.serving.output import OutputProcessor, RequestState

    tokenizer = Tokenizer.from_file(str(trained_exports["none"] / "tokenizer.json"))
    vocab = json.loads((trained_exports["none"] / "kvexport.json").read_text())["model"]["dims"]["vocab_size"]
    processor = OutputProcessor(tokenizer, (0,), vocab)
    constraint = _constraint(choice=["yes", "no"])
    processor.check_structured(constraint)
    state = RequestState("r1", [5, 6], SamplingParams(max_tokens=8, structured=constraint))
    processor.prepare(state)
    processor.add_request(state)
    refused = tokenizer.encode(" maybe").ids[0]
    batch = processor.accepted("r1", [refused])
    processor.publish(batch)
    events = list(state)
    assert [e.finish_reason for e in events] == ["error"] and events[0].token_id is None
    assert events[0].error is not None and events[0].error.startswith("structured output: ")
    assert state.output == []  # the refused token is not part of the output
