"""A prompt's attention as matrix products over the in-place cache, for ONNX Runtime's CPU.

An in-place graph's ``GroupQueryAttention`` writes a call's keys and values into the bound
cache and attends over it. On CPU, ONNX Runtime 1.31 runs several prompts' attention there
slowly: sixteen 128-token GPT-2 prompts took 10 ms a layer on 2 AVX-512 cores, where
``MatMul``, ``Softmax`` and ``MatMul`` over the same tensors took 2.8 ms. At batch 1 its
flash path is as fast as the products or faster, and so it is over more than 256 keys
(sixteen 512-token prompts took 1.17x its time as products). :class:`PromptAttentionPass`
turns each such node into ``If(S > 1 and B > 1 and every row's tokens end at the mask's
width and the width is at most 256)``:

- then, the products: the new keys and values as ``[B, Nkv, S, D]`` (``Reshape``,
  ``Transpose``), written into the cache by ``ScatterND`` at each row's positions. The cache
  is the graph's input and output bound to one buffer, as the node's were; ONNX Runtime's
  ``ScatterND`` copies its data to its output only when the two are different buffers, so
  it writes just the new rows (0.3-0.8 ms for sixteen 128-token rows of 12 heads, whatever
  the buffer's length), and ``If`` hands its output's buffer to the branch. Attention reads
  the cache's positions before the new rows from the past (the scatter writes none of
  them) and the new rows themselves: the scores ``Q K^T * scale`` (``FusedMatMul``, the
  query heads of a KV group as rows ``[B, Nkv, S * G, D]``, token by token), one bias that
  is ``lowest`` where a key is in a query's future and the node's padding bias elsewhere
  (built once for all layers), every score raised to at least its row's largest less 80
  (see :func:`_rewrite`), ``Softmax``, and the product with the values, transposed to
  ``[B, S, Nkv, G * D]`` straight into the ``If``'s output (a ``Reshape`` after the ``If``
  makes either branch's ``[B, S, N * D]``: one last in the branch made ONNX Runtime copy
  its result into that output, and the GPT-2 call of eight 128-token prompts took
  1.04-1.06x the time). A call of 256 tokens a row or more runs its queries in two blocks,
  the first half over the keys up to its last query only, so the products skip a quarter
  of the scores, all in the queries' future: four 256-token prompts in one call took 0.91x
  the time of one block for SmolLM2-135M and 0.92x for GPT-2, a 256-token piece after 256
  with an 8-bit cache 0.92x (2 cores, AVX-512 VNNI; four blocks gained no more, and at 128
  tokens a row or fewer blocks gained nothing, so those calls keep one);
- else, the node as it was: decode calls (one token a row), one row, rows whose tokens do
  not all end at the mask's width (pieces after pasts of different lengths), and calls over
  more than 256 keys.

A row's new tokens go where the node puts them: after its ``seqlens_k + 1 - S`` cached
tokens, or at 0 for a first prompt (whose rows may be right padded). An 8-bit cache
(``--kv-cache int8``) is written as the op writes it, ``clamp(rint(x * (1 / scale)), -128,
127)``, and attention reads every key and value back as ``code * scale``, as the op does
(:func:`_cache_scales`); its products run for every call of several tokens a row, one row
and over more than 256 keys too: the op's 8-bit path took 1.6-1.9x its float path's time
for a prompt (GPT-2, a 256-token piece after 256: 143 ms through the op, 76 as products, 78
for the float cache's op). Nodes with rotary inside, a local window, a softcap, cos/sin
caches, an fp16 or a 4-bit cache are left alone, as are graphs whose ``input_ids`` are one
token a row and nodes whose cache is not a ``past.*`` input.

With an 8-bit cache, a call of several tokens a row runs as the products whenever all its
rows end at the mask's width. So several rows after a past of one length (a burst's second
pieces) may share a call, which the op refuses. Rows after pasts of different lengths still
reach the op, which refuses them as well, so the engine sends only equal ones. Four 256-token
second pieces after 256 took 0.80-0.91x the time of four calls (SmolLM2-135M, 2 Zen 5 cores,
as the engine runs them). The pass then sets the model's metadata
``kvexport.rows_after_past`` (:data:`ROWS_AFTER_PAST`) for the runtime. Not with a float
cache: there such a call needs the products over more than 256 keys, and four of them took
0.98x the time of four calls of the op, so a row after a past keeps the op.

The runtime applies it when it opens an in-place graph on CPU
(:func:`kvexport.runtime.session.cpu_graph`), so exports keep ``GroupQueryAttention``, which
CUDA and other runtimes want. Where kvexport's own kernel is built,
:class:`~kvexport.passes.CacheAttentionPass` runs first and takes every fp32 node, so this
pass rewrites what is left (an 8-bit cache's). ``counts["nodes"]`` says how many were rewritten.
"""

