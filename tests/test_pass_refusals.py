"""Every graph a pass can't take is one line and exit 2, from ``rewrite`` and ``import`` alike, with nothing written.

Each case edits a real foreign decoder graph (Optimum's 2-layer export) so that exactly one
pass's precondition fails, runs the CLI on it, and checks the exact message, the exit code,
that no traceback is printed and that no output exists afterwards.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import onnx
import pytest
from click.testing import CliRunner

from kvexport.cli import main

OPTIMUM = Path(__file__).parent / "data" / "foreign" / "optimum-l2.onnx"
IN_PLACE = ["--attention", "ort", "--passes", "rename_cache,shared_buffer_cache,cleanup"]


def _rename_graph_input(proto: onnx.ModelProto, old: str, new: str) -> None:
    for value in proto.graph.input:
        if value.name == old:
            value.name = new
    for node in proto.graph.node:
        node.input[:] = [new if name == old else name for name in node.input]


def _no_mask(proto: onnx.ModelProto) -> None:
    _rename_graph_input(proto, "attention_mask", "mask")


def _no_cache(proto: onnx.ModelProto) -> None:
    for index, value in enumerate(proto.graph.input):
        _rename_graph_input(proto, value.name, f"input_{index}")
    for index, value in enumerate(proto.graph.output[1:]):
        old, value.name = value.name, f"output_{index}"
        for node in proto.graph.node:
            node.output[:] = [value.name if name == old else name for name in node.output]
            node.input[:] = [value.name if name == old else name for name in node.input]


def _two_first_layers(proto: onnx.ModelProto) -> None:
    _rename_graph_input(proto, "past_key_values.1.key", "past_key_values.0.key_again")


def _name_taken(proto: onnx.ModelProto) -> None:
    node = next(n for n in proto.graph.node if n.output)
    old = node.output[0]
    node.output[0] = "past.0.key"
    for other in proto.graph.node:
        other.input[:] = ["past.0.key" if name == old else name for name in other.input]


CASES: dict[str, tuple[Callable[[onnx.ModelProto], None], list[str], str]] = {
    "shared_buffer_cache: no attention_mask": (
        _no_mask,
        IN_PLACE,
        "the graph has no attention_mask input to take lengths from",
    ),
    "rename_cache: no cache at all": (
        _no_cache,
        [],
        "the graph has no KV-cache inputs or outputs",
    ),
    "rename_cache: two tensors for one slot": (
        _two_first_layers,
        [],
        "'past_key_values.0.key' and 'past_key_values.0.key_again' both map to past.0.key; rename one of them by hand",
    ),
    "rename_cache: a canonical name already taken": (
        _name_taken,
        [],
        "'past.0.key' is already used by a tensor that is not a cache tensor; rename it first",
    ),
}


def _fused(tmp_path: Path) -> onnx.ModelProto:
    """Optimum's graph with ONNX Runtime's fused attention (MultiHeadAttention), as a user would have it."""
    out = tmp_path / "fused" / "decode.onnx"
    done = CliRunner().invoke(main, ["rewrite", str(OPTIMUM), str(out), "--attention", "ort", "--passes", "rename_cache,fold_shapes,fuse_attention"])
    assert done.exit_code == 0, done.output
    return onnx.load(str(out))


def _edited(tmp_path: Path, edit: Callable[[onnx.ModelProto], None]) -> Path:
    proto = _fused(tmp_path) if edit is _no_mask else onnx.load(str(OPTIMUM))
    edit(proto)
    path = tmp_path / "edited.onnx"
    onnx.save(proto, str(path))
    return path


@pytest.mark.parametrize("case", list(CASES))
def test_rewrite_refuses_in_one_line(case: str, tmp_path: Path) -> None:
    edit, extra, message = CASES[case]
    source = _edited(tmp_path, edit)
    out = tmp_path / "out" / "decode.onnx"
    result = CliRunner().invoke(main, ["rewrite", str(source), str(out), *extra])
    assert result.exit_code == 2, result.output
    assert "Traceback" not in result.output
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"Error: {source}: {message}")
    assert not out.exists() and not (tmp_path / "out").exists()


@pytest.mark.parametrize("case", ["rename_cache: two tensors for one slot", "rename_cache: a canonical name already taken"])
def test_import_refuses_in_one_line(case: str, tmp_path: Path) -> None:
    edit, _, message = CASES[case]
    source = _edited(tmp_path, edit)
    out = tmp_path / "imported"
    result = CliRunner().invoke(main, ["import", str(source), "--out", str(out), "--attention", "ort"])
    assert result.exit_code == 2, result.output
    assert "Traceback" not in result.output
    lines = [line for line in result.stderr.strip().splitlines() if not line.startswith("kvexport: ")]  # progress
    assert len(lines) == 1 and lines[0].startswith(f"Error: {source}: {message}")
    assert not out.exists()
