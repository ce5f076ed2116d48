"""``kvexport serve`` on Ray Serve: the same FastAPI app, one engine per replica.

Each replica of :class:`KvexportReplica` builds its own :class:`~kvexport.serving.engine.Engine`, and serves the app of
``kvexport serve`` (:func:`~kvexport.serving.app.create_app`) as its ingress, built after
the engine (``serve.ingress()`` late-bound), so nothing of the HTTP surface is written
twice. Each response names its replica in an ``x-kvexport-replica`` header, and
``/metrics`` reports the replica that answers.

Three ways in:

- ``kvexport serve DIR --replicas N [--ray-address auto|ray://...]`` starts (or joins) a Ray
  cluster and deploys N replicas behind Serve's HTTP proxy;
- ``serve run kvexport.serving.ray:app dir=DIR [slots=8 prefix_cache=false ...]`` with
  Serve's own CLI, every :class:`~kvexport.serving.config.EngineConfig` field a key;
- a ``serve deploy`` config whose ``import_path`` is ``kvexport.serving.ray:app``
  (``examples/ray_serve.yaml``, with autoscaling).

The export directory must be readable at the same path on every node that runs a replica:
a shared filesystem (NFS, a mounted bucket) or the same copy on each node; a replica whose
copy differs from its manifest's hashes refuses to start, with the file named.
"""

from __future__ import annotations

import dataclasses
import os
import signal
import socket
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ray import serve
from ray.serve import Application

from kvexport.errors import KvexportError
from kvexport.serving.app import API_KEY_ENV, create_app
from kvexport.serving.config import ApiConfig, EngineConfig
from kvexport.serving.engine import Engine
from kvexport.serving.tool_use import chat_settings

DEPLOYMENT = "kvexport"


@serve.deployment(name=DEPLOYMENT, ray_actor_options={"num_cpus": 0})
@serve.ingress()
class KvexportReplica:
    """One replica: an engine over the export directory, behind the app of ``kvexport serve``."""

    def __init__(self, directory: str, config: EngineConfig, api: ApiConfig) -> None:
        self.api = api
        self.engine = Engine(directory, config)
        self.replica = f"{socket.gethostname()}:{os.getpid()}"

    def __serve_build_asgi_app__(self) -> Any:
        """The app of ``kvexport serve`` over this replica's engine (Serve calls it after ``__init__``)."""
        return create_app(self.engine, self.api, replica=self.replica)

    def __del__(self) -> None:
        engine = getattr(self, "engine", None)
        if engine is not None:
            engine.close(drain=False, timeout=5)


def build(
    directory: str | Path,
    config: EngineConfig | None = None,
    *,
    replicas: int = 2,
    api: ApiConfig | None = None,
) -> Application:
    """The Serve application: ``replicas`` copies of :class:`KvexportReplica` over ``directory``, each answering as ``api`` says."""
    config = config or EngineConfig()
    path = Path(directory).resolve()
    if not (path / "kvexport.json").is_file():
        raise KvexportError(f"{directory}: no kvexport.json; pass an export directory (kvexport export --out ...)")
    api = api or ApiConfig()
    chat_settings(path, api)  # a bad template file or parser name fails here, not in every replica
    deployment = KvexportReplica.options(  # type: ignore[attr-defined]
        num_replicas=replicas, max_ongoing_requests=config.slots + config.max_queue
    )
    return deployment.bind(str(path), config, api)


# the application's own arguments and ApiConfig's fields; every other key=value is an EngineConfig field
_APP_ARGUMENTS = ("dir", "replicas")
_API_ARGUMENTS = tuple(f.name for f in dataclasses.fields(ApiConfig))


def app(args: dict[str, Any]) -> Application:
    """Serve's application builder: ``serve run kvexport.serving.ray:app dir=DIR [replicas=2 slots=8 ...]``.

    Besides ``dir`` and ``replicas``, a key is a field of
    :class:`~kvexport.serving.config.ApiConfig` (``name``, ``chat_template``, ``api_key``
    (default: the ``KVEXPORT_API_KEY`` environment variable), ``enable_prompt_tokens_details``)
    or of :class:`~kvexport.serving.config.EngineConfig` (``prefix_cache=false``, ``chunk=128``, ...).
    """
    if "dir" not in args:
        raise KvexportError("pass the export directory: serve run kvexport.serving.ray:app dir=DIR")
    api = ApiConfig.from_strings({k: v for k, v in args.items() if k in _API_ARGUMENTS})
    if api.api_key is None and os.environ.get(API_KEY_ENV):
        api = dataclasses.replace(api, api_key=os.environ[API_KEY_ENV])
    config = EngineConfig.from_strings({k: v for k, v in args.items() if k not in _APP_ARGUMENTS + _API_ARGUMENTS})
    replicas = int(args.get("replicas", "2"))
    return build(args["dir"], config, replicas=replicas, api=api)


def serve_with_ray(
    directory: str | Path,
    config: EngineConfig | None = None,
    *,
    replicas: int,
    address: str | None = None,
    host: str = "127.0.0.1",
    port: int = 8000,
    api: ApiConfig | None = None,
    say: Callable[[str], None] = lambda message: None,
    stop: threading.Event | None = None,
) -> None:
    """Deploy ``replicas`` replicas answering as ``api`` says on a Ray cluster (started here unless ``address``) until SIGTERM / SIGINT.

    ``stop``, when given, ends it too (tests). Serve's HTTP proxy listens on ``host:port``.
    On the way out the application is deleted and a cluster started here is shut down.
    """
    import ray

    application = build(directory, config, replicas=replicas, api=api)
    started_here = address is None
    ray.init(address=address, include_dashboard=False, log_to_driver=False, ignore_reinit_error=True)
    finished = stop or threading.Event()
    previous = {sig: signal.signal(sig, lambda *_: finished.set()) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        serve.start(http_options={"host": host, "port": port})
        serve.run(application, name=DEPLOYMENT, route_prefix="/")
        say(
            f"serving {directory} on http://{host}:{port} through Ray Serve, {replicas} replicas; stop with Ctrl-C or SIGTERM"
        )
        finished.wait()
    finally:
        say("shutting down: deleting the deployment")
        serve.shutdown()
        if started_here:
            ray.shutdown()
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    say("stopped")
