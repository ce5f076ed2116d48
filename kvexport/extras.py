"""What the base install leaves out, and the one line that says how to add it.

``pip install kvexport`` is what a serving image needs: ONNX Runtime, onnx, the passes,
numpy and tokenizers. Export and verify also need torch and transformers, which come
with ``pip install 'kvexport[export]'`` (as ``optimum[exporters]`` adds its exporters).
"""

from __future__ import annotations

import importlib.util

from kvexport.errors import KvexportError

EXPORT_EXTRA = "kvexport[export]"
EXPORT_PACKAGES = ("torch", "transformers")


def missing_export_packages() -> list[str]:
    """The packages of the ``export`` extra that can't be imported here."""
    missing = []
    for name in EXPORT_PACKAGES:
        try:
            found = importlib.util.find_spec(name) is not None
        except (ImportError, ValueError):  # a finder refused it, or a half-removed install
            found = False
        if not found:
            missing.append(name)
    return missing


def require_export_extra(what: str) -> None:
    """Refuse ``what`` with one line when torch or transformers is missing."""
    missing = missing_export_packages()
    if missing:
        raise KvexportError(
            f"{what} needs {' and '.join(missing)}, which the base install leaves out; "
            f"install them with: pip install '{EXPORT_EXTRA}'"
        )
