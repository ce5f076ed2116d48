"""The paged KV cache: kvexport's attention kernel over a block table, the block manager, the engine over a pool.

The kernel's paged layout is checked against its own row layout (itself checked against ONNX
Runtime's GroupQueryAttention in tests/passes/test_cache_attention.py) on the same keys and
values scattered over a shuffled pool: decode rows of different lengths, prompt pieces after a
past, fresh prompts, a window; outputs equal and the new rows written where the table says.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper

from kvexport.runtime import kernels


@pytest.fixture(scope="module")
def library() -> Path:
    """The built kernel library (built here where the set-up did not)."""
    return kernels.library_path() or kernels.build()


def _session(library: Path, *, paged: bool, heads: int, kv_heads: int, size: int, window: int) -> ort.InferenceSession:
    float_ = TensorProto.FLOAT
    names = ["q", "k", "v", "past_key", "past_value", "seqlens", "", *(["block_table"] if paged else [])]
    inputs = [
        helper.make_tensor_value_info("q", float_, ["B", "S", heads * size]),
        helper.make_tensor_value_info("k", float_, ["B", "S", kv_heads * size]),
        helper.make_tensor_value_info("v", float_, ["B", "S", kv_heads * size]),
        helper.make_tensor_value_info("past_key", float_, ["P", kv_heads, "C", size]),
        helper.make_tensor_value_info("past_value", float_, ["P", kv_heads, "C", size]),
        helper.make_tensor_value_info("seqlens", TensorProto.INT32, ["B"]),
        *([helper.make_tensor_value_info("block_table", TensorProto.INT32, ["B", "W"])] if paged else []),
    ]
    outputs = [
        helper.make_tensor_value_info("out", float_, ["B", "S", heads * size]),
        helper.make_tensor_value_info("present_key", float_, ["P", kv_heads, "C", size]),
        helper.make_tensor_value_info("present_value", float_, ["P", kv_heads, "C", size]),
    ]
    node = helper.make_node(
        "CacheAttention", names, ["out", "present_key", "present_value"], domain="kvexport",
        num_heads=heads, kv_num_heads=kv_heads, scale=0.0, local_window_size=window,
    )
    graph = helper.make_graph([node], "paged", inputs, outputs)
    model = helper.make_model(graph, ir_version=10, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("kvexport", 1)])
    options = ort.SessionOptions()
    options.register_custom_ops_library(str(library))
    options.intra_op_num_threads = 2
    return ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])


def _to_pool(rows: np.ndarray, table: np.ndarray, pool_blocks: int, block: int) -> np.ndarray:
    """Row-layout cache [B, H, C, D] scattered into a pool [P, H, Bs, D] by ``table`` [B, C / Bs]."""
    batch, heads, capacity, size = rows.shape
    pool = np.full((pool_blocks, heads, block, size), np.nan, np.float32)  # blocks no row owns hold NaN: a stray read shows
    for b in range(batch):
        for j in range(capacity // block):
            pool[table[b, j]] = rows[b, :, j * block : (j + 1) * block]
    return pool


@pytest.mark.parametrize(
    ("heads", "kv_heads", "size", "tokens", "lengths", "window"),
    [
        (6, 2, 64, 1, [5, 40, 17], -1),  # decode rows of different lengths
        (3, 3, 16, 1, [1, 63], 9),  # one query head a KV head, a window
        (6, 2, 64, 7, [30, 7, 44], -1),  # pieces after pasts (and a fresh one)
        (4, 1, 32, 33, [33, 40], 20),  # long pieces, a window
    ],
)
def test_paged_layout_matches_rows(
    library: Path, heads: int, kv_heads: int, size: int, tokens: int, lengths: list[int], window: int
) -> None:
    rng = np.random.default_rng(len(lengths) * tokens + size)
    batch, block, capacity = len(lengths), 8, 64
    width = capacity // block
    past = rng.standard_normal((2, batch, kv_heads, capacity, size)).astype(np.float32)
    q = rng.standard_normal((batch, tokens, heads * size)).astype(np.float32)
    k = rng.standard_normal((batch, tokens, kv_heads * size)).astype(np.float32)
    v = rng.standard_normal((batch, tokens, kv_heads * size)).astype(np.float32)
    seqlens = np.array([n - 1 for n in lengths], np.int32)
    pool_blocks = batch * width + 3
    table = rng.permutation(pool_blocks)[: batch * width].reshape(batch, width).astype(np.int32)

    rows = _session(library, paged=False, heads=heads, kv_heads=kv_heads, size=size, window=window)
    out, key_rows, value_rows = rows.run(None, {"q": q, "k": k, "v": v, "past_key": past[0], "past_value": past[1], "seqlens": seqlens})
    paged = _session(library, paged=True, heads=heads, kv_heads=kv_heads, size=size, window=window)
    feeds = {
        "q": q, "k": k, "v": v, "seqlens": seqlens, "block_table": table,
        "past_key": _to_pool(past[0], table, pool_blocks, block), "past_value": _to_pool(past[1], table, pool_blocks, block),
    }
    paged_out, key_pool, value_pool = paged.run(None, feeds)
    np.testing.assert_allclose(paged_out, out, rtol=1e-5, atol=1e-5)
    for pool, want in ((key_pool, key_rows), (value_pool, value_rows)):
        for b, n in enumerate(lengths):  # every position up to a row's last, read back through its table
            got = np.stack([pool[table[b, t // block], :, t % block] for t in range(n)], axis=1)
            np.testing.assert_array_equal(got, want[b, :, :n])


def test_paged_table_outside_the_pool_is_refused(library: Path) -> None:
    session = _session(library, paged=True, heads=2, kv_heads=1, size=16, window=-1)
    pool = np.zeros((4, 1, 8, 16), np.float32)
    feeds = {
        "q": np.zeros((1, 1, 32), np.float32), "k": np.zeros((1, 1, 16), np.float32), "v": np.zeros((1, 1, 16), np.float32),
        "past_key": pool, "past_value": pool, "seqlens": np.array([9], np.int32), "block_table": np.array([[0, 4]], np.int32),
    }
    with pytest.raises(Exception, match="block_table names block 4, outside the pool's 4"):
        session.run(None, feeds)
