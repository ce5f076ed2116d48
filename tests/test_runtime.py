"""The Generator: parity with transformers' generate, IO-bound cache buffers, sampling, EOS, errors."""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path

import numpy as np
import onnx
import pytest
import torch
from click.testing import CliRunner

from kvexport import KvexportError
from kvexport.cli import main
from kvexport.models.gpt2 import load_gpt2
from kvexport.runtime import Generator, SamplingConfig, choose_tokens
from kvexport.runtime.prepacked import CACHE_DIR, DATA_FILE
from tests.conftest import TINY
from tests.torchless import SERVING_IMAGE, refused, run_without


@pytest.fixture(scope="module")
def generator(tiny_export: Path) -> Generator:
    return Generator(tiny_export)


def _hf_generate(generator: Generator, rows: list[list[int]], new_tokens: int) -> np.ndarray:
    model = load_gpt2(generator.manifest.source)
    width = max(map(len, rows))
    ids = torch.tensor([[0] * (width - len(r)) + r for r in rows])
    mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows])
    with torch.no_grad():
        out = model.generate(
            ids, attention_mask=mask, max_new_tokens=new_tokens, do_sample=False, pad_token_id=0
        )
    return out[:, width:].numpy()


def test_greedy_matches_transformers_for_a_ragged_left_padded_batch(generator: Generator) -> None:
    rows = [[464, 6766, 318, 4171, 290], [40, 1101], [1, 2, 3]]
    out = generator.generate(rows, 12, eos_token_id=-1)
    assert out.shape == (3, 5 + 12)
    np.testing.assert_array_equal(out[:, 5:], _hf_generate(generator, rows, 12))
    # the prompt part is left-padded with the pad (EOS) id
    assert out[1, :3].tolist() == [50256] * 3 and out[1, 3:5].tolist() == [40, 1101]


def test_cache_stays_in_two_preallocated_banks_and_is_handed_over_by_pointer(
    generator: Generator,
) -> None:
    steps = 6
    traced = Generator(generator.directory, trace_cache=True)
    list(traced.stream([[5, 6, 7]], steps, eos_token_id=-1))
    trace = traced.last_stats.cache_pointers  # prefill outputs, then (past, present) per decode step
    assert generator.last_stats.cache_pointers == []  # untraced by default
    assert len(trace) == 1 + 2 * (steps - 1)
    banks = {frozenset(t.values()) for t in trace}
    assert len(banks) == 2  # exactly two sets of buffers for the whole generation
    for previous, following in zip(trace[0::2], trace[1::2], strict=False):
        # each step reads its past from the very buffers the previous step wrote its present to
        assert [previous[n.replace("past", "present")] for n in following] == list(
            following.values()
        )


def test_shared_buffer_cache_is_one_buffer_read_and_written_in_place(
    tiny_ort_export: Path, generator: Generator
) -> None:
    shared = Generator(tiny_ort_export, trace_cache=True)
    assert shared.manifest.cache_layout == "shared-buffer"
    rows = [[464, 6766, 318, 4171, 290], [40, 1101]]
    out = shared.generate(rows, 8, eos_token_id=-1)
    np.testing.assert_array_equal(out, generator.generate(rows, 8, eos_token_id=-1))
    np.testing.assert_array_equal(out[:, 5:], _hf_generate(generator, rows, 8))
    # prefill past, prefill present, decode past, decode present: decode is bound once for all steps
    trace = shared.last_stats.cache_pointers
    assert len(trace) == 4
    assert len({frozenset(t.values()) for t in trace}) == 1  # one buffer set, never another
    for bound in trace:
        assert len(set(bound.values())) == 2 * TINY["n_layer"]  # one buffer per cache tensor
    for past, present in zip(trace[0::2], trace[1::2], strict=True):
        # present.l.key is bound to the very buffer past.l.key reads
        assert [present[n.replace("past", "present")] for n in past] == list(past.values())


def test_sampling_is_deterministic_with_a_seed(generator: Generator) -> None:
    options = {"do_sample": True, "temperature": 5.0, "top_k": 0, "top_p": 1.0, "eos_token_id": -1}
    first = generator.generate([[1, 2, 3]], 10, seed=123, **options)
    again = generator.generate([[1, 2, 3]], 10, seed=123, **options)
    other = generator.generate([[1, 2, 3]], 10, seed=124, **options)
    np.testing.assert_array_equal(first, again)
    assert not np.array_equal(first, other)


