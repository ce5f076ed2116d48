"""shared_buffer_cache: MultiHeadAttention + Concat-style presents -> GroupQueryAttention in place."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx_ir as ir
import pytest

from kvexport.passes import CleanupPass, build_pipeline, run_pipeline
from kvexport.passes.shared_buffer_cache import (
    CAPACITY_DIM,
    SharedBufferCacheError,
    SharedBufferCachePass,
)
from tests.conftest import TINY


def _ort_fused(path: Path) -> ir.Model:
    model = ir.load(path)
    run_pipeline(model, build_pipeline("ort"))
    return model


def _ops(model: ir.Model) -> list[str]:
    return [node.op_type for node in model.graph]


def _ancestor_ops(value: ir.Value | None) -> set[str]:
    seen: set[str] = set()
    stack = [value]
    while stack:
        current = stack.pop()
        node = current.producer() if current is not None else None
        if node is not None:
            seen.add(node.op_type)
            stack.extend(node.inputs)
    return seen


@pytest.mark.parametrize("graph", ["prefill", "decode"])
def test_attention_becomes_gqa_over_capacity_sized_shared_buffers(tiny_export: Path, graph: str) -> None:
    model = _ort_fused(tiny_export / f"{graph}.onnx")
    layers = TINY["n_layer"]
    assert _ops(model).count("MultiHeadAttention") == layers
    shared = SharedBufferCachePass()
    assert shared(model).modified
    # prefill's mask spans the cache, not the tokens fed: it gets a dim of its own
    separated = int(graph == "prefill")
    assert shared.counts == {
        "attention_converted": layers, "attention_adopted": 0, "bias_replaced": layers, "mask_dim_separated": separated
    }
    mask = next(v for v in model.graph.inputs if v.name == "attention_mask")
    assert mask.shape is not None and str(mask.shape[1]) == "total_sequence"  # decode: the export named it so
    assert _ops(model).count("GroupQueryAttention") == layers
    assert "MultiHeadAttention" not in _ops(model)
    past = [v for v in model.graph.inputs if (v.name or "").startswith("past.")]
    present = [v for v in model.graph.outputs if (v.name or "").startswith("present.")]
    # prefill gains the (empty) buffers as inputs; both graphs read and write the same names
    assert [v.name for v in past] == [f"past.{i}.{k}" for i in range(layers) for k in ("key", "value")]
    assert [v.name for v in present] == [n.replace("past", "present") for n in (v.name for v in past)]
    for value in past + present:
        assert value.shape is not None and str(value.shape[2]) == CAPACITY_DIM
        producer = value.producer()
        if producer is not None:
            assert producer.op_type == "GroupQueryAttention"
    for node in model.graph:
        if node.op_type == "GroupQueryAttention":
            # the op writes into the buffer it reads: present i comes from past i
            layer_inputs = [v.name for v in node.inputs[3:5] if v is not None]
            layer_outputs = [v.name for v in node.outputs[1:3]]
            assert [n.replace("past", "present") for n in layer_inputs] == layer_outputs
    # lengths are computed once per graph from attention_mask, not once per layer; the
    # mask's existing Shape nodes are reused, and in prefill the exporter's own reads of
    # them (which meant the tokens' length) read input_ids instead: one Shape more at most
    assert _ops(model).count("Shape") <= 4 + separated
    mask_shapes = [use.node for use in mask.uses() if use.node.op_type == "Shape"]
    total = next(n for n in model.graph if n.outputs[0].name == "kvexport.total_sequence_length")
    total_chain = {total, *(v.producer() for v in total.inputs if v is not None)}
    total_chain |= {v.producer() for n in list(total_chain) if n is not None for v in n.inputs if v is not None}
    if separated:  # only total_sequence_length reads the mask's width
        assert {u.node for shape in mask_shapes for u in shape.outputs[0].uses()} <= total_chain
    CleanupPass()(model)
    # GQA masks causally itself: the bias is the padding mask alone, and the exporter's
    # mask-building chain (Range/GatherND over shapes: host work and copies under CUDA) is gone
    assert {"Range", "GatherND", "LessOrEqual"}.isdisjoint(_ops(model))
    for node in model.graph:
        if node.op_type == "GroupQueryAttention":
            bias = node.inputs[10]
            assert bias is not None and _ancestor_ops(bias) <= {"Where", "Unsqueeze", "Cast", "Expand", "Concat", "Shape", "Slice"}
            # seqlens_k (a device input under CUDA) is computed from the mask tensor, not its shape
            assert "Shape" not in _ancestor_ops(node.inputs[5])


def test_graph_without_mha_is_left_alone(tiny_export: Path) -> None:
    model = ir.load(tiny_export / "decode.onnx")  # unfused
    before = _ops(model)
    assert not SharedBufferCachePass()(model).modified
    assert _ops(model) == before


def test_graph_without_attention_mask_is_refused(tiny_export: Path) -> None:
    model = _ort_fused(tiny_export / "decode.onnx")
    mask = next(v for v in model.graph.inputs if v.name == "attention_mask")
    mask.name = "mask"
    with pytest.raises(SharedBufferCacheError, match="no attention_mask input"):
        SharedBufferCachePass()(model)


def test_a_bias_that_is_not_a_pure_mask_is_kept(tiny_export: Path) -> None:
    model = _ort_fused(tiny_export / "decode.onnx")
    attention = next(n for n in model.graph if n.op_type == "MultiHeadAttention")
    where = attention.inputs[5].producer()
    assert where is not None and where.op_type == "Where"
    fill = where.inputs[2]
    fill.const_value = ir.tensor(np.array(-100.0, np.float32))  # an additive bias, not a mask
    shared = SharedBufferCachePass()
    shared(model)
    assert shared.counts["bias_replaced"] == 0
    kept = [n.inputs[10] for n in model.graph if n.op_type == "GroupQueryAttention"]
    assert kept and all(v is where.outputs[0] for v in kept)
