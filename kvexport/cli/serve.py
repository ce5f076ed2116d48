"""``kvexport serve``: the OpenAI-compatible server (:func:`kvexport.serving.server.serve`, or Ray Serve replicas)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import click

from kvexport.cli.base import UserError, main, progress, run
from kvexport.extras import require_extra
from kvexport.serving.config import engine_options
from kvexport.serving.reasoning import REASONING_PARSERS
from kvexport.serving.tool_parsers import TOOL_PARSERS


@main.command("serve")
@click.argument("directory", type=click.Path(path_type=Path))
@click.option("--host", default="127.0.0.1", show_default=True, help="Address to listen on.")
@click.option("--port", default=8000, show_default=True, type=click.IntRange(0, 65535), help="Port (0: any free one, printed).")
@click.option("--model-name", default=None, help="The model name clients use [default: the directory's name].")
@click.option(
    "--replicas",
    type=click.IntRange(1),
    default=None,
    help="Serve through Ray Serve with this many replicas, one engine each (needs kvexport[ray]).",
)
@click.option(
    "--ray-address",
    default=None,
    help="With --replicas: join this Ray cluster (auto, ray://host:10001) instead of starting one here.",
)
@click.option(
    "--chat-template",
    type=click.Path(path_type=Path),
    default=None,
    help="A Jinja chat template for /v1/chat/completions [default: the export's tokenizer_config.json one, if any].",
)
@click.option(
    "--api-key",
    envvar="KVEXPORT_API_KEY",
    default=None,
    help="Require 'Authorization: Bearer KEY' on every /v1 and tokenizer route (401 otherwise) [env: KVEXPORT_API_KEY].",
)
@click.option(
    "--enable-prompt-tokens-details",
    is_flag=True,
    help="Send usage.prompt_tokens_details.cached_tokens (prompt tokens the prefix cache served); null otherwise, as vLLM.",
)
@click.option(
    "--return-tokens-as-token-ids",
    is_flag=True,
    help="Show logprobs' tokens as 'token_id:N' unless a request sets return_tokens_as_token_ids (vLLM's flag).",
)
@click.option(
    "--tool-call-parser",
    type=click.Choice([*sorted(TOOL_PARSERS), "none"]),
    default=None,
    help="How tool calls are read from the output [default: the one the chat template implies, if any].",
)
@click.option(
    "--enable-auto-tool-choice",
    is_flag=True,
    help='Serve tool_choice "auto" (the model decides whether to call a tool), as vLLM\'s flag; "required" and named calls need no flag.',
)
@click.option(
    "--reasoning-parser",
    type=click.Choice([*sorted(REASONING_PARSERS), "none"]),
    default=None,
    help="How thinking (<think>...</think>) is split into the message's reasoning [default: the one the chat template implies, if any].",
)
@engine_options
def serve_command(
    directory: Path,
    host: str,
    port: int,
    model_name: str | None,
    replicas: int | None,
    ray_address: str | None,
    chat_template: Path | None,
    api_key: str | None,
    enable_prompt_tokens_details: bool,
    return_tokens_as_token_ids: bool,
    tool_call_parser: str | None,
    enable_auto_tool_choice: bool,
    reasoning_parser: str | None,
    engine_settings: dict[str, Any],
) -> None:
    """Serve DIRECTORY over HTTP with an OpenAI-compatible API.

    Routes: /v1/completions, /v1/chat/completions, /v1/models, /tokenize, /detokenize,
    /tokenizer_info, /health, /metrics. Many requests decode together (continuous batching
    over the in-place cache): the export needs --target ort-cpu / ort-cuda. Needs the serve
    extra: pip install 'kvexport[serve]'.
    """
    from kvexport.serving.config import ApiConfig, EngineConfig

    config = run(lambda: EngineConfig.from_options(engine_settings))
    api = ApiConfig(
        name=model_name,
        chat_template=None if chat_template is None else str(chat_template),
        api_key=api_key or None,
        enable_prompt_tokens_details=enable_prompt_tokens_details,
        return_tokens_as_token_ids=return_tokens_as_token_ids,
        tool_call_parser=tool_call_parser,
        reasoning_parser=reasoning_parser,
        enable_auto_tool_choice=enable_auto_tool_choice,
    )
    if replicas is not None:
        run(lambda: require_extra("ray", "kvexport serve --replicas"))
        from kvexport.serving.ray import serve_with_ray

        run(
            lambda: serve_with_ray(
                directory, config, replicas=replicas, address=ray_address, host=host, port=port, api=api, say=progress,
            )
        )
        return
    if ray_address is not None:
        raise UserError("--ray-address needs --replicas N")
    run(lambda: require_extra("serve", "kvexport serve"))
    from kvexport.serving.server import serve

    run(
        lambda: serve(directory, config, host=host, port=port, api=api, say=progress)
    )
