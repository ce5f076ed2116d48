"""Attention-mask knowledge: the additive mask ``Where``, the padding condition, and each row's length read off the mask."""

from __future__ import annotations

import numpy as np
import onnx_ir as ir

from .values import const_float, const_ints, initializer


def is_mask_where(node: ir.Node | None) -> bool:
    """Whether ``node`` is ``Where(cond, 0, fill)`` with fill -inf or its float type's lowest.

    That is an attention mask as an additive bias: keys are either kept or masked out.
    """
    if node is None or node.op_type != "Where" or node.domain not in ("", "ai.onnx") or len(node.inputs) != 3:
        return False
    return const_float(node.inputs[1]) == 0.0 and is_lowest(node.inputs[2])


def is_lowest(fill: ir.Value | None) -> bool:
    """Whether ``fill`` is a scalar constant -inf or its float type's lowest value: "masked out"."""
    low = const_float(fill)
    if low is None or fill is None or fill.const_value is None:
        return False
    dtype = np.asarray(fill.const_value.numpy()).dtype
    return low == -np.inf or (np.issubdtype(dtype, np.floating) and low == float(np.finfo(dtype).min))

def padding_condition(graph: ir.Graph, mask: ir.Value) -> tuple[list[ir.Node], ir.Value]:
    """``Unsqueeze(Cast(mask, bool), [1, 2])``: [batch, 1, 1, total], true for keys that are not padding.

    Returns the new nodes (for the caller to place) and their output.
    """
    cast = ir.node("Cast", [mask], attributes={"to": ir.DataType.BOOL})
    axes = initializer(graph, "kvexport.axes_1_2", np.array([1, 2], np.int64))
    unsqueeze = ir.node("Unsqueeze", [cast.outputs[0], axes])
    condition = unsqueeze.outputs[0]
    condition.type = ir.TensorType(ir.DataType.BOOL)
    if mask.shape is not None and len(mask.shape) == 2:
        condition.shape = ir.Shape([mask.shape[0], 1, 1, mask.shape[1]])
    return [cast, unsqueeze], condition

def is_padding_condition(condition: ir.Value, mask: ir.Value) -> bool:
    """Whether ``condition`` is :func:`padding_condition` of ``mask`` already."""
    unsqueeze = condition.producer()
    if unsqueeze is None or unsqueeze.op_type != "Unsqueeze" or const_ints(unsqueeze.inputs[1]) != [1, 2]:
        return False
    cast = unsqueeze.inputs[0].producer() if unsqueeze.inputs[0] is not None else None
    return (
        cast is not None
        and cast.op_type == "Cast"
        and cast.inputs[0] is mask
        and cast.attributes.get_int("to") == ir.DataType.BOOL
    )


def mask_dim(graph: ir.Graph, mask: ir.Value, axis: int, created: list[ir.Node]) -> ir.Value:
    """``Shape(mask)[axis:axis+1]`` ([1] int64), reusing a Shape node the graph already has.

    ``mask`` is any graph input (the attention mask, or input_ids for the query length).
    """
    for use in mask.uses():
        node = use.node
        if node.op_type != "Shape" or node.domain not in ("", "ai.onnx"):
            continue
        start = node.attributes.get_int("start", 0) or 0
        end = node.attributes.get_int("end", None)
        if start == axis and end == axis + 1:
            return node.outputs[0]
    full = next(
        (
            u.node.outputs[0]
            for u in mask.uses()
            if u.node.op_type == "Shape" and not u.node.attributes
        ),
        None,
    )
    if full is None:
        shape = ir.node("Shape", [mask])
        created.append(shape)
        full = shape.outputs[0]
    piece = ir.node(
        "Slice",
        [
            full,
            initializer(graph, f"kvexport.{mask.name}_dim{axis}_start", np.array([axis], np.int64)),
            initializer(graph, f"kvexport.{mask.name}_dim{axis}_end", np.array([axis + 1], np.int64)),
        ],
    )
    created.append(piece)
    return piece.outputs[0]


def mask_lengths(graph: ir.Graph, mask: ir.Value) -> tuple[ir.Value, ir.Value]:
    """``seqlens_k`` [batch] int32 and ``total_sequence_length`` int32 scalar for the mask.

    ``total_sequence_length`` is the mask's width, from a Shape node the graph already has
    where it can (GroupQueryAttention wants it in host memory). ``seqlens_k`` is each row's
    own length less one, read off the mask's *values*: the index of the row's last 1,
    ``ReduceMax(mask * CumSum(ones)) - 1``. One rule serves a left-padded batch (every row
    ends at the last column), right-padded prompts (onnxruntime-genai's convention) and
    slots of different lengths decoding together in one call over a mask as wide as the
    buffer. It is computed from the mask tensor, so under CUDA it stays on the device: a
    value derived from a shape would be computed on the host and copied over.
    """
    created: list[ir.Node] = []
    total_1d = mask_dim(graph, mask, 1, created)
    total32 = ir.node("Cast", [total_1d], attributes={"to": ir.DataType.INT32})
    scalar = initializer(graph, "kvexport.scalar_shape", np.array([], np.int64))
    total = ir.node("Reshape", [total32.outputs[0], scalar])
    everywhere = ir.node("Equal", [mask, mask])
    ones = ir.node("Cast", [everywhere.outputs[0]], attributes={"to": ir.DataType.INT32})
    axis = initializer(graph, "kvexport.axis_1", np.array([1], np.int64))
    axis_scalar = initializer(graph, "kvexport.axis_1_scalar", np.array(1, np.int64))
    counted = ir.node("CumSum", [ones.outputs[0], axis_scalar])  # 1..width along each row
    mask32 = ir.node("Cast", [mask], attributes={"to": ir.DataType.INT32})
    kept = ir.node("Mul", [mask32.outputs[0], counted.outputs[0]])
    length = ir.node("ReduceMax", [kept.outputs[0], axis], attributes={"keepdims": 0})
    seqlens = ir.node("Sub", [length.outputs[0], initializer(graph, "kvexport.one_int32", np.array(1, np.int32))])
    total.outputs[0].name = "kvexport.total_sequence_length"
    seqlens.outputs[0].name = "kvexport.seqlens_k"
    total.outputs[0].shape, total.outputs[0].type = ir.Shape([]), ir.TensorType(ir.DataType.INT32)
    seqlens.outputs[0].type = ir.TensorType(ir.DataType.INT32)
    graph.extend([*created, total32, total, everywhere, ones, counted, mask32, kept, length, seqlens])
    return seqlens.outputs[0], total.outputs[0]
