"""What the base install leaves out, and the one line that says how to add it.

``pip install kvexport`` is what a serving image needs: ONNX Runtime, onnx, the passes,
numpy and tokenizers. Export and verify also need torch and transformers, which come
with ``pip install 'kvexport[export]'`` (as ``optimum[exporters]`` adds its exporters), and
``kvexport serve`` FastAPI, uvicorn and prometheus-client with ``kvexport[serve]``, and
``kvexport serve --replicas`` Ray Serve besides with ``kvexport[ray]``, and ``kvexport bench``
matplotlib for its plot with ``kvexport[bench]``. Each command checks its extras before it
starts work, so none fails minutes in.
"""

from __future__ import annotations

import importlib.util

from kvexport.errors import KvexportError

# extra -> the packages it adds that kvexport imports
EXTRAS: dict[str, tuple[str, ...]] = {
    "export": ("torch", "transformers"),
    "serve": ("fastapi", "uvicorn", "prometheus_client", "jinja2"),
    "ray": ("fastapi", "uvicorn", "prometheus_client", "ray"),
    "bench": ("matplotlib",),  # bench's plot; its baselines need the export extra
}
EXPORT_EXTRA = "kvexport[export]"


def missing_packages(packages: tuple[str, ...]) -> list[str]:
    """The ``packages`` that can't be imported here."""
    missing = []
    for name in packages:
        try:
            found = importlib.util.find_spec(name) is not None
        except (ImportError, ValueError):  # a finder refused it, or a half-removed install
            found = False
        if not found:
            missing.append(name)
    return missing


def require_extra(extra: str, what: str) -> None:
    """Refuse ``what`` with one line when a package of ``kvexport[extra]`` is missing."""
    missing = missing_packages(EXTRAS[extra])
    if missing:
        names = missing[0] if len(missing) == 1 else f"{', '.join(missing[:-1])} and {missing[-1]}"
        raise KvexportError(
            f"{what} needs {names}, which the base install leaves out; "
            f"install them with: pip install 'kvexport[{extra}]'"
        )


def require_export_extra(what: str) -> None:
    """Refuse ``what`` with one line when torch or transformers is missing."""
    require_extra("export", what)
