"""A decode call's attention through kvexport's own CPU kernel (``kvexport.DecodeAttention``).

ONNX Runtime 1.31's CPU ``GroupQueryAttention`` reads a decode call's fp32 cache at about
22 GB/s on 2 Zen 5 cores (sixteen rows of SmolLM2-135M at 600 positions, 0.78 ms a layer),
where the cores stream 38 GB/s, and each query head of a group reads the group's keys
again. kvexport's kernel (``kvexport/runtime/kernels/decode_attention.cc``) reads each key
and value once for the group and runs the same call in 0.40 ms (1.5-2x faster from one to
sixteen rows, 128 to 600 positions; outputs within 2e-7 of the op's).

:class:`DecodeAttentionPass` turns each such node into ``If(the call has one token a row)``:
then the kernel, else the node as it was (prompt pieces, whatever their rows). Nodes inside
subgraphs are rewritten too: after :class:`~kvexport.passes.PromptAttentionPass` the op sits
in the else branch of its ``If``. A node qualifies where its queries and cache are fp32, the
cache is in place (a ``past.*`` or ``decode.past.*`` value whose ``present`` has its shape),
and it has no rotary, softcap, smooth softmax, cos/sin caches, position ids, head sink or
scores output; a local window is kept (the kernel attends to the last ``local_window_size``
positions, the query's own included, as the op does).

The runtime applies it when it opens a graph on CPU and the kernel library is built
(:func:`kvexport.runtime.session.cpu_graph`); the library is registered with the session
there. ``counts["nodes"]`` says how many nodes were rewritten.
"""

from __future__ import annotations

import onnx_ir as ir
from onnx_ir.passes import InPlacePass, PassResult

from .values import ints

_MS = "com.microsoft"
DOMAIN = "kvexport"  # the custom op's domain (kvexport.runtime.kernels registers it)
OP_TYPE = "DecodeAttention"
_CACHE_PREFIXES = ("past.", "decode.past.")
# the model's metadata key the pass sets: a graph it rewrote is not rewritten again (its else branches keep the op)
REWRITTEN = "kvexport.decode_attention"
# attributes whose presence (with these values) the kernel keeps the node's meaning under
_NEUTRAL = {"do_rotary": 0, "softcap": 0.0, "smooth_softmax": 0, "rotary_interleaved": 0}


class DecodeAttentionPass(InPlacePass):
    """Each fp32 in-place ``GroupQueryAttention`` as ``If(one token a row)``: kvexport's kernel, else the node."""

    def __init__(self) -> None:
        super().__init__()
        self.counts: dict[str, int] = {"nodes": 0}

    def call(self, model: ir.Model) -> PassResult:
        """Rewrite every node this pass can, in the graph and its subgraphs (see the module docstring)."""
        self.counts["nodes"] = 0
        if REWRITTEN in model.metadata_props:
            return PassResult(model, modified=False)
        presents = {value.name: value for value in model.graph.outputs if value.name}
        for node in list(ir.traversal.RecursiveGraphIterator(model.graph)):
            graph = node.graph
            if graph is not None and _rewritable(node, presents):
                _rewrite(model.graph, graph, node, self.counts["nodes"])
                self.counts["nodes"] += 1
        if self.counts["nodes"]:
            model.metadata_props[REWRITTEN] = OP_TYPE
            model.opset_imports.setdefault(DOMAIN, 1)
        return PassResult(model, modified=self.counts["nodes"] > 0)


def _rewritable(node: ir.Node, presents: dict[str, ir.Value]) -> bool:
    if node.domain != _MS or node.op_type != "GroupQueryAttention" or len(node.outputs) != 3:
        return False
    inputs = list(node.inputs) + [None] * max(0, 14 - len(node.inputs))
    query, key, value, past_key, past_value, seqlens = inputs[:6]
    if key is None or value is None or past_key is None or past_value is None or query is None or seqlens is None:
        return False  # packed QKV, or no cache
    if any(v is not None for v in (*inputs[7:10], *inputs[11:])):
        return False  # cos/sin caches, position ids, head sinks, a quantized cache's scales
    for name, neutral in _NEUTRAL.items():
        attribute = node.attributes.get(name)
        if attribute is not None and attribute.value != neutral:
            return False
    if any(v.dtype != ir.DataType.FLOAT for v in (query, key, value, past_key, past_value)):
        return False
    bias = inputs[10]
    if bias is not None and bias.dtype != ir.DataType.FLOAT:
        return False
    for past in (past_key, past_value):
        name = past.name or ""
        prefix = next((p for p in _CACHE_PREFIXES if name.startswith(p)), None)
        if prefix is None:
            return False
        present = presents.get(name.replace("past.", "present.", 1))
        if present is None or past.shape is None or present.shape is None or list(past.shape) != list(present.shape):
            return False  # not in place: the cache grows by the call (the kernel writes into a buffer of the past's length)
    return True


def _rewrite(top: ir.Graph, graph: ir.Graph, node: ir.Node, number: int) -> None:
    """``If(Shape(query)[1] == 1)``: the kernel (then), or the node as it was (else)."""
    prefix = f"kvexport.decode{number}_"
    inputs = list(node.inputs) + [None] * max(0, 11 - len(node.inputs))
    query = inputs[0]
    assert query is not None
    attributes = {name: attr.value for name, attr in node.attributes.items()}
    scale = float(attributes.get("scale", 0.0) or 0.0)
    kernel = ir.node(
        OP_TYPE,
        [*inputs[:6], inputs[10]] if inputs[10] is not None else list(inputs[:6]),
        attributes={
            "num_heads": int(attributes["num_heads"]),
            "kv_num_heads": int(attributes["kv_num_heads"]),
            "scale": scale,
            "local_window_size": int(attributes.get("local_window_size", -1)),
        },
        domain=DOMAIN,
        num_outputs=3,
    )
    twin = ir.node(node.op_type, list(node.inputs), attributes=attributes, domain=node.domain, num_outputs=3)
    for index, (mine, theirs) in enumerate(zip(kernel.outputs, twin.outputs, strict=True)):
        mine.name, theirs.name = f"{prefix}kernel{index}", f"{prefix}gqa{index}"
    then_branch = ir.Graph([], list(kernel.outputs), nodes=[kernel], name=f"{node.name or 'attention'}_kernel")
    else_branch = ir.Graph([], list(twin.outputs), nodes=[twin], name=f"{node.name or 'attention'}_op")
    tokens = ir.node("Shape", [query], attributes={"start": 1, "end": 2})
    one_token = ir.node("Equal", [tokens.outputs[0], ints(top, [1])])
    branch = ir.node("If", [one_token.outputs[0]], attributes={"then_branch": then_branch, "else_branch": else_branch}, num_outputs=3, name=node.name)
    tokens.outputs[0].name, one_token.outputs[0].name = f"{prefix}tokens", f"{prefix}one_token"
    graph.insert_before(node, [tokens, one_token, branch])
    for index, (old, new) in enumerate(zip(node.outputs, branch.outputs, strict=True)):
        new.shape, new.type, new.name = old.shape, old.type, f"{prefix}out{index}"
        if old in graph.outputs:  # a present (or a branch's output): the If's output takes its name and place
            position, name = list(graph.outputs).index(old), old.name
            old.name = f"{name}.replaced"
            graph.outputs[position], new.name = new, name
        else:
            old.replace_all_uses_with(new)
    graph.remove(node, safe=True)
