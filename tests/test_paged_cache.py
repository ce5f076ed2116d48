"""The paged KV cache: kvexport's attention kernel over a block table, the block manager, the engine over a pool.

The kernel's paged layout is checked against its own row layout (itself checked against ONNX
Runtime's GroupQueryAttention in tests/passes/test_cache_attention.py) on the same keys and
values scattered over a shuffled pool: decode rows of different lengths, prompt pieces after a
past, fresh prompts, a window; outputs equal and the new rows written where the table says.
"""

from __future__ import annotations

import os
import subprocess
import sys
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


def _session(
    library: Path, *, paged: bool, heads: int, kv_heads: int, size: int, window: int, cache: int = TensorProto.FLOAT, tiles: bool = False
) -> ort.InferenceSession:
    float_ = TensorProto.FLOAT
    names = ["q", "k", "v", "past_key", "past_value", "seqlens", "", *(["block_table"] if paged else [])]
    stored = size + 4 if cache == TensorProto.INT8 else size  # a q8 position: the codes, then the scale's 4 bytes
    inputs = [
        helper.make_tensor_value_info("q", float_, ["B", "S", heads * size]),
        helper.make_tensor_value_info("k", float_, ["B", "S", kv_heads * size]),
        helper.make_tensor_value_info("v", float_, ["B", "S", kv_heads * size]),
        helper.make_tensor_value_info("past_key", cache, ["P0", "P1", "C", stored]),
        helper.make_tensor_value_info("past_value", cache, ["P0", "P1", "C", stored]),
        helper.make_tensor_value_info("seqlens", TensorProto.INT32, ["B"]),
        *([helper.make_tensor_value_info("block_table", TensorProto.INT32, ["B", "W"])] if paged else []),
    ]
    outputs = [
        helper.make_tensor_value_info("out", float_, ["B", "S", heads * size]),
        helper.make_tensor_value_info("present_key", cache, ["P0", "P1", "C", stored]),
        helper.make_tensor_value_info("present_value", cache, ["P0", "P1", "C", stored]),
    ]
    node = helper.make_node(
        "CacheAttention", names, ["out", "present_key", "present_value"], domain="kvexport",
        num_heads=heads, kv_num_heads=kv_heads, scale=0.0, local_window_size=window, **({"bf16_tiles": 1} if tiles else {}),
    )
    graph = helper.make_graph([node], "paged", inputs, outputs)
    model = helper.make_model(graph, ir_version=10, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("kvexport", 1)])
    options = ort.SessionOptions()
    options.register_custom_ops_library(str(library))
    options.intra_op_num_threads = 2
    return ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])