def test_top_k_1_and_tiny_top_p_are_greedy() -> None:
    logits = np.random.default_rng(0).normal(size=(4, 97)).astype(np.float32)
    greedy = logits.argmax(-1)
    rng = np.random.default_rng(1)
    np.testing.assert_array_equal(
        choose_tokens(logits, SamplingConfig(do_sample=True, top_k=1), rng), greedy
    )
    np.testing.assert_array_equal(
        choose_tokens(logits, SamplingConfig(do_sample=True, top_p=1e-6), rng), greedy
    )
    # top_k=5 only ever picks among the five best
    top5 = np.argsort(-logits, -1)[:, :5]
    for _ in range(50):
        picked = choose_tokens(
            logits, SamplingConfig(do_sample=True, top_k=5, temperature=3.0), rng
        )
        assert all(p in row for p, row in zip(picked, top5, strict=True))


def test_each_row_stops_at_its_eos(generator: Generator) -> None:
    rows = [[464, 6766, 318], [40, 1101, 11]]
    free = generator.generate(rows, 8, eos_token_id=-1)[:, 3:]
    # call EOS the first token of row 0 that neither appeared earlier in row 0 nor anywhere in row 1
    k = next(
        i
        for i in range(8)
        if free[0, i] not in free[0, :i].tolist() and free[0, i] not in free[1].tolist()
    )
    eos = int(free[0, k])
    out = generator.generate(rows, 8, eos_token_id=eos)[:, 3:]
    assert out[0, :k].tolist() == free[0, :k].tolist()
    assert (out[0, k:] == eos).all()  # the finished row is padded with EOS
    np.testing.assert_array_equal(out[1], free[1])  # the other row is unaffected
    # when every row has finished, the stream ends early
    steps = list(generator.stream([rows[0]], 8, eos_token_id=eos))
    assert len(steps) == k + 1 and int(steps[-1][0]) == eos


def test_streamed_text_is_transformers_greedy_text(generator: Generator) -> None:
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(generator.directory / "tokenizer.json"))
    prompt_ids = tokenizer.encode("The sky is").ids
    assert prompt_ids == [464, 6766, 318]
    reference = tokenizer.decode(_hf_generate(generator, [prompt_ids], 6)[0].tolist())
    started = time.perf_counter()
    pieces = list(generator.stream_text("The sky is", 6, eos_token_id=-1))
    elapsed = time.perf_counter() - started
    assert "".join(pieces) == reference
    stats = generator.last_stats
    # the first token's time, then one timed step per further token, all inside the call
    assert (stats.new_tokens, stats.prompt_tokens, stats.batch, len(stats.step_s)) == (6, 3, 1, 5)
    assert stats.decode_s == pytest.approx(sum(stats.step_s))
    assert stats.decode_ms_per_token == pytest.approx(1000 * stats.decode_s / 5)
    assert 0 < stats.ttft_s and stats.ttft_s + stats.decode_s <= elapsed
    assert stats.tokens_per_s == pytest.approx(6 / (stats.ttft_s + stats.decode_s))


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda g: g.generate([], 4), "the prompt is empty; pass at least one token"),
        (lambda g: g.generate([[1, 2], []], 4), "the prompt is empty; pass at least one token"),
        (
            lambda g: g.generate([1, 50257], 4),
            r"token id 50257 is out of vocabulary \(its 50257 tokens are 0..50256\)",
        ),
        (lambda g: g.generate([-3, 1], 4), r"token id -3 is out of vocabulary"),
        (
            lambda g: g.generate([1] * 60, 5),
            r"this model's maximum context length is 64 tokens, but 65 were requested \(60 in the prompt, 5 for",
        ),
        (lambda g: g.generate([1, 2], 0), "max_new_tokens 0: must be a positive integer"),
        (lambda g: g.generate([1, 2], -2), "max_new_tokens -2: must be a positive integer"),
        (
            lambda g: g.generate([1, 2], 3, do_sample=True, top_p=0.0),
            r"top_p 0.0: must be in \(0, 1\]",
        ),
        (
            lambda g: g.generate([1, 2], 3, do_sample=True, temperature=0),
            "temperature 0: must be > 0",
        ),
        (lambda g: g.generate_text("", 3), "the prompt is empty; pass some text"),
    ],
)
def test_bad_generation_input_is_one_clear_error(
    generator: Generator, call: object, message: str
) -> None:
    with pytest.raises(KvexportError, match=message):
        call(generator)  # type: ignore[operator]


