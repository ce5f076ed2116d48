"""shared_buffer_cache: MultiHeadAttention + Concat-style presents -> GroupQueryAttention in place."""

from __future__ import annotations

from pathlib import Path

import onnx_ir as ir
import pytest

from passes import build_pipeline, run_pipeline
from passes.shared_buffer_cache import CAPACITY_DIM, SharedBufferCacheError, SharedBufferCachePass
from tests.conftest import TINY


def _ort_fused(path: Path) -> ir.Model:
    model = ir.load(path)
    run_pipeline(model, build_pipeline("ort"))
    return model


def _ops(model: ir.Model) -> list[str]:
    return [node.op_type for node in model.graph]


@pytest.mark.parametrize("graph", ["prefill", "decode"])
def test_attention_becomes_gqa_over_capacity_sized_shared_buffers(tiny_export: Path, graph: str) -> None:
    model = _ort_fused(tiny_export / f"{graph}.onnx")
    layers = TINY["n_layer"]
    assert _ops(model).count("MultiHeadAttention") == layers
    shared = SharedBufferCachePass()
    assert shared(model).modified
    assert shared.counts == {"attention_converted": layers}
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
    # lengths are computed once per graph from attention_mask, not once per layer
    assert _ops(model).count("Shape") <= 4  # the mask's existing Shape nodes are reused


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
