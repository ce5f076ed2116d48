"""``kvexport serve``'s OpenAI API as vLLM answers it: logprobs, echo, prompt lists, n, chat, tokenize.

Driven with the ``openai`` client and raw HTTP against the app on 127.0.0.1 (a free
port); log-probabilities are checked against the log-softmax of PyTorch's logits on the
same tokens, texts against the engine's own single requests or the Generator.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import pytest
import torch
from tokenizers import Tokenizer

from kvexport.serving.config import ApiConfig
from tests.conftest import TRAINED
from tests.test_serving import _server

TOKENIZER = Tokenizer.from_file(str(TRAINED / "tokenizer.json"))
HELDOUT_IDS = TOKENIZER.encode((TRAINED / "heldout.txt").read_text()).ids
TEMPLATE = (
    "{% for message in messages %}{{ message['role'] }}: {{ message['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)


@pytest.fixture(scope="module")
def template_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("template") / "chat.jinja"
    path.write_text(TEMPLATE)
    return path


@pytest.fixture(scope="module")
def all_logits_server(trained_all_logits: Path, template_file: Path) -> Iterator[str]:
    api = ApiConfig(chat_template=str(template_file), enable_prompt_tokens_details=True)
    with _server(trained_all_logits, api, slots=4, max_context=128, max_queue=16) as (url, _):
        yield url


@pytest.fixture(scope="module")
def plain_server(trained_exports: dict[str, Path]) -> Iterator[str]:
    with _server(trained_exports["none"], slots=4, max_context=128, max_queue=16) as (url, _):
        yield url


@pytest.fixture(scope="module")
def torch_model() -> torch.nn.Module:
    from transformers import GPT2LMHeadModel

    return GPT2LMHeadModel.from_pretrained(TRAINED).eval()


def _reference(model: torch.nn.Module, ids: list[int]) -> np.ndarray:
    """log-softmax of PyTorch's logits after each position of ``ids``: [len, V]."""
    with torch.no_grad():
        return torch.log_softmax(model(torch.tensor([ids])).logits[0].double(), -1).numpy()


def _post(url: str, route: str, body: dict[str, object]) -> httpx.Response:
    return httpx.post(f"{url}{route}", json=body, timeout=60)


def test_the_openai_client_gets_logprobs_echo_and_n(all_logits_server: str, torch_model: torch.nn.Module) -> None:
    from openai import OpenAI

    client = OpenAI(base_url=f"{all_logits_server}/v1", api_key="unused", max_retries=0)
    prompt = "The help topic for"
    done = client.completions.create(
        model="trained", prompt=prompt, max_tokens=6, temperature=1.0, seed=5, logprobs=2, echo=True, n=2,
        extra_body={"ignore_eos": True},
    )
    prompt_ids = TOKENIZER.encode(prompt).ids
    assert [c.index for c in done.choices] == [0, 1]
    assert all(c.text.startswith(prompt) for c in done.choices) and done.choices[0].text != done.choices[1].text
    logprobs = done.choices[0].logprobs
    assert logprobs is not None and logprobs.tokens is not None and logprobs.token_logprobs is not None
    assert len(logprobs.tokens) == len(prompt_ids) + 6 and logprobs.token_logprobs[0] is None
    assert logprobs.top_logprobs is not None and logprobs.top_logprobs[0] is None
    generated = TOKENIZER.encode(done.choices[0].text[len(prompt) :]).ids
    ids = prompt_ids + generated
    reference = _reference(torch_model, ids)
    for position in range(1, len(ids)):
        assert abs(logprobs.token_logprobs[position] - reference[position - 1, ids[position]]) < 2e-4
        assert 1 <= len(logprobs.top_logprobs[position]) <= 3  # the token itself and the top 2
        assert next(iter(logprobs.top_logprobs[position].values())) == logprobs.token_logprobs[position]  # it comes first
    assert "".join(logprobs.tokens) == done.choices[0].text
    assert logprobs.text_offset == list(np.cumsum([0] + [len(t) for t in logprobs.tokens[:-1]]))
    assert done.usage is not None and (done.usage.prompt_tokens, done.usage.completion_tokens) == (len(prompt_ids), 12)


