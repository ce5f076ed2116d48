"""Attention over the in-place cache through kvexport's own CPU kernel (``kvexport.CacheAttention``).

ONNX Runtime 1.31's CPU ``GroupQueryAttention`` leaves speed on the table on both kinds of
call (2 Zen 5 cores, SmolLM2-135M's 9 query heads over 3 KV heads, one layer):

- a decode call reads the fp32 cache at about 22 GB/s where the cores stream 38 GB/s, and
  each query head of a group reads the group's keys again: sixteen rows at 600 positions
  took 0.78 ms; the kernel, reading each key and value once for the group, 0.40 ms;
- a prompt's scores are computed for every key, the queries' future included, then
  masked: a 256-token piece after 256 took 1.2-1.4 ms, four fresh 256-token prompts 2.6-3.1
  ms; the kernel runs queries in blocks of 16 over the keys up to the block's last only, its
  scores and weighted sums as AVX-512 register tiles over keys transposed once a call,
  in 0.81-0.87 and 1.4-1.6 ms.

The kernel (``kvexport/runtime/kernels/cache_attention.cc``) means what the op means for
these graphs: a row's new tokens go after its ``seqlens_k + 1 - S`` cached ones (at 0 for a
first prompt, whose rows may be right padded), each query attends to the positions up to
its own (and to the row's last), within ``local_window_size`` where that is set, with the
padding bias added. Its outputs are within 1e-6 of the op's and it writes the same cache.
It also takes several rows after pasts of any lengths, which the op refuses; the engine
does not send those (sharing such calls gained nothing: 0.97-1.00x).

:class:`CacheAttentionPass` replaces each fp32 ``GroupQueryAttention`` over an in-place
cache (a ``past.*`` or ``decode.past.*`` value whose ``present`` has its shape) without
rotary, softcap, smooth softmax, cos/sin caches, position ids, head sink, quantized cache
or scores output, with no window or one of a position or more, by the kernel, with the same inputs (less ``total_sequence_length``) and
outputs. The runtime applies it when it opens a graph on CPU and the kernel library is
built, before :class:`~kvexport.passes.PromptAttentionPass`, which then takes what is left
(an 8-bit cache); the library is registered with the session there
(:func:`kvexport.runtime.session.cpu_graph`). ``counts["nodes"]`` says how many nodes were
replaced.
"""

from __future__ import annotations

import onnx_ir as ir
from onnx_ir.passes import InPlacePass, PassResult

from .values import stand_in
from .vocabulary import CACHE_ATTENTION, GROUP_QUERY_ATTENTION, KVEXPORT_DOMAIN, MS_DOMAIN

_CACHE_PREFIXES = ("past.", "decode.past.")
# attributes whose presence (with these values) the kernel keeps the node's meaning under
_NEUTRAL = {"do_rotary": 0, "softcap": 0.0, "smooth_softmax": 0, "rotary_interleaved": 0}


class CacheAttentionPass(InPlacePass):
    """Each fp32 in-place ``GroupQueryAttention`` as kvexport's ``CacheAttention`` kernel."""

    def __init__(self) -> None:
        super().__init__()
        self.counts: dict[str, int] = {"nodes": 0}

    def call(self, model: ir.Model) -> PassResult:
        """Replace every node the kernel can take, in the graph and its subgraphs (see the module docstring)."""
        self.counts["nodes"] = 0
        presents = {value.name: value for value in model.graph.outputs if value.name}
        for node in list(ir.traversal.RecursiveGraphIterator(model.graph)):
            graph = node.graph
            if graph is not None and _replaceable(node, presents):
                _replace(graph, node, self.counts["nodes"])
                self.counts["nodes"] += 1
        if self.counts["nodes"]:
            model.opset_imports.setdefault(KVEXPORT_DOMAIN, 1)
        return PassResult(model, modified=self.counts["nodes"] > 0)


def _replaceable(node: ir.Node, presents: dict[str, ir.Value]) -> bool:
    if node.domain != MS_DOMAIN or node.op_type != GROUP_QUERY_ATTENTION or len(node.outputs) != 3:
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
    window = node.attributes.get("local_window_size")
    if window is not None and window.value != -1 and window.value < 1:
        return False  # a window of no positions (the kernel reads 0 as none)
    if any(v.dtype != ir.DataType.FLOAT for v in (past_key, past_value)):
        return False
    # the op's T is one type: an input of no known type (a derived graph's, the mixed step's) is the cache's
    if any(v is not None and v.dtype not in (None, ir.DataType.FLOAT) for v in (query, key, value, inputs[10])):
        return False
    for past in (past_key, past_value):
        name = past.name or ""
        if not name.startswith(_CACHE_PREFIXES):
            return False
        present = presents.get(name.replace("past.", "present.", 1))
        if present is None or past.shape is None or present.shape is None or list(past.shape) != list(present.shape):
            return False  # not in place: the cache grows by the call (the kernel writes into a buffer of the past's length)
    return True


def _replace(graph: ir.Graph, node: ir.Node, number: int) -> None:
    """The kernel in the node's place: the same inputs less ``total_sequence_length``, the same outputs."""
    inputs = list(node.inputs) + [None] * max(0, 11 - len(node.inputs))
    attributes = {name: attr.value for name, attr in node.attributes.items()}
    kernel = ir.node(
        CACHE_ATTENTION,
        [*inputs[:6], inputs[10]] if inputs[10] is not None else list(inputs[:6]),
        attributes={
            "num_heads": int(attributes["num_heads"]),
            "kv_num_heads": int(attributes["kv_num_heads"]),
            "scale": float(attributes.get("scale", 0.0) or 0.0),  # 0: the kernel's 1/sqrt(D), as the op's
            "local_window_size": int(attributes.get("local_window_size", -1)),
        },
        domain=KVEXPORT_DOMAIN,
        num_outputs=3,
        name=node.name,
    )
    graph.insert_before(node, kernel)
    for index, (old, new) in enumerate(zip(node.outputs, kernel.outputs, strict=True)):
        stand_in(graph, old, new, f"kvexport.cache_attention{number}_{index}")  # a present keeps its name and place
    graph.remove(node, safe=True)
