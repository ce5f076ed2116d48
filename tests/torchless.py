"""Run Python or the ``kvexport`` CLI in a child process where some packages can't be imported.

The one place that hides packages, for the tests that prove what the base install (no
torch, no transformers) or a serving image (no onnx_ir, no onnxscript either) can run. A
hidden package looks uninstalled (``sys.modules[name] = None``: ``find_spec`` finds
nothing, ``import`` raises), and every import statement that asks for one is recorded and
reported on stderr at exit, so an import that the code tries and then swallows (``except
ImportError``) is caught too.
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Sequence

EXPORT_EXTRA = ("torch", "transformers")
SERVING_IMAGE = ("torch", "transformers", "onnxscript", "onnx_ir")
REFUSED_MARK = "refused imports: "

_PRELUDE = """
import atexit, builtins, sys

_packages = {packages!r}
_refused = []
for _name in _packages:
    sys.modules[_name] = None  # as if not installed: find_spec gives None, import raises

_import = builtins.__import__

def _recording_import(name, *args, **kwargs):
    if name.split(".")[0] in _packages:
        _refused.append(name)
    return _import(name, *args, **kwargs)

builtins.__import__ = _recording_import
atexit.register(lambda: print({mark!r} + ",".join(sorted(set(_refused))), file=sys.stderr))
"""

_CLI = """
from kvexport.cli import main
main(sys.argv[1:], prog_name="kvexport")
"""


def run_without(
    packages: Sequence[str], code: str, args: Sequence[str] = (), timeout: float = 300
) -> subprocess.CompletedProcess[str]:
    """Run ``code`` (with ``args`` as ``sys.argv[1:]``) where ``packages`` can't be imported."""
    source = _PRELUDE.format(packages=tuple(packages), mark=REFUSED_MARK) + code
    return subprocess.run(
        [sys.executable, "-c", source, *args], capture_output=True, text=True, timeout=timeout
    )


def run_cli_without(
    packages: Sequence[str], args: Sequence[str], timeout: float = 300
) -> subprocess.CompletedProcess[str]:
    """``kvexport ARGS`` where ``packages`` can't be imported."""
    return run_without(packages, _CLI, args, timeout)


def refused(done: subprocess.CompletedProcess[str]) -> list[str]:
    """The imports the child tried and was refused (from its last stderr line)."""
    line = next(line for line in reversed(done.stderr.splitlines()) if line.startswith(REFUSED_MARK))
    return [name for name in line[len(REFUSED_MARK) :].split(",") if name]