from __future__ import annotations

import itertools

import numpy as np
import onnx_ir as ir
from onnx_ir.passes import InPlacePass, PassResult

from .values import initializer, ints, stand_in
from .vocabulary import GROUP_QUERY_ATTENTION, MS_DOMAIN, ROWS_AFTER_PAST

_PAST_PREFIX = "past."
# fp32 only: in fp16 a padding bias of fp16's lowest plus a negative score overflows to -inf, and a padded
# row of -inf would give NaN; CPU sessions of fp16 graphs keep the op
_FLOATS = (ir.DataType.FLOAT,)
_LONGEST = 256  # the most keys (the mask's width) a call's products attend over; longer calls keep the op
_RANGE = 80.0  # how far below its row's largest score a score is kept (see _rewrite)
_BLOCKS = 2  # blocks of queries, each over the keys up to its last query (see the module docstring)
_BLOCK_TOKENS = 128  # the fewest queries a row of a block has: calls of fewer tokens a row run as one block
# attributes whose presence (with these values) the rewrite keeps the node's meaning under
_NEUTRAL = {"do_rotary": 0, "local_window_size": -1, "softcap": 0.0, "smooth_softmax": 0, "rotary_interleaved": 0}


class PromptAttentionPass(InPlacePass):
    """Each prompt ``GroupQueryAttention`` over an in-place ``past.*`` cache as ``ScatterND`` and matrix products."""

    def __init__(self) -> None:
        super().__init__()
        self.counts: dict[str, int] = {"nodes": 0}

    def call(self, model: ir.Model) -> PassResult:
        """Rewrite every prompt GroupQueryAttention this pass can (see the module docstring)."""
        graph = model.graph
        self.counts["nodes"] = 0
        if _one_token(graph):
            return PassResult(model, modified=False)
        shared: dict[tuple[int, int | None, int, int, bool], _Shared] = {}
        nodes = [n for n in graph if _rewritable(graph, n)]
        every_call = bool(nodes) and all(_cache_scales(n) is not None for n in nodes)  # before the rewrite moves them
        for node in nodes:
            _rewrite(graph, node, shared, self.counts["nodes"])
            self.counts["nodes"] += 1
        # the top level only: kvexport's graphs keep their attention there (a node in a subgraph would go unseen)
        if every_call and not any(n.op_type == GROUP_QUERY_ATTENTION for n in graph):
            model.metadata_props[ROWS_AFTER_PAST] = "products"
        return PassResult(model, modified=self.counts["nodes"] > 0)


def _one_token(graph: ir.Graph) -> bool:
    """A decode graph: its ``input_ids`` are one token a row."""
    for value in graph.inputs:
        if value.name == "input_ids" and value.shape is not None and len(value.shape) == 2:
            return value.shape[1] == 1
    return False


def _inputs(node: ir.Node) -> list[ir.Value | None]:
    """The node's inputs padded with None to GroupQueryAttention's 14 (more are left as they are)."""
    return list(node.inputs) + [None] * max(0, 14 - len(node.inputs))


