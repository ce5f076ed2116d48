"""User-facing errors.

Every error a user can cause (bad paths, bad options, corrupt files) is a
:class:`KvexportError` whose message is one line saying what is wrong and what to
do. The CLI turns it into a clean non-zero exit; library callers can catch it.
"""

from __future__ import annotations

import threading


class Terminated(BaseException):
    """SIGTERM arrived: raised in the main thread so that cleanup runs as it does for Ctrl-C."""


# Set by the CLI's SIGTERM handler. The handler also raises Terminated, but an exception
# raised at an arbitrary bytecode can be swallowed (inside a __del__, or a library's broad
# except): the atomic writer checks this before it renames the result into place.
TERMINATING = threading.Event()


class KvexportError(Exception):
    """A problem with the user's input, described in one actionable line."""


class ExportError(KvexportError):
    """The export could not produce graphs."""


class ManifestError(KvexportError):
    """A kvexport directory or its manifest is missing, corrupt or inconsistent."""


class ProviderError(KvexportError):
    """The requested ONNX Runtime execution provider is not available."""


def first_line(exc: BaseException) -> str:
    """The first line of an exception's message (its type name when the message is empty).

    Third-party errors (ONNX Runtime, transformers, the exporters) carry pages of detail;
    kvexport's one-line messages quote only their first line.
    """
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__
