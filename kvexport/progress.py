"""The one progress callback type: a short message per phase (the CLI prints them on stderr)."""

from __future__ import annotations

from collections.abc import Callable

Progress = Callable[[str], None]


def silent(message: str) -> None:
    """A :data:`Progress` that says nothing (the library's default)."""