def test_lm_evaluation_harness_loglikelihood_requests_score(all_logits_server: str, torch_model: torch.nn.Module) -> None:
    """What lm-eval's local-completions sends: token-id prompts, echo, logprobs 1, max_tokens 1."""
    contexts = [HELDOUT_IDS[10:30], HELDOUT_IDS[200:212]]
    continuations = [HELDOUT_IDS[30:34], [7, 9]]
    prompts = [c + x for c, x in zip(contexts, continuations, strict=True)]
    body = {"model": "trained", "prompt": prompts, "temperature": 0, "max_tokens": 1, "logprobs": 1, "seed": 1234, "echo": True}
    response = _post(all_logits_server, "/v1/completions", body)
    assert response.status_code == 200, response.text
    choices = sorted(response.json()["choices"], key=lambda c: c["index"])
    assert len(choices) == 2
    for choice, context, prompt in zip(choices, contexts, prompts, strict=True):
        token_logprobs = choice["logprobs"]["token_logprobs"]
        assert len(token_logprobs) == len(prompt) + 1
        got = sum(token_logprobs[len(context) : -1])  # lm-eval's sum over the continuation
        reference = _reference(torch_model, prompt)
        want = sum(reference[p - 1, prompt[p]] for p in range(len(context), len(prompt)))
        assert abs(got - want) < 1e-3
        greedy = all(
            lp == max(top.values())
            for lp, top in zip(token_logprobs[len(context) : -1], choice["logprobs"]["top_logprobs"][len(context) : -1], strict=True)
        )
        assert greedy == all(int(np.argmax(reference[p - 1])) == prompt[p] for p in range(len(context), len(prompt)))


def test_echo_alone_and_prompt_logprobs_on_a_last_position_export(plain_server: str) -> None:
    alone = _post(plain_server, "/v1/completions", {"prompt": [5, 17, 300], "echo": True, "max_tokens": 0})
    assert alone.status_code == 200 and alone.json()["choices"][0]["text"] == TOKENIZER.decode([5, 17, 300])
    assert alone.json()["usage"]["completion_tokens"] == 0
    echoed = _post(plain_server, "/v1/completions", {"prompt": "The help", "echo": True, "max_tokens": 3, "temperature": 0})
    plain = _post(plain_server, "/v1/completions", {"prompt": "The help", "max_tokens": 3, "temperature": 0})
    assert echoed.json()["choices"][0]["text"] == "The help" + plain.json()["choices"][0]["text"]
    refused = _post(plain_server, "/v1/completions", {"prompt": "The help", "echo": True, "logprobs": 1, "max_tokens": 1})
    assert refused.status_code == 400
    assert refused.json()["error"]["message"] == (
        "prompt logprobs need the logits at every prompt position, and none's prefill graph returns the last "
        "position's only; serve an export made with --all-logits"
    )


def test_a_list_of_prompts_gives_n_choices_per_prompt_in_order(plain_server: str) -> None:
    prompts = ["The help topic", "A statement"]
    body = {"prompt": prompts, "n": 2, "max_tokens": 5, "temperature": 0.8, "seed": 3, "ignore_eos": True}
    choices = _post(plain_server, "/v1/completions", body).json()["choices"]
    assert [c["index"] for c in choices] == [0, 1, 2, 3]
    for index, choice in enumerate(choices):  # choice p * n + i draws with seed + i
        single = {"prompt": prompts[index // 2], "max_tokens": 5, "temperature": 0.8, "seed": 3 + index % 2, "ignore_eos": True}
        assert choice["text"] == _post(plain_server, "/v1/completions", single).json()["choices"][0]["text"]


def test_streamed_chunks_carry_their_own_tokens_logprobs(plain_server: str) -> None:
    # a stop string that starts with a common letter: text is held back, offsets still follow the tokens
    body = {"prompt": [5, 17, 300], "max_tokens": 5, "temperature": 0, "logprobs": 1, "ignore_eos": True, "stop": ["e\u2603"]}
    whole = _post(plain_server, "/v1/completions", body).json()["choices"][0]["logprobs"]
    with httpx.stream("POST", f"{plain_server}/v1/completions", json={**body, "stream": True}, timeout=60) as response:
        lines = [line for line in response.iter_lines() if line.startswith("data: {")]
    chunks = [httpx.Response(200, content=line[6:]).json()["choices"][0]["logprobs"] for line in lines]
    assert [len(c["tokens"]) for c in chunks] == [1] * 5
    # the second request reuses the first's cached prompt rows: fp32 rounding, not a different result
    np.testing.assert_allclose([c["token_logprobs"][0] for c in chunks], whole["token_logprobs"], atol=1e-5)
    assert [c["tokens"][0] for c in chunks] == whole["tokens"]
    assert [c["text_offset"][0] for c in chunks] == whole["text_offset"]


def test_chat_with_and_without_streaming(all_logits_server: str) -> None:
    from openai import OpenAI

    client = OpenAI(base_url=f"{all_logits_server}/v1", api_key="unused", max_retries=0)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "The help topic"}]
    done = client.chat.completions.create(model="trained", messages=messages, max_tokens=8, temperature=0, logprobs=True, top_logprobs=2)  # type: ignore[arg-type]
    rendered = "system: Be brief.\nuser: The help topic\nassistant:"
    completion = _post(all_logits_server, "/v1/completions", {"prompt": rendered, "max_tokens": 8, "temperature": 0}).json()
    assert done.object == "chat.completion" and done.choices[0].message.role == "assistant"
    assert done.choices[0].message.content == completion["choices"][0]["text"]
    content = done.choices[0].logprobs.content  # type: ignore[union-attr]
    assert content is not None and len(content) == done.usage.completion_tokens  # type: ignore[union-attr]
    assert all(len(entry.top_logprobs) == 2 and entry.top_logprobs[0].token == entry.token for entry in content)
    assert done.usage is not None and done.usage.prompt_tokens == len(TOKENIZER.encode(rendered).ids)
    chunks = list(client.chat.completions.create(model="trained", messages=messages, max_tokens=8, temperature=0, stream=True))  # type: ignore[arg-type]
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == done.choices[0].message.content
    assert chunks[-1].choices[0].finish_reason == "length"


