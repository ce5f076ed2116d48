"""PromptAttentionPass: a prompt's GroupQueryAttention as ScatterND and products, behind If(several rows of several tokens).

The rewritten graph's numbers are checked against the op's own (ONNX Runtime sessions, the
cache bound in place as the runtime binds it), on GPT-2 (one KV head a query head) and the
trained Llama (two query heads a KV head): logits and the cache each call leaves, for fresh
prompts batched, a piece after a past, decode steps after them, and left-padded prompts.
The rest of the suite's parity tests against PyTorch run on the rewritten graphs too (it is
the CPU default).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx_ir as ir
import pytest

from kvexport import export_model
from kvexport.passes import PromptAttentionPass, prompt_attention, vocabulary
from kvexport.runtime.generator import Generator
from kvexport.runtime.kernels import KERNELS_VARIABLE
from kvexport.runtime.opened import open_export
from kvexport.runtime.session import PROMPT_ATTENTION_VARIABLE
from kvexport.serving import runner as serving_runner
from kvexport.serving.runner import ModelRunner

TRAINED_LLAMA = Path(__file__).parents[1] / "data" / "tiny-trained-llama"


@pytest.fixture(autouse=True)
def _without_the_kernel(monkeypatch: pytest.MonkeyPatch) -> None:
    """These tests compare the products with the op: kvexport's kernel, where built, would take both's place."""
    monkeypatch.setenv(KERNELS_VARIABLE, "off")


@pytest.fixture(scope="module")
def llama_ort(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("prompt-attention-llama") / "out"
    export_model(out, str(TRAINED_LLAMA), target="ort-cpu")
    return out


def test_each_prompt_attention_becomes_an_if_over_products_and_the_op(trained_exports: dict[str, Path]) -> None:
    model = ir.load(trained_exports["int8-pc"] / "prefill.onnx")
    layers = sum(n.op_type == "GroupQueryAttention" for n in model.graph)
    outputs = [value.name for value in model.graph.outputs]
    result = PromptAttentionPass()(model)
    assert result.modified and layers > 0
    assert not any(n.op_type == "GroupQueryAttention" for n in model.graph)
    branches = [n for n in model.graph if n.op_type == "If"]
    assert len(branches) == layers
    for branch in branches:
        products = branch.attributes["then_branch"].as_graph()
        op = branch.attributes["else_branch"].as_graph()
        assert {"ScatterND", "FusedMatMul", "Softmax", "MatMul"} <= {n.op_type for n in products}
        # the queries in two blocks, the first over the keys up to its last query: a Softmax a block
        assert [n.op_type for n in products].count("Softmax") == 2
        assert "GroupQueryAttention" not in {n.op_type for n in products}
        assert [n.op_type for n in op] == ["GroupQueryAttention"]
    assert [value.name for value in model.graph.outputs] == outputs  # the presents keep their names and places
    assert vocabulary.ROWS_AFTER_PAST not in model.metadata_props  # a float cache: a row after a past keeps the op

    quantized = ir.load(trained_exports["kv-int8"] / "prefill.onnx")  # an int8 cache: written as the op writes it
    assert PromptAttentionPass()(quantized).modified
    for branch in (n for n in quantized.graph if n.op_type == "If"):
        products = branch.attributes["then_branch"].as_graph()
        assert [n.op_type for n in products].count("QuantizeLinear") == 2 and "ScatterND" in {n.op_type for n in products}
    # every call of several tokens a row as the products: the model says rows after a past may share a call (the
    # runner reads the key the pass writes, the vocabulary's)
    assert quantized.metadata_props[vocabulary.ROWS_AFTER_PAST] == "products"
    assert serving_runner.ROWS_AFTER_PAST is vocabulary.ROWS_AFTER_PAST

    int4 = ir.load(trained_exports["kv-int4"] / "prefill.onnx")
    assert not PromptAttentionPass()(int4).modified and vocabulary.ROWS_AFTER_PAST not in int4.metadata_props  # 4 bits: the op

    decode = ir.load(trained_exports["int8-pc"] / "decode.onnx")  # one token a row: left to the op
    assert not PromptAttentionPass()(decode).modified
    assert sum(n.op_type == "GroupQueryAttention" for n in decode.graph) == layers


def _calls(export: Path, monkeypatch: pytest.MonkeyPatch, mode: str) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """Logits of a sequence of calls, and the cache rows they wrote, with the prompt attention run by ``mode``."""
    monkeypatch.setenv(PROMPT_ATTENTION_VARIABLE, mode)
    runner = ModelRunner(open_export(export), 4, 64)
    rng = np.random.default_rng(3)
    vocab = runner.vocab_size
    logits = [runner.run_rows(0, [list(rng.integers(0, vocab, 13)) for _ in range(3)])]  # batched: the products
    logits.append(runner.decode([1, 2, 3], [13, 13, 13]).astype(np.float32))
    logits.append(runner.run_rows(3, [list(rng.integers(0, vocab, 9))]))  # batch 1: the op (an int8 cache's: products)
    logits.append(runner.run_piece(3, list(rng.integers(0, vocab, 7)), 9))  # after a past
    logits.append(runner.decode([4, 5, 6, 7], [14, 14, 14, 16]).astype(np.float32))
    logits.append(runner.run_rows(0, [list(rng.integers(0, vocab, 5)) for _ in range(2)]))  # rows reused: written afresh
    cache = [runner.cache.banks.host_view(0, i, (4, *runner.cache.row_shape)).copy() for i in range(len(runner.cache.past))]
    return [np.array(x, np.float32) for x in logits], cache


def _assert_like_the_op(
    logits: list[np.ndarray], expected_logits: list[np.ndarray], cache: list[np.ndarray], expected_cache: list[np.ndarray], lengths: list[int]
) -> None:
    """The products' logits and cache rows (row i's first ``lengths[i]`` positions of each cache tensor) against the op's.

    An 8-bit cache: the products and the op sum in other orders, so a value at a rounding boundary may take the next
    code in one and not in the other (rarely: once in these tests' calls), and one code step moves a logit by up to
    ~1e-3; each cache tensor's codes may move by one, in under 0.1% of them.
    """
    coded = cache[0].dtype == np.int8
    for got, want in zip(logits, expected_logits, strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=2e-3 if coded else 1e-4)
    for got, want in zip(cache, expected_cache, strict=True):
        if coded:
            moved = np.concatenate([(got[row, :, :n].astype(np.int32) - want[row, :, :n]).ravel() for row, n in enumerate(lengths)])
            assert np.abs(moved).max() <= 1 and np.mean(moved != 0) < 1e-3
        else:
            for row, n in enumerate(lengths):
                np.testing.assert_allclose(got[row, :, :n], want[row, :, :n], rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("which", ["gpt2", "llama", "gpt2 int8 cache"])
def test_the_products_give_the_ops_logits_and_cache(
    which: str, trained_exports: dict[str, Path], llama_ort: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    export = {"gpt2": trained_exports["none"], "llama": llama_ort, "gpt2 int8 cache": trained_exports["kv-int8"]}[which]
    expected_logits, expected_cache = _calls(export, monkeypatch, "gqa")
    logits, cache = _calls(export, monkeypatch, "products")
    _assert_like_the_op(logits, expected_logits, cache, expected_cache, [5, 5, 15, 17])  # what each row holds at the end


@pytest.mark.parametrize("which", ["gpt2", "llama", "gpt2 int8 cache"])
def test_calls_of_256_tokens_a_row_run_their_queries_in_two_blocks_and_give_the_ops_logits_and_cache(
    which: str, trained_exports: dict[str, Path], llama_ort: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """256 tokens a row (the models' longest): the first 128 queries attend over the first 128 keys only."""
    export = {"gpt2": trained_exports["none"], "llama": llama_ort, "gpt2 int8 cache": trained_exports["kv-int8"]}[which]
    results = {}
    for mode in ("gqa", "products"):
        monkeypatch.setenv(PROMPT_ATTENTION_VARIABLE, mode)
        runner = ModelRunner(open_export(export), 3, 256)
        rng = np.random.default_rng(11)
        logits = [runner.run_rows(0, [list(rng.integers(0, runner.vocab_size, 256)) for _ in range(2)])]  # the products
        logits.append(runner.run_rows(2, [list(rng.integers(0, runner.vocab_size, 256))]))  # the op (an int8 cache's: products)
        cache = [runner.cache.banks.host_view(0, i, (3, *runner.cache.row_shape)).copy() for i in range(len(runner.cache.past))]
        results[mode] = ([np.array(x, np.float32) for x in logits], cache)
    (logits, cache), (expected_logits, expected_cache) = results["products"], results["gqa"]
    _assert_like_the_op(logits, expected_logits, cache, expected_cache, [256] * 3)


@pytest.mark.parametrize("block_tokens", [None, 2])
@pytest.mark.parametrize("which", ["gpt2", "llama", "gpt2 int8 cache"])
def test_pieces_after_a_past_share_a_call_that_the_op_refuses(
    which: str, block_tokens: int | None, trained_exports: dict[str, Path], llama_ort: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Several rows' second pieces, after pasts of one length, in one call: only the products take it (the op needs
    batch 1 for new tokens over a past), and each row's logits are the op's for its piece alone. With blocks of at
    least 2 tokens, the 7-token pieces run in two blocks after their pasts (the first over the past and its own 3)."""
    if block_tokens is not None:
        monkeypatch.setattr(prompt_attention, "_BLOCK_TOKENS", block_tokens)
    export = {"gpt2": trained_exports["none"], "llama": llama_ort, "gpt2 int8 cache": trained_exports["kv-int8"]}[which]
    rng = np.random.default_rng(5)
    monkeypatch.setenv(PROMPT_ATTENTION_VARIABLE, "products")
    runner = ModelRunner(open_export(export), 3, 64)
    assert runner.can_batch_after_past == (which == "gpt2 int8 cache")  # the engine sends such calls with an 8-bit cache only
    firsts = [list(rng.integers(0, runner.vocab_size, 13)) for _ in range(3)]
    seconds = np.array([rng.integers(0, runner.vocab_size, 7) for _ in range(3)], np.int64)
    runner.run_rows(0, firsts)
    together = runner.run_rows(0, seconds.tolist(), 13)  # rows 0..2, positions 13..19, one call
    monkeypatch.setenv(PROMPT_ATTENTION_VARIABLE, "gqa")
    alone = ModelRunner(open_export(export), 3, 64)
    assert not alone.can_batch_after_past
    alone.run_rows(0, firsts)
    expected = np.stack([alone.run_piece(row, list(seconds[row]), 13) for row in range(3)])
    coded = runner.cache.banks.host_view(0, 0, (3, *runner.cache.row_shape)).dtype == np.int8
    # an 8-bit cache: a code at a rounding edge may move by one (below), and one code step moves a logit by up to ~1e-3
    np.testing.assert_allclose(together, expected, rtol=1e-4, atol=2e-3 if coded else 1e-4)
    for index in range(len(runner.cache.past)):
        got = runner.cache.banks.host_view(0, index, (3, *runner.cache.row_shape))[:, :, :20]
        want = alone.cache.banks.host_view(0, index, (3, *alone.cache.row_shape))[:, :, :20]
        if got.dtype == np.int8:  # one call's projections round a little differently from three calls': a code may move by 1
            assert np.abs(got.astype(np.int32) - want).max() <= 1 and np.mean(got != want) < 1e-3
        else:
            np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)
    with pytest.raises(RuntimeError):  # the op itself refuses the call: the products above are what ran it
        alone.run_rows(0, seconds.tolist(), 13)


def test_left_padded_prompts_generate_the_same_tokens(trained_exports: dict[str, Path], monkeypatch: pytest.MonkeyPatch) -> None:
    prompts = [[5, 9, 2, 7, 1, 3, 8], [4, 4], [11, 6, 3]]  # one call, left padded to 7: rows whose first queries see nothing
    tokens = {}
    for mode in ("gqa", "products"):
        monkeypatch.setenv(PROMPT_ATTENTION_VARIABLE, mode)
        tokens[mode] = Generator(trained_exports["none"]).generate(prompts, 12, eos_token_id=-1)
    assert tokens["products"].tolist() == tokens["gqa"].tolist()


def test_an_unknown_choice_is_one_line(tiny_ort_export: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from kvexport.errors import ProviderError

    monkeypatch.setenv(PROMPT_ATTENTION_VARIABLE, "flash")
    with pytest.raises(ProviderError, match=r"^KVEXPORT_PROMPT_ATTENTION=flash: choose products, gqa$"):
        ModelRunner(open_export(tiny_ort_export), 2, 32)
