"""rename_cache: other exporters' cache names -> past.<l>.key|value / present.<l>.key|value."""

from __future__ import annotations

import numpy as np
import onnx
import onnx_ir as ir
import onnxruntime as ort
import pytest

from kvexport.passes import CacheNamingError, NoCacheError, RenameCachePass
from kvexport.passes.rename_cache import canonical_cache_names, parse_cache_name

CACHE = ["b", 2, "s", 4]


def _cache_model(past: list[str], present: list[str], layers: int = 2) -> ir.Model:
    """present_i = Concat(past_i, new) for each name pair; plus an unrelated input/output."""
    inputs = [onnx.helper.make_tensor_value_info("input_ids", onnx.TensorProto.INT64, ["b", 1])]
    inputs += [onnx.helper.make_tensor_value_info(n, onnx.TensorProto.FLOAT, CACHE) for n in past]
    outputs = [onnx.helper.make_tensor_value_info("logits", onnx.TensorProto.FLOAT, None)]
    outputs += [onnx.helper.make_tensor_value_info(n, onnx.TensorProto.FLOAT, None) for n in present]
    nodes = [onnx.helper.make_node("Cast", ["input_ids"], ["logits"], to=onnx.TensorProto.FLOAT)]
    for p, q in zip(past, present, strict=True):
        nodes.append(onnx.helper.make_node("Concat", [p, p], [q], axis=2))
    graph = onnx.helper.make_graph(nodes, "cache", inputs, outputs)
    proto = onnx.helper.make_model(graph, opset_imports=[onnx.helper.make_opsetid("", 18)], ir_version=10)
    return ir.serde.deserialize_model(proto)


def _names(model: ir.Model) -> tuple[list[str], list[str]]:
    return [v.name or "" for v in model.graph.inputs], [v.name or "" for v in model.graph.outputs]


CANONICAL_IN = ["input_ids", "past.0.key", "past.0.value", "past.1.key", "past.1.value"]
CANONICAL_OUT = ["logits", "present.0.key", "present.0.value", "present.1.key", "present.1.value"]


@pytest.mark.parametrize(
    ("past", "present"),
    [
        (  # Optimum
            ["past_key_values.0.key", "past_key_values.0.value", "past_key_values.1.key", "past_key_values.1.value"],
            ["present.0.key", "present.0.value", "present.1.key", "present.1.value"],
        ),
        (  # split style
            ["past_key_0", "past_value_0", "past_key_1", "past_value_1"],
            ["present_key_0", "present_value_0", "present_key_1", "present_value_1"],
        ),
        (  # torch's flattened tuples
            ["past_key_values_0_0", "past_key_values_0_1", "past_key_values_1_0", "past_key_values_1_1"],
            ["present_0_0", "present_0_1", "present_1_0", "present_1_1"],
        ),
        (  # k / v tokens
            ["cache.k.0", "cache.v.0", "cache.k.1", "cache.v.1"],
            ["present_k_0", "present_v_0", "present_k_1", "present_v_1"],
        ),
    ],
    ids=["optimum", "split", "torch-flat", "k-v-tokens"],
)
def test_foreign_names_become_canonical_by_object(past: list[str], present: list[str]) -> None:
    model = _cache_model(past, present)
    concat_inputs_before = [node.inputs[0] for node in model.graph if node.op_type == "Concat"]
    rename = RenameCachePass()
    result = rename(model)
    assert result.modified
    changed = [n for n in past + present if n not in CANONICAL_IN + CANONICAL_OUT]
    assert rename.counts == {"renamed": len(changed), "stacked_split": 0}
    assert _names(model) == (CANONICAL_IN, CANONICAL_OUT)
    # renamed by object: the nodes still read the very same values, now under new names
    assert [node.inputs[0] for node in model.graph if node.op_type == "Concat"] == concat_inputs_before
    assert [v.name for v in concat_inputs_before] == CANONICAL_IN[1:]
    assert model.graph.inputs[1].metadata_props["kvexport.original_name"] == past[0]
    assert canonical_cache_names(model) == CANONICAL_IN[1:] + CANONICAL_OUT[1:]


