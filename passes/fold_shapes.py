"""fold_shapes: replace shape arithmetic the model already knows with constants.

Exporters compute the target of nearly every ``Reshape`` at run time::

    Reshape(X, Concat(Unsqueeze(Gather(Shape(X), 0)), Unsqueeze(Gather(Shape(X), 1)), [3], [16]))

although heads (3) and head dim (16) are fixed and batch / sequence can be copied from
the input by ``Reshape``'s 0. The pass infers symbolic shapes for the graph (ONNX
Runtime's symbolic inference, which follows shape *data* through those chains), then:

- ``ReshapeToConstantShape``: a Reshape whose output shape is known becomes
  ``Reshape(X, [0, 0, 3, 16])``: static dims as numbers, a symbolic dim found at the same
  position of the input as 0, at most one other symbolic dim as -1. Batch and sequence
  stay dynamic.
- ``ReshapeTransposeReshapeToTranspose``: ``Reshape(Transpose(Reshape(K[a,b,c,d], [-1,c,d]),
  [0,2,1]), [a,b,d,c])`` (how ``k.transpose(-2, -1)`` is sometimes lowered) becomes
  ``Transpose(K, [0,1,3,2])``.
- ``ReshapeIdentity``: a Reshape to the shape its input already has is removed;
  ``ReshapeOfReshape``: two Reshapes in a row become one.
- ``StaticDimFromShape``: ``Gather(Shape(X), i)`` of a static dim becomes a constant.
- ``GemmSandwichToMatMul``: ``Reshape(Gemm(Reshape(X, [-1, K]), W, B), [a, s, N])`` becomes
  ``MatMul(X, W) + B``: the Reshapes only exist because Gemm is 2-D.
- ``SmallConstantOfShape``: ``ConstantOfShape`` of a constant shape of at most 1024
  elements (``torch.full([], x)``) becomes the constant itself.
- ``ShapeFromFirstCarrier``: every layer reads the query and key lengths from its own
  tensors (``Shape(query)``, ``Shape(present_key)``); each named dim is read instead from
  the first value that carries it, a graph input where one does, and common-subexpression
  elimination then keeps one chain per graph however deep the model is.

- ``DecodeMaskFromAttentionMask`` (decode graphs only: ``input_ids`` is [batch, 1]): the
  attention mask bias ``Where(cond, 0, -inf)``, whose ``cond`` the exporter built from
  ``attention_mask`` as causal AND padding over ranges of the shapes, gets
  ``cond = Unsqueeze(Cast(attention_mask, bool), [1, 2])``. A single query sits at the
  last position, so the causal part admits every key and padding is all that is left.
  Under CUDA this removes host-side shape work and its copy to the device from every
  decode step. (A GPT-2 decoder masks causally and by padding only; a model with other
  masks, e.g. a sliding window, would need that kept.)

The chains left without users are then removed, so only what truly depends on run-time
lengths stays (the causal / padding mask of prefill, computed once per graph). A round is
constant folding, inference, the rules, the two steps above and dead-node removal; rounds
run under a ``PassManager(early_stop=True)`` until one changes nothing, at most
``_MAX_ROUNDS`` (6) of them.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import onnx_ir as ir
from onnx_ir.passes import InPlacePass, PassManager, PassResult
from onnx_ir.passes.common import (
    CommonSubexpressionEliminationPass,
    DeduplicateInitializersPass,
    IdentityEliminationPass,
    LiftConstantsToInitializersPass,
    RemoveUnusedNodesPass,
)
from onnxscript import optimizer
from onnxscript.rewriter import MatchResult, RewriteRuleClassBase

from ._masks import is_mask_where, is_padding_condition, padding_condition
from ._rules import apply_rules
from ._shapes import annotate_symbolic_shapes
from .values import const_ints, dims_of, ints

_MAX_ROUNDS = 6


class ReshapeToConstantShape(RewriteRuleClassBase):
    """``Reshape(X, <computed>)`` -> ``Reshape(X, [0, 0, 3, 16])`` when the output shape is known.

    A constant target whose -1 stands for a static dim (``[0, 0, -1, 16]``) gets the number.
    """

    def pattern(self, op: Any, data: ir.Value, shape: ir.Value) -> ir.Value:
        """Any Reshape."""
        return op.Reshape(data, shape, _outputs=["reshaped"])

    def check(self, context: Any, data: ir.Value, shape: ir.Value, reshaped: ir.Value, **_: Any) -> MatchResult:
        """The shape is computed, and the output dims are numbers or copies of input dims."""
        result = MatchResult()
        target = _constant_target(data, shape, reshaped)
        return result.fail(target) if isinstance(target, str) else result

    def rewrite(self, op: Any, data: ir.Value, shape: ir.Value, reshaped: ir.Value, **_: Any) -> ir.Value:
        """Reshape to the constant."""
        target = _constant_target(data, shape, reshaped)
        assert not isinstance(target, str)  # check() accepted this match
        return op.Reshape(data, op.Constant(value=ir.tensor(target, dtype=ir.DataType.INT64)))


def _constant_target(data: ir.Value, shape: ir.Value, reshaped: ir.Value) -> list[int] | str:
    """The constant Reshape target for a known output shape, or why there is none (for ``check``)."""
    known = const_ints(shape)
    if known is not None and -1 not in known:
        return "the target shape is already a constant without -1"
    output_dims = dims_of(reshaped)
    if output_dims is None:
        return "the output shape is not known"
    input_dims = dims_of(data) or []
    new_dims: list[int] = []
    for position, dim in enumerate(output_dims):
        if isinstance(dim, int):
            if dim == 0:
                return "an empty dim can't be written as a Reshape target"
            new_dims.append(dim)
        elif position < len(input_dims) and input_dims[position] == dim:
            new_dims.append(0)
        else:
            new_dims.append(-1)
    unknown = new_dims.count(-1)
    if unknown > 1:
        return f"{unknown} output dims are neither static nor copies of input dims"
    if known is not None and unknown >= known.count(-1):
        return "the constant target would stay as it is"
    return new_dims


class ReshapeTransposeReshapeToTranspose(RewriteRuleClassBase):
    """``Reshape(Transpose(Reshape(K, [-1, c, d]), [0, 2, 1]), [a, b, d, c])`` -> ``Transpose(K, [0, 1, 3, 2])``."""

    def pattern(self, op: Any, data: ir.Value, merged_shape: ir.Value, split_shape: ir.Value) -> ir.Value:
        """Merge leading dims, swap the last two, split again."""
        merged = op.Reshape(data, merged_shape, _outputs=["merged"])
        return op.Reshape(op.Transpose(merged, perm=[0, 2, 1]), split_shape)

    def check(self, context: Any, data: ir.Value, merged: ir.Value, **_: Any) -> MatchResult:
        """Shapes prove it is a swap of the last two axes of a rank-4 tensor."""
        result = MatchResult()
        data_dims = dims_of(data)
        merged_dims = dims_of(merged)
        output_dims = dims_of(context.output_values[0])
        if data_dims is None or merged_dims is None or output_dims is None:
            return result.fail("shapes are not known")
        if len(data_dims) != 4 or len(merged_dims) != 3:
            return result.fail("not a rank-4 tensor merged to rank 3")
        if merged_dims[1:] != data_dims[2:]:
            return result.fail("the merge does not keep the last two axes")
        a, b, c, d = data_dims
        if output_dims != [a, b, d, c]:
            return result.fail("the result is not the input with its last two axes swapped")
        if len(merged.uses()) != 1:
            return result.fail("the merged tensor has other users")
        return result

    def rewrite(self, op: Any, data: ir.Value, **_: Any) -> ir.Value:
        """One Transpose."""
        return op.Transpose(data, perm=[0, 1, 3, 2])


class ReshapeIdentity(RewriteRuleClassBase):
    """``Reshape(X, s)`` -> ``X`` when ``s`` is X's own (known) shape."""

    def pattern(self, op: Any, data: ir.Value, shape: ir.Value) -> ir.Value:
        """Any Reshape."""
        return op.Reshape(data, shape)

    def check(self, context: Any, data: ir.Value, shape: ir.Value, **_: Any) -> MatchResult:
        """Input and output dims are the same, every one of them known."""
        result = MatchResult()
        output = context.output_values[0]
        input_dims = dims_of(data)
        if input_dims is None or input_dims != dims_of(output):
            return result.fail("input and output shapes are not known to be equal")
        if output.is_graph_output():
            return result.fail("the output is a graph output")
        return result

    def rewrite(self, op: Any, data: ir.Value, **_: Any) -> ir.Value:
        """The input itself."""
        return op.Identity(data)