def test_generate_command_streams_text_and_reports_speed(tiny_export: Path) -> None:
    result = CliRunner().invoke(
        main, ["generate", str(tiny_export), "--prompt", "The sky is", "--max-new-tokens", "5"]
    )
    assert result.exit_code == 0, result.output
    assert result.stdout.startswith("The sky is")
    assert "tokens/s" in result.stderr and "TTFT" in result.stderr
    empty = CliRunner().invoke(main, ["generate", str(tiny_export), "--prompt", ""])
    assert (
        empty.exit_code == 2 and empty.stderr.strip() == "Error: --prompt is empty; pass some text"
    )
    too_long = CliRunner().invoke(main, ["generate", str(tiny_export), "--prompt", "word " * 70])
    assert too_long.exit_code == 2
    assert too_long.stderr.strip() == (
        "Error: this model's maximum context length is 64 tokens, but 121 were requested (71 in the prompt, "
        "50 for the completion); shorten the prompt or ask for fewer tokens; or truncate the prompt "
        "(truncate=True, --truncate)"
    )
    truncated = CliRunner().invoke(
        main,
        ["generate", str(tiny_export), "--prompt", "word " * 70, "--max-new-tokens", "4", "--truncate"],
    )
    assert truncated.exit_code == 0, truncated.output
    assert "prompt 60;" in truncated.stderr  # 64 positions - 4 new tokens


def test_truncate_keeps_the_last_tokens_and_matches_the_short_prompt(tiny_export: Path) -> None:
    generator = Generator(tiny_export)
    prompt = list(range(100, 170))  # 70 tokens > 64 positions
    with pytest.raises(KvexportError, match="maximum context length is 64 tokens, but 74 were requested"):
        generator.generate(prompt, 4)
    truncated = generator.generate(prompt, 4, truncate=True)
    assert truncated.shape == (1, 64)
    np.testing.assert_array_equal(truncated, generator.generate(prompt[-60:], 4))
    with pytest.raises(KvexportError, match="but 134 were requested \\(70 in the prompt, 64 for the completion\\); shorten the prompt or ask for fewer tokens$"):
        generator.generate(prompt, 64, truncate=True)  # nothing of the prompt would fit


