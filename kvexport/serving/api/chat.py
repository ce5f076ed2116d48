"""``POST /v1/chat/completions``: ``messages`` rendered by the chat template (:mod:`kvexport.serving.chat`).

The same controls as completions, ``logprobs`` / ``top_logprobs`` in the chat shape, vLLM's
``echo`` and ``prompt_logprobs`` (top level, not streamed), tools and reasoning
(:mod:`kvexport.serving.tool_use`: ``tool_calls`` and ``reasoning`` in the message), and
streamed ``chat.completion.chunk`` deltas. Without ``max_tokens`` (or
``max_completion_tokens``) a chat may use the rest of the context, as vLLM's does.
"""

from __future__ import annotations

import dataclasses

from fastapi import APIRouter, Depends, Request
from fastapi.responses import Response, StreamingResponse

from kvexport.serving.api.common import (
    Served,
    chat_prompt,
    refusal,
    served,
    submit_choices,
    wrong_model,
)
from kvexport.serving.api.render import ChatRender, Choice, answer, error_response
from kvexport.serving.protocol import ChatCompletionRequest
from kvexport.serving.tool_use import ToolUse

router = APIRouter()


def echo_text(body: ChatCompletionRequest) -> str:
    """What ``echo`` puts before the reply (vLLM's): the last message's text when it has the reply's role, else nothing.

    The reply's role is the assistant's after a generation prompt; without one
    (``add_generation_prompt: false``) the reply continues the last message, whatever its role.
    """
    last = body.messages[-1]
    if body.echo and (not body.add_generation_prompt or last.role == "assistant"):
        return last.text()
    return ""


@router.post("/v1/chat/completions", response_model=None)
async def chat_completions(body: ChatCompletionRequest, request: Request, context: Served = Depends(served)) -> Response:  # noqa: B008
    """A ``chat.completion`` body, or its ``chat.completion.chunk`` deltas as SSE."""
    problem = wrong_model(context, body.model) or refusal(body)
    if problem is not None:
        return problem
    if body.top_logprobs is not None and not body.logprobs:
        return error_response(400, "top_logprobs: needs logprobs: true", param="top_logprobs")
    if body.prompt_logprobs is not None and body.stream:  # vLLM's rule: a streamed chat carries no prompt logprobs
        return error_response(400, "prompt_logprobs: not available with stream: true", param="prompt_logprobs")
    engine = context.engine
    choices: list[Choice] = []
    uses: list[ToolUse] = []

    def submit() -> None:  # in a worker thread: the template renders and the tools' grammar compiles here
        use = context.tool_use(body.tools, body.tool_choice, body.parallel_tool_calls, body.chat_template_kwargs)
        uses.append(use)
        prompt = chat_prompt(context, body.messages, body.add_generation_prompt, body.continue_final_message, use.template_arguments)
        ids = body.truncated(engine.encode(prompt))
        wanted = body.wanted_tokens()
        params = body.sampling_params(
            wanted if wanted is not None else max(1, engine.capacity - len(ids)),
            logprobs=(body.top_logprobs or 0) if body.logprobs else None,
            prompt_logprobs=body.prompt_logprobs,
        )
        params = dataclasses.replace(params, structured=use.constraint(params.structured))
        for child in engine.submit_n(ids, params, body.n):
            choices.append(Choice(len(choices), child))

    refused = await submit_choices(submit, choices, "messages")
    if refused is not None:
        return refused
    render = ChatRender(
        context.model, choices, context.names(body), body, context.api.enable_prompt_tokens_details, echo_text(body), uses[0]
    )
    if body.stream:
        return StreamingResponse(render.stream(), media_type="text/event-stream")
    return await answer(choices, request, render.whole)