class StaticDimFromShape(RewriteRuleClassBase):
    """``Gather(Shape(X), i)`` -> a constant when X's dim ``i`` is static."""

    def pattern(self, op: Any, data: ir.Value, index: ir.Value) -> ir.Value:
        """One dim read out of a Shape."""
        return op.Gather(op.Shape(data, _outputs=["shape"]), index, axis=0)

    def check(self, context: Any, data: ir.Value, shape: ir.Value, index: ir.Value, **_: Any) -> MatchResult:
        """The index is constant and the dim it reads is a number."""
        result = MatchResult()
        dims = _static_dims_read(data, shape, index)
        return result.fail(dims) if isinstance(dims, str) else result

    def rewrite(self, op: Any, data: ir.Value, shape: ir.Value, index: ir.Value, **_: Any) -> ir.Value:
        """The dim as a constant."""
        dims = _static_dims_read(data, shape, index)
        assert not isinstance(dims, str)  # check() accepted this match
        return op.Constant(value=ir.tensor(dims))


def _static_dims_read(data: ir.Value, shape: ir.Value, index: ir.Value) -> np.ndarray | str:
    """What ``Gather(Shape(data), index)`` reads, when every dim it reads is static; else why not."""
    dims = dims_of(data)
    positions = const_ints(index)
    if dims is None or positions is None or index.shape is None:
        return "input shape or index not known"
    node = shape.producer()
    assert node is not None
    start = node.attributes.get_int("start", 0) or 0
    end = node.attributes.get_int("end", len(dims))
    sliced = dims[start:end] if end is not None else dims[start:]
    try:
        values = [sliced[p] for p in positions]
    except IndexError:
        return "index out of range"
    if not all(isinstance(v, int) for v in values):
        return "the dim read is symbolic"
    index_dims = dims_of(index)
    if index_dims is None or not all(isinstance(d, int) for d in index_dims):
        return "the index has a symbolic shape"
    return np.array(values, dtype=np.int64).reshape([int(d) for d in index_dims])


