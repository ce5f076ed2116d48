"""``POST /tokenize`` (a prompt, or chat messages through the template), ``POST /detokenize`` and ``GET /tokenizer_info``, in vLLM's shapes."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Depends
from fastapi.responses import JSONResponse, Response

from kvexport.errors import KvexportError
from kvexport.runtime.opened import out_of_vocabulary
from kvexport.serving.api.common import Served, chat_prompt, decode, served, wrong_model
from kvexport.serving.api.render import error_response
from kvexport.serving.protocol import DetokenizeRequest, TokenizeRequest

router = APIRouter()


@router.post("/tokenize", response_model=None)
async def tokenize(body: TokenizeRequest, context: Served = Depends(served)) -> Response:  # noqa: B008
    """The token ids of a prompt or of rendered messages, with their strings when asked."""
    problem = wrong_model(context, body.model)
    if problem is not None:
        return problem
    refused = body.refused()
    if refused is not None:
        return error_response(400, str(refused), param=refused.parameter)
    if (body.prompt is None) == (body.messages is None):
        return error_response(400, "tokenize: send a prompt or messages (one of them)", param="prompt")
    engine = context.engine
    text = body.prompt
    if body.messages is not None:
        try:  # tools and arguments as the chat route renders them (tool_choice "none": nothing else matters here)
            use = context.tool_use(body.tools, "none", None, body.chat_template_kwargs)
            text = chat_prompt(context, body.messages, body.add_generation_prompt, body.continue_final_message, use.template_arguments)
        except KvexportError as exc:
            return error_response(400, str(exc), param=getattr(exc, "parameter", None) or "messages")
    assert text is not None
    try:
        ids = engine.encode(text)
    except KvexportError as exc:
        return error_response(400, str(exc), param="prompt")
    tokenizer = engine.tokenizer
    strings = [tokenizer.id_to_token(t) for t in ids] if body.return_token_strs and tokenizer is not None else None
    return JSONResponse({"count": len(ids), "max_model_len": engine.capacity, "tokens": ids, "token_strs": strings})


@router.post("/detokenize", response_model=None)
async def detokenize(body: DetokenizeRequest, context: Served = Depends(served)) -> Response:  # noqa: B008
    """The text of token ids."""
    problem = wrong_model(context, body.model)
    if problem is not None:
        return problem
    engine = context.engine
    outside = [t for t in body.tokens if not 0 <= t < engine.vocab_size]
    if outside:
        return error_response(400, f"tokens: {out_of_vocabulary(outside, engine.vocab_size)}", param="tokens")
    if engine.tokenizer is None:
        return error_response(400, f"{engine.directory} has no tokenizer; there is no text to give", param="tokens")
    return JSONResponse({"prompt": decode(engine.tokenizer, body.tokens)})


@router.get("/tokenizer_info")
async def tokenizer_info(context: Served = Depends(served)) -> dict[str, Any]:  # noqa: B008
    """The tokenizer's special tokens, sizes and chat template."""
    engine = context.engine
    eos = engine.eos_token_id
    eos_text = engine.tokenizer.id_to_token(eos) if engine.tokenizer is not None and eos is not None else None
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "eos_token": eos_text,
        "eos_token_id": eos,
        "bos_token": eos_text,
        "model_max_length": engine.capacity,
        "vocab_size": engine.vocab_size,
        "add_bos_token": False,
        "chat_template": None if context.chat_template is None else context.chat_template.text,
    }
