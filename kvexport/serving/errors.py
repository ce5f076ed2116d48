"""Errors that name the request field they are about, as vLLM's ``VLLMValidationError(msg, parameter=...)`` does.

Raised where the field is checked (the sampling settings, the request body, the engine's
admission), so the HTTP layer answers with the field in ``param`` without reading the
message. Plain Python.
"""

from __future__ import annotations

from kvexport.errors import KvexportError


class ParameterError(KvexportError):
    """A request field that can't be served as given; ``parameter`` names it (None: the request as a whole)."""

    def __init__(self, message: str, *, parameter: str | None = None) -> None:
        super().__init__(message)
        self.parameter = parameter