@pytest.mark.parametrize(
    ("body", "message", "param"),
    [
        ({"messages": [{"role": "", "content": "hi"}]}, "messages.0.role: String should have at least 1 character (string_too_short)", "messages"),
        ({"messages": []}, "messages: List should have at least 1 item after validation, not 0 (too_short)", "messages"),
        ({"messages": [{"role": "user", "content": "hi"}], "top_logprobs": 2}, "top_logprobs: needs logprobs: true", "top_logprobs"),
        ({"messages": [{"role": "user", "content": "hi"}], "tools": [{"type": "function"}]}, "tools[0].function: must be an object with a name", "tools"),
    ],
)
def test_bad_chat_requests_are_400(all_logits_server: str, body: dict[str, object], message: str, param: str) -> None:
    response = _post(all_logits_server, "/v1/chat/completions", body)
    assert response.status_code == 400
    assert (response.json()["error"]["message"], response.json()["error"]["param"]) == (message, param)


def test_chat_without_a_template_names_the_option(plain_server: str) -> None:
    response = _post(plain_server, "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]})
    assert response.status_code == 400
    assert response.json()["error"]["message"] == (
        "this model has no chat template: start kvexport serve with --chat-template FILE (a Jinja template), or use "
        "/v1/completions"
    )


def test_tokenize_detokenize_and_tokenizer_info_in_vllms_shapes(all_logits_server: str) -> None:
    text = "The help topic for the for statement"
    tokens = _post(all_logits_server, "/tokenize", {"prompt": text, "return_token_strs": True}).json()
    assert tokens["tokens"] == TOKENIZER.encode(text).ids and tokens["count"] == len(tokens["tokens"])
    assert tokens["max_model_len"] == 128 and tokens["token_strs"] == [TOKENIZER.id_to_token(t) for t in tokens["tokens"]]
    assert _post(all_logits_server, "/detokenize", {"tokens": tokens["tokens"]}).json() == {"prompt": text}
    chat = _post(all_logits_server, "/tokenize", {"messages": [{"role": "user", "content": "hi"}]}).json()
    assert chat["tokens"] == TOKENIZER.encode("user: hi\nassistant:").ids
    outside = _post(all_logits_server, "/detokenize", {"tokens": [1, 99999]})
    assert outside.status_code == 400 and outside.json()["error"]["param"] == "tokens"
    info = httpx.get(f"{all_logits_server}/tokenizer_info", timeout=10).json()
    assert info["eos_token"] == TOKENIZER.id_to_token(info["eos_token_id"]) and info["model_max_length"] == 128
    assert info["chat_template"] == TEMPLATE  # the template's text, as vLLM gives it


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"use_beam_search": True}, "use_beam_search"),
        ({"response_format": {"type": "yaml"}}, "response_format"),
        ({"structured_outputs": {"structural_tag": "{}"}}, "structured_outputs"),
        ({"guided_json": {"type": "object"}}, "guided_json"),
        ({"skip_special_tokens": False}, "skip_special_tokens"),
        ({"logit_bias": {"x": 1}}, "logit_bias"),
        ({"logit_bias": {"5": 101}}, "logit_bias"),
        ({"repetition_penalty": 0}, "repetition_penalty"),
        ({"presence_penalty": -2.5}, "presence_penalty"),
        ({"logprobs": 21}, "logprobs"),
        ({"logprobs": -1}, "logprobs"),  # the whole vocabulary: only with --max-logprobs -1
        ({"min_tokens": 9, "max_tokens": 3}, "min_tokens"),
        ({"stop_token_ids": [99999]}, "stop_token_ids"),
        ({"n": 2, "temperature": 0}, "n"),
        ({"n": 30, "temperature": 1.0}, "n"),  # more sequences than the server can ever queue: not a 503 forever
        ({"allowed_token_ids": [5], "logit_bias": {"5": -100}}, "logit_bias"),
        ({"stream_options": {"include_usage": True}}, "stream_options"),
        ({"truncation_side": "middle"}, "truncation_side"),
        ({"seed": 2**63}, "seed"),  # vLLM's range: a 64-bit signed integer
        ({"seed": -(2**63) - 1}, "seed"),
        ({"logit_bias": {"x": 1, "y": 2}}, "logit_bias"),
    ],
)
def test_fields_not_served_or_out_of_range_are_400_naming_them(plain_server: str, extra: dict[str, object], param: str) -> None:
    response = _post(plain_server, "/v1/completions", {"prompt": "x", "max_tokens": 3, **extra})
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param


