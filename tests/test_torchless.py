"""The base install: which commands run without torch and transformers, and what the others say.

Each command runs in a child process whose import system refuses the packages, as
``python -X importtime`` would show them absent; any attempt to import them, even one the
code catches, fails the test.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from tests.torchless import EXPORT_EXTRA, SERVING_IMAGE, refused, run_cli_without, run_without

FOREIGN = Path(__file__).parent / "data" / "foreign"


def _optimum_dir(tmp: Path) -> Path:
    """What ``optimum-cli export onnx`` leaves: model.onnx, config.json and the tokenizer."""
    directory = tmp / "optimum"
    directory.mkdir()
    shutil.copy(FOREIGN / "optimum-l2.onnx", directory / "model.onnx")
    for name in ("config.json", "tokenizer.json"):
        shutil.copy(FOREIGN / "checkpoint-l2" / name, directory / name)
    return directory


def _torch_free_command(command: str, export: Path, tmp: Path) -> tuple[tuple[str, ...], list[str]]:
    """What ``command`` runs without, and its arguments."""
    if command == "check":
        return SERVING_IMAGE, ["check", str(export), "--steps", "2"]
    if command == "generate":
        return SERVING_IMAGE, ["generate", str(export), "--prompt", "The sky is", "--max-new-tokens", "3"]
    if command == "inspect":
        return SERVING_IMAGE, ["inspect", str(export)]
    if command == "rewrite":
        return EXPORT_EXTRA, ["rewrite", str(FOREIGN / "optimum-l2.onnx"), str(tmp / "rewritten.onnx")]
    return EXPORT_EXTRA, ["import", str(_optimum_dir(tmp)), "--out", str(tmp / "imported"), "--attention", "ort"]


@pytest.mark.parametrize("command", ["check", "generate", "inspect", "rewrite", "import"])
def test_commands_run_without_torch_or_transformers(command: str, tiny_export: Path, tmp_path: Path) -> None:
    packages, args = _torch_free_command(command, tiny_export, tmp_path)
    done = run_cli_without(packages, args)
    assert done.returncode == 0, done.stderr
    assert refused(done) == [], f"kvexport {command} tried to import {refused(done)}"
    if command == "import":
        assert (tmp_path / "imported" / "kvexport.json").is_file()
        checked = run_cli_without(SERVING_IMAGE, ["check", str(tmp_path / "imported"), "--steps", "2"])
        assert checked.returncode == 0, checked.stdout + checked.stderr
    if command == "rewrite":
        assert (tmp_path / "rewritten.onnx").is_file()


@pytest.mark.parametrize(
    ("args", "what"),
    [
        (["gpt2", "--out", "{tmp}/out", "--random-init"], "kvexport gpt2"),
        (["verify", "{export}"], "kvexport verify (the PyTorch reference)"),
        (["bench", "{export}"], "kvexport bench (the PyTorch baselines)"),
        (
            ["import", str(FOREIGN / "optimum-l2.onnx"), "--out", "{tmp}/imported", "--model", str(FOREIGN / "checkpoint-l2")],
            "kvexport import --model",
        ),
    ],
)
def test_commands_that_need_the_export_extra_say_so_in_one_line(
    args: list[str], what: str, tiny_export: Path, tmp_path: Path
) -> None:
    filled = [a.format(tmp=tmp_path, export=tiny_export) for a in args]
    done = run_cli_without(EXPORT_EXTRA, filled)
    assert done.returncode == 2
    lines = done.stderr.splitlines()
    assert lines[-2] == (
        f"Error: {what} needs torch and transformers, which the base install leaves out; "
        "install them with: pip install 'kvexport[export]'"
    )
    assert "Traceback" not in done.stderr
    assert not (tmp_path / "out").exists() and not (tmp_path / "imported").exists()


def test_the_library_names_that_need_torch_raise_the_same_line() -> None:
    code = (
        "import kvexport\n"
        "generator = kvexport.Generator\n"  # torch-free names load
        "try:\n"
        "    kvexport.export_gpt2\n"
        "except kvexport.KvexportError as exc:\n"
        "    print(exc)\n"
    )
    done = run_without(EXPORT_EXTRA, code)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == (
        "kvexport.export_gpt2 needs torch and transformers, which the base install leaves out; "
        "install them with: pip install 'kvexport[export]'"
    )


def test_serve_without_the_serve_extra_says_so_in_one_line(tiny_ort_export: Path) -> None:
    done = run_cli_without(("fastapi", "uvicorn"), ["serve", str(tiny_ort_export), "--port", "0"])
    assert done.returncode == 2
    assert done.stderr.splitlines()[-2] == (
        "Error: kvexport serve needs fastapi and uvicorn, which the base install leaves out; "
        "install them with: pip install 'kvexport[serve]'"
    )


def test_bench_without_matplotlib_says_so_before_it_measures(tiny_export: Path, tmp_path: Path) -> None:
    done = run_cli_without(("matplotlib",), ["bench", str(tiny_export), "--results", str(tmp_path / "results")])
    assert done.returncode == 2
    assert done.stderr.splitlines()[-2] == (
        "Error: kvexport bench (its plot) needs matplotlib, which the base install leaves out; "
        "install them with: pip install 'kvexport[bench]'"
    )
    assert "Traceback" not in done.stderr
    assert not (tmp_path / "results").exists()  # refused before measuring anything