def _rewritable(graph: ir.Graph, node: ir.Node) -> bool:
    if node.domain != MS_DOMAIN or node.op_type != GROUP_QUERY_ATTENTION:
        return False
    inputs = _inputs(node)
    query, key, value, past_key, past_value = inputs[:5]
    if key is None or value is None or past_key is None or past_value is None:
        return False  # packed QKV, or no cache
    if any(v is not None for v in (*inputs[7:10], inputs[11])) or len(node.inputs) > 14:
        return False  # cos/sin caches, position ids, head sinks
    for name, neutral in _NEUTRAL.items():
        attribute = node.attributes.get(name)
        if attribute is not None and attribute.value != neutral:
            return False
    if len(node.outputs) != 3:
        return False  # the attention probabilities asked for too (output_qk), or no presents
    pasts_are_inputs = all(v in graph.inputs and (v.name or "").startswith(_PAST_PREFIX) for v in (past_key, past_value))
    presents_are_outputs = all(out in graph.outputs for out in node.outputs[1:3])
    if not (pasts_are_inputs and presents_are_outputs):
        return False
    quantized = past_key.dtype not in _FLOATS or any(v is not None for v in inputs[12:14])
    if query is None or (quantized and _cache_scales(node) is None):
        return False  # an fp16 cache, or a quantized one the products don't write (4 bits)
    if query.shape is not None and len(query.shape) == 3 and query.shape[1] == 1:
        return False
    if past_key.shape is None or len(past_key.shape) != 4 or not isinstance(past_key.shape[3], int):
        return False
    present = node.outputs[1].shape  # in place: the present is the past's buffer, one length
    return present is None or len(present) != 4 or present[2] == past_key.shape[2]


def _cache_scales(node: ir.Node) -> tuple[ir.Value, ir.Value] | None:
    """An 8-bit cache's ``k_scale`` and ``v_scale`` (inputs 12 and 13), where the products can write it; else None.

    ONNX Runtime 1.31's kernel writes a new row as ``clamp(rint(x * (1 / scale)), -128, 127)``
    and attends over every key and value read back as ``q * scale``, the new rows' too
    (checked against its output and cache: equal codes, outputs within 4e-7).
    """
    inputs = _inputs(node)
    query, past, k_scale, v_scale = inputs[0], inputs[3], inputs[12], inputs[13]
    bits = node.attributes.get("kv_cache_bit_width")
    types = {node.attributes.get_string(name, "NONE") for name in ("k_quant_type", "v_quant_type")}
    if query is None or past is None or past.dtype != ir.DataType.INT8 or k_scale is None or v_scale is None:
        return None
    if bits is None or bits.value != 8 or not types <= {"PER_TENSOR", "PER_CHANNEL"}:
        return None
    if any(value.dtype != ir.DataType.FLOAT for value in (query, k_scale, v_scale)):
        return None  # fp32 queries and scales only (kvexport's exporter refuses an fp16 graph with an int8 cache)
    return k_scale, v_scale