def test_any_integer_seed_and_a_null_max_tokens_as_vllm_takes_them(plain_server: str) -> None:
    seeded = _post(plain_server, "/v1/completions", {"prompt": "x", "seed": -7, "max_tokens": 3, "ignore_eos": True})
    assert seeded.status_code == 200 and seeded.json()["usage"]["completion_tokens"] == 3
    unbounded = _post(plain_server, "/v1/completions", {"prompt": "x", "max_tokens": None, "temperature": 0, "ignore_eos": True})
    assert unbounded.json()["usage"]["completion_tokens"] == 16  # vLLM's default, for null too


def test_any_role_and_any_message_key_reach_the_template_as_vllm_hands_them(all_logits_server: str) -> None:
    """The test template renders ``role: content``; a role of its own and an extra key pass through unchanged."""
    messages = [{"role": "developer", "content": "be brief"}, {"role": "tool", "content": "42", "tool_call_id": "call-1"}]
    rendered = _post(all_logits_server, "/tokenize", {"messages": messages}).json()
    assert rendered["tokens"] == TOKENIZER.encode("developer: be brief\ntool: 42\nassistant:").ids
    answer = _post(all_logits_server, "/v1/chat/completions", {"messages": messages, "max_tokens": 2})
    assert answer.status_code == 200, answer.text
    from kvexport.serving.protocol import ChatMessage

    seen = ChatMessage.model_validate(messages[1]).for_template()
    assert seen == {"role": "tool", "content": "42", "tool_call_id": "call-1"}  # what the template gets


def test_fields_unknown_to_vllm_are_ignored_as_vllm_ignores_them(plain_server: str) -> None:
    body = {"prompt": [5, 17], "max_tokens": 3, "temperature": 0, "ignore_eos": True}
    plain = _post(plain_server, "/v1/completions", body).json()["choices"][0]["text"]
    response = _post(plain_server, "/v1/completions", {**body, "not_a_field": 1, "user": "someone"})
    assert response.status_code == 200 and response.json()["choices"][0]["text"] == plain


def test_penalties_and_bias_change_the_text_over_http(plain_server: str) -> None:
    body = {"prompt": HELDOUT_IDS[:20], "max_tokens": 12, "temperature": 0, "ignore_eos": True}
    plain = _post(plain_server, "/v1/completions", body).json()["choices"][0]
    for extra in ({"presence_penalty": 2.0}, {"frequency_penalty": 2.0}, {"repetition_penalty": 2.0}):
        assert _post(plain_server, "/v1/completions", {**body, **extra}).json()["choices"][0]["text"] != plain["text"]
    first = TOKENIZER.encode(plain["text"]).ids[0]
    banned = _post(plain_server, "/v1/completions", {**body, "logit_bias": {str(first): -100}, "logprobs": 0}).json()
    assert banned["choices"][0]["logprobs"]["tokens"][0] != TOKENIZER.decode([first])


