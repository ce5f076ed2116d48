"""What every command shares: the ``kvexport`` group, progress on stderr, one-line user errors, shared options.

Results go to stdout, progress to stderr. Every user error is one line and a non-zero
exit, never a traceback.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import signal
import sys
import warnings
from collections.abc import Callable
from types import FrameType
from typing import Any, TypeVar

import click

from kvexport.errors import TERMINATING, KvexportError, Terminated

F = TypeVar("F", bound=Callable[..., Any])

EXIT_FAILED_CHECKS = 1  # verify ran and some check failed; user errors exit 2 (click's usage code)


def progress(message: str) -> None:
    """Print one progress line on stderr; stop here if a SIGTERM came."""
    if TERMINATING.is_set():  # a SIGTERM whose exception a finalizer swallowed: stop at the next stage
        raise Terminated
    click.echo(f"kvexport: {message}", err=True)


def _quiet_libraries() -> None:
    """Keep third-party chatter off the terminal; kvexport reports what matters itself."""
    warnings.filterwarnings("ignore")
    logging.getLogger("transformers").setLevel(logging.ERROR)
    # read by transformers when export or verify first imports it; importing it here would
    # load transformers (and torch) for commands that need neither
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")


def _raise_on_sigterm(signum: int, frame: FrameType | None) -> None:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # one cleanup, however many signals follow
    TERMINATING.set()  # in case the exception below lands where something swallows it
    raise Terminated


def _swallowed_sigterm_hook(previous: Callable[[Any], object]) -> Callable[[Any], None]:
    """An unraisable hook that drops a Terminated a ``__del__`` or callback swallowed, and hands the rest to ``previous``.

    A SIGTERM that lands while the garbage collector runs a finalizer raises there, and Python
    prints "Exception ignored in ..." with a traceback. The command stops anyway: at its next
    progress line or before its output is renamed into place (TERMINATING is set).
    """

    def hook(unraisable: Any) -> None:
        if not isinstance(unraisable.exc_value, Terminated):
            previous(unraisable)

    hook.kvexport = True  # type: ignore[attr-defined]  # installed once, however often main() runs
    return hook


class UserError(click.ClickException):
    """A ClickException that exits 2, like click's own usage errors."""

    exit_code = 2


def run(call: Callable[[], Any]) -> Any:
    """Run library code, turning user errors into one-line ClickExceptions."""
    try:
        return call()
    except KvexportError as exc:
        raise UserError(str(exc)) from None
    except (KeyboardInterrupt, Terminated) as stop:
        click.echo("kvexport: interrupted; nothing was written", err=True)
        sys.exit(143 if isinstance(stop, Terminated) else 130)


def json_option(function: F) -> F:
    """``--json``: machine-readable output on stdout."""
    return click.option("--json", "as_json", is_flag=True, help="Print JSON instead of a table.")(
        function
    )


def provider_option(function: F) -> F:
    """``--provider cpu|cuda|auto``, as ``EngineConfig.provider`` defines it."""
    from kvexport.serving.config import EngineConfig

    setting = next(f for f in dataclasses.fields(EngineConfig) if f.name == "provider")
    return click.option(
        "--provider",
        type=click.Choice(list(setting.metadata["choices"])),
        default=setting.default,
        show_default=True,
        help=setting.metadata["help"],
    )(function)


def cuda_graph_option(function: F) -> F:
    """``--cuda-graph``, as ``EngineConfig.cuda_graph`` defines it (``generate`` and ``bench``; ``serve`` gets it from the config)."""
    from kvexport.serving.config import EngineConfig

    setting = next(f for f in dataclasses.fields(EngineConfig) if f.name == "cuda_graph")
    return click.option(
        setting.metadata["flag"], "cuda_graph", is_flag=True, default=setting.default, help=setting.metadata["help"]
    )(function)


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="kvexport")
def main() -> None:
    """Export decoder LMs (GPT-2, ...) to ONNX prefill/decode graphs with a KV cache, verify and serve them."""
    _quiet_libraries()
    signal.signal(signal.SIGTERM, _raise_on_sigterm)
    if not getattr(sys.unraisablehook, "kvexport", False):
        sys.unraisablehook = _swallowed_sigterm_hook(sys.unraisablehook)