class GemmSandwichToMatMul(RewriteRuleClassBase):
    """``Reshape(Gemm(Reshape(X[a,s,K], [-1,K]), W, B), [a,s,N])`` -> ``Add(MatMul(X, W), B)``.

    The two Reshapes exist only because Gemm is 2-D; MatMul takes the 3-D activation as
    it is, so batch and sequence need no shape arithmetic at all. Only ``transB=0`` with
    a constant weight and a 1-D (or absent) bias, alpha = beta = 1.
    """

    def pattern(self, op: Any, data: ir.Value, flat_shape: ir.Value, weight: ir.Value, out_shape: ir.Value) -> ir.Value:
        """Flatten, Gemm, unflatten."""
        flat = op.Reshape(data, flat_shape, _outputs=["flat"])
        product = op.Gemm(flat, weight, _allow_other_inputs=True, _allow_other_attributes=True, _outputs=["product"])
        return op.Reshape(product, out_shape)

    def check(self, context: Any, data: ir.Value, flat: ir.Value, weight: ir.Value, product: ir.Value, **_: Any) -> MatchResult:
        """Shapes and attributes make the MatMul form exact."""
        result = MatchResult()
        gemm = product.producer()
        assert gemm is not None
        attrs = gemm.attributes
        if attrs.get_int("transA", 0) or attrs.get_int("transB", 0):
            return result.fail("transposed Gemm operands")
        if attrs.get_float("alpha", 1.0) != 1.0 or attrs.get_float("beta", 1.0) != 1.0:
            return result.fail("alpha or beta is not 1")
        if weight.const_value is None:
            return result.fail("the weight is not a constant", weight)
        bias = gemm.inputs[2] if len(gemm.inputs) > 2 else None
        if bias is not None and (bias.shape is None or len(bias.shape) != 1):
            return result.fail("the bias is not 1-D")
        data_dims, output_dims, weight_dims = dims_of(data), dims_of(context.output_values[0]), dims_of(weight)
        if data_dims is None or output_dims is None or weight_dims is None:
            return result.fail("shapes not known")
        if len(data_dims) < 2 or output_dims[:-1] != data_dims[:-1] or output_dims[-1] != weight_dims[1]:
            return result.fail("the reshapes do not just flatten and restore the leading dims")
        if len(flat.uses()) != 1 or len(product.uses()) != 1:
            return result.fail("intermediate values have other users")
        return result

    def rewrite(self, op: Any, data: ir.Value, weight: ir.Value, product: ir.Value, **_: Any) -> ir.Value:
        """MatMul, then the Gemm's bias if it has one."""
        gemm = product.producer()
        assert gemm is not None
        bias = gemm.inputs[2] if len(gemm.inputs) > 2 else None
        matmul = op.MatMul(data, weight)
        return matmul if bias is None else op.Add(matmul, bias)


