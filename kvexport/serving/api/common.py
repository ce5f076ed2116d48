"""What the routes share: the served engine and model, the model check, chat prompts, and submitting choices.

A refusal names the field it is about: a :class:`~kvexport.serving.errors.ParameterError`
carries it from where it was raised; any other one-line error is about the route's input
(``prompt`` or ``messages``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse
from starlette.concurrency import run_in_threadpool
from tokenizers import Tokenizer

from kvexport.errors import KvexportError
from kvexport.serving.api.render import Choice, TokenNames, cancel, error_response
from kvexport.serving.chat import ChatTemplate
from kvexport.serving.config import ApiConfig
from kvexport.serving.engine import Engine, EngineClosed, EngineFull
from kvexport.serving.errors import ParameterError
from kvexport.serving.protocol import ChatMessage, SamplingFields
from kvexport.serving.tool_use import ToolSettings, ToolUse

RETRY_AFTER_S = 1


@dataclass(frozen=True)
class Served:
    """What one app serves: the engine, the model name clients use, the chat template, the playground page and the API's settings."""

    engine: Engine
    model: str
    chat_template: ChatTemplate | None
    playground: str
    api: ApiConfig
    tools: ToolSettings

    def names(self, body: SamplingFields) -> TokenNames:
        """How tokens are shown: as ``token_id:N`` when the request asks, else when the server does (``--return-tokens-as-token-ids``)."""
        as_ids = body.return_tokens_as_token_ids
        return TokenNames(self.engine.tokenizer, self.api.return_tokens_as_token_ids if as_ids is None else as_ids)

    def tool_use(self, tools: Any, tool_choice: Any, parallel_tool_calls: bool | None, chat_template_kwargs: dict[str, Any] | None) -> ToolUse:
        """A request's tools and thinking, checked against this server's parsers and template."""
        return ToolUse.of(tools, tool_choice, parallel_tool_calls, chat_template_kwargs, self.tools, self.chat_template)


def served(request: Request) -> Served:
    """The app's :class:`Served` (a FastAPI dependency, as vLLM reads ``app.state``)."""
    value: Served = request.app.state.served
    return value


def wrong_model(served: Served, name: str | None) -> JSONResponse | None:
    """A 404 naming the served model when the request asks for another one."""
    if name is not None and name != served.model:
        return error_response(
            404, f"the model `{name}` does not exist; this server serves `{served.model}`", param="model", code="model_not_found"
        )
    return None


def chat_prompt(
    served: Served,
    messages: list[ChatMessage],
    add_generation_prompt: bool,
    continue_final_message: bool = False,
    arguments: dict[str, Any] | None = None,
) -> str:
    """The prompt text of ``messages`` (chat and /tokenize), with the template's extra ``arguments`` (``tools``, ...); one line when there is no template.

    ``continue_final_message`` (vLLM's, transformers' ``apply_chat_template`` meaning): the
    text ends with the last message's own content, so the model continues that message
    instead of starting a new one (it needs ``add_generation_prompt`` false).
    """
    if served.chat_template is None:
        raise ParameterError(
            "this model has no chat template: start kvexport serve with --chat-template FILE (a Jinja template), "
            "or use /v1/completions",
            parameter="messages",
        )
    if continue_final_message and add_generation_prompt:
        raise ParameterError(
            "continue_final_message: cannot be true with add_generation_prompt true; set add_generation_prompt to false",
            parameter="continue_final_message",
        )
    rendered = served.chat_template.render(
        [m.for_template() for m in messages], add_generation_prompt=add_generation_prompt, **(arguments or {})
    )
    if not continue_final_message:
        return rendered
    final = messages[-1].text()
    for piece in (final, final.strip()):  # as transformers cuts it: after the last place the message's text appears
        if piece and piece in rendered:
            return rendered[: rendered.rindex(piece) + len(piece)]
    raise ParameterError(
        "continue_final_message: the final message's text does not appear in the rendered chat; the template changes it",
        parameter="continue_final_message",
    )


def decode(tokenizer: Tokenizer | None, ids: list[int], *, special: bool = False) -> str:
    """The text of ``ids`` ("" without a tokenizer); ``special`` keeps special tokens' text (an echoed prompt's)."""
    return "" if tokenizer is None else str(tokenizer.decode(ids, skip_special_tokens=not special))


def refusal(body: SamplingFields) -> JSONResponse | None:
    """A 400 for the first field of ``body`` this server does not serve, naming it."""
    refused = body.refused()
    if refused is None:
        return None
    return error_response(400, str(refused), param=refused.parameter)


async def submit_choices(submit: Callable[[], None], choices: list[Choice], input_field: str) -> JSONResponse | None:
    """Run ``submit`` in a worker thread; on a refusal cancel what it had queued and answer in OpenAI's shape.

    In a thread, not on the event loop: tokenizing, rendering a chat template and compiling a
    grammar (milliseconds for a large JSON schema) would otherwise hold up every other
    stream's chunks. The 400's ``param`` is the field the error names, else ``input_field``
    (the prompt or the messages: a prompt too long, a template that refuses them).
    """
    try:
        await run_in_threadpool(submit)
    except (EngineFull, EngineClosed) as exc:
        cancel(choices)
        return error_response(503, str(exc), kind="server_overloaded", headers={"Retry-After": str(RETRY_AFTER_S)})
    except KvexportError as exc:
        cancel(choices)
        param = exc.parameter if isinstance(exc, ParameterError) else input_field
        return error_response(400, str(exc), param=param)
    except BaseException:  # the route itself cancelled (a client gone, under Ray Serve): nothing it queued may run on
        cancel(choices)
        raise
    return None
