"""A real SIGTERM during export leaves neither the target nor temporary leftovers."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from kvexport.cli import base
from kvexport.errors import Terminated


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


class _Finalizer:
    def __init__(self, error: BaseException) -> None:
        self.error = error

    def __del__(self) -> None:
        raise self.error


def test_sigterm_swallowed_by_a_finalizer_prints_no_traceback(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    # CI saw a SIGTERM land inside regex's __del__: Python printed "Exception ignored in ..."
    # with a traceback although the export then stopped cleanly on TERMINATING
    handed_on: list[BaseException | None] = []
    monkeypatch.setattr(sys, "unraisablehook", base._swallowed_sigterm_hook(lambda u: handed_on.append(u.exc_value)))
    finalizer = _Finalizer(Terminated())
    del finalizer
    assert capsys.readouterr().err == "" and handed_on == []
    other = _Finalizer(ValueError("a real fault"))
    del other
    assert [str(e) for e in handed_on] == ["a real fault"]  # to the hook it replaced (pytest's, in a test run)