class SmallConstantOfShape(RewriteRuleClassBase):
    """``ConstantOfShape(<constant shape>)`` -> the constant, when it is small (``torch.full([], x)``)."""

    def pattern(self, op: Any, shape: ir.Value) -> ir.Value:
        """Any ConstantOfShape."""
        return op.ConstantOfShape(shape, _allow_other_attributes=True, _outputs=["filled"])

    def check(self, context: Any, shape: ir.Value, **_: Any) -> MatchResult:
        """The shape is a constant of at most 1024 elements."""
        result = MatchResult()
        dims = const_ints(shape)
        if dims is None or shape.shape is None or len(shape.shape) != 1 or int(np.prod(dims)) > 1024:
            return result.fail("the shape is not a small constant", shape)
        return result

    def rewrite(self, op: Any, shape: ir.Value, filled: ir.Value, **_: Any) -> ir.Value:
        """The filled tensor (ConstantOfShape's ``value``, 0.0 as float32 when it has none)."""
        dims = const_ints(shape)
        assert dims is not None  # check() read it
        node = filled.producer()
        fill = node.attributes.get("value") if node is not None else None
        base = fill.as_tensor().numpy().reshape(-1) if fill is not None else np.zeros(1, np.float32)
        return op.Constant(value=ir.tensor(np.full([int(d) for d in dims], base[0], dtype=base.dtype)))


class ReshapeOfReshape(RewriteRuleClassBase):
    """``Reshape(Reshape(X, s1), s2)`` -> ``Reshape(X, s2)`` when ``s2`` is constant and its 0s copy the same dims."""

    def pattern(self, op: Any, data: ir.Value, first_shape: ir.Value, second_shape: ir.Value) -> ir.Value:
        """Two Reshapes in a row."""
        return op.Reshape(op.Reshape(data, first_shape, _outputs=["middle"]), second_shape)

    def check(self, context: Any, data: ir.Value, middle: ir.Value, second_shape: ir.Value, **_: Any) -> MatchResult:
        """Every 0 in the second target copies a dim that the input has at the same place."""
        result = MatchResult()
        dims = const_ints(second_shape)
        if dims is None:
            return result.fail("the second target is not a constant", second_shape)
        data_dims, middle_dims = dims_of(data), dims_of(middle)
        for position, dim in enumerate(dims):
            if dim != 0:
                continue
            if data_dims is None or middle_dims is None or position >= min(len(data_dims), len(middle_dims)):
                return result.fail("a 0 in the second target copies a dim of unknown origin")
            if data_dims[position] != middle_dims[position]:
                return result.fail("a 0 in the second target copies a dim the input does not have there")
        if len(middle.uses()) != 1 or middle.is_graph_output():
            return result.fail("the middle tensor has other users")
        return result

    def rewrite(self, op: Any, data: ir.Value, second_shape: ir.Value, **_: Any) -> ir.Value:
        """One Reshape."""
        return op.Reshape(data, second_shape)


RULES = [
    SmallConstantOfShape.rule(),
    ReshapeOfReshape.rule(),
    StaticDimFromShape.rule(),
    GemmSandwichToMatMul.rule(),
    ReshapeIdentity.rule(),
    ReshapeTransposeReshapeToTranspose.rule(),
    ReshapeToConstantShape.rule(),
]


def _depends_on(value: ir.Value, source: ir.Value, limit: int = 200) -> bool:
    """Whether ``source`` is among ``value``'s ancestors (looking at ``limit`` nodes at most)."""
    stack, seen = [value], 0
    while stack and seen < limit:
        current = stack.pop()
        if current is source:
            return True
        node = current.producer()
        if node is not None:
            seen += 1
            stack.extend(v for v in node.inputs if v is not None)
    return False


