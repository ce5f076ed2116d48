"""What importing the plain parts of serving loads: the scheduler is tested and used without a model."""

from __future__ import annotations

import subprocess
import sys


def test_importing_the_scheduler_loads_neither_onnxruntime_onnx_nor_torch() -> None:
    code = (
        "import sys\n"
        "import kvexport.serving.scheduler\n"
        "loaded = [name for name in ('onnxruntime', 'onnx', 'torch') if name in sys.modules]\n"
        "assert not loaded, loaded\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
