"""The mixed step (``passes/mixed_step.py``): a prompt chunk and a decode call in one call.

The graph itself is checked in tests/passes/test_mixed_step.py. Its reference here is the two calls it replaces, run by the same runner on the same cache: the
chunk at batch 1 (``run_piece``), then the decode call over the running rows. Both are
checked against PyTorch elsewhere (test_runtime, test_serving). The engine is checked
here with it on and off (it is off by default; test_families turns it on for every
family).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from kvexport.runtime.opened import open_export
from kvexport.serving import Engine, SamplingParams
from kvexport.serving.runner import ModelRunner
from tests.conftest import write_config
from tests.test_families import FAMILY_CONFIGS

CAPACITY = 48


@pytest.fixture(scope="module")
def qwen3_export(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny Qwen3 (grouped-query attention, Q/K norms, rotary outside the op) as an ort-cpu int8 export
    (per channel, asked for by name; the down projections rotated first)."""
    import dataclasses

    from kvexport import export_model
    from kvexport.export.quantization import QUANTIZATION_SCHEMES

    config = write_config(tmp_path_factory.mktemp("config-qwen3"), FAMILY_CONFIGS["qwen3"])
    out = tmp_path_factory.mktemp("mixed-qwen3") / "out"
    per_channel = dataclasses.replace(QUANTIZATION_SCHEMES["int8"], per_channel=True)
    export_model(out, str(config), random_init=True, seed=5, target="ort-cpu", quantize="int8", quantization=per_channel)
    return out


def _exports(request: pytest.FixtureRequest, which: str) -> Path:
    if which == "qwen3":
        return Path(request.getfixturevalue("qwen3_export"))
    if which == "all-logits":
        return Path(request.getfixturevalue("trained_all_logits"))
    return Path(request.getfixturevalue("trained_exports")[which])


def _cache(runner: ModelRunner) -> list[np.ndarray]:
    shape = (runner.cache.slots, *runner.cache.row_shape)
    return [runner.cache.banks.host_view(0, index, shape).copy() for index in range(len(runner.cache.past))]


def _restore(runner: ModelRunner, saved: list[np.ndarray]) -> None:
    shape = (runner.cache.slots, *runner.cache.row_shape)
    for index, array in enumerate(saved):
        runner.cache.banks.host_view(0, index, shape)[...] = array


@pytest.mark.parametrize("which", ["none", "int8-pc", "int8", "kv-int8", "all-logits", "qwen3"])
def test_a_mixed_call_gives_what_a_chunk_then_a_decode_call_give(request: pytest.FixtureRequest, which: str) -> None:
    """Slots 0 and 2 decode; slot 1, between them, takes its prompt's second chunk in the same call."""
    export = _exports(request, which)
    opened = open_export(export, "cpu")
    runner = ModelRunner(opened, 4, CAPACITY, mixed=True)
    assert runner.mixed_session is not None, runner.unmixed_because
    vocab = opened.manifest.dims.vocab_size
    rng = np.random.default_rng(11)
    running = {0: rng.integers(0, vocab, 9).tolist(), 2: rng.integers(0, vocab, 14).tolist()}
    prompt = rng.integers(0, vocab, 11).tolist()
    for slot, tokens in running.items():
        runner.run_piece(slot, tokens, 0)
    runner.run_piece(1, prompt[:6], 0)
    chunk = prompt[6:]
    # slot 1's decode row is not running: it writes one harmless row just past the chunk's rows
    tokens, positions = [7, 0, 3], [9, len(prompt), 14]
    before = _cache(runner)

    want_prompt = runner.run_piece(1, chunk, 6)
    want_decode = runner.decode(tokens, positions).astype(np.float32)
    want_cache = _cache(runner)
    _restore(runner, before)
    got_prompt, got_decode = runner.mixed(1, chunk, 6, tokens, positions)

    assert got_prompt.shape == want_prompt.shape == ((len(chunk) if which == "all-logits" else 1), vocab)
    np.testing.assert_allclose(got_prompt, want_prompt, rtol=1e-4, atol=1e-4)
    # row 1's logits are the harmless row's: not compared
    np.testing.assert_allclose(got_decode[[0, 2]].astype(np.float32), want_decode[[0, 2]], rtol=1e-4, atol=1e-4)
    assert got_decode[[0, 2]].argmax(-1).tolist() == want_decode[[0, 2]].argmax(-1).tolist()
    got_cache = _cache(runner)
    for got, want in zip(got_cache, want_cache, strict=True):  # every real row: the chunk's and the decoded tokens'
        tolerance = 1 if got.dtype == np.int8 else 1e-4  # an int8 cache may round one step apart
        for slot, length in ((0, 10), (1, len(prompt)), (2, 15)):
            np.testing.assert_allclose(got[slot, :, :length].astype(np.float32), want[slot, :, :length].astype(np.float32), atol=tolerance, rtol=1e-4)


@pytest.mark.parametrize(("scheme", "mixed"), [("int8-pc", True), ("int8-pc", False), ("none", True), ("int8", True), ("kv-int8", True)])
def test_the_engine_gives_the_same_tokens_with_and_without_the_mixed_step(
    trained_exports: dict[str, Path], scheme: str, mixed: bool
) -> None:
    """Three streams decode while a 90-token prompt arrives in 16-token chunks, each as it runs alone."""
    rng = np.random.default_rng(2)
    export = trained_exports[scheme]
    short = [rng.integers(0, 2048, n).tolist() for n in (5, 8, 12)]
    long = rng.integers(0, 2048, 90).tolist()
    greedy = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    with Engine(export, slots=4, max_context=128, chunk=16, step_ms=1, mixed_step=mixed, warm_up=0) as alone_engine:
        want = [alone_engine.submit(p, greedy).result()[0] for p in [*short, long]]  # one at a time
    with Engine(export, slots=4, max_context=128, chunk=16, step_ms=1, mixed_step=mixed, warm_up=0) as engine:
        streams = [iter(engine.submit(p, greedy)) for p in short]
        heads = [[next(stream).token_id] for stream in streams]  # all three decoding now
        late = engine.submit(long, greedy)
        got = [head + [event.token_id for event in stream] for head, stream in zip(heads, streams, strict=True)]
        got.append(late.result()[0])
        stats = engine.stats()
    assert got == want
    if mixed:  # the long prompt's chunks carried the others' decode rows
        assert stats.mixed_steps >= 3
    else:
        assert stats.mixed_steps == 0
