"""Symbolic shape inference (ONNX Runtime's) written back onto the IR."""

from __future__ import annotations

import logging

import onnx
import onnx_ir as ir

from .values import dims_of

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
    # its warnings ("Cannot determine if ... < 0") go to stderr through logging's last
    # resort: on a refused graph they'd break the one-line error; what it can't tell, it leaves
    inference_log = logging.getLogger("onnxruntime.tools.symbolic_shape_infer")
    level = inference_log.level
    inference_log.setLevel(logging.ERROR)
    try:
        inferred = SymbolicShapeInference.infer_shapes(proto, auto_merge=True)
    except Exception:  # the inference is best effort; the rules then simply don't fire
        return 0
    finally:
        inference_log.setLevel(level)
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