def test_bench_writes_json_and_plot_with_every_system(
    tiny_export: Path, tiny_ort_export: Path, tmp_path: Path
) -> None:
    results = tmp_path / "bench"
    export = shutil.copytree(tiny_export, tmp_path / "export")  # the pre-packed cache goes in it
    result = CliRunner().invoke(
        main,
        [
            "bench",
            str(export),
            "--compare",
            str(tiny_ort_export),
            "--contexts",
            "8,24",
            "--batches",
            "1,2",
            "--new-tokens",
            "3",
            "--repeats",
            "1",
            "--results",
            str(results),
        ],
    )
    assert result.exit_code == 0, result.output
    data = json.loads((results / "bench.json").read_text())
    systems = {(m["system"], m["batch"], m["context"]) for m in data["measurements"]}
    systems_named = (
        "kvexport", "kvexport-prepacked", "kvexport-shared", "kvexport[ort]", "pytorch", "no-cache", "floor", "floor[ort]",
    )
    for system in systems_named:
        for batch in (1, 2):
            for context in (8, 24):
                assert (system, batch, context) in systems
    decode = {(m["system"], m["batch"], m["context"]): m["decode_ms_per_token"] for m in data["measurements"]}
    for name, system, baseline in (
        ("decode_vs_floor_ctx8", "kvexport", "floor"),
        ("decode_kvexport[ort]_vs_kvexport_ctx8", "kvexport[ort]", "kvexport"),
        ("decode_kvexport-prepacked_vs_kvexport_ctx8", "kvexport-prepacked", "kvexport"),
    ):  # each headline ratio is the two batch-1 measurements it names
        assert data["ratios"][name] == pytest.approx(decode[(system, 1, 8)] / decode[(baseline, 1, 8)], abs=1.5e-3)
    assert set(data["variant_memory"]) == {"kvexport-prepacked", "kvexport-shared", "kvexport[ort]"}
    assert data["disk_bytes"]["kvexport[ort]"] == sum(
        f.stat().st_size for f in tiny_ort_export.iterdir() if f.is_file()
    )
    floors = {(m["system"], m["batch"], m["context"]): m["decode_ms_per_token"] for m in data["measurements"]}
    for floor in ("floor", "floor[ort]"):  # one bandwidth for the run: the floor grows with the cache
        assert floors[(floor, 1, 8)] < floors[(floor, 1, 24)] < floors[(floor, 2, 24)]
    weights = json.loads((tiny_export / "kvexport.json").read_text())["weights"]["bytes"]
    assert floors[("floor", 1, 8)] == pytest.approx(
        1000 * (weights + 2 * TINY["n_layer"] * 8 * TINY["n_embd"] * 4) / (data["bandwidth_gb_s"] * 1e9), rel=0.01
    )
    # PSS counts a page mapped twice in one process once, RSS once per mapping: within one
    # reading PSS is never above RSS. (Growths are differences of two readings each, which
    # other work on the machine can skew either way, so they are only recorded.)
    assert 0 < data["pss_after_load_mb"] <= data["rss_after_load_mb"]
    assert data["ratios"]["generator_rss_vs_weights"] == pytest.approx(
        data["generator_rss_mb"] * 2**20 / weights, abs=1.5e-3
    )
    assert (results / "bench.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_bench_times_the_engine_with_and_without_a_cached_prefix(tiny_ort_export: Path, tmp_path: Path) -> None:
    results = tmp_path / "bench"
    args = ["bench", str(tiny_ort_export), "--no-baselines", "--no-memory-variants", "--contexts", "8", "--batches", "1"]
    args += ["--new-tokens", "2", "--repeats", "1", "--prefix", "40", "--results", str(results)]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 0, result.output
    data = json.loads((results / "bench.json").read_text())
    ttft = {m["system"]: m["ttft_ms"] for m in data["measurements"] if m["context"] == 40 + 16}
    assert set(ttft) == {"engine[cold]", "engine[prefix-cached]"} and all(t > 0 for t in ttft.values())
    assert data["ratios"]["ttft_prefix_cached_vs_cold"] == pytest.approx(
        ttft["engine[prefix-cached]"] / ttft["engine[cold]"], abs=1.5e-3
    )


def test_bench_compare_refuses_other_weights(tiny_export: Path, tiny_odd_torchscript_export: Path) -> None:
    result = CliRunner().invoke(
        main, ["bench", str(tiny_export), "--compare", str(tiny_odd_torchscript_export)]
    )
    assert result.exit_code == 2
    assert result.stderr.strip() == (
        f"Error: --compare {tiny_odd_torchscript_export}: holds other weights than {tiny_export}; "
        "compare exports of the same model"
    )


def test_shared_weights_generator_gives_the_same_tokens(
    tiny_export: Path, generator: Generator
) -> None:
    shared = Generator(tiny_export, share_weights=True)
    rows = [[464, 6766, 318], [40]]
    np.testing.assert_array_equal(
        shared.generate(rows, 8, eos_token_id=-1), generator.generate(rows, 8, eos_token_id=-1)
    )


def test_one_generator_used_from_two_threads_matches_serial_use(generator: Generator) -> None:
    import threading

    prompts = [[[464, 6766, 318]], [[40, 1101, 11, 2]]]
    serial = [generator.generate(p, 10, eos_token_id=-1) for p in prompts]
    results: dict[int, np.ndarray] = {}

    def work(index: int) -> None:
        for _ in range(5):
            results[index] = generator.generate(prompts[index], 10, eos_token_id=-1)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    for index, expected in enumerate(serial):
        np.testing.assert_array_equal(results[index], expected)


def test_prepacked_generator_maps_one_shared_file_and_gives_the_same_tokens(
    tiny_export: Path, generator: Generator, tmp_path: Path
) -> None:
    export = shutil.copytree(tiny_export, tmp_path / "export")
    prepacked = Generator(export, prepacked=True)
    rows = [[464, 6766, 318], [40]]
    np.testing.assert_array_equal(
        prepacked.generate(rows, 8, eos_token_id=-1), generator.generate(rows, 8, eos_token_id=-1)
    )
    (cache,) = (export / CACHE_DIR).iterdir()
    assert sorted(p.name for p in cache.iterdir()) == ["decode.onnx", "prefill.onnx", DATA_FILE]
    placed: dict[str, dict[str, dict[str, str]]] = {}
    for graph in ("prefill", "decode"):
        model = onnx.load(str(cache / f"{graph}.onnx"), load_external_data=False)
        placed[graph] = {
            t.name: {e.key: e.value for e in t.external_data} for t in model.graph.initializer if t.external_data
        }
        for entries in placed[graph].values():
            assert entries["location"] == DATA_FILE and int(entries["offset"]) % 4096 == 0
    packed = {name for name, e in placed["decode"].items() if "prepacked_0" in e}
    assert packed  # ONNX Runtime wrote the GEMM weights' packed form
    # one region per weight and per packed form, whichever graph points at it
    for name in set(placed["prefill"]) & set(placed["decode"]):
        assert placed["prefill"][name] == placed["decode"][name]
    built = (cache / DATA_FILE).stat().st_mtime_ns
    command = ["generate", str(export), "--prompt", "The sky is", "--max-new-tokens", "6"]
    plain, packed = (CliRunner().invoke(main, command + extra) for extra in ([], ["--prepacked"]))
    assert packed.exit_code == 0, packed.output
    assert packed.stdout == plain.stdout and packed.stdout.startswith("The sky is")
    assert (cache / DATA_FILE).stat().st_mtime_ns == built  # found, not rebuilt


def test_prepacked_refusals(tiny_export: Path, tmp_path: Path) -> None:
    with pytest.raises(KvexportError, match="^prepacked and share_weights are two ways"):
        Generator(tiny_export, prepacked=True, share_weights=True)
    blocker = tmp_path / "file"
    blocker.write_text("")
    with pytest.raises(KvexportError, match=f"^{blocker}: can't write the pre-packed weights cache there"):
        Generator(tiny_export, prepacked=True, prepack_dir=blocker)
    command = ["generate", str(tiny_export), "--prompt", "x", "--prepacked", "--prepack-dir", str(blocker)]
    refused = CliRunner().invoke(main, command)
    assert refused.exit_code == 2
    assert refused.stderr.startswith(f"Error: {blocker}: can't write the pre-packed weights cache there (")
    assert refused.stderr.strip().endswith("; pass another cache directory")


def test_cpu_rewrites_run_as_one_pipeline_where_each_pass_finds_its_own_nodes(tiny_export: Path, tiny_ort_export: Path) -> None:
    """The session-open rewrites are a PassManager of the passes the host wants; a pass with nothing to rewrite says so."""
    import onnx_ir as ir

    from kvexport.passes import CacheAttentionPass, PromptAttentionPass, SignedChannelsPass
    from kvexport.passes.vocabulary import CACHE_ATTENTION, GROUP_QUERY_ATTENTION, KVEXPORT_DOMAIN
    from kvexport.runtime.session import cpu_pipeline, cpu_rewrites

    every = {"signed": True, "products": True, "kernel": True}
    assert [type(p) for p in cpu_pipeline(**every)] == [SignedChannelsPass, CacheAttentionPass, PromptAttentionPass]
    assert cpu_pipeline(signed=False, products=False, kernel=False) == []
    portable = ir.load(tiny_export / "prefill.onnx")  # no attention op, no 8-bit weights: nothing for any of them
    before = [(n.domain, n.op_type, n.name) for n in portable.graph]
    assert not cpu_rewrites(portable, **every)
    assert [(n.domain, n.op_type, n.name) for n in portable.graph] == before
    in_place = ir.load(tiny_ort_export / "prefill.onnx")  # fp32 in-place attention: the kernel takes every layer
    layers = sum(n.op_type == GROUP_QUERY_ATTENTION for n in in_place.graph)
    assert layers == TINY["n_layer"] and cpu_rewrites(in_place, **every)
    assert sum((n.domain, n.op_type) == (KVEXPORT_DOMAIN, CACHE_ATTENTION) for n in in_place.graph) == layers
    assert not any(n.op_type == GROUP_QUERY_ATTENTION for n in in_place.graph)


def test_a_graph_that_only_names_an_op_is_opened_as_it_is(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """What the rewrites look for is an op (domain and type, in subgraphs too), not its name anywhere in the file."""
    from onnx import TensorProto, helper

    from kvexport.runtime import session

    value = helper.make_tensor_value_info("x", TensorProto.FLOAT, [1])
    named = helper.make_node("Identity", ["x"], ["y"], name="GroupQueryAttention", doc_string="MatMulIntegerToFloat")
    graph = helper.make_graph([named], "named", [value], [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1])])
    path = tmp_path / "named.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)], ir_version=10), str(path))
    monkeypatch.setattr(session, "cpu_rewrites", lambda *args, **kwargs: pytest.fail("a graph without the ops was rewritten"))
    assert session.cpu_graph(path, session.session_options()) == str(path)

    attention = helper.make_node("GroupQueryAttention", [], ["z"], domain="com.microsoft")
    branch = helper.make_graph([attention], "branch", [], [helper.make_tensor_value_info("z", TensorProto.FLOAT, None)])
    choice = helper.make_node("If", ["c"], ["z"], then_branch=branch, else_branch=branch)
    ops = session.graph_ops(helper.make_graph([named, choice], "g", [value], []))
    assert ops == {("", "Identity"), ("", "If"), ("com.microsoft", "GroupQueryAttention")}


