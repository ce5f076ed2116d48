"""onnxruntime-genai's model builder graphs, brought to kvexport's contract before import.

The builder (``python -m onnxruntime_genai.models.builder``) writes one decoder graph that
is GQA-fused already, and computes two things itself that kvexport's contract gives as
inputs or computes otherwise:

- **positions**: there is no ``position_ids`` input. Each ``GroupQueryAttention`` has
  ``do_rotary=1`` and rotates the packed queries and keys by the position it derives from
  the cache index, reading ``cos_cache`` / ``sin_cache`` tables. A left-padded row's
  positions then count its pads, where transformers' (and kvexport's runtime) count tokens.
- **row lengths**: ``seqlens_k`` is ``ReduceSum(attention_mask) - 1``, the count of a row's
  ones (genai pads on the right); a left-padded row would be taken as shorter than it is.

:func:`from_genai` rewrites each such op so that the graph computes what kvexport's runtime
expects: a ``position_ids`` input [batch, sequence]; the packed QKV split into query, key
and value (where they are packed), query and key rotated by ``com.microsoft.RotaryEmbedding`` at ``position_ids``
with the builder's own tables, and ``do_rotary=0``. The op is then marked as fused over
the exporter's cache, so the in-place cache pass (``passes.shared_buffer_cache``) adopts it
as it adopts the ones ``fuse_attention`` makes; the mark also tells that pass to replace the
builder's lengths by its own (the index of each row's last 1) and to add the padding bias.
That runs after the shape folding, which would otherwise read the mask's width off
``input_ids`` in the prefill graph, where both are named ``sequence``. What changed goes
into the manifest.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import onnx_ir as ir
from onnx_ir.passes.common import TopologicalSortPass

from kvexport.errors import KvexportError
from kvexport.passes.values import initializer
from kvexport.passes.vocabulary import GQA_MARK, GROUP_QUERY_ATTENTION, MS_DOMAIN, ROTARY_EMBEDDING


def is_genai_graph(model: ir.Model) -> bool:
    """Whether the graph is the builder's: GroupQueryAttention that rotates itself, and no ``position_ids`` input."""
    rotates = any(
        node.op_type == GROUP_QUERY_ATTENTION and node.attributes.get_int("do_rotary", 0) for node in model.graph
    )
    return rotates and not any(value.name == "position_ids" for value in model.graph.inputs)


def from_genai(model: ir.Model, where: str) -> dict[str, Any]:
    """Rewrite the builder's attention as the module docstring says; returns what changed, for the manifest.

    Raises:
        KvexportError: a graph without ``input_ids`` / ``attention_mask``, attention whose
            query is missing, or rotary tables that are not
            constants (the builder's long/short switch for longrope).

    """
    graph = model.graph
    inputs = {value.name: value for value in graph.inputs}
    ids, mask = inputs.get("input_ids"), inputs.get("attention_mask")
    if ids is None or mask is None:
        raise KvexportError(f"{where}: an onnxruntime-genai graph without input_ids or attention_mask; import can't drive it")
    positions = ir.Value(name="position_ids", shape=ir.Shape(ids.shape) if ids.shape else None, type=ir.TensorType(ir.DataType.INT64))
    graph.inputs.insert(list(graph.inputs).index(mask) + 1, positions)
    converted = 0
    for node in [n for n in graph if n.op_type == GROUP_QUERY_ATTENTION and n.domain == MS_DOMAIN]:
        if not node.attributes.get_int("do_rotary", 0):
            continue
        packed, cos, sin = node.inputs[0], node.inputs[7], node.inputs[8]
        if packed is None:
            raise KvexportError(f"{where}: {node.name}: GroupQueryAttention without a query input; not supported")
        if cos is None or sin is None or cos.const_value is None or sin.const_value is None:
            raise KvexportError(
                f"{where}: {node.name}: its rotary tables are computed in the graph (longrope's long/short switch?); "
                "import takes constant cos_cache / sin_cache tables"
            )
        heads, kv_heads = node.attributes.get_int("num_heads"), node.attributes.get_int("kv_num_heads")
        head_dim = 2 * int(cos.const_value.numpy().shape[1])
        created: list[ir.Node] = []
        query: ir.Value
        key: ir.Value | None
        value: ir.Value | None
        if node.inputs[1] is None:  # query, key and value packed in one tensor: split them
            sizes = initializer(graph, f"kvexport.qkv_split_{heads}_{kv_heads}_{head_dim}",
                                np.array([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], np.int64))
            created.append(ir.node("Split", [packed, sizes], attributes={"axis": -1}, num_outputs=3))
            query, key, value = created[0].outputs
        else:
            query, key, value = packed, node.inputs[1], node.inputs[2]
        interleaved = node.attributes.get_int("rotary_interleaved", 0)
        rotated = [
            ir.node(ROTARY_EMBEDDING, [tensor, positions, cos, sin], domain=MS_DOMAIN,
                    attributes={"num_heads": count, "interleaved": interleaved})
            for tensor, count in ((query, heads), (key, kv_heads))
        ]  # fmt: skip
        graph.insert_before(node, [*created, *rotated])
        new_inputs = [rotated[0].outputs[0], rotated[1].outputs[0], value, *node.inputs[3:7], None, None]
        for index, input_value in enumerate(new_inputs):
            node.replace_input_with(index, input_value)
        node.attributes["do_rotary"] = ir.AttrInt64("do_rotary", 0)
        node.metadata_props[GQA_MARK] = "genai"
        for present in node.outputs[1:3]:
            if present.shape is not None and len(present.shape) == 4:
                present.shape = ir.Shape([*present.shape[:3], head_dim])
        for past in node.inputs[3:5]:
            if past is not None and past.shape is not None and len(past.shape) == 4:
                past.shape = ir.Shape([*past.shape[:3], head_dim])
        converted += 1
    TopologicalSortPass()(model)
    return {
        "tool": "onnxruntime-genai model builder",
        "attention_converted": converted,
        "computed_by_the_graph_before": "rotary positions from the cache index (do_rotary), row lengths as the count of the mask's ones",
        "now": "position_ids input and com.microsoft.RotaryEmbedding; row lengths the index of the mask's last 1, a padding bias",
    }