def decode_mask_from_attention_mask(model: ir.Model) -> int:
    """``DecodeMaskFromAttentionMask`` (see the module docstring); returns how many masks changed."""
    graph = model.graph
    inputs = {v.name: v for v in graph.inputs}
    ids, mask = inputs.get("input_ids"), inputs.get("attention_mask")
    if ids is None or mask is None or ids.shape is None or mask.shape is None:
        return 0
    if len(ids.shape) != 2 or ids.shape[1] != 1 or len(mask.shape) != 2:
        return 0  # not a one-token decode graph
    changed = 0
    padding: ir.Value | None = None
    for node in list(graph):
        if not is_mask_where(node):
            continue
        cond = node.inputs[0]
        if cond is None or cond is padding or is_padding_condition(cond, mask):
            continue  # already the padding mask
        dims = dims_of(cond)
        if dims is None or len(dims) != 4 or dims[1] != 1 or dims[2] != 1 or not _depends_on(cond, mask):
            continue
        if padding is None:
            nodes, padding = padding_condition(graph, mask)
            padding.name = "kvexport.decode_padding"
            graph.insert_before(node, nodes)
        node.replace_input_with(0, padding)
        changed += 1
    return changed


def _dim_carriers(graph: ir.Graph) -> dict[str, tuple[ir.Value, int]]:
    """For each named symbolic dim, the first value that has it, and where: graph inputs first."""
    carriers: dict[str, tuple[ir.Value, int]] = {}
    for value in [*graph.inputs, *(output for node in graph for output in node.outputs)]:
        for axis, dim in enumerate(dims_of(value) or []):
            if isinstance(dim, str):
                carriers.setdefault(dim, (value, axis))
    return carriers


def _read_dim(node: ir.Node) -> int | None:
    """The one position of its Shape input that a Gather or a one-element Slice reads, or None."""
    if node.op_type == "Gather" and (node.attributes.get_int("axis", 0) or 0) == 0:
        index = const_ints(node.inputs[1])
        return index[0] if index is not None and len(index) == 1 else None
    if node.op_type == "Slice" and len(node.inputs) >= 3:
        starts, ends = const_ints(node.inputs[1]), const_ints(node.inputs[2])
        extra = [const_ints(v) for v in node.inputs[3:] if v is not None]
        if starts is None or ends is None or len(starts) != 1 or any(e not in ([0], [1]) for e in extra):
            return None
        if len(node.inputs) > 4 and const_ints(node.inputs[4]) != [1]:
            return None  # a step other than 1
        start, end = starts[0], ends[0]
        return start if end == start + 1 or (start == -1 and end >= 2**31) else None
    return None


def _shape_of(graph: ir.Graph, value: ir.Value) -> ir.Value:
    """A new ``Shape(value)`` node, placed right after ``value`` is made."""
    shape = ir.node("Shape", [value])
    producer = value.producer()
    if producer is not None:
        graph.insert_after(producer, shape)
    else:
        graph.insert_before(graph[0], shape)
    output = shape.outputs[0]
    output.type = ir.TensorType(ir.DataType.INT64)
    output.shape = ir.Shape([len(value.shape) if value.shape is not None else None])
    return output


def share_dim_sources(model: ir.Model) -> int:
    """``ShapeFromFirstCarrier``: a dim read out of ``Shape(X)`` is read from the first value that has it.

    (A static dim that a Slice reads becomes a constant.)

    Symbolic shape inference names each dim; every layer computes the same lengths from
    its own tensors (``Shape(query)``, ``Shape(present_key)``), so a single-graph decoder
    keeps a few Shape nodes per layer. Reading each named dim from the first value that
    carries it (a graph input where one does) makes the layers' chains identical, and
    common-subexpression elimination then leaves one chain for the graph, whatever its
    depth. It also frees the attention tensors of uses that block fusion. Returns how
    many reads moved.
    """
    graph = model.graph
    carriers = _dim_carriers(graph)
    shapes: dict[int, ir.Value] = {}
    moved = 0
    for reader in list(graph):
        if reader.op_type not in ("Gather", "Slice") or reader.domain not in ("", "ai.onnx"):
            continue
        dims = _shape_dims(reader.inputs[0])
        position = _read_dim(reader)
        if dims is None or position is None or not -len(dims) <= position < len(dims):
            continue
        dim = dims[position]
        if isinstance(dim, int):  # a static dim read by a Slice (a Gather's is StaticDimFromShape's)
            if reader.op_type == "Slice" and not reader.outputs[0].is_graph_output():
                reader.outputs[0].replace_all_uses_with(ints(graph, [dim]))
                moved += 1
            continue
        if dim not in carriers:
            continue
        carrier, axis = carriers[dim]
        source = reader.inputs[0].producer()  # type: ignore[union-attr]
        if _is_whole_shape_of(source, carrier) and position == axis:
            continue  # already reads the carrier
        if id(carrier) not in shapes:
            shapes[id(carrier)] = _shape_of(graph, carrier)
        if reader.op_type == "Gather":
            index = reader.inputs[1]
            scalar = index is not None and index.shape is not None and len(index.shape) == 0
            reader.replace_input_with(1, ints(graph, axis) if scalar else ints(graph, [axis]))
        else:
            reader.replace_input_with(1, ints(graph, [axis]))
            reader.replace_input_with(2, ints(graph, [axis + 1]))
        reader.replace_input_with(0, shapes[id(carrier)])
        moved += 1
    return moved