def test_serve_refuses_a_bad_chat_template_in_one_line(trained_exports: dict[str, Path], tmp_path: Path) -> None:
    from click.testing import CliRunner

    from kvexport.cli import main

    broken = tmp_path / "broken.jinja"
    broken.write_text("{% for message in messages %}")
    for path, message in (
        (tmp_path / "missing.jinja", f"Error: --chat-template {tmp_path / 'missing.jinja'}: can't read it (No such file or directory); pass a Jinja template file"),
        (broken, f"Error: {broken}: not a valid Jinja template (line 1: Unexpected end of template. Jinja was looking for the following tags: 'endfor' or 'else'. The innermost block that needs to be closed is 'for'.); fix it"),
    ):
        result = CliRunner().invoke(main, ["serve", str(trained_exports["none"]), "--port", "0", "--chat-template", str(path)])
        assert result.exit_code == 2 and result.stderr.strip() == message


def test_several_bad_logit_bias_keys_are_all_named_and_the_seeds_range_is_vllms(plain_server: str) -> None:
    both = _post(plain_server, "/v1/completions", {"prompt": "x", "max_tokens": 3, "logit_bias": {"x": 1, "5": 1, "y": 2}})
    assert both.json()["error"]["message"] == "logit_bias: the keys 'x', 'y' are not token ids"
    outside = _post(plain_server, "/v1/completions", {"prompt": "x", "max_tokens": 3, "logit_bias": {"99999": 1, "5": 1, "70000": 2}})
    assert outside.json()["error"]["message"] == "logit_bias: token ids 99999, 70000 are out of vocabulary (its 2048 tokens are 0..2047)"
    for seed in (2**63 - 1, -(2**63)):  # the ends of the range are taken
        assert _post(plain_server, "/v1/completions", {"prompt": "x", "max_tokens": 2, "seed": seed}).status_code == 200


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("tools", [{"type": "function", "function": {"name": "f"}}], "tools: this model's chat template does not render tools; serve it "
         "with --chat-template FILE (a template that reads `tools`), or leave tools out"),
        ("documents", [{"text": "x"}], "documents: not served by kvexport serve; leave it out"),
    ],
)
def test_tokenize_refuses_the_chat_fields_the_chat_route_refuses(all_logits_server: str, field: str, value: object, message: str) -> None:
    body = {"messages": [{"role": "user", "content": "hi"}], field: value, "tool_choice": "none"}
    for route in ("/tokenize", "/v1/chat/completions"):
        answer = _post(all_logits_server, route, body)
        assert answer.status_code == 400 and answer.json()["error"]["param"] == field, (route, answer.text)
        assert answer.json()["error"]["message"] == message


def test_continue_final_message_continues_the_last_message_in_chat_and_tokenize(all_logits_server: str) -> None:
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "The help"}]
    body = {"messages": messages, "continue_final_message": True, "add_generation_prompt": False}
    want = TOKENIZER.encode("user: hi\nassistant: The help").ids  # no newline after it, no new turn
    assert _post(all_logits_server, "/tokenize", body).json()["tokens"] == want
    greedy = {"max_tokens": 4, "temperature": 0, "ignore_eos": True}
    chat = _post(all_logits_server, "/v1/chat/completions", {**body, **greedy}).json()
    completion = _post(all_logits_server, "/v1/completions", {"prompt": want, **greedy}).json()
    assert chat["usage"]["prompt_tokens"] == len(want)
    assert chat["choices"][0]["message"]["content"] == completion["choices"][0]["text"]
    for route in ("/tokenize", "/v1/chat/completions"):  # both at once: vLLM's 400
        both = _post(all_logits_server, route, {"messages": messages, "continue_final_message": True, **greedy})
        assert both.status_code == 400 and both.json()["error"]["param"] == "continue_final_message", route


def _sse(answer: httpx.Response) -> list[dict[str, object]]:
    lines = [line.removeprefix("data: ") for line in answer.text.splitlines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(line) for line in lines[:-1]]


def test_choices_carry_vllms_null_fields_and_return_token_ids_fills_them(plain_server: str) -> None:
    prompt = TOKENIZER.encode("The help topic").ids
    plain = _post(plain_server, "/v1/completions", {"prompt": prompt, "max_tokens": 4, "temperature": 0, "ignore_eos": True}).json()
    choice = plain["choices"][0]
    assert (choice["prompt_logprobs"], choice["prompt_token_ids"], choice["token_ids"]) == (None, None, None)
    body = {"prompt": prompt, "max_tokens": 4, "temperature": 0, "ignore_eos": True, "return_token_ids": True}
    asked = _post(plain_server, "/v1/completions", body).json()["choices"][0]
    assert asked["prompt_token_ids"] == prompt and len(asked["token_ids"]) == 4
    assert TOKENIZER.decode(asked["token_ids"]) == asked["text"] == choice["text"]
    echoed = _post(plain_server, "/v1/completions", {**body, "echo": True}).json()["choices"][0]
    assert echoed["token_ids"] == asked["token_ids"] and echoed["prompt_token_ids"] == prompt  # the output's ids only
    chunks = _sse(httpx.post(f"{plain_server}/v1/completions", json={**body, "stream": True, "echo": True}, timeout=30))
    streamed = [c["choices"][0] for c in chunks]  # type: ignore[index]
    assert streamed[0]["prompt_token_ids"] == prompt and all(c["prompt_token_ids"] is None for c in streamed[1:])
    assert [t for c in streamed for t in c["token_ids"]] == asked["token_ids"]  # type: ignore[union-attr]


