"""mixed_step: an in-place prefill graph -> one call for a prompt chunk and the decode rows.

What the derived graph computes is checked against the two calls it replaces in
tests/test_mixed_step.py; here, its shape: each layer's attention split in two, nothing
else duplicated, and the graphs it refuses.
"""

from __future__ import annotations

from pathlib import Path

import onnx_ir as ir
import pytest

from kvexport.passes.mixed_step import MixedStepError, mixed_step


def test_the_mixed_graph_splits_each_layers_attention_and_nothing_else(trained_exports: dict[str, Path]) -> None:
    model = ir.load(trained_exports["int8-pc"] / "prefill.onnx")
    layers = sum(n.op_type == "GroupQueryAttention" for n in model.graph)
    matmuls = sum(n.op_type == "MatMulIntegerToFloat" for n in model.graph)
    mixed_step(model)
    names = {value.name for value in model.graph.inputs}
    outputs = {value.name for value in model.graph.outputs}
    assert sum(n.op_type == "GroupQueryAttention" for n in model.graph) == 2 * layers
    assert sum(n.op_type == "MatMulIntegerToFloat" for n in model.graph) == matmuls  # one set of GEMMs for both
    assert "decode.attention_mask" in names
    assert {f"decode.past.{layer}.{kind}" for layer in range(layers) for kind in ("key", "value")} <= names
    assert {f"decode.present.{layer}.{kind}" for layer in range(layers) for kind in ("key", "value")} <= outputs


def test_a_graph_without_in_place_attention_is_refused_in_one_line() -> None:
    x = ir.Value(name="input_ids", type=ir.TensorType(ir.DataType.INT64), shape=ir.Shape(["batch", "sequence"]))
    node = ir.node("Identity", [x])
    node.outputs[0].name = "logits"
    graph = ir.Graph([x], node.outputs, nodes=[node], opset_imports={"": 18})
    with pytest.raises(MixedStepError, match=r"^the graph has no GroupQueryAttention; .*--target ort-cpu") as caught:
        mixed_step(ir.Model(graph, ir_version=10))
    assert "\n" not in str(caught.value)


def _first_attention(model: ir.Model) -> ir.Node:
    return next(n for n in model.graph if n.op_type == "GroupQueryAttention")


def test_rotary_inside_the_op_a_bias_that_is_not_padding_and_an_unknown_last_position_are_refused(
    trained_exports: dict[str, Path],
) -> None:
    path = trained_exports["int8-pc"] / "prefill.onnx"
    rotary = ir.load(path)
    _first_attention(rotary).attributes["do_rotary"] = ir.AttrInt64("do_rotary", 1)
    with pytest.raises(MixedStepError, match="rotary inside GroupQueryAttention takes positions from the cache"):
        mixed_step(rotary)

    biased = ir.load(path)  # a bias the graph is given: it could hold anything, a causal mask say
    given = ir.Value(name="causal_bias", type=ir.TensorType(ir.DataType.FLOAT), shape=ir.Shape(["batch", 1, "sequence", "total"]))
    biased.graph.inputs.append(given)
    _first_attention(biased).replace_input_with(10, given)
    with pytest.raises(MixedStepError, match="its attention bias is not the padding bias"):
        mixed_step(biased)

    sliced = ir.load(path)  # the last position taken some other way (kvexport import's Slice)
    gather = next(n for n in sliced.graph if n.op_type == "GatherElements")
    data = gather.inputs[0]
    assert data is not None
    ir.convenience.replace_all_uses_with(gather.outputs[0], data)
    sliced.graph.remove(gather, safe=True)
    with pytest.raises(MixedStepError, match="last position is not the GatherElements"):
        mixed_step(sliced)
    with pytest.raises(MixedStepError, match="manifest says it gives every position's logits"):
        mixed_step(ir.load(path), all_logits=True)