class _Shared:
    """What every layer's rewrite reads: whether the call is a prompt, the scatter's indices, the bias."""

    def __init__(self, graph: ir.Graph, node: ir.Node, kv_heads: int, group: int, dtype: ir.DataType, number: int, quantized: bool) -> None:
        query, seqlens, total_int32 = node.inputs[0], node.inputs[5], node.inputs[6]
        bias = _inputs(node)[10]
        assert query is not None and seqlens is not None and total_int32 is not None
        self.nodes: list[ir.Node] = []
        self.prefix = f"kvexport.prompt{number}_"
        zero, one, scalar = ints(graph, 0), ints(graph, 1), ints(graph, [])
        batch = self._op("Shape", [query], start=0, end=1)  # [1]
        tokens = self._op("Shape", [query], start=1, end=2)  # [1]
        self.total = self._op("Reshape", [self._op("Cast", [total_int32], to=ir.DataType.INT64), ints(graph, [1])])  # [1]
        batch_n, tokens_n, total_n = (self._op("Reshape", [dim, scalar]) for dim in (batch, tokens, self.total))  # scalars
        # row b's new tokens go to positions start_b .. start_b + S - 1: its length (seqlens_k + 1) less S, as
        # GroupQueryAttention's past length; 0 for a first prompt, whose rows may be right padded
        lengths = self._op("Add", [self._op("Cast", [seqlens], to=ir.DataType.INT64), one])  # [B]
        starts = self._op("Max", [self._op("Sub", [lengths, tokens]), zero])
        self.start = self._op("Slice", [starts, ints(graph, [0]), ints(graph, [1])])  # [1]: row 0's
        # the products run when S > 1 and every row's tokens end at the mask's width (so all start at start_0)
        reach = self._op("Add", [starts, tokens])
        ends_at_total = self._op(
            "And",
            [
                self._op("Equal", [self._op("ReduceMin", [reach], keepdims=0), total_n]),
                self._op("Equal", [self._op("ReduceMax", [reach], keepdims=0), total_n]),
            ],
        )
        prompt = self._op("And", [self._op("Greater", [tokens_n, one]), ends_at_total])
        if quantized:  # any rows and keys: the op's 8-bit cache path took 1.6-1.9x the float one's time for a prompt
            self.prompt = prompt
        else:
            # and B > 1: at batch 1, ONNX Runtime 1.31's GroupQueryAttention (its flash path) was as fast or faster;
            # and at most LONGEST keys: over longer ones the flash path was the faster (16 x 512 1.17x, 8 x 384 1.30x)
            several = self._op("Greater", [batch_n, one])
            short = self._op("LessOrEqual", [total_n, ints(graph, _LONGEST)])
            self.prompt = self._op("And", [self._op("And", [prompt, several]), short])
        steps = self._op("Range", [zero, tokens_n, one])  # [S]
        positions = self._op("Add", [self._op("Unsqueeze", [starts, one]), self._op("Unsqueeze", [steps, zero])])  # [B, S]
        column = self._op("Unsqueeze", [positions, ints(graph, [1, 3])])  # [B, 1, S, 1]
        # the scatter's indices [B, Nkv, S, 3]: (row, head, position)
        shape = self._op("Concat", [batch, ints(graph, [kv_heads]), tokens, ints(graph, [1])], axis=0)
        rows = self._op("Range", [zero, batch_n, one])
        heads = initializer(graph, f"kvexport.prompt_heads_{kv_heads}", np.arange(kv_heads, dtype=np.int64).reshape(1, kv_heads, 1, 1))
        parts = [
            self._op("Expand", [self._op("Reshape", [rows, ints(graph, [-1, 1, 1, 1])]), shape]),
            self._op("Expand", [heads, shape]),
            self._op("Expand", [column, shape]),
        ]
        self.indices = self._op("Concat", parts, axis=-1)
        # the bias [B, 1, S, total]: lowest where a key is in a query's future, else the node's padding bias (or 0)
        keys = self._op("Range", [zero, total_n, one])  # [total]
        future = self._op("Greater", [keys, column])  # [B, 1, S, total]
        lowest = initializer(graph, f"kvexport.prompt_lowest_{dtype.name.lower()}", np.array(np.finfo(dtype.numpy()).min, dtype.numpy()))
        allowed = bias if bias is not None else initializer(graph, f"kvexport.prompt_zero_{dtype.name.lower()}", np.array(0, dtype.numpy()))
        bias_of_rows = self._op("Where", [future, lowest, allowed])
        # _BLOCKS blocks of queries, each over the keys up to its last query's position: rows [first, end) of the
        # queries as the products stack them (token s, head g of the group: row s * G + g), keys [0, keys_end),
        # and the bias of those rows and keys (each token's row once for each head of a group)
        self.blocks: list[tuple[ir.Value, ir.Value, ir.Value, ir.Value]] = []
        # (a call of fewer than _BLOCKS * _BLOCK_TOKENS tokens a row: every block but the last empty, one block in effect)
        split = self._op("Cast", [self._op("GreaterOrEqual", [tokens, ints(graph, [_BLOCKS * _BLOCK_TOKENS])])], to=ir.DataType.INT64)
        edges = [ints(graph, [0])]
        for index in range(1, _BLOCKS):
            edges.append(self._op("Mul", [self._op("Div", [self._op("Mul", [tokens, ints(graph, [index])]), ints(graph, [_BLOCKS])]), split]))
        edges.append(tokens)
        for start_token, end_token in itertools.pairwise(edges):
            # at least one key: an empty block's bias is reshaped, and -1 over no keys and no rows is no length
            keys_end = self._op("Max", [self._op("Add", [self.start, end_token]), ints(graph, [1])])
            block = self._op("Slice", [bias_of_rows, self._op("Concat", [start_token, ints(graph, [0])], axis=0), self._op("Concat", [end_token, keys_end], axis=0), ints(graph, [2, 3])])
            if group > 1:  # [B, 1, S_b, 1, K_b] tiled to [B, 1, S_b, G, K_b], then [B, 1, S_b * G, K_b]
                tiled = self._op("Tile", [self._op("Unsqueeze", [block, ints(graph, [3])]), ints(graph, [1, 1, 1, group, 1])])
                block = self._op("Reshape", [tiled, self._op("Concat", [ints(graph, [0, 1, -1]), keys_end], axis=0)])
            first, end = (self._op("Mul", [edge, ints(graph, [group])]) for edge in (start_token, end_token))
            self.blocks.append((first, end, keys_end, block))

    def _op(self, op_type: str, inputs: list[ir.Value], **attributes: int) -> ir.Value:
        node = ir.node(op_type, inputs, attributes=attributes)
        node.outputs[0].name = f"{self.prefix}{len(self.nodes)}"  # named: a subgraph's values may not reuse a name
        self.nodes.append(node)
        return node.outputs[0]