def test_chat_sends_the_top_level_prompt_fields_and_token_ids_when_asked(all_logits_server: str) -> None:
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "temperature": 0, "ignore_eos": True}
    plain = _post(all_logits_server, "/v1/chat/completions", body).json()
    assert (plain["prompt_logprobs"], plain["prompt_token_ids"], plain["choices"][0]["token_ids"]) == (None, None, None)
    asked = _post(all_logits_server, "/v1/chat/completions", {**body, "return_token_ids": True}).json()
    prompt = TOKENIZER.encode("user: hi\nassistant:").ids
    assert asked["prompt_token_ids"] == prompt and TOKENIZER.decode(asked["choices"][0]["token_ids"]) == asked["choices"][0]["message"]["content"]
    chunks = _sse(httpx.post(f"{all_logits_server}/v1/chat/completions", json={**body, "return_token_ids": True, "stream": True}, timeout=30))
    assert chunks[0]["prompt_token_ids"] == prompt
    assert [t for c in chunks[1:] for t in c["choices"][0]["token_ids"]] == asked["choices"][0]["token_ids"]  # type: ignore[index]


def test_an_echoed_prompt_of_special_tokens_keeps_their_text_and_offsets_stay_inside_it(all_logits_server: str) -> None:
    eos = TOKENIZER.token_to_id("<|endoftext|>")
    assert eos is not None
    prompt = [eos] * 5  # vLLM's test: a prompt of special tokens, echoed
    body = {"prompt": prompt, "max_tokens": 1, "temperature": 0, "echo": True, "logprobs": 0, "ignore_eos": True}
    choice = _post(all_logits_server, "/v1/completions", body).json()["choices"][0]
    assert choice["text"].startswith("<|endoftext|>" * 5)
    offsets, tokens = choice["logprobs"]["text_offset"], choice["logprobs"]["tokens"]
    assert offsets[:5] == [13 * i for i in range(5)] and all(offset <= len(choice["text"]) for offset in offsets)
    assert "".join(tokens) == choice["text"]


