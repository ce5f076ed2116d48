"""Matchers over values: constants a pass reads or adds, and shapes as plain lists."""

from __future__ import annotations

import numpy as np
import onnx_ir as ir


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

def take_graph_output(graph: ir.Graph, old: ir.Value, new: ir.Value, shape: ir.Shape | None) -> None:
    """``new`` becomes the graph output ``old`` was, in its place and under its name, with ``shape``.

    ``old`` stays in the graph (renamed ``<name>.replaced``) for whatever still reads it.
    """
    position = list(graph.outputs).index(old)
    name = old.name
    old.name = f"{name}.replaced"
    graph.outputs[position] = new
    new.name, new.shape = name, shape


def stand_in(graph: ir.Graph, old: ir.Value, new: ir.Value, name: str) -> None:
    """``new`` (named ``name``, with ``old``'s shape and type) stands for ``old``, a replaced node's output.

    As a graph output (a present, or a subgraph's output) it takes ``old``'s name and place
    (:func:`take_graph_output`); elsewhere it takes ``old``'s readers.
    """
    new.shape, new.type, new.name = old.shape, old.type, name
    if old in graph.outputs:
        take_graph_output(graph, old, new, old.shape)
    else:
        old.replace_all_uses_with(new)


def ints(graph: ir.Graph, value: int | list[int]) -> ir.Value:
    """A shared int64 initializer holding ``value`` (a scalar or a 1-D list), named by its values."""
    array = np.array(value, np.int64)
    name = "kvexport.ints_" + ("_".join(map(str, array.reshape(-1))) + ("_1d" if array.ndim else ""))
    return initializer(graph, name.replace("-", "m"), array)


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