def _to_pool(rows: np.ndarray, table: np.ndarray, pool_blocks: int, block: int) -> np.ndarray:
    """Row-layout cache [B, H, C, D] scattered into a pool [H, P, Bs, D] by ``table`` [B, C / Bs]."""
    batch, heads, capacity, size = rows.shape
    pool = np.full((heads, pool_blocks, block, size), np.nan, np.float32)  # blocks no row owns hold NaN: a stray read shows
    for b in range(batch):
        for j in range(capacity // block):
            pool[:, table[b, j]] = rows[b, :, j * block : (j + 1) * block]
    return pool


BLOCK, CAPACITY = 8, 64  # the kernel tests' block of positions and each row's capacity


def _problem(
    seed: int, heads: int, kv_heads: int, size: int, tokens: int, lengths: list[int], *, half: bool = False, block: int = BLOCK
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray, int]:
    """Random queries, keys and values of ``tokens`` a row, a past of CAPACITY positions (values fp16 can hold, with
    ``half``), rows' last positions, and a shuffled table of ``block``-position blocks over a pool of 3 more; and its blocks."""
    rng = np.random.default_rng(seed)
    batch, width = len(lengths), CAPACITY // block
    past = rng.standard_normal((2, batch, kv_heads, CAPACITY, size))
    past = (past.astype(np.float16) if half else past).astype(np.float32)
    q = rng.standard_normal((batch, tokens, heads * size)).astype(np.float32)
    k = rng.standard_normal((batch, tokens, kv_heads * size)).astype(np.float32)
    v = rng.standard_normal((batch, tokens, kv_heads * size)).astype(np.float32)
    seqlens = np.array([n - 1 for n in lengths], np.int32)
    pool_blocks = batch * width + 3
    table = rng.permutation(pool_blocks)[: batch * width].reshape(batch, width).astype(np.int32)
    return past, q, k, v, seqlens, table, pool_blocks


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
    past, q, k, v, seqlens, table, pool_blocks = _problem(len(lengths) * tokens + size, heads, kv_heads, size, tokens, lengths)
    block = BLOCK

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
            got = np.stack([pool[:, table[b, t // block], t % block] for t in range(n)], axis=1)
            np.testing.assert_array_equal(got, want[b, :, :n])


@pytest.mark.parametrize(
    ("heads", "kv_heads", "size", "tokens", "lengths", "window"),
    [
        (6, 2, 64, 1, [5, 40, 17], -1),  # decode rows
        (3, 3, 20, 1, [1, 63], 9),  # a head size the vector loops don't divide, a window
        (6, 2, 64, 7, [30, 7, 44], -1),  # pieces after pasts
        (4, 1, 32, 33, [33, 40], 20),  # long pieces, a window
    ],
)
def test_fp16_pool_matches_fp32_rows(
    library: Path, heads: int, kv_heads: int, size: int, tokens: int, lengths: list[int], window: int
) -> None:
    """An fp16 pool reads and writes what an fp32 cache holds after rounding to fp16: the same outputs, the new rows in fp16."""
    past, q, k, v, seqlens, table, pool_blocks = _problem(7 * tokens + size, heads, kv_heads, size, tokens, lengths, half=True)
    block = BLOCK

    rows = _session(library, paged=False, heads=heads, kv_heads=kv_heads, size=size, window=window)
    rounded = {"k": k.astype(np.float16).astype(np.float32), "v": v.astype(np.float16).astype(np.float32)}
    out, key_rows, value_rows = rows.run(None, {"q": q, **rounded, "past_key": past[0], "past_value": past[1], "seqlens": seqlens})
    half = _session(library, paged=True, heads=heads, kv_heads=kv_heads, size=size, window=window, cache=TensorProto.FLOAT16)
    feeds = {
        "q": q, "k": k, "v": v, "seqlens": seqlens, "block_table": table,
        "past_key": _to_pool(past[0], table, pool_blocks, block).astype(np.float16),
        "past_value": _to_pool(past[1], table, pool_blocks, block).astype(np.float16),
    }
    half_out, key_pool, value_pool = half.run(None, feeds)
    assert key_pool.dtype == np.float16
    np.testing.assert_allclose(half_out, out, rtol=1e-5, atol=1e-5)
    for pool, want in ((key_pool, key_rows), (value_pool, value_rows)):
        for b, n in enumerate(lengths):  # the new rows rounded to nearest even, as numpy rounds them
            got = np.stack([pool[:, table[b, t // block], t % block] for t in range(n)], axis=1)
            np.testing.assert_array_equal(got.astype(np.float32), want[b, :, :n])


def test_fp16_writes_round_as_numpy(library: Path) -> None:
    """New rows go into an fp16 pool rounded as numpy rounds: ties to even, subnormals, overflow to inf, NaN kept.

    A head size of 20: the first 16 values of a row take the vector conversion, the last 4 the portable one.
    """
    specials = np.array([1.0, 1 + 2**-11, 1 + 3 * 2**-11, 65504.0, 65520.0, 1e6, -1e6, 6e-8, 3e-8, 2**-24 * 1.5,
                         -0.0, 1e-5, 2.0 / 3.0, -1.0 / 3.0, 1e-40, np.pi], np.float32)
    row = np.concatenate([specials, specials[[1, 2, 4, 9]]])  # the portable tail gets ties and a subnormal too
    size, block = 20, 8
    session = _session(library, paged=True, heads=1, kv_heads=1, size=size, window=-1, cache=TensorProto.FLOAT16)
    pool = np.zeros((1, 2, block, size), np.float16)
    feeds = {
        "q": np.zeros((1, 1, size), np.float32), "k": row[None, None], "v": -row[None, None],
        "past_key": pool, "past_value": pool.copy(), "seqlens": np.array([0], np.int32), "block_table": np.array([[1]], np.int32),
    }
    _, keys, values = session.run(None, feeds)
    with np.errstate(over="ignore"):  # 65520 and 1e6 overflow to inf, as they should
        want = row.astype(np.float16)
    np.testing.assert_array_equal(keys[0, 1, 0].view(np.uint16), want.view(np.uint16))
    np.testing.assert_array_equal(values[0, 1, 0].view(np.uint16), (-want).view(np.uint16))


def _to_q8(values: np.ndarray) -> np.ndarray:
    """fp32 positions [..., D] as a q8 pool holds them: D int8 codes (the largest magnitude as 127, ties to even), then
    the fp32 scale's 4 bytes."""
    top = np.abs(values).max(axis=-1, keepdims=True).astype(np.float32)
    inverse = np.divide(np.float32(127), top, out=np.zeros_like(top), where=top > 0)
    with np.errstate(invalid="ignore"):  # the blocks no row owns hold NaN (a stray read shows): their codes are moot
        codes = np.rint(np.clip(values * inverse, -127, 127)).astype(np.int8)
    return np.concatenate([codes, (top / np.float32(127)).astype(np.float32).view(np.int8)], axis=-1)


def _from_q8(pool: np.ndarray) -> np.ndarray:
    """A q8 pool's positions [..., D + 4] back as fp32 [..., D]: codes times scale."""
    codes, scale = pool[..., :-4].astype(np.float32), np.ascontiguousarray(pool[..., -4:]).view(np.float32)
    return codes * scale


@pytest.mark.parametrize(
    ("heads", "kv_heads", "size", "tokens", "lengths", "window", "tiles", "block"),
    [
        (6, 2, 64, 1, [5, 40, 17], -1, False, BLOCK),  # decode rows (AVX-512's loop where the CPU has it)
        (6, 2, 64, 1, [20, 63, 40], 9, False, 16),  # decode rows over whole runs of 16 keys, a window
        (3, 3, 20, 1, [1, 63], 9, False, BLOCK),  # a head size the vector loops don't divide (the converting loop), a window
        (6, 2, 64, 7, [30, 7, 44], -1, False, BLOCK),  # pieces after pasts
        (4, 1, 32, 33, [33, 40], 20, True, BLOCK),  # long pieces, a window, on AMX tiles where the CPU has them
    ],
)
def test_q8_pool_is_the_fp32_attention_of_what_it_holds(
    library: Path, heads: int, kv_heads: int, size: int, tokens: int, lengths: list[int], window: int, tiles: bool, block: int
) -> None:
    """A q8 pool writes each new position as numpy's reference quantization does (its codes exactly, but where the scaled
    value lies within 2e-3 of a tie, there within a step; scales within an ulp) and attends over what it holds: the fp32
    row layout's output over the dequantized past and new rows, within 1e-5 (5e-5 on tiles)."""
    past, q, k, v, seqlens, table, pool_blocks = _problem(11 * tokens + size, heads, kv_heads, size, tokens, lengths, block=block)
    q8 = _session(library, paged=True, heads=heads, kv_heads=kv_heads, size=size, window=window, cache=TensorProto.INT8, tiles=tiles)
    pools = [_to_q8(_to_pool(past[i], table, pool_blocks, block)) for i in range(2)]
    feeds = {"q": q, "k": k, "v": v, "seqlens": seqlens, "block_table": table, "past_key": pools[0], "past_value": pools[1]}
    q8_out, key_pool, value_pool = q8.run(None, feeds)
    assert key_pool.dtype == np.int8 and key_pool.shape[-1] == size + 4
    new = {"k": np.empty_like(k), "v": np.empty_like(v)}
    for name, pool, fresh in (("k", key_pool, k), ("v", value_pool, v)):
        for b, n in enumerate(lengths):
            for s in range(tokens):
                t = n - tokens + s
                got = pool[:, table[b, t // block], t % block]  # [Nkv, D + 4]
                heads_values = fresh[b, s].reshape(kv_heads, size)
                want = _to_q8(heads_values)
                scaled = heads_values * (np.float32(127) / np.abs(heads_values).max(axis=-1, keepdims=True))
                near_tie = np.abs(np.abs(scaled - np.floor(scaled)) - 0.5) < 2e-3  # the kernel's fast math may round either way
                differ = got[:, :size].astype(np.int32) - want[:, :size]
                assert not differ[~near_tie].any() and np.abs(differ).max() <= 1
                scales = (np.ascontiguousarray(x[:, size:]).view(np.float32) for x in (got, want))
                np.testing.assert_allclose(*scales, rtol=2e-7)
                new[name][b, s] = _from_q8(got).reshape(-1)
    held = [np.stack([_from_q8(pools[i])[:, table[b]].reshape(kv_heads, CAPACITY, size) for b in range(len(lengths))]) for i in range(2)]
    rows = _session(library, paged=False, heads=heads, kv_heads=kv_heads, size=size, window=window)
    want = rows.run(None, {"q": q, "k": new["k"], "v": new["v"], "past_key": held[0], "past_value": held[1], "seqlens": seqlens})[0]
    np.testing.assert_allclose(q8_out, want, rtol=0, atol=5e-5 if tiles and _has_amx() else 1e-5)


def _has_amx() -> bool:
    flags = Path("/proc/cpuinfo").read_text().split()
    return "amx_tile" in flags and "amx_bf16" in flags


@pytest.mark.parametrize(
    ("heads", "kv_heads", "size", "tokens", "lengths", "window", "half"),
    [
        (6, 2, 64, 7, [30, 7, 44], -1, False),  # pieces after pasts, and a fresh one
        (9, 3, 64, 40, [40, 64], -1, True),  # three query heads a KV head (48 rows a block of queries), an fp16 pool
        (4, 1, 32, 33, [33, 40], 20, False),  # long pieces, a window, a head size of 32
        (2, 1, 128, 17, [17, 50], -1, True),  # a head size of 128: two passes of 64 values
    ],
)
def test_prompts_on_amx_tiles_are_attention_in_bf16(
    library: Path, monkeypatch: pytest.MonkeyPatch, heads: int, kv_heads: int, size: int, tokens: int, lengths: list[int], window: int,
    half: bool,
) -> None:
    """The prompt session's nodes (bf16_tiles) run prompts on AMX tiles by default (and with KVEXPORT_ATTENTION_PATH=amx):
    against float64 attention of the same inputs within 5e-5 (every operand as two bf16 parts), where the fp32 path is
    within 1e-5; skipped by name where the CPU has no AMX. KVEXPORT_ATTENTION_PATH=avx512 keeps them on the fp32 path."""
    if not _has_amx():
        pytest.skip("this CPU has no AMX tiles: the bf16 prompt attention is tested where it has")
    past, q, k, v, seqlens, table, pool_blocks = _problem(len(lengths) * tokens + size, heads, kv_heads, size, tokens, lengths, half=half)
    cache = TensorProto.FLOAT16 if half else TensorProto.FLOAT
    dtype = np.float16 if half else np.float32
    feeds = {
        "q": q, "k": k, "v": v, "seqlens": seqlens, "block_table": table,
        "past_key": _to_pool(past[0], table, pool_blocks, BLOCK).astype(dtype), "past_value": _to_pool(past[1], table, pool_blocks, BLOCK).astype(dtype),
    }
    outs = {}
    monkeypatch.delenv("KVEXPORT_ATTENTION_PATH", raising=False)
    by_default = _session(library, paged=True, heads=heads, kv_heads=kv_heads, size=size, window=window, cache=cache, tiles=True)
    unasked = by_default.run(None, feeds)[0]
    monkeypatch.setenv("KVEXPORT_ATTENTION_PATH", "avx512")
    narrowed = _session(library, paged=True, heads=heads, kv_heads=kv_heads, size=size, window=window, cache=cache, tiles=True)
    monkeypatch.setenv("KVEXPORT_ATTENTION_PATH", "amx")
    for tiles in (False, True):
        session = _session(library, paged=True, heads=heads, kv_heads=kv_heads, size=size, window=window, cache=cache, tiles=tiles)
        outs[tiles] = session.run(None, feeds)[0]
    np.testing.assert_array_equal(unasked, outs[True])
    np.testing.assert_array_equal(narrowed.run(None, feeds)[0], outs[False])
    want = np.zeros_like(q, dtype=np.float64)  # float64 attention: the keys and values the cache holds after the call
    group = heads // kv_heads
    for b, n in enumerate(lengths):
        keys, values = past[0][b].astype(np.float64), past[1][b].astype(np.float64)
        start = n - tokens
        for s in range(tokens):
            position = start + s
            for h in range(heads):
                kvh = h // group
                key = np.concatenate([keys[kvh, :start], k[b, :, kvh * size : (kvh + 1) * size].astype(np.float16 if half else np.float32)])
                value = np.concatenate([values[kvh, :start], v[b, :, kvh * size : (kvh + 1) * size].astype(np.float16 if half else np.float32)])
                first = max(0, position + 1 - window) if window > 0 else 0
                scores = key[first : position + 1] @ q[b, s, h * size : (h + 1) * size].astype(np.float64) / np.sqrt(size)
                weights = np.exp(scores - scores.max())
                want[b, s, h * size : (h + 1) * size] = weights @ value[first : position + 1] / weights.sum()
    np.testing.assert_allclose(outs[False], want, rtol=0, atol=1e-5)
    np.testing.assert_allclose(outs[True], want, rtol=0, atol=5e-5)  # split operands: about 16 significant bits
    assert not np.array_equal(outs[True], outs[False])  # the tiles ran: their rounding shows


KERNEL_TESTS = [  # the kernel's outputs and cache against references: decode, pieces, prompts, windows, fp16 pools
    "tests/test_paged_cache.py::test_paged_layout_matches_rows",
    "tests/test_paged_cache.py::test_fp16_pool_matches_fp32_rows",
    "tests/test_paged_cache.py::test_fp16_writes_round_as_numpy",
    "tests/test_paged_cache.py::test_q8_pool_is_the_fp32_attention_of_what_it_holds",
    "tests/passes/test_cache_attention.py::test_the_kernel_gives_group_query_attentions_output_and_cache",
]


@pytest.mark.parametrize(("path", "flag"), [("generic", None), ("f16c", "f16c")])
def test_each_narrower_kernel_path_passes_the_kernel_tests(library: Path, path: str, flag: str | None) -> None:
    """The kernel's hand-written paths are chosen at run time: the in-process tests run the CPU's best (AVX-512's loops
    and conversions where it has them); here the kernel tests run again with KVEXPORT_ATTENTION_PATH narrowing it: F16C's
    conversions (skipped by name where the CPU has none) and the portable path, on every host."""
    if flag is not None and flag not in Path("/proc/cpuinfo").read_text().split():
        pytest.skip(f"this CPU has no {flag}: the {path} path is tested where it has")
    env = {**os.environ, "KVEXPORT_ATTENTION_PATH": path, "KVEXPORT_KERNELS": str(library)}
    root = Path(__file__).parent.parent
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *KERNEL_TESTS],
        env=env, cwd=root, capture_output=True, text=True, timeout=600, check=False,
    )
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]
    assert " passed" in result.stdout and "skipped" not in result.stdout


def test_an_unknown_or_missing_kernel_path_is_refused_in_one_line(library: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVEXPORT_ATTENTION_PATH", "sse9")
    with pytest.raises(Exception, match="KVEXPORT_ATTENTION_PATH=sse9 is not amx, avx512, f16c, generic or auto"):
        _session(library, paged=True, heads=2, kv_heads=1, size=16, window=-1)
    if "avx512f" not in Path("/proc/cpuinfo").read_text().split():
        monkeypatch.setenv("KVEXPORT_ATTENTION_PATH", "avx512")
        with pytest.raises(Exception, match="KVEXPORT_ATTENTION_PATH=avx512 but this CPU has no AVX-512"):
            _session(library, paged=True, heads=2, kv_heads=1, size=16, window=-1)


def test_paged_table_outside_the_pool_is_refused(library: Path) -> None:
    session = _session(library, paged=True, heads=2, kv_heads=1, size=16, window=-1)
    pool = np.zeros((1, 4, 8, 16), np.float32)
    feeds = {
        "q": np.zeros((1, 1, 32), np.float32), "k": np.zeros((1, 1, 16), np.float32), "v": np.zeros((1, 1, 16), np.float32),
        "past_key": pool, "past_value": pool, "seqlens": np.array([9], np.int32), "block_table": np.array([[0, 4]], np.int32),
    }
    with pytest.raises(Exception, match="block_table names block 4, outside the pool's 4"):
        session.run(None, feeds)


# ---------------------------------------------------------------- the engine over a pool

TRAINED_LLAMA = Path(__file__).parent / "data" / "tiny-trained-llama"


@pytest.fixture(scope="module")
def llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from kvexport import export_model

    out = tmp_path_factory.mktemp("paged-llama") / "out"
    export_model(out, str(TRAINED_LLAMA), target="ort-cpu")
    return out


def _run(export: Path, prompts: list[list[int]], params: object, **settings: object) -> tuple[list[list[int]], object]:
    from kvexport.serving.engine import Engine

    with Engine(export, warm_up=0, **settings) as engine:
        states = [engine.submit(prompt, params) for prompt in prompts]  # type: ignore[arg-type]
        tokens = [state.result()[0] for state in states]
        return tokens, (engine.stats(), engine.kv_layout, engine.table.blocks)


def _prompts(count: int, seed: int, shared: int = 0) -> list[list[int]]:
    """Prompts of 3..40 tokens; the first ``shared`` tokens the same in all (a prefix the cache reuses)."""
    rng = np.random.default_rng(seed)
    head = [int(t) for t in rng.integers(5, 250, shared)]
    return [head + [int(t) for t in rng.integers(5, 250, int(rng.integers(3, 40)))] for _ in range(count)]


def test_paged_engine_gives_the_slot_layouts_tokens(llama: Path) -> None:
    from kvexport.serving.request import SamplingParams

    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    prompts = _prompts(7, 1) + _prompts(5, 2, shared=37)  # ragged, batched, and a prefix that spans blocks
    slots, (_, layout, _) = _run(llama, prompts, params, slots=4, max_context=128, kv_layout="slots")
    paged, (stats, paged_layout, _blocks) = _run(llama, prompts, params, slots=4, max_context=128, kv_cache_dtype="fp32")
    assert layout.startswith("slots") and paged_layout == "paged"
    assert paged == slots
    assert stats.prefix_hits > 0 and stats.preemptions == 0  # type: ignore[attr-defined]


def test_paged_decode_calls_run_only_the_running_rows(llama: Path) -> None:
    """A paged decode call gathers its running requests' table rows: no row runs for a free or prefilling slot below one."""
    from kvexport.serving.engine import Engine
    from kvexport.serving.request import SamplingParams
    from kvexport.serving.scheduler import CallPlan

    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    short = SamplingParams(max_tokens=2, temperature=0, ignore_eos=True)  # the first request's slot frees early
    prompts = _prompts(4, 7)
    in_slots = [_run(llama, [prompt], short if i == 0 else params, slots=4, max_context=128, kv_layout="slots")[0][0] for i, prompt in enumerate(prompts)]
    calls: list[tuple[int, list[int]]] = []
    with Engine(llama, slots=4, max_context=128, kv_cache_dtype="fp32", warm_up=0) as engine:
        execute = engine.runner.execute

        def recorded(plan: CallPlan, **kwargs: object) -> object:
            decode = plan.decode
            if decode is not None and decode.speculative is None:
                calls.append((decode.rows, sorted(r.slot for r in decode.requests)))
            return execute(plan, **kwargs)  # type: ignore[arg-type]

        engine.runner.execute = recorded  # type: ignore[method-assign,assignment]
        tokens = [state.result()[0] for state in [engine.submit(prompt, short if i == 0 else params) for i, prompt in enumerate(prompts)]]
    assert tokens == in_slots
    assert calls and all(rows == len(slots) for rows, slots in calls)
    assert any(max(slots) + 1 > rows for rows, slots in calls)  # a slot below a running one did not run


def test_an_fp16_pool_keeps_the_fp32_caches_greedy_tokens_and_logprobs(llama: Path) -> None:
    """The default pool holds fp16: on the trained model its greedy tokens are the fp32 cache's, log-probabilities within 5e-3 (fp16 keeps 11 bits)."""
    from kvexport.serving.engine import Engine
    from kvexport.serving.request import SamplingParams

    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True, logprobs=0)
    prompts = _prompts(6, 5) + _prompts(3, 6, shared=37)
    results: dict[str, list[list[tuple[int, float]]]] = {}
    for dtype in ("fp32", "fp16"):
        with Engine(llama, slots=4, max_context=128, kv_cache_dtype=dtype, warm_up=0) as engine:
            assert engine.cache_dtype == dtype and engine.runner.cache.cache_dtype == np.dtype(dtype.replace("fp", "float"))
            states = [engine.submit(prompt, params) for prompt in prompts]
            results[dtype] = [[(e.token_id, e.logprob.logprob) for e in state if e.logprob is not None] for state in states]  # type: ignore[misc]
    for full, half in zip(results["fp32"], results["fp16"], strict=True):
        assert [token for token, _ in half] == [token for token, _ in full] and len(full) == 24
        np.testing.assert_allclose([lp for _, lp in half], [lp for _, lp in full], atol=5e-3)


def test_a_q8_pool_keeps_the_fp32_caches_greedy_tokens(llama: Path) -> None:
    """A q8 pool (int8 codes and a scale a position and head) serves the trained model's greedy tokens as the fp32 cache
    does, prefix sharing included, up to a near tie (the fp32 cache's top two within 0.05), with log-probabilities within
    0.15 (0.03 on average: 8 bits a value, where fp16 keeps 11); its blocks take (D + 4) / (4 D) of the fp32 pool's bytes."""
    from kvexport.runtime.opened import open_export
    from kvexport.serving.engine import Engine
    from kvexport.serving.request import SamplingParams

    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True, logprobs=2)
    prompts = _prompts(6, 5) + _prompts(3, 6, shared=37)
    results: dict[str, list[list[tuple[int, float, float]]]] = {}
    blocks: dict[str, int] = {}
    for dtype in ("fp32", "q8"):
        with Engine(llama, slots=4, max_context=128, kv_cache_dtype=dtype, warm_up=0) as engine:
            assert engine.cache_dtype == dtype
            blocks[dtype] = engine.runner.cache.block_bytes
            states = [engine.submit(prompt, params) for prompt in prompts]
            results[dtype] = [
                [(e.token_id, e.logprob.logprob, e.logprob.top[0][1] - e.logprob.top[1][1]) for e in state if e.logprob is not None]  # type: ignore[misc]
                for state in states
            ]
    head_dim = open_export(llama, "cpu").manifest.dims.head_dim
    assert blocks["q8"] * 4 * head_dim == blocks["fp32"] * (head_dim + 4)
    differences = []
    for full, q8 in zip(results["fp32"], results["q8"], strict=True):
        assert len(full) == len(q8) == 24
        for (token, logprob, margin), (q8_token, q8_logprob, _) in zip(full, q8, strict=True):
            if margin < 0.05:  # a near tie: the two caches may choose either, and the rest differs from there
                break
            assert q8_token == token
            differences.append(abs(q8_logprob - logprob))
    assert len(differences) >= 24 * len(prompts) // 2  # most positions compared: the check has teeth
    assert max(differences) < 0.15 and float(np.mean(differences)) < 0.03


def test_preempted_requests_finish_with_the_uninterrupted_tokens(llama: Path) -> None:
    from kvexport.runtime.opened import open_export
    from kvexport.serving.engine import slot_bytes
    from kvexport.serving.request import SamplingParams

    params = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    prompts = _prompts(6, 3)
    block = slot_bytes(open_export(llama, "cpu").manifest, 16)
    whole, _ = _run(llama, prompts, params, slots=6, max_context=96, kv_layout="slots")
    small, (stats, _, _blocks) = _run(llama, prompts, params, slots=6, max_context=96, kv_memory=10 * block, kv_cache_dtype="fp32")
    assert stats.preemptions > 0  # type: ignore[attr-defined]
    assert small == whole


def test_a_soak_with_hang_ups_and_a_small_pool_ends_with_every_block_free(llama: Path) -> None:
    from kvexport.runtime.opened import open_export
    from kvexport.serving.engine import Engine, slot_bytes
    from kvexport.serving.request import SamplingParams

    rng = np.random.default_rng(7)
    block = slot_bytes(open_export(llama, "cpu").manifest, 16)
    with Engine(llama, slots=8, max_context=96, kv_memory=12 * block, prefix_cache=False, warm_up=0) as engine:
        states = []
        for i, prompt in enumerate(_prompts(40, 4)):
            params = SamplingParams(max_tokens=int(rng.integers(1, 50)), temperature=float(i % 2), seed=i, ignore_eos=True)
            states.append(engine.submit(prompt, params))
            if rng.random() < 0.3:
                states[int(rng.integers(len(states)))].cancel()
        reasons = [state.result()[2] for state in states]
        stats = engine.stats()
    assert set(reasons) <= {"length", "cancelled"} and "length" in reasons
    assert stats.preemptions > 0 and stats.kv_blocks_used == 0 and stats.slots_in_use == 0


def test_a_pool_too_small_for_one_request_is_refused_at_start(llama: Path) -> None:
    from kvexport.errors import KvexportError
    from kvexport.runtime.cache import pool_manifest
    from kvexport.runtime.opened import open_export
    from kvexport.serving.engine import Engine, slot_bytes

    block = slot_bytes(pool_manifest(open_export(llama, "cpu").manifest, "fp16"), 16)  # an fp16 pool's block
    with pytest.raises(KvexportError, match=r"holds 5 blocks of 16 tokens .* fp16 cache\); one request of max_context 96 tokens needs 8"):
        Engine(llama, max_context=96, kv_memory=5 * block, kv_cache_dtype="fp16", warm_up=0)
    with pytest.raises(KvexportError, match=r"holds 2 blocks of 16 tokens .* fp32 cache\); one request"):
        Engine(llama, max_context=96, kv_memory=5 * block, warm_up=0)  # a float export's pool stays fp32: twice the bytes
    with pytest.raises(KvexportError, match=r"--kv-cache-dtype fp16: the cache stays in slots here \(--kv-layout slots\)"):
        Engine(llama, kv_layout="slots", kv_cache_dtype="fp16", warm_up=0)


def test_paged_is_refused_where_the_kernel_does_not_read_the_cache(trained_exports: dict[str, Path]) -> None:
    from kvexport.errors import KvexportError
    from kvexport.serving.engine import Engine

    with pytest.raises(KvexportError, match="--kv-layout paged: no paged cache here \\(an int8 cache"):
        Engine(trained_exports["kv-int8"], kv_layout="paged", warm_up=0)
    with Engine(trained_exports["kv-int8"], max_context=64, warm_up=0) as engine:
        assert engine.kv_layout.startswith("slots (an int8 cache")


def test_the_pass_pages_every_cache_read_and_refuses_other_readers(llama: Path, trained_exports: dict[str, Path]) -> None:
    import onnx_ir as ir

    from kvexport.passes import PagedCachePass, PassInputError
    from kvexport.runtime.session import cpu_rewrites

    model = ir.load(llama / "prefill.onnx")
    cpu_rewrites(model, kernel=True)
    paged = PagedCachePass()
    assert paged(model).modified
    kernels = [node for node in model.graph if node.op_type == "CacheAttention"]
    table = next(value for value in model.graph.inputs if value.name == "block_table")
    assert paged.counts["nodes"] == len(kernels) > 0 and all(node.inputs[7] is table for node in kernels)
    for value in model.graph.inputs:
        if value.name.startswith("past."):
            assert list(value.shape)[1] == "kv_blocks" and {node.op_type for node, _ in value.uses()} == {"CacheAttention"}
    quantized = ir.load(trained_exports["kv-int8"] / "prefill.onnx")
    cpu_rewrites(quantized, kernel=True)
    with pytest.raises(PassInputError, match=r"past\.0\.key feeds .*only kvexport.s CacheAttention reads a paged cache"):
        PagedCachePass()(quantized)


def test_speculative_rounds_over_the_paged_cache_give_the_slot_layouts_tokens(trained_all_logits: Path) -> None:
    from kvexport.runtime.speculative import PromptLookup
    from kvexport.serving.request import SamplingParams

    params = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    prompt = [[int(t) for t in np.tile(np.arange(30, 50), 3)]]  # a repeating prompt: lookup drafts are kept
    slots, _ = _run(trained_all_logits, prompt, params, slots=2, max_context=128, kv_layout="slots", drafter=PromptLookup())
    paged, (stats, layout, _) = _run(trained_all_logits, prompt, params, slots=2, max_context=128, drafter=PromptLookup(), kv_cache_dtype="fp32")
    assert layout == "paged" and stats.accepted_tokens > 0  # type: ignore[attr-defined]
    assert paged == slots


def test_decode_calls_of_many_rows_run_the_bf16_products_row_by_row(trained_exports: dict[str, Path]) -> None:
    """``bf16_decode_rows``: a call of that many rows runs through the prompts' bf16 session, each row as it would alone
    there; fewer rows keep the export's int8 blocks."""
    from kvexport.runtime.opened import open_export
    from kvexport.serving.runner import ModelRunner

    opened = open_export(trained_exports["int8"], "cpu")
    rng = np.random.default_rng(11)
    prompts = [[int(t) for t in rng.integers(5, 250, n)] for n in (9, 30, 17, 4)]
    tokens, positions = [7, 8, 9, 10], [len(p) for p in prompts]

    def decoded(threshold: int, rows: int, alone: bool = False) -> np.ndarray:
        runner = ModelRunner(opened, 4, 64, prompt_products=True, bf16_decode_rows=threshold)
        if runner.prompt_session is None:
            pytest.skip(f"no bf16 session here: {runner.prompt_products}")
        for slot, prompt in enumerate(prompts):
            runner.run_piece(slot, prompt, 0)
        if alone:  # each row in a call of its own: rows 1.. are the call's last row, earlier rows fed their own past's token
            return np.stack([runner.decode(tokens[: r + 1], positions[: r + 1])[r].astype(np.float32) for r in range(rows)])
        return np.array(runner.decode(tokens[:rows], positions[:rows]), np.float32)

    many = decoded(4, 4)
    few = decoded(4, 3)
    blocks = decoded(0, 4)
    np.testing.assert_allclose(few, blocks[:3], atol=1e-5)  # 3 rows < 4: the blocks
    np.testing.assert_allclose(many, decoded(1, 4, alone=True), atol=1e-4)  # 4 rows: bf16, the rows' numbers alone
    assert np.abs(many - blocks).max() > 1e-3  # and not the blocks'
    assert (many.argmax(-1) == blocks.argmax(-1)).all()
