"""fuse_attention: one fused op per layer in both graphs, past/present kept, parity with PyTorch."""

from __future__ import annotations

from pathlib import Path

import onnx_ir as ir
import pytest

from kvexport import verify
from kvexport.passes import FoldShapesPass, FuseAttentionPass, RenameCachePass
from kvexport.passes.fold_shapes import count_ops
from kvexport.passes.fuse_attention import count_attention_ops
from kvexport.testing import export_foreign, kvexport_dir_with_graphs
from tests.conftest import TINY

FUSED_OP = {"onnx": ("", "Attention"), "ort": ("com.microsoft", "MultiHeadAttention")}


@pytest.fixture(scope="module")
def optimum_torchscript_graphs(tmp_path_factory: pytest.TempPathFactory, tiny_config: Path) -> Path:
    """The tiny model (seed 1, like ``tiny_export``) exported by TorchScript with Optimum names."""
    return export_foreign(tmp_path_factory.mktemp("optimum-ts"), tiny_config, seed=1, style="optimum")


def _fuse(path: Path, target: str, out: Path) -> tuple[ir.Model, FuseAttentionPass]:
    model = ir.load(path)
    RenameCachePass()(model)
    FoldShapesPass()(model)
    fuse = FuseAttentionPass(target)  # type: ignore[arg-type]
    fuse(model)
    out.mkdir(parents=True, exist_ok=True)
    ir.save(model, out / path.name, external_data=f"{path.name}.data")
    return model, fuse


@pytest.mark.parametrize("target", ["onnx", "ort"])
@pytest.mark.parametrize("source", ["dynamo", "torchscript-optimum"])
def test_one_fused_op_per_layer_and_parity_with_pytorch(
    target: str,
    source: str,
    tiny_export: Path,
    optimum_torchscript_graphs: Path,
    tmp_path: Path,
) -> None:
    graphs_dir = tiny_export if source == "dynamo" else optimum_torchscript_graphs
    fused_paths = {}
    for name, with_past in (("prefill", False), ("decode", True)):
        model, fuse = _fuse(graphs_dir / f"{name}.onnx", target, tmp_path / "fused")
        layers = TINY["n_layer"]
        assert count_attention_ops(model) == layers
        assert count_ops(model, "Softmax") == 0
        rule = f"{'Onnx' if target == 'onnx' else 'Ort'}Attention{'WithPast' if with_past else ''}"
        assert fuse.counts[rule] == layers
        domain, op_type = FUSED_OP[target]
        for layer in range(layers):
            for kind in ("key", "value"):
                present = next(v for v in model.graph.outputs if v.name == f"present.{layer}.{kind}")
                producer = present.producer()
                assert producer is not None
                assert (producer.domain, producer.op_type) == (domain, op_type)
                if with_past:  # the op reads the past directly
                    assert f"past.{layer}.{kind}" in [v.name for v in producer.inputs if v is not None]
        if target == "onnx":
            assert model.opset_imports[""] == 23
        fused_paths[name] = tmp_path / "fused" / f"{name}.onnx"
    directory = kvexport_dir_with_graphs(tiny_export, fused_paths, tmp_path / "dir")
    report = verify(directory, steps=4, record=False)
    assert report.ok, report.failures()


def test_unmatched_graph_is_left_alone(tiny_export: Path) -> None:
    model = ir.load(tiny_export / "decode.onnx")
    for node in model.graph:
        if node.op_type == "Softmax":
            node.attributes["axis"] = ir.AttrInt64("axis", 1)  # no longer attention's softmax
    nodes = len(model.graph)
    fuse = FuseAttentionPass("ort")
    result = fuse(model)
    assert fuse.counts["OrtAttention"] == 0 and fuse.counts["OrtAttentionWithPast"] == 0
    assert fuse.counts["InfiniteMaskToLowest"] == 0  # the export's masks use lowest already
    assert not result.modified and len(model.graph) == nodes
    assert count_attention_ops(model) == 0
    assert count_ops(model, "Softmax") == TINY["n_layer"]
