"""File hashes in the manifest, ``kvexport check`` (no torch), and damaged copies refused."""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import onnx
import pytest
from click.testing import CliRunner

from kvexport import ManifestError
from kvexport.cli import main
from kvexport.runtime import Generator


@pytest.fixture
def copy(tiny_export: Path, tmp_path: Path) -> Path:
    return Path(shutil.copytree(tiny_export, tmp_path / "copy", ignore=shutil.ignore_patterns(".*")))


def test_manifest_records_every_file(tiny_export: Path) -> None:
    files = json.loads((tiny_export / "kvexport.json").read_text())["files"]
    assert set(files) == {"prefill.onnx", "decode.onnx", "weights.onnx.data", "tokenizer.json"}
    for name, record in files.items():
        data = (tiny_export / name).read_bytes()
        assert record == {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}


def test_check_passes_on_an_intact_copy(copy: Path) -> None:
    result = CliRunner().invoke(main, ["check", str(copy), "--steps", "3"])
    assert result.exit_code == 0, result.output
    lines = result.stdout.strip().splitlines()
    assert [line.split()[1] for line in lines[:-1]] == [
        "manifest", "files", "prefill", "prefill", "decode", "decode", "greedy",
    ]
    assert lines[-1].startswith(f"PASS: {copy}")
    report = json.loads(CliRunner().invoke(main, ["check", str(copy), "--json"]).stdout)
    assert report["ok"] is True and report["failures"] == []


def _flip_two_bits(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    data[len(data) // 3] ^= 0x80
    path.write_bytes(bytes(data))


@pytest.mark.parametrize(
    ("damage", "message"),
    [
        (_flip_two_bits, "weights.onnx.data: its sha256 differs from the one recorded (corrupted); copy it again"),
        (
            lambda p: p.write_bytes(p.read_bytes()[:1000]),
            "weights.onnx.data: 1000 bytes where the export wrote {size} (truncated or replaced); copy it again",
        ),
    ],
)
def test_a_damaged_weights_file_fails_check_verify_and_the_generator(copy: Path, damage, message: str) -> None:  # type: ignore[no-untyped-def]
    weights = copy / "weights.onnx.data"
    message = message.format(size=weights.stat().st_size)
    damage(weights)
    checked = CliRunner().invoke(main, ["check", str(copy)])
    assert checked.exit_code == 1
    assert f"FAIL files                  {message}" in checked.stdout
    verified = CliRunner().invoke(main, ["verify", str(copy)])
    assert verified.exit_code == 1
    assert f"FAIL {message}" in verified.stdout
    with pytest.raises(ManifestError, match="sha256 differs|truncated"):
        Generator(copy, check=True)


def test_check_without_a_manifest_is_one_line(tmp_path: Path) -> None:
    result = CliRunner().invoke(main, ["check", str(tmp_path)])
    assert result.exit_code == 2
    assert result.stderr.strip() == f"Error: {tmp_path}: no kvexport.json; pass a directory made by `kvexport export` or `kvexport import`"


def test_inspect_warns_about_external_data_outside_the_directory(copy: Path, tmp_path: Path) -> None:
    proto = onnx.load(str(copy / "decode.onnx"), load_external_data=False)
    tensor = next(t for t in proto.graph.initializer if t.external_data)
    for entry in tensor.external_data:
        if entry.key == "location":
            entry.value = "../secret.bin"
    (tmp_path / "secret.bin").write_bytes(b"\0" * 16)
    onnx.save(proto, str(copy / "decode.onnx"))
    result = CliRunner().invoke(main, ["inspect", str(copy / "decode.onnx")])
    assert result.exit_code == 0
    assert "  warning: " in result.stdout and "points outside the model directory ('../secret.bin')" in result.stdout
