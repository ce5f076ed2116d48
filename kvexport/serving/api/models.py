"""``GET /v1/models``, ``GET /health`` and the playground at ``GET /``.

The playground is one HTML page with no external assets (``serving/playground.html``): a
prompt, max tokens, temperature, the tokens as they stream with TTFT and tokens/s, a chat
mode when there is a chat template and a key field when there is an API key.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from fastapi import APIRouter, Depends
from fastapi.responses import HTMLResponse

from kvexport.serving.api.common import Served, served

PLAYGROUND = Path(__file__).parent.parent / "playground.html"

router = APIRouter()


def playground_page(model: str, *, chat: bool, api_key: bool, tools: bool = False, auto_tools: bool = False) -> str:
    """The playground's HTML (no external assets), told the model name and whether chat, a key, tools and ``tool_choice: auto`` apply."""
    settings = {"model": model, "chat": chat, "api_key": api_key, "tools": tools, "auto_tools": auto_tools}
    config = json.dumps(settings).replace("<", "\\u003c")
    return PLAYGROUND.read_text(encoding="utf-8").replace("__SERVER_CONFIG__", config)


@router.get("/health")
async def health() -> dict[str, str]:
    """Whether the server answers."""
    return {"status": "ok"}


@router.get("/", response_class=HTMLResponse)
async def playground(context: Served = Depends(served)) -> HTMLResponse:  # noqa: B008
    """The playground page."""
    return HTMLResponse(context.playground)


@router.get("/v1/models")
async def models(context: Served = Depends(served)) -> dict[str, Any]:  # noqa: B008
    """The one model served, with its context length."""
    return {
        "object": "list",
        "data": [
            {
                "id": context.model,
                "object": "model",
                "created": int(time.time()),
                "owned_by": "kvexport",
                "root": str(context.engine.directory),
                "max_model_len": context.engine.capacity,
            }
        ],
    }