def test_canonical_graph_is_left_unmodified() -> None:
    model = _cache_model(CANONICAL_IN[1:], CANONICAL_OUT[1:])
    result = RenameCachePass()(model)
    assert not result.modified
    assert _names(model) == (CANONICAL_IN, CANONICAL_OUT)


def test_optimum_style_is_the_reverse_mapping() -> None:
    model = _cache_model(CANONICAL_IN[1:], CANONICAL_OUT[1:])
    RenameCachePass(style="optimum")(model)
    inputs, outputs = _names(model)
    assert inputs[1:] == ["past_key_values.0.key", "past_key_values.0.value", "past_key_values.1.key", "past_key_values.1.value"]
    assert outputs == CANONICAL_OUT  # Optimum's outputs are present.<l>.key already
    RenameCachePass()(model)
    assert _names(model) == (CANONICAL_IN, CANONICAL_OUT)


def test_graph_without_cache_is_refused() -> None:
    model = _cache_model([], [])
    with pytest.raises(NoCacheError, match=r"the graph has no KV-cache inputs or outputs \(it has input_ids, logits\)"):
        RenameCachePass()(model)


@pytest.mark.parametrize(
    ("past", "present", "message"),
    [
        (
            ["past_key_0", "past_value_0", "past_key_1", "past_kv_value_key_1"],
            ["present_key_0", "present_value_0", "present_key_1", "present_value_1"],
            "'past_kv_value_key_1' names both a key and a value",
        ),
        (
            ["past_key_0", "past_value_0", "cache_key_0", "past_value_1"],
            ["present_key_0", "present_value_0", "present_key_1", "present_value_1"],
            "'past_key_0' and 'cache_key_0' both map to past.0.key",
        ),
        (
            ["past_key_1", "past_value_1", "past_key_2", "past_value_2"],
            ["present_key_1", "present_value_1", "present_key_2", "present_value_2"],
            r"past cache layers are numbered \[1, 2\], not 0..1",
        ),
        (
            ["past_key_0", "past_value_0", "past_key_1", "past_1_x_2"],
            ["present_key_0", "present_value_0", "present_key_1", "present_value_1"],
            "can't tell the layer and key/value kind of cache tensor 'past_1_x_2'",
        ),
        (
            ["past_key_0", "past_value_0", "past_key_1", "past_3"],
            ["present_key_0", "present_value_0", "present_key_1", "present_value_1"],
            "'past_3' names no key/value kind and is not a .2, batch, heads, sequence, head_dim. stack",
        ),
    ],
    ids=["both-kinds", "duplicate-slot", "layers-from-1", "unparseable", "kindless-not-stacked"],
)
def test_ambiguous_names_are_refused_and_nothing_is_renamed(past: list[str], present: list[str], message: str) -> None:
    model = _cache_model(past, present)
    before = _names(model)
    with pytest.raises(CacheNamingError, match=message):
        RenameCachePass()(model)
    assert _names(model) == before


def test_missing_value_is_refused() -> None:
    model = _cache_model(["past_key_0"], ["present_key_0"], layers=1)
    with pytest.raises(CacheNamingError, match="past layer 0 has no value tensor"):
        RenameCachePass()(model)
    assert _names(model) == (["input_ids", "past_key_0"], ["logits", "present_key_0"])


def test_parse_ignores_non_cache_names() -> None:
    for name in ("input_ids", "attention_mask", "position_ids", "logits", "cache_position"):
        assert parse_cache_name(name, "past") is None