_GENERATE = """
import json, kvexport
generator = kvexport.Generator(sys.argv[1])
tokens = generator.generate([[464, 6766, 318]], 5, eos_token_id=-1)
print(json.dumps({"tokens": tokens.tolist(), "text": generator.generate_text("The sky is", 5, eos_token_id=-1)}))
"""


def test_generation_needs_neither_torch_nor_transformers(generator: Generator, tiny_export: Path) -> None:
    done = run_without(SERVING_IMAGE, _GENERATE, [str(tiny_export)], timeout=120)
    assert done.returncode == 0, done.stderr
    assert refused(done) == []
    result = json.loads(done.stdout)
    expected = generator.generate([[464, 6766, 318]], 5, eos_token_id=-1)
    assert result["tokens"] == expected.tolist()
    assert result["text"] == generator.generate_text("The sky is", 5, eos_token_id=-1)


def test_any_of_the_exports_eos_tokens_ends_a_row(tiny_export: Path, tmp_path: Path) -> None:
    """Llama 3 lists several EOS tokens: the Generator ends a row on any of them (and text stops before it)."""
    plain = Generator(tiny_export)
    for prompt in ([11, 200, 3000, 7], [5, 6, 7, 8, 9], [40000, 2, 31, 900]):
        free = plain.generate([prompt], 6, eos_token_id=-1, do_sample=True, seed=0)[0, len(prompt):].tolist()
        # the first token that the row has not produced before: made an EOS, it ends the row there
        stop = next((i for i in range(1, 6) if free[i] not in free[:i]), None)
        if stop is not None:
            break
    assert stop is not None, "no prompt gave a new token after its first"
    export = shutil.copytree(tiny_export, tmp_path / "export")
    manifest = json.loads((export / "kvexport.json").read_text())
    first = next(t for t in range(50257) if t not in free)  # an EOS this prompt never produces
    manifest["tokenizer"]["eos_token_id"] = first
    manifest["tokenizer"]["eos_token_ids"] = [first, free[stop]]
    (export / "kvexport.json").write_text(json.dumps(manifest))
    generator = Generator(export)
    got = generator.generate([prompt], 6, do_sample=True, seed=0)[0, len(prompt):].tolist()  # the same draws
    assert got == free[: stop + 1]  # the row ended on the second EOS, and with it the generation
    text = "".join(generator.stream_text(generator.tokenizer.decode(prompt), 6, do_sample=True, seed=0))  # type: ignore[union-attr]
    assert text == generator.tokenizer.decode(free[:stop])  # type: ignore[union-attr]
