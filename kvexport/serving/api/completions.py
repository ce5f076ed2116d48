"""``POST /v1/completions``: a prompt (text or token ids) or a list of them, ``n`` choices each.

Choice index = prompt × n + i; ``echo`` puts the prompt first (with ``logprobs``, its
log-probabilities first, the first prompt token's ``null``); ``prompt_logprobs``; every
sampling control of :mod:`kvexport.serving.protocol`; SSE streaming, one chunk per token.
"""

from __future__ import annotations

from fastapi import APIRouter, Depends, Request
from fastapi.responses import Response, StreamingResponse

from kvexport.serving.api.common import Served, decode, refusal, served, submit_choices, wrong_model
from kvexport.serving.api.render import Choice, CompletionRender, answer, error_response
from kvexport.serving.protocol import CompletionRequest
from kvexport.serving.request import DEFAULT_MAX_TOKENS, SamplingParams

router = APIRouter()


@router.post("/v1/completions", response_model=None)
async def completions(body: CompletionRequest, request: Request, context: Served = Depends(served)) -> Response:  # noqa: B008
    """A ``text_completion`` body, or its chunks as SSE."""
    problem = wrong_model(context, body.model) or refusal(body)
    if problem is not None:
        return problem
    if body.max_tokens == 0 and not body.echo:
        return error_response(400, "max_tokens: Input should be greater than or equal to 1 (greater_than_equal)", param="max_tokens")
    if body.max_tokens == 0 and body.logprob_token_ids:  # vLLM's rule: an echo alone generates no token to report
        return error_response(400, "logprob_token_ids: echo with max_tokens 0 generates no token; drop one of them", param="logprob_token_ids")
    engine = context.engine
    prompt_logprobs = body.prompt_logprobs if body.prompt_logprobs is not None else (body.logprobs if body.echo else None)
    echo_only = body.echo and body.max_tokens == 0
    choices: list[Choice] = []

    def submit() -> None:
        engine.check_fits(len(body.prompts()) * body.n)
        prompts: list[tuple[list[int], SamplingParams]] = []
        echoes: list[str] = []
        for prompt in body.prompts():
            ids = engine.encode(prompt) if isinstance(prompt, str) else [int(t) for t in prompt]
            ids = body.truncated(ids)
            wanted = 1 if echo_only else (body.max_tokens if body.max_tokens is not None else DEFAULT_MAX_TOKENS)
            prompts.append((ids, body.sampling_params(wanted, logprobs=body.logprobs, prompt_logprobs=prompt_logprobs)))
            echo = ""
            if body.echo:  # the prompt as sent, unless it was token ids or truncated: then every id's text, special ones too (vLLM's)
                echo = prompt if isinstance(prompt, str) and body.truncate_prompt_tokens is None else decode(engine.tokenizer, ids, special=True)
            echoes.append(echo)
        # queued together: their first pieces can share a prefill call
        children = engine.submit_all(prompts, body.n)
        for index, child in enumerate(children):
            ids, echo = prompts[index // body.n][0], echoes[index // body.n]
            choices.append(Choice(len(choices), child, echo, ids if body.echo else [], echo_only))

    refused = await submit_choices(submit, choices, "prompt")
    if refused is not None:
        return refused
    first = choices[:: body.n]  # one choice per prompt: each prompt's n choices are together
    render = CompletionRender(context.model, choices, first, context.names(body), body, context.api.enable_prompt_tokens_details)
    if body.stream:
        return StreamingResponse(render.stream(), media_type="text/event-stream")
    return await answer(choices, request, render.whole)
