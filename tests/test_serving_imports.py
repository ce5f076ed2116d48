"""What importing the plain parts of serving loads: the scheduler and the output parsers need no model."""

from __future__ import annotations

import subprocess
import sys

import pytest


@pytest.mark.parametrize(
    ("module", "heavy"),
    [
        # the scheduler is tested and used without a model
        ("kvexport.serving.scheduler", ("onnxruntime", "onnx", "torch")),
        # the tool-call and reasoning parsers are plain text work
        ("kvexport.serving.parsed_output", ("onnxruntime", "onnx", "torch", "transformers", "llguidance")),
    ],
)
def test_importing_the_plain_parts_of_serving_loads_nothing_heavy(module: str, heavy: tuple[str, ...]) -> None:
    code = (
        "import sys\n"
        f"import {module}\n"
        f"loaded = [name for name in {heavy!r} if name in sys.modules]\n"
        "assert not loaded, loaded\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
