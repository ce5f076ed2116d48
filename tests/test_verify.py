"""verify: passes on good exports, and fails (as data, not exceptions) on broken ones."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from kvexport import KvexportError, ManifestError, verify
from kvexport.bundle.storage import WEIGHTS_FILE
from kvexport.testing import refresh_file_record

from .conftest import copy_with_swapped_graphs


@pytest.mark.parametrize("fixture", ["tiny_export", "tiny_odd_torchscript_export"])
def test_verify_passes_every_step_for_both_cases(
    fixture: str, request: pytest.FixtureRequest, tmp_path: Path
) -> None:
    out = tmp_path / "copy"
    shutil.copytree(request.getfixturevalue(fixture), out)
    report = verify(out, steps=5)
    assert report.ok, report.failures()
    assert report.weights_match and not report.io_problems
    cases = {c.case for c in report.tensors}
    assert cases == {"batch1", "batch2-left-padded"}
    # prefill (step 0) plus 5 decode steps, for logits and every present tensor
    n_layer = json.loads((out / "kvexport.json").read_text())["model"]["dims"]["num_layers"]
    for case in cases:
        assert sorted({c.step for c in report.tensors if c.case == case}) == list(range(6))
        assert len([c for c in report.tensors if c.case == case]) == 6 * (1 + 2 * n_layer)
        assert len([t for t in report.tokens if t.case == case and t.ok]) == 6
    worst = report.worst()
    assert worst["logits"].max_abs_diff < 1e-4 and worst["cache"].max_abs_diff < 1e-4
    # the summary is recorded in the manifest
    recorded = json.loads((out / "kvexport.json").read_text())["verify"]
    assert recorded["ok"] is True and recorded["checks"] == len(report.tensors) + len(report.tokens)


def test_verify_catches_corrupted_weights(tiny_export: Path, tmp_path: Path) -> None:
    out = tmp_path / "corrupt"
    shutil.copytree(tiny_export, out)
    with open(out / WEIGHTS_FILE, "r+b") as handle:
        handle.seek(4096 * 3)
        chunk = bytearray(handle.read(4096))
        for i in range(0, len(chunk), 4):
            chunk[i + 3] ^= 0x40  # flip an exponent bit of every float in this page
        handle.seek(4096 * 3)
        handle.write(chunk)
    hashed = verify(out, steps=2, record=False)
    assert not hashed.ok and hashed.file_problems and not hashed.tensors  # the hash check stops it
    # with the file record rewritten to match, the numbers against PyTorch still catch it
    refresh_file_record(out)
    report = verify(out, steps=2, record=False)
    assert not report.ok and not report.file_problems
    assert any(not c.ok for c in report.tensors)
    assert report.failures()


def test_verify_reports_graphs_swapped_in_the_manifest(tiny_export: Path, tmp_path: Path) -> None:
    out = copy_with_swapped_graphs(tiny_export, tmp_path / "swapped")
    report = verify(out, steps=1, record=False)
    assert not report.ok
    assert any("may be swapped" in p for p in report.io_problems)


def test_verify_reports_a_layer_count_that_does_not_match(
    tiny_export: Path, tmp_path: Path
) -> None:
    out = tmp_path / "layers"
    shutil.copytree(tiny_export, out)
    data = json.loads((out / "kvexport.json").read_text())
    data["model"]["dims"]["num_layers"] = 3
    (out / "kvexport.json").write_text(json.dumps(data))
    report = verify(out, steps=1, record=False)
    assert not report.ok
    assert "prefill: present outputs do not match the manifest's 3 layers" in report.io_problems


def test_verify_rejects_what_it_cannot_check(tiny_export: Path, tmp_path: Path) -> None:
    with pytest.raises(ManifestError, match="no such directory"):
        verify(tmp_path / "missing")
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ManifestError, match="no kvexport.json"):
        verify(empty)
    truncated = tmp_path / "truncated"
    shutil.copytree(tiny_export, truncated)
    text = (truncated / "kvexport.json").read_text()
    (truncated / "kvexport.json").write_text(text[: len(text) // 2])
    with pytest.raises(ManifestError, match="not valid JSON"):
        verify(truncated)
    missing_graph = tmp_path / "missing-graph"
    shutil.copytree(tiny_export, missing_graph)
    (missing_graph / "decode.onnx").unlink()
    report = verify(missing_graph, record=False)  # the file record names what is missing
    assert not report.ok
    assert report.failures() == ["decode.onnx: missing; copy the whole export directory again"]
    corrupt_graph = tmp_path / "corrupt-graph"
    shutil.copytree(tiny_export, corrupt_graph)
    (corrupt_graph / "prefill.onnx").write_bytes(b"\x08\xff\xff garbage")
    assert "(truncated or replaced)" in verify(corrupt_graph, record=False).failures()[0]
    # an export without a file record (older kvexport) still gets one clear error
    for directory in (missing_graph, corrupt_graph):
        data = json.loads((directory / "kvexport.json").read_text())
        data["files"] = None
        (directory / "kvexport.json").write_text(json.dumps(data))
    with pytest.raises(ManifestError, match="decode.onnx: graph file is missing"):
        verify(missing_graph)
    with pytest.raises(ManifestError, match="prefill.onnx: not a readable ONNX graph"):
        verify(corrupt_graph)
    with pytest.raises(KvexportError, match="--steps 0: must be at least 1"):
        verify(tiny_export, steps=0)


def test_in_place_exports_verify_rows_of_different_lengths_decoded_together(tiny_ort_export: Path, tiny_export: Path) -> None:
    report = verify(tiny_ort_export, steps=3, record=False)
    assert report.ok, report.failures()
    slots = [t for t in report.tokens if t.case == "slots-ragged"]
    assert len(slots) == 4 and all(len(t.onnx_tokens) == 3 for t in slots)  # prefill + 3 steps, three rows
    cache_rows = {t.name for t in report.tensors if t.case == "slots-ragged" and t.name != "logits"}
    assert cache_rows == {f"present.{layer}.{kind}[row {row}]" for layer in range(2) for kind in ("key", "value") for row in range(3)}
    # the concat layout has no shared buffer to hold rows of different lengths
    assert not [t for t in verify(tiny_export, steps=2, record=False).tokens if t.case == "slots-ragged"]