def _stacked_model() -> onnx.ModelProto:
    """ONNX Runtime's old GPT-2 layout: past_0 [2, b, H, S, D] in, present_0 stacked out."""
    stacked = [2, "b", 2, "s", 4]
    nodes = [
        onnx.helper.make_node("Gather", ["past_0", "zero"], ["k"], axis=0),
        onnx.helper.make_node("Gather", ["past_0", "one"], ["v"], axis=0),
        onnx.helper.make_node("Mul", ["k", "two"], ["k2"]),
        onnx.helper.make_node("Add", ["v", "two"], ["v2"]),
        onnx.helper.make_node("Unsqueeze", ["k2", "axes"], ["k3"]),
        onnx.helper.make_node("Unsqueeze", ["v2", "axes"], ["v3"]),
        onnx.helper.make_node("Concat", ["k3", "v3"], ["present_0"], axis=0),
        onnx.helper.make_node("ReduceSum", ["past_0"], ["total"], keepdims=0),
    ]
    initializers = [
        onnx.numpy_helper.from_array(np.array(0, np.int64), "zero"),
        onnx.numpy_helper.from_array(np.array(1, np.int64), "one"),
        onnx.numpy_helper.from_array(np.array(2, np.float32), "two"),
        onnx.numpy_helper.from_array(np.array([0], np.int64), "axes"),
    ]
    graph = onnx.helper.make_graph(
        nodes,
        "stacked",
        [onnx.helper.make_tensor_value_info("past_0", onnx.TensorProto.FLOAT, stacked)],
        [
            onnx.helper.make_tensor_value_info("present_0", onnx.TensorProto.FLOAT, stacked),
            onnx.helper.make_tensor_value_info("total", onnx.TensorProto.FLOAT, None),
        ],
        initializers,
    )
    return onnx.helper.make_model(graph, opset_imports=[onnx.helper.make_opsetid("", 18)], ir_version=10)


def test_stacked_cache_is_split_into_key_and_value_with_outputs_unchanged() -> None:
    proto = _stacked_model()
    stacked = np.random.default_rng(0).normal(size=(2, 3, 2, 5, 4)).astype(np.float32)
    before = ort.InferenceSession(proto.SerializeToString(), providers=["CPUExecutionProvider"])
    expected_present, expected_total = before.run(None, {"past_0": stacked})

    model = ir.serde.deserialize_model(proto)
    rename = RenameCachePass()
    rename(model)
    assert rename.counts["stacked_split"] == 2
    assert _names(model) == (["past.0.key", "past.0.value"], ["present.0.key", "present.0.value", "total"])
    # the Gathers that read halves of the stack now read the new inputs directly
    assert all(
        node.inputs[0] is not None and node.inputs[0].name in ("past.0.key", "past.0.value")
        for node in model.graph
        if node.op_type in ("Mul", "Add")
    )
    after = ort.InferenceSession(
        ir.serde.serialize_model(model).SerializeToString(), providers=["CPUExecutionProvider"]
    )
    key, value, total = after.run(None, {"past.0.key": stacked[0], "past.0.value": stacked[1]})
    np.testing.assert_array_equal(key, expected_present[0])
    np.testing.assert_array_equal(value, expected_present[1])
    np.testing.assert_allclose(total, expected_total, rtol=1e-6)


def test_stacked_cache_can_be_refused_instead_of_split() -> None:
    model = ir.serde.deserialize_model(_stacked_model())
    with pytest.raises(CacheNamingError, match="'past_0' holds key and value in one tensor"):
        RenameCachePass(split_stacked=False)(model)
    assert _names(model) == (["past_0"], ["present_0", "total"])


def test_second_run_on_a_renamed_graph_changes_nothing() -> None:
    model = _cache_model(["past_key_0", "past_value_0"], ["present_key_0", "present_value_0"])
    assert RenameCachePass()(model).modified
    again = RenameCachePass()
    assert not again(model).modified
    assert again.counts == {"renamed": 0, "stacked_split": 0}
    assert model.graph.inputs[1].metadata_props["kvexport.original_name"] == "past_key_0"
