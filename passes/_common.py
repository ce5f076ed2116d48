"""Helpers shared by the passes: rule-set passes with per-rule counts, shape annotation."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import onnx
import onnx_ir as ir
from onnx_ir.passes import InPlacePass, PassResult
from onnxscript.rewriter import RewriteRule, RewriteRuleSet


class RulePass(InPlacePass):
    """Apply onnxscript rewrite rules one after another; ``counts`` says how often each fired.

    Subclasses set ``rules``. Each rule runs to a fixed point over the whole model before
    the next one starts, so the counts are per rule, not per rule set.
    """

    rules: Sequence[RewriteRule] = ()

    def __init__(self) -> None:
        super().__init__()
        self.counts: dict[str, int] = {}

    def call(self, model: ir.Model) -> PassResult:
        """Apply every rule in ``rules`` to ``model`` in place."""
        self.counts = apply_rules(model, self.rules)
        return PassResult(model, modified=any(self.counts.values()))


def apply_rules(model: ir.Model, rules: Sequence[RewriteRule]) -> dict[str, int]:
    """Apply each rule in turn; return how often each one fired (summed over same names)."""
    counts: dict[str, int] = {}
    for rule in rules:
        name = rule.name or type(rule).__name__
        fired = RewriteRuleSet([rule]).apply_to_model(model)
        counts[name] = counts.get(name, 0) + fired
    return counts


def initializer(graph: ir.Graph, name: str, array: np.ndarray) -> ir.Value:
    """A constant the pass adds as a named initializer (with its shape and type set).

    An initializer of that name holding the same values is reused, so a pass run again
    adds nothing; one holding other values is an error (``register_initializer`` raises).
    """
    existing = graph.initializers.get(name)
    if existing is not None and existing.const_value is not None:
        if np.array_equal(existing.const_value.numpy(), array) and existing.const_value.numpy().dtype == array.dtype:
            return existing
    tensor = ir.Tensor(array)
    constant = ir.Value(name=name, const_value=tensor, shape=tensor.shape, type=ir.TensorType(tensor.dtype))
    graph.register_initializer(constant)
    return constant


def const_ints(value: ir.Value | None) -> list[int] | None:
    """The value as a list of Python ints when it is a constant integer tensor, else None."""
    if value is None or value.const_value is None:
        return None
    array = value.const_value.numpy()
    if array.dtype.kind not in "iu":
        return None
    return [int(v) for v in array.reshape(-1)]


def const_float(value: ir.Value | None) -> float | None:
    """The value as one Python float when it is a constant with a single element, else None."""
    if value is None or value.const_value is None:
        return None
    array = value.const_value.numpy()
    if array.size != 1:
        return None
    return float(np.asarray(array).reshape(-1)[0])


def is_mask_where(node: ir.Node | None) -> bool:
    """Whether ``node`` is ``Where(cond, 0, fill)`` with fill -inf or its float type's lowest.

    That is an attention mask as an additive bias: keys are either kept or masked out.
    """
    if node is None or node.op_type != "Where" or node.domain not in ("", "ai.onnx") or len(node.inputs) != 3:
        return False
    zero, fill = node.inputs[1], node.inputs[2]
    low = const_float(fill)
    if const_float(zero) != 0.0 or low is None or fill is None or fill.const_value is None:
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


def const_close(value: ir.Value | None, expected: float, atol: float = 1e-6) -> float | None:
    """The constant's single value when it equals ``expected`` to its own precision, else None.

    The tolerance is ``atol`` or one unit of the constant's float type at ``expected``,
    whichever is larger: an fp16 export stores 0.044715 as 0.04471, which is still gelu's.
    """
    found = const_float(value)
    if found is None:
        return None
    dtype = np.asarray(value.const_value.numpy()).dtype  # type: ignore[union-attr]
    unit = float(np.finfo(dtype).eps) * abs(expected) if np.issubdtype(dtype, np.floating) else 0.0
    return found if abs(found - expected) <= max(atol, unit) else None


def dims_of(value: ir.Value | None) -> list[int | str] | None:
    """The value's shape as ints (static dims) and strings (symbolic dims), or None if unknown.

    An unnamed symbolic dim makes the whole shape unknown: two unnamed dims can't be
    proven equal.
    """
    if value is None or value.shape is None:
        return None
    dims: list[int | str] = []
    for dim in value.shape:
        if isinstance(dim, int):
            dims.append(dim)
        elif dim.value is None:
            return None
        else:
            dims.append(dim.value)
    return dims


_LARGE_ELEMENTS = 1024  # tensors this big are weights, never shape arithmetic


def _structure_only(model: ir.Model) -> onnx.ModelProto:
    """Serialize ``model`` with every large initializer as a dangling external reference.

    Shape inference needs their dtype and dims only. Swapping them for placeholders
    while serializing keeps the weights from being copied into the proto (6 GB for
    gpt2-xl, once per fold_shapes round); the originals are put back at once.
    """
    swapped: list[tuple[ir.Value, ir.TensorProtocol]] = []
    for value in model.graph.initializers.values():
        tensor = value.const_value
        if tensor is None or tensor.size <= _LARGE_ELEMENTS:
            continue
        placeholder = ir.ExternalTensor(
            "kvexport-shape-inference-placeholder",
            0,
            tensor.nbytes,
            tensor.dtype,
            shape=ir.Shape(tensor.shape.numpy()),
            name=tensor.name or value.name or "",
        )
        swapped.append((value, tensor))
        value.const_value = placeholder
    try:
        return ir.serde.serialize_model(model)
    finally:
        for value, tensor in swapped:
            value.const_value = tensor


def annotate_symbolic_shapes(model: ir.Model) -> int:
    """Infer symbolic shapes for every value and write them onto the IR; return how many changed.

    Uses ONNX Runtime's symbolic shape inference (it propagates shape *data* through
    Shape/Gather/Concat chains, which ONNX's own inference does not), on a copy of the
    graph without tensor data. Values whose shape the inference can't name are left as
    they were, and so are graph outputs that declare a shape (their dim names are the IO contract, e.g.
    ``total_sequence`` where the inference would write ``past_sequence + 1``). Failing
    inference changes nothing.
    """
    from onnxruntime.tools.symbolic_shape_infer import SymbolicShapeInference

    proto = _structure_only(model)
    try:
        inferred = SymbolicShapeInference.infer_shapes(proto, auto_merge=True)
    except Exception:  # the inference is best effort; the rules then simply don't fire
        return 0
    if inferred is None:
        return 0
    found: dict[str, list[int | str]] = {}
    types: dict[str, int] = {}
    for info in list(inferred.graph.value_info) + list(inferred.graph.output):
        if not info.type.HasField("tensor_type") or not info.type.tensor_type.HasField("shape"):
            continue
        inferred_dims: list[int | str] = []
        for dim in info.type.tensor_type.shape.dim:
            if dim.HasField("dim_value"):
                inferred_dims.append(int(dim.dim_value))
            elif dim.HasField("dim_param"):
                inferred_dims.append(dim.dim_param)
            else:
                break
        else:
            found[info.name] = inferred_dims
            types[info.name] = info.type.tensor_type.elem_type
    changed = 0
    for node in model.graph:
        for output in node.outputs:
            new_dims = found.get(output.name or "")
            if new_dims is None or dims_of(output) == new_dims:
                continue
            if output.is_graph_output() and output.shape is not None:
                continue  # a graph output's declared shape is the graph's contract
            output.shape = ir.Shape(new_dims)
            if output.type is None and types.get(output.name or ""):
                output.type = ir.TensorType(ir.DataType(types[output.name or ""]))
            changed += 1
    return changed
