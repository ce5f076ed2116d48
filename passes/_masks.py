"""Attention-mask knowledge: the additive mask ``Where`` and the padding condition."""

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