def test_continuous_usage_stats_put_the_usage_so_far_on_every_chunk(plain_server: str) -> None:
    body = {"prompt": "The help topic", "max_tokens": 5, "temperature": 0, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
    chunks = _sse(httpx.post(f"{plain_server}/v1/completions", json=body, timeout=30))
    prompt = len(TOKENIZER.encode("The help topic").ids)
    counted = [c["usage"] for c in chunks[:-1]]
    assert [u["completion_tokens"] for u in counted] == [1, 2, 3, 4, 5]  # type: ignore[index]
    assert all(u["prompt_tokens"] == prompt for u in counted)  # type: ignore[index]
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 5  # type: ignore[index]
    plain = _sse(httpx.post(f"{plain_server}/v1/completions", json={**body, "stream_options": {"include_usage": True}}, timeout=30))
    assert all(c["usage"] is None for c in plain[:-1])


def test_prompt_tokens_details_are_null_unless_the_server_enables_them(plain_server: str, all_logits_server: str) -> None:
    body = {"prompt": HELDOUT_IDS[:12], "max_tokens": 2, "temperature": 0, "ignore_eos": True}
    assert _post(plain_server, "/v1/completions", body).json()["usage"]["prompt_tokens_details"] is None
    streamed = _sse(httpx.post(f"{plain_server}/v1/completions", json={**body, "stream": True, "stream_options": {"include_usage": True}}, timeout=30))
    assert "prompt_tokens_details" not in streamed[-1]["usage"]  # type: ignore[operator]  # vLLM leaves it out of a chunk
    _post(all_logits_server, "/v1/completions", body)
    again = _post(all_logits_server, "/v1/completions", body).json()["usage"]["prompt_tokens_details"]
    assert again == {"cached_tokens": 11}  # all but the last prompt token came from the prefix cache


def test_logprob_token_ids_report_those_tokens_as_pytorch_scores_them(all_logits_server: str, torch_model: torch.nn.Module) -> None:
    prompt = HELDOUT_IDS[40:52]
    wanted = [5, 300, 1999]
    body = {"prompt": prompt, "max_tokens": 3, "temperature": 0, "ignore_eos": True, "logprobs": 0, "logprob_token_ids": wanted,
            "return_tokens_as_token_ids": True}
    choice = _post(all_logits_server, "/v1/completions", body).json()["choices"][0]
    generated = [int(t.removeprefix("token_id:")) for t in choice["logprobs"]["tokens"]]
    reference = _reference(torch_model, prompt + generated)
    for step, (token, top) in enumerate(zip(generated, choice["logprobs"]["top_logprobs"], strict=True)):
        row = reference[len(prompt) - 1 + step]
        assert next(iter(top)) == f"token_id:{token}"  # the chosen token first, then every id asked for, in order
        assert [int(t.removeprefix("token_id:")) for t in list(top)[1:]] == [t for t in wanted if t != token]
        for name, value in top.items():
            assert abs(value - row[int(name.removeprefix("token_id:"))]) < 2e-4
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "temperature": 0, "ignore_eos": True,
            "logprobs": True, "top_logprobs": 1, "logprob_token_ids": wanted, "return_tokens_as_token_ids": True}
    content = _post(all_logits_server, "/v1/chat/completions", chat).json()["choices"][0]["logprobs"]["content"]
    for entry in content:
        shown = [e["token"] for e in entry["top_logprobs"]]
        assert shown[0] == entry["token"] and set(shown[1:]) | {entry["token"]} >= {f"token_id:{t}" for t in wanted}
    # with echo, the prompt's positions keep their own alternatives (logprobs of them), the generated ones the ids
    echoed = _post(all_logits_server, "/v1/completions", {**body, "echo": True, "logprobs": 5}).json()["choices"][0]["logprobs"]
    assert echoed["top_logprobs"][0] is None and all(5 <= len(top) <= 6 for top in echoed["top_logprobs"][1 : len(prompt)])
    assert all(len(top) == len(wanted) + 1 or len(top) == len(wanted) for top in echoed["top_logprobs"][len(prompt) :])
    for extra, message in [
        ({"logprobs": None}, "logprob_token_ids: needs logprobs set"),
        ({"logprob_token_ids": [5, 99999]}, "out of vocabulary"),
        ({"logprob_token_ids": list(range(129))}, "129 ids; give 1 to 128"),
        ({"echo": True, "max_tokens": 0}, "echo with max_tokens 0 generates no token"),
    ]:
        refused = _post(all_logits_server, "/v1/completions", {**body, **extra})
        assert refused.status_code == 400 and refused.json()["error"]["param"] == "logprob_token_ids", refused.text
        assert message in refused.json()["error"]["message"]


def test_chat_echo_puts_the_last_message_first_as_vllm_does(all_logits_server: str) -> None:
    saying = "The help topic for"
    messages = [{"role": "user", "content": "say it"}, {"role": "assistant", "content": saying}]
    body = {"messages": messages, "max_tokens": 4, "temperature": 0, "ignore_eos": True,
            "add_generation_prompt": False, "continue_final_message": True}
    plain = _post(all_logits_server, "/v1/chat/completions", body).json()["choices"][0]["message"]["content"]
    echoed = _post(all_logits_server, "/v1/chat/completions", {**body, "echo": True}).json()
    assert echoed["choices"][0]["message"]["content"] == saying + plain
    assert echoed["usage"]["completion_tokens"] == 4  # the echo is not generated
    chunks = _sse(httpx.post(f"{all_logits_server}/v1/chat/completions", json={**body, "echo": True, "stream": True}, timeout=30))
    deltas = [c["choices"][0]["delta"].get("content", "") for c in chunks]  # type: ignore[index]
    assert deltas[:2] == ["", saying] and "".join(deltas) == saying + plain
    # after a generation prompt the reply is the assistant's: a user's last message is not echoed
    asked = {"messages": messages[:1], "max_tokens": 2, "temperature": 0, "ignore_eos": True}
    assert _post(all_logits_server, "/v1/chat/completions", {**asked, "echo": True}).json()["choices"][0]["message"]["content"] == (
        _post(all_logits_server, "/v1/chat/completions", asked).json()["choices"][0]["message"]["content"]
    )


