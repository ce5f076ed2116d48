"""Atomic output directories and safe external-data loading."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import onnx
import pytest

import kvexport.export.writer
from kvexport import KvexportError, ManifestError, export_gpt2
from kvexport.bundle.storage import atomic_output_dir, check_external_data


def _siblings(path: Path) -> list[str]:
    return sorted(p.name for p in path.parent.iterdir())


def test_atomic_dir_appears_only_on_success(tmp_path: Path) -> None:
    out = tmp_path / "out"
    with atomic_output_dir(out, force=False) as work:
        (work / "a.txt").write_text("a")
        assert not out.exists()
    assert (out / "a.txt").read_text() == "a"
    assert _siblings(out) == ["out"]
    assert oct(out.stat().st_mode & 0o777) != oct(
        0o700
    )  # an ordinary directory, not mkdtemp's private one


def test_atomic_dir_failure_leaves_nothing(tmp_path: Path) -> None:
    out = tmp_path / "out"
    with pytest.raises(KeyboardInterrupt), atomic_output_dir(out, force=False) as work:
        (work / "half.onnx").write_text("half")
        raise KeyboardInterrupt
    assert _siblings(out) == []


def test_atomic_dir_creates_missing_parents_and_removes_them_on_failure(tmp_path: Path) -> None:
    out = tmp_path / "a" / "b" / "out"
    with pytest.raises(RuntimeError), atomic_output_dir(out, force=False) as work:
        assert work.parent == out.parent and work.parent.is_dir()
        raise RuntimeError("export failed")
    assert list(tmp_path.iterdir()) == []
    with atomic_output_dir(out, force=False) as work:
        (work / "a.txt").write_text("a")
    assert (out / "a.txt").read_text() == "a"
    assert _siblings(out) == ["out"]


def test_existing_output_is_refused_then_replaced_only_with_force(tmp_path: Path) -> None:
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("precious")
    with pytest.raises(KvexportError, match="not empty; pass --force"):
        with atomic_output_dir(out, force=False):
            pass
    assert (out / "keep.txt").read_text() == "precious"
    # a failure with --force keeps the old contents too
    with pytest.raises(RuntimeError), atomic_output_dir(out, force=True) as work:
        (work / "new.txt").write_text("new")
        raise RuntimeError("boom")
    assert sorted(p.name for p in out.iterdir()) == ["keep.txt"]
    with atomic_output_dir(out, force=True) as work:
        (work / "new.txt").write_text("new")
    assert sorted(p.name for p in out.iterdir()) == ["new.txt"]
    assert _siblings(out) == ["out"]


def test_interrupted_export_leaves_neither_target_nor_temporaries(
    tmp_path: Path, tiny_odd_config: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def interrupted(*args: object, **kwargs: object) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(kvexport.export.writer, "save_with_shared_weights", interrupted)
    out = tmp_path / "exports" / "model"
    out.parent.mkdir()
    with pytest.raises(KeyboardInterrupt):
        export_gpt2(out, str(tiny_odd_config), random_init=True)
    assert list(out.parent.iterdir()) == []


def _graph_with_external(location: str) -> onnx.ModelProto:
    weight = onnx.numpy_helper.from_array(np.zeros(4, dtype=np.float32), "w")
    weight.ClearField("raw_data")
    weight.data_location = onnx.TensorProto.EXTERNAL
    for key, value in (("location", location), ("offset", "0"), ("length", "16")):
        entry = weight.external_data.add()
        entry.key, entry.value = key, value
    graph = onnx.helper.make_graph(
        [onnx.helper.make_node("Add", ["x", "w"], ["y"])],
        "g",
        [onnx.helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [4])],
        [onnx.helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [4])],
        [weight],
    )
    return onnx.helper.make_model(graph, ir_version=10)


@pytest.mark.parametrize(
    "location", ["../secret.bin", "/etc/passwd", "sub/../../secret.bin", "link.bin"]
)
def test_external_data_outside_the_directory_is_refused(tmp_path: Path, location: str) -> None:
    model_dir = tmp_path / "model"
    model_dir.mkdir()
    (tmp_path / "secret.bin").write_bytes(b"\0" * 16)
    os.symlink(tmp_path / "secret.bin", model_dir / "link.bin")
    path = model_dir / "g.onnx"
    onnx.save(_graph_with_external(location), str(path))
    with pytest.raises(ManifestError, match="points outside the model directory"):
        check_external_data(path)


def test_external_data_inside_the_directory_is_accepted(tmp_path: Path) -> None:
    (tmp_path / "w.bin").write_bytes(b"\0" * 16)
    path = tmp_path / "g.onnx"
    onnx.save(_graph_with_external("w.bin"), str(path))
    assert check_external_data(path).graph.initializer[0].name == "w"
    (tmp_path / "w.bin").unlink()
    with pytest.raises(ManifestError, match="'w.bin' is missing"):
        check_external_data(path)


def test_a_swallowed_sigterm_still_leaves_nothing(tmp_path: Path) -> None:
    """The CLI's SIGTERM handler sets TERMINATING before it raises: if the exception is swallowed, the rename refuses."""
    from kvexport.errors import TERMINATING, Terminated

    out = tmp_path / "out"
    TERMINATING.set()
    try:
        with pytest.raises(Terminated), atomic_output_dir(out, force=False) as work:
            (work / "graph.onnx").write_text("complete")  # the work finished, but a SIGTERM came
    finally:
        TERMINATING.clear()
    assert list(tmp_path.iterdir()) == []
