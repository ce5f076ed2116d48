"""kvexport rewrite: foreign graphs in, canonical (and fused) graphs out, parity after every pass."""

from __future__ import annotations

import json
from pathlib import Path

import onnx
import onnx_ir as ir
import pytest
from click.testing import CliRunner

from kvexport import verify
from kvexport.cli import main
from kvexport.passes.fold_shapes import count_ops
from kvexport.passes.rename_cache import canonical_cache_names
from kvexport.testing import FOREIGN_STYLES, export_foreign, kvexport_dir_with_graphs
from tests.conftest import TINY

PIPELINE_PREFIXES = [
    "rename_cache",
    "rename_cache,fold_shapes",
    "rename_cache,fold_shapes,fuse_attention",
    "rename_cache,fold_shapes,fuse_attention,fuse_ort_block",
    "rename_cache,fold_shapes,fuse_attention,fuse_ort_block,cleanup",
]


@pytest.fixture(scope="module")
def foreign_graphs(tmp_path_factory: pytest.TempPathFactory, tiny_config: Path) -> dict[str, Path]:
    """The tiny model (seed 1, as ``tiny_export``) exported by TorchScript under each naming style."""
    return {
        style: export_foreign(tmp_path_factory.mktemp(f"foreign-{style}"), tiny_config, seed=1, style=style)
        for style in FOREIGN_STYLES
    }


def _rewrite(source: Path, output: Path, *extra: str) -> dict[str, object]:
    result = CliRunner().invoke(main, ["rewrite", str(source), str(output), "--json", *extra])
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)


@pytest.mark.parametrize("style", list(FOREIGN_STYLES))
def test_default_rewrite_gives_canonical_names_and_folded_shapes(
    style: str, foreign_graphs: dict[str, Path], tmp_path: Path
) -> None:
    source = foreign_graphs[style] / "decode.onnx"
    report = _rewrite(source, tmp_path / "decode.onnx")
    assert [p["name"] for p in report["passes"]] == ["rename_cache", "fold_shapes", "cleanup"]  # type: ignore[index]
    model = ir.load(tmp_path / "decode.onnx")
    layers = TINY["n_layer"]
    expected = [f"past.{i}.{k}" for i in range(layers) for k in ("key", "value")]
    expected += [f"present.{i}.{k}" for i in range(layers) for k in ("key", "value")]
    assert canonical_cache_names(model) == expected
    assert count_ops(model, "Shape") <= 4
    assert count_ops(model, "Softmax") == layers  # no fusion unless asked
    assert count_ops(ir.load(source), "Shape") > 4 * layers


@pytest.mark.parametrize("passes", PIPELINE_PREFIXES)
def test_parity_with_pytorch_after_every_pass(
    passes: str, foreign_graphs: dict[str, Path], tiny_export: Path, tmp_path: Path
) -> None:
    graphs = {}
    for name in ("prefill", "decode"):
        graphs[name] = tmp_path / "rewritten" / f"{name}.onnx"
        graphs[name].parent.mkdir(exist_ok=True)
        attention = ["--attention", "ort"] if "fuse" in passes else []
        _rewrite(foreign_graphs["optimum"] / f"{name}.onnx", graphs[name], "--passes", passes, *attention)
    report = verify(kvexport_dir_with_graphs(tiny_export, graphs, tmp_path / "dir"), steps=3, record=False)
    assert report.ok, report.failures()


def test_optimum_names_on_request(foreign_graphs: dict[str, Path], tmp_path: Path) -> None:
    _rewrite(foreign_graphs["split"] / "decode.onnx", tmp_path / "decode.onnx", "--names", "optimum")
    names = [v.name for v in ir.load(tmp_path / "decode.onnx").graph.inputs]
    assert names[3:5] == ["past_key_values.0.key", "past_key_values.0.value"]


def _no_cache_graph(path: Path) -> Path:
    h = onnx.helper
    graph = h.make_graph(
        [h.make_node("Relu", ["x"], ["y"])],
        "no-cache",
        [h.make_tensor_value_info("x", onnx.TensorProto.FLOAT, ["b", 4])],
        [h.make_tensor_value_info("y", onnx.TensorProto.FLOAT, ["b", 4])],
    )
    onnx.save(h.make_model(graph, opset_imports=[h.make_opsetid("", 18)], ir_version=10), path)
    return path