def _one(graph: ir.Graph) -> ir.Value:
    return initializer(graph, "kvexport.prompt_one_float", np.array(1, np.float32))


def _int8_zero(graph: ir.Graph) -> ir.Value:
    return initializer(graph, "kvexport.prompt_zero_int8", np.array(0, np.int8))


def _rewrite(graph: ir.Graph, node: ir.Node, shared: dict[tuple[int, int | None, int, int, bool], _Shared], layer: int) -> None:
    """``If(_Shared.prompt)``: the products (then), or the node as it was (else: see the module docstring)."""
    query, key, value, past_key, past_value = node.inputs[:5]
    assert query is not None and key is not None and value is not None and past_key is not None and past_value is not None
    assert past_key.shape is not None
    heads = int(node.attributes["num_heads"].value)
    kv_heads = int(node.attributes["kv_num_heads"].value)
    size = past_key.shape[3]
    assert isinstance(size, int)  # _rewritable
    group = heads // kv_heads
    scale_attribute = node.attributes.get("scale")
    scale = float(scale_attribute.value) if scale_attribute is not None and scale_attribute.value else 1 / np.sqrt(size)
    scales = _cache_scales(node)
    dtype = (query.dtype if scales is not None else past_key.dtype) or ir.DataType.FLOAT
    bias = _inputs(node)[10]
    key_of = (id(node.inputs[6]), id(bias) if bias is not None else None, kv_heads, group, scales is not None)
    before: list[ir.Node] = []
    common = shared.get(key_of)
    if common is None:
        common = shared[key_of] = _Shared(graph, node, kv_heads, group, dtype, len(shared), scales is not None)
        before += common.nodes
    nodes: list[ir.Node] = []
    prefix = f"{common.prefix}layer{layer}_"

    def op(op_type: str, inputs: list[ir.Value], domain: str = "", **attributes: int | float | list[int]) -> ir.Value:
        made = ir.node(op_type, inputs, attributes=attributes, domain=domain)
        made.outputs[0].name = f"{prefix}{len(nodes)}"
        nodes.append(made)
        return made.outputs[0]

    def heads_first(projection: ir.Value, count: int, width: int = size) -> ir.Value:  # [B, S, count * W] -> [B, count, S, W]
        return op("Transpose", [op("Reshape", [projection, ints(graph, [0, 0, count, width])])], perm=[0, 2, 1, 3])

    first, axis = ints(graph, [0]), ints(graph, [2])
    written, cached = [], []
    for index, (projection, past) in enumerate(((key, past_key), (value, past_value))):
        rows = heads_first(projection, kv_heads)
        cache_scale = scales[index] if scales is not None else None
        if cache_scale is not None:  # int8 codes, as the op writes them; attention reads the cache's values back
            if node.attributes.get_string("v_quant_type" if index else "k_quant_type", "NONE") == "PER_CHANNEL":
                cache_scale = op("Reshape", [cache_scale, ints(graph, [1, kv_heads, 1, size])])  # [H * D] or [H, D] too
            inverse = op("Reciprocal", [cache_scale])
            rows = op("QuantizeLinear", [op("Mul", [rows, inverse]), _one(graph), _int8_zero(graph)])
        written.append(op("ScatterND", [past, common.indices, rows]))
        # the cache's first start_0 positions and the new rows: read from the past, whose positions before
        # start_0 the scatter does not write, so the scatter's output (the bound buffer) has no other reader
        keys = op("Concat", [op("Slice", [past, first, common.start, axis]), rows], axis=2)
        cached.append(keys if cache_scale is None else op("Mul", [op("Cast", [keys], to=dtype), cache_scale]))
    # [B, Nkv, S * G, D]: row s * G + g is token s of query head kv * G + g, so a block of tokens is a block of rows
    queries = op("Reshape", [heads_first(query, kv_heads, group * size), ints(graph, [0, kv_heads, -1, size])])
    range_value = initializer(graph, f"kvexport.prompt_range_{dtype.name.lower()}", np.array(_RANGE, dtype.numpy()))
    blocks = []
    for index, (first_row, end_row, keys_end, bias_of_block) in enumerate(common.blocks):
        rows = op("Slice", [queries, first_row, end_row, axis])
        last = index == len(common.blocks) - 1  # over every key: the keys and values as they are
        keys, values = (c if last else op("Slice", [c, first, keys_end, axis]) for c in cached)
        scores = op("FusedMatMul", [rows, keys], domain=MS_DOMAIN, alpha=scale, transB=1)  # [B, Nkv, S_b * G, K_b]
        biased = op("Add", [scores, bias_of_block])
        # no score more than 80 below its row's largest: exp(-80) is 1.8e-35 of the largest weight, nothing in fp32, and
        # it keeps Softmax's exponentials normal; from -87 down they are denormal, and ONNX Runtime's Softmax ran 7-14x slower
        floor = op("Sub", [op("ReduceMax", [biased, ints(graph, [-1])], keepdims=1), range_value])
        weights = op("Softmax", [op("Max", [biased, floor])], axis=-1)
        blocks.append(op("MatMul", [weights, values]))  # [B, Nkv, S_b * G, D]
    mixed = op("Concat", blocks, axis=2) if len(blocks) > 1 else blocks[0]
    # [B, S, Nkv, G * D], the Transpose writing the If's output: a last Reshape to [B, S, N * D] in the branch made ONNX
    # Runtime copy the result into that output (Reshape's output is its input's buffer); it follows the If instead
    result = op("Transpose", [op("Reshape", [mixed, ints(graph, [0, kv_heads, -1, group * size])])], perm=[0, 2, 1, 3])
    products = ir.Graph([], [result, *written], nodes=nodes, name=f"{node.name or 'attention'}_prompt")

    twin = ir.node(
        node.op_type, list(node.inputs), attributes={name: attr.value for name, attr in node.attributes.items()}, domain=node.domain, num_outputs=3
    )
    for index, output in enumerate(twin.outputs):
        output.name = f"{prefix}gqa{index}"
    original = ir.Graph([], list(twin.outputs), nodes=[twin], name=f"{node.name or 'attention'}_decode")
    branch = ir.node("If", [common.prompt], attributes={"then_branch": products, "else_branch": original}, num_outputs=3, name=node.name)
    flat = ir.node("Reshape", [branch.outputs[0], ints(graph, [0, 0, heads * size])])  # [B, S, N * D] either way
    graph.insert_before(node, [*before, branch, flat])
    branch.outputs[0].type, branch.outputs[0].name = node.outputs[0].type, f"{prefix}heads"  # its rank differs by branch
    outputs = [flat.outputs[0], *branch.outputs[1:]]
    for index, (old, new) in enumerate(zip(node.outputs[:3], outputs, strict=True)):
        stand_in(graph, old, new, f"{prefix}out{index}")  # a present: the branch's output takes its name and place
    graph.remove(node, safe=True)
