"""``kvexport serve``: the HTTP app on uvicorn, on one machine.

The engine is built first (the export checked, loaded and warmed up with
``EngineConfig.warm_up`` requests, so the first clients do not pay for ONNX Runtime's
first runs), then uvicorn serves the app on
a socket bound here, so ``--port 0`` works and the address is known before the first
request. SIGTERM or Ctrl-C: uvicorn stops taking connections and lets the running
requests finish; then the engine drains and stops, and the process exits 0.
"""

from __future__ import annotations

import signal
import socket
from collections.abc import Callable
from pathlib import Path

from kvexport.errors import KvexportError
from kvexport.passes.vocabulary import PAGE_TOKENS
from kvexport.serving.config import ApiConfig, EngineConfig
from kvexport.serving.engine import DEFAULT_KV_MEMORY, Engine, slot_bytes


def serve(
    directory: str | Path,
    config: EngineConfig | None = None,
    *,
    host: str = "127.0.0.1",
    port: int = 8000,
    api: ApiConfig | None = None,
    say: Callable[[str], None] = lambda message: None,
) -> None:
    """Serve ``directory`` with the engine ``config`` describes, answering as ``api`` says, until SIGTERM or SIGINT; returns after a clean shutdown."""
    import uvicorn

    from kvexport.serving.app import create_app
    from kvexport.serving.tool_use import chat_settings

    path = Path(directory)
    api = api or ApiConfig()
    chat_settings(path, api)  # a bad template file or parser name fails before the engine loads
    engine = Engine(path, config or EngineConfig())
    app = create_app(engine, api)
    served = app.state.served.model
    listener = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        listener.bind((host, port))
    except OSError as exc:
        engine.close(drain=False)
        raise KvexportError(f"--host {host} --port {port}: can't listen there ({exc.strerror}); pick another port") from None
    listener.listen(2048)  # connections queue from here on, so the "serving" line below is already true
    bound_port = listener.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", access_log=False, lifespan="off"))
    # uvicorn takes SIGTERM / SIGINT while it serves and raises them again once it has
    # shut down gracefully; ignored then, they end nothing more
    previous = {sig: signal.signal(sig, signal.SIG_IGN) for sig in (signal.SIGTERM, signal.SIGINT)}
    quantization = engine.manifest.quantization or {}
    if quantization.get("per_channel") and quantization.get("activation_scale") != "row":
        say(
            "note: this per-channel int8 export quantizes activations over each call's rows, so a request's "
            "output can depend on the requests batched with it; export it again (now quantized row by row)"
        )
    say(
        f"serving {path} as {served!r} on http://{host}:{bound_port} ({engine.slots} slots of {engine.capacity} tokens, "
        f"{cache_summary(engine)}, {engine.provider}{prompt_summary(engine)}{', API key required' if api.api_key else ''}); "
        "stop with Ctrl-C or SIGTERM"
    )
    try:
        server.run(sockets=[listener])
    finally:
        say("shutting down: finishing the requests already admitted")
        engine.close(drain=True)
        listener.close()
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    say("stopped")


def prompt_summary(engine: Engine) -> str:
    """``, prompts and decode calls of 16+ rows in bf16 (amx)`` where a prompt session runs their products, else nothing."""
    runner = engine.runner
    if runner.prompt_session is None:
        return ""
    rows = f" and decode calls of {runner.bf16_decode_rows}+ rows" if runner.bf16_decode_rows else ""
    return f", prompts{rows} in bf16 ({runner.prompt_products})"


def cache_summary(engine: Engine) -> str:
    """The cache's dtype and size, and how --kv-memory sized it: ``int8 cache 1.2 GiB (--kv-memory: 16 slots of 75.5 MiB)``.

    Paged: ``paged fp32 cache, 1455 blocks of 16 tokens (at most 1.00 GiB, held as requests fill them)``.
    """
    blocks = engine.table.blocks
    if blocks is not None:
        pool = engine.runner.cache.pool_bytes  # type: ignore[attr-defined]
        return (
            f"paged {engine.cache_dtype} cache, {blocks.blocks - 1} blocks of {PAGE_TOKENS} tokens (at most "
            f"{pool / 2**30:.2f} GiB, held as requests fill them)"
        )
    per_slot = slot_bytes(engine.manifest, engine.capacity)
    text = f"{engine.manifest.cache_dtype} cache{_unpaged(engine)} {engine.slots * per_slot / 2**30:.2f} GiB"
    if engine.config.kv_memory is not None:
        text += f" (--kv-memory {engine.config.kv_memory} bytes: {engine.slots} slots of {per_slot / 2**20:.1f} MiB)"
    elif engine.config.max_context is None and engine.capacity < engine.manifest.dims.max_positions:
        text += (
            f" (the default {DEFAULT_KV_MEMORY / 2**30:g} GiB budget; the model takes {engine.manifest.dims.max_positions} "
            "tokens: --max-context or --kv-memory for more)"
        )
    return text


def _unpaged(engine: Engine) -> str:
    """`` in slots (why)`` where the engine keeps the slot layout."""
    return f" in {engine.kv_layout}"