def test_chat_prompt_logprobs_are_pytorchs_at_the_top_level(all_logits_server: str, torch_model: torch.nn.Module) -> None:
    body = {"messages": [{"role": "user", "content": "The help topic"}], "max_tokens": 1, "temperature": 0, "prompt_logprobs": 2,
            "return_token_ids": True}
    answer = _post(all_logits_server, "/v1/chat/completions", body).json()
    prompt = answer["prompt_token_ids"]
    assert prompt == TOKENIZER.encode("user: The help topic\nassistant:").ids
    reference = _reference(torch_model, prompt)
    got = answer["prompt_logprobs"]
    assert len(got) == len(prompt) and got[0] is None
    for position in range(1, len(prompt)):
        entry = got[position][str(prompt[position])]
        assert abs(entry["logprob"] - reference[position - 1, prompt[position]]) < 2e-4
        assert entry["rank"] == int((reference[position - 1] > reference[position - 1, prompt[position]]).sum()) + 1
        assert len(got[position]) <= 3  # the prompt token and the 2 likeliest
    refused = _post(all_logits_server, "/v1/chat/completions", {**body, "stream": True})
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "prompt_logprobs"


def test_truncation_side_right_keeps_the_first_tokens(plain_server: str) -> None:
    prompt = HELDOUT_IDS[:20]
    body = {"prompt": prompt, "max_tokens": 2, "temperature": 0, "ignore_eos": True, "truncate_prompt_tokens": 8, "return_token_ids": True}
    left = _post(plain_server, "/v1/completions", body).json()["choices"][0]
    right = _post(plain_server, "/v1/completions", {**body, "truncation_side": "right"}).json()["choices"][0]
    assert left["prompt_token_ids"] == prompt[-8:] and right["prompt_token_ids"] == prompt[:8]
    alone = _post(plain_server, "/v1/completions", {**body, "prompt": prompt[:8], "truncate_prompt_tokens": None}).json()["choices"][0]
    assert right["token_ids"] == alone["token_ids"]


def test_the_servers_return_tokens_as_token_ids_is_the_default_a_request_overrides(trained_exports: dict[str, Path]) -> None:
    from fastapi.testclient import TestClient

    from kvexport.serving import Engine
    from kvexport.serving.app import create_app

    body = {"prompt": "The help", "max_tokens": 2, "temperature": 0, "ignore_eos": True, "logprobs": 1}
    with Engine(trained_exports["none"], slots=2, max_context=64, warm_up=0) as engine:
        client = TestClient(create_app(engine, ApiConfig(return_tokens_as_token_ids=True)))
        shown = client.post("/v1/completions", json=body).json()["choices"][0]["logprobs"]["tokens"]
        named = client.post("/v1/completions", json={**body, "return_tokens_as_token_ids": False}).json()["choices"][0]
    assert all(t.startswith("token_id:") for t in shown) and len(shown) == 2
    assert "".join(named["logprobs"]["tokens"]) == named["text"] and [f"token_id:{t}" for t in TOKENIZER.encode(named["text"]).ids] == shown


def test_max_logprobs_minus_one_lets_a_request_ask_for_every_token(
    trained_all_logits: Path, template_file: Path, torch_model: torch.nn.Module
) -> None:
    from fastapi.testclient import TestClient

    from kvexport.serving import Engine
    from kvexport.serving.app import create_app

    prompt = HELDOUT_IDS[60:70]
    body = {"prompt": prompt, "max_tokens": 1, "temperature": 0, "logprobs": -1, "prompt_logprobs": -1, "return_tokens_as_token_ids": True}
    with Engine(trained_all_logits, slots=2, max_context=64, warm_up=0, max_logprobs=-1) as engine:
        client = TestClient(create_app(engine, ApiConfig(chat_template=str(template_file))))
        choice = client.post("/v1/completions", json=body).json()["choices"][0]
        chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1, "logprobs": True, "top_logprobs": -1}
        content = client.post("/v1/chat/completions", json=chat).json()["choices"][0]["logprobs"]["content"]
    vocab = TOKENIZER.get_vocab_size()
    top = choice["logprobs"]["top_logprobs"][0]
    reference = _reference(torch_model, prompt)
    assert len(top) == vocab and len(content[0]["top_logprobs"]) == vocab
    assert max(abs(value - reference[-1, int(name.removeprefix("token_id:"))]) for name, value in top.items()) < 2e-4
    assert all(len(entry) == vocab for entry in choice["prompt_logprobs"][1:])


def test_the_served_name_is_the_configs_or_else_the_directorys(tmp_path: Path) -> None:
    export = tmp_path / "my-export"
    export.mkdir()
    assert ApiConfig().model_name(export) == "my-export"
    assert ApiConfig().model_name(export / ".") == "my-export"  # the directory's own name, however it is spelled
    assert ApiConfig(name="qwen").model_name(export) == "qwen"
