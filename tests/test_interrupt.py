"""A real SIGTERM during export leaves neither the target nor temporary leftovers."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path


def test_sigterm_during_export_leaves_nothing(tmp_path: Path, tiny_config: Path) -> None:
    exports = tmp_path / "exports"
    exports.mkdir()
    process = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "kvexport.cli",
            "gpt2",
            "--out",
            str(exports / "model"),
            "--random-init",
            "--model",
            str(tiny_config),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "HF_HUB_OFFLINE": "1"},
    )
    # wait until the export has started writing its temporary sibling, then stop it
    deadline = time.monotonic() + 120
    while not any(exports.iterdir()) and time.monotonic() < deadline and process.poll() is None:
        time.sleep(0.05)
    assert process.poll() is None, "the export finished before it could be interrupted"
    process.send_signal(signal.SIGTERM)
    _, stderr = process.communicate(timeout=60)
    assert process.returncode == 143, stderr[-3000:]  # 128 + SIGTERM
    assert "kvexport: interrupted; nothing was written" in stderr
    assert "Traceback" not in stderr
    assert list(exports.iterdir()) == []