def _is_whole_shape_of(node: ir.Node | None, value: ir.Value) -> bool:
    return (
        node is not None
        and node.op_type == "Shape"
        and node.inputs[0] is value
        and not node.attributes.get_int("start", 0)
        and node.attributes.get_int("end") is None
    )


def _shape_dims(value: ir.Value | None) -> list[int | str] | None:
    """The dims a shape tensor holds: ``Shape(X)`` (with start/end), or a Gather of one by constant indices."""
    node = value.producer() if value is not None else None
    if node is None or node.domain not in ("", "ai.onnx"):
        return None
    if node.op_type == "Shape":
        dims = dims_of(node.inputs[0])
        if dims is None:
            return None
        start = node.attributes.get_int("start", 0) or 0
        end = node.attributes.get_int("end", len(dims))
        return dims[start:end] if end is not None else dims[start:]
    if node.op_type == "Gather" and (node.attributes.get_int("axis", 0) or 0) == 0:
        inner, indices = _shape_dims(node.inputs[0]), const_ints(node.inputs[1])
        if inner is None or indices is None or node.inputs[1] is None or node.inputs[1].shape is None:
            return None
        if len(node.inputs[1].shape) != 1 or not all(-len(inner) <= i < len(inner) for i in indices):
            return None
        return [inner[i] for i in indices]
    return None


def count_ops(model: ir.Model, op_type: str) -> int:
    """How many nodes of ``op_type`` the main graph has."""
    return sum(1 for node in model.graph if node.op_type == op_type)


class _FoldRound(InPlacePass):
    """One round: constant folding, shape inference, :data:`RULES`, the decode-mask and first-carrier steps.

    Adds what fired to the shared ``counts``; modified when any rule fired.
    """

    def __init__(self, counts: dict[str, int]) -> None:
        super().__init__()
        self.counts = counts

    def call(self, model: ir.Model) -> PassResult:
        optimizer.fold_constants(model)
        # Constant nodes become initializers: one form of constant for the rules and
        # for the shape inference (which reads only ``value`` attributes).
        LiftConstantsToInitializersPass(lift_all_constants=True, size_limit=0)(model)
        annotate_symbolic_shapes(model)
        fired = apply_rules(model, RULES)
        fired["DecodeMaskFromAttentionMask"] = decode_mask_from_attention_mask(model)
        fired["ShapeFromFirstCarrier"] = share_dim_sources(model)
        if fired["ShapeFromFirstCarrier"]:
            DeduplicateInitializersPass()(model)
            CommonSubexpressionEliminationPass()(model)
        for name, n in fired.items():
            self.counts[name] = self.counts.get(name, 0) + n
        RemoveUnusedNodesPass()(model)
        IdentityEliminationPass()(model)  # what ReshapeIdentity left
        return PassResult(model, modified=any(fired.values()))


class FoldShapesPass(InPlacePass):
    """Fold shape computations into constant Reshape targets; ``counts`` per rule, plus Shape nodes removed.

    Rounds of :class:`_FoldRound` run under an ``onnx_ir`` ``PassManager`` with
    ``early_stop``: until a round fires nothing (at most ``_MAX_ROUNDS``).
    """

    def __init__(self) -> None:
        super().__init__()
        self.counts: dict[str, int] = {}

    def call(self, model: ir.Model) -> PassResult:
        """Fold until a round changes nothing, or for ``_MAX_ROUNDS`` rounds."""
        shapes_before = count_ops(model, "Shape")
        nodes_before = len(model.graph)
        counts: dict[str, int] = {"DecodeMaskFromAttentionMask": 0, "ShapeFromFirstCarrier": 0}
        PassManager([_FoldRound(counts)], steps=_MAX_ROUNDS, early_stop=True)(model)
        counts["shape_nodes_removed"] = shapes_before - count_ops(model, "Shape")
        self.counts = counts
        return PassResult(model, modified=len(model.graph) != nodes_before or any(counts.values()))


__all__ = ["FoldShapesPass", "count_ops"]