def test_graph_without_kv_cache_is_refused_with_one_line(tmp_path: Path) -> None:
    source = _no_cache_graph(tmp_path / "plain.onnx")
    result = CliRunner().invoke(main, ["rewrite", str(source), str(tmp_path / "out.onnx")])
    assert result.exit_code == 2
    assert result.stderr.strip() == (
        f"Error: {source}: the graph has no KV-cache inputs or outputs (it has x, y); "
        "export the decoder with past/present tensors"
    )
    assert sorted(p.name for p in tmp_path.iterdir()) == ["plain.onnx"]  # nothing written


def test_existing_output_is_not_clobbered_without_force(foreign_graphs: dict[str, Path], tmp_path: Path) -> None:
    output = tmp_path / "decode.onnx"
    output.write_text("precious")
    source = foreign_graphs["optimum"] / "decode.onnx"
    result = CliRunner().invoke(main, ["rewrite", str(source), str(output)])
    assert result.exit_code == 2
    assert result.stderr.strip() == f"Error: {output}: exists; pass --force to replace it, or choose another path"
    assert output.read_text() == "precious"
    result = CliRunner().invoke(main, ["rewrite", str(source), str(output), "--force"])
    assert result.exit_code == 0, result.output
    assert canonical_cache_names(ir.load(output))


def test_output_parents_are_created(foreign_graphs: dict[str, Path], tmp_path: Path) -> None:
    output = tmp_path / "not" / "yet" / "decode.onnx"
    _rewrite(foreign_graphs["optimum"] / "decode.onnx", output)
    assert canonical_cache_names(ir.load(output))


def test_corrupt_graph_is_one_line(tmp_path: Path) -> None:
    source = tmp_path / "broken.onnx"
    source.write_bytes(b"\x00not onnx at all")
    result = CliRunner().invoke(main, ["rewrite", str(source), str(tmp_path / "out.onnx")])
    assert result.exit_code == 2
    assert result.stderr.strip().startswith(f"Error: {source}: not a readable ONNX graph")
    assert len(result.stderr.strip().splitlines()) == 1


def test_attention_left_unfused_is_refused_with_the_closest_rules_reason(foreign_graphs: dict[str, Path], tmp_path: Path) -> None:
    model = ir.load(foreign_graphs["optimum"] / "decode.onnx")
    softmaxes = [node for node in model.graph if node.op_type == "Softmax"]
    for node in softmaxes:
        node.attributes["axis"] = ir.AttrInt64("axis", 1)  # no longer attention's softmax
    source = tmp_path / "odd.onnx"
    ir.save(model, source, external_data="odd.onnx.data")
    output = tmp_path / "out.onnx"
    result = CliRunner().invoke(main, ["rewrite", str(source), str(output), "--attention", "ort"])
    assert result.exit_code == 2, result.output
    assert result.stderr.strip().splitlines() == [
        f"Error: {source}: --attention ort: {len(softmaxes)} attention subgraph(s) left unfused (closest rule OrtAttentionWithPast: "
        "pattern stopped at /transformer/h.0/attn/Transpose_4 (4 nodes matched): Attribute axis mismatch: expected -1, "
        "got 1.); nothing written (--attention unfused keeps the attention as it is)"
    ]
    assert sorted(tmp_path.iterdir()) == [source, tmp_path / "odd.onnx.data"]  # nothing written
    unfused = CliRunner().invoke(main, ["rewrite", str(source), str(output), "--attention", "unfused"])
    assert unfused.exit_code == 0, unfused.output


def test_explain_says_why_a_rule_did_not_fire(foreign_graphs: dict[str, Path], tmp_path: Path) -> None:
    source = foreign_graphs["optimum"] / "decode.onnx"
    result = CliRunner().invoke(main, ["rewrite", str(source), str(tmp_path / "out.onnx"), "--attention", "ort", "--explain"])
    assert result.exit_code == 0, result.output
    lines = [line for line in result.stdout.splitlines() if line.startswith("fuse_attention: ")]
    # the decode graph has a past: once its attention is fused, the rule without one finds nothing to start from
    assert lines == ["fuse_attention: OrtAttention matched 0 times: no node looks like the pattern's output"]
    as_json = _rewrite(source, tmp_path / "again.onnx", "--attention", "ort", "--explain")
    report = next(p for p in as_json["passes"] if p["name"] == "fuse_attention")  # type: ignore[index, union-attr]
    assert set(report["explanations"]) == {"OrtAttention"}
    plain = _rewrite(source, tmp_path / "plain.onnx", "--attention", "ort")
    assert all(not p["explanations"] for p in plain["passes"])  # type: ignore[index, union-attr]
