"""User-facing errors.

Every error a user can cause (bad paths, bad options, corrupt files) is a
:class:`KvexportError` whose message is one line saying what is wrong and what to
do. The CLI turns it into a clean non-zero exit; library callers can catch it.
"""

from __future__ import annotations


class KvexportError(Exception):
    """A problem with the user's input, described in one actionable line."""


class ExportError(KvexportError):
    """The export could not produce graphs."""


class ManifestError(KvexportError):
    """A kvexport directory or its manifest is missing, corrupt or inconsistent."""


class ProviderError(KvexportError):
    """The requested ONNX Runtime execution provider is not available."""
