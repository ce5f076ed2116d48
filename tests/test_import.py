"""``kvexport import``: Optimum's one-graph decoder becomes a kvexport directory that the runtime, check and verify take."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import onnx
import pytest
from click.testing import CliRunner

from kvexport import Generator, verify
from kvexport.cli import main
from kvexport.passes.fuse_attention import count_attention_ops
from kvexport.testing import run_single_graph
from kvexport.tools.check import check

FOREIGN = Path(__file__).parent / "data" / "foreign"
CHECKPOINT = FOREIGN / "checkpoint-l3"


@pytest.fixture(scope="module")
def optimum_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """What ``optimum-cli export onnx`` leaves: model.onnx, config.json and the tokenizer."""
    directory = tmp_path_factory.mktemp("optimum-export")
    shutil.copy(FOREIGN / "optimum-l3.onnx", directory / "model.onnx")
    for name in ("config.json", "tokenizer.json"):
        shutil.copy(CHECKPOINT / name, directory / name)
    return directory


def _import(source: Path, out: Path, *extra: str) -> dict[str, object]:
    result = CliRunner().invoke(main, ["import", str(source), "--out", str(out), "--json", *extra])
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)


@pytest.mark.parametrize(("attention", "cache"), [("unfused", "concat"), ("ort", "concat"), ("ort", "shared-buffer")])
def test_optimum_graph_becomes_a_directory_that_verifies(
    optimum_dir: Path, attention: str, cache: str, tmp_path: Path
) -> None:
    out = tmp_path / "imported"
    manifest = _import(optimum_dir, out, "--model", str(CHECKPOINT), "--attention", attention, "--cache", cache)
    assert manifest["model"]["source"]["kind"] == "local"  # type: ignore[index]
    assert manifest["cache"]["layout"] == cache  # type: ignore[index]
    assert manifest["genai"]["written"] == (cache == "shared-buffer")  # type: ignore[index]
    prefill = onnx.load(str(out / "prefill.onnx"), load_external_data=False)
    decode = onnx.load(str(out / "decode.onnx"), load_external_data=False)
    prefill_inputs = [i.name for i in prefill.graph.input]
    assert prefill_inputs[:3] == ["input_ids", "attention_mask", "position_ids"]
    # the in-place layout's prefill takes the empty buffers it fills; the concat one has no past
    assert len(prefill_inputs) == (3 + 6 if cache == "shared-buffer" else 3)
    assert [d.dim_value or d.dim_param for d in prefill.graph.output[0].type.tensor_type.shape.dim] == ["batch", 1, 2048]
    ids = decode.graph.input[0]
    assert [d.dim_value or d.dim_param for d in ids.type.tensor_type.shape.dim] == ["batch", 1]
    assert sum(1 for i in decode.graph.input if i.name.startswith("past.")) == 6
    # weights once: both graphs point into one file no bigger than the source graph
    data = {t.external_data[0].value for g in (prefill, decode) for t in g.graph.initializer if t.external_data}
    assert data == {"weights.onnx.data"}
    # Optimum stores the tied head a second time, transposed; the import reads the embedding
    assert not [t.name for g in (prefill, decode) for t in g.graph.initializer if list(t.dims) == [24, 2048]]
    assert (out / "weights.onnx.data").stat().st_size < 0.7 * (FOREIGN / "optimum-l3.onnx").stat().st_size
    assert (out / "tokenizer.json").is_file()
    if attention == "ort":
        import onnx_ir as ir

        for name in ("prefill", "decode"):
            assert count_attention_ops(ir.load(out / f"{name}.onnx")) == 3
    report = verify(out)
    assert report.ok, report
    assert check(out).ok


def test_generator_keeps_the_original_graphs_greedy_tokens(optimum_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "imported"
    _import(optimum_dir, out, "--attention", "ort")
    prompts = [[5, 17, 300, 42, 9, 2047], [88, 1024, 7]]
    generated = Generator(out).generate(
        np.array([[0, 0, 0, 88, 1024, 7], prompts[0]][::-1]),
        max_new_tokens=6,
        attention_mask=np.array([[1] * 6, [0, 0, 0, 1, 1, 1]]),
        eos_token_id=-1,
    )
    # the reference: Optimum's own graph, driven greedily by its own names
    tokens: list[list[int]] = []
    for _ in range(6):
        steps = run_single_graph(FOREIGN / "optimum-l3.onnx", prompts, tokens)
        tokens.append(list(steps[-1]["logits"][:, -1, :].argmax(-1)))
    assert generated[:, 6:].tolist() == np.array(tokens).T.tolist()


def test_without_checkpoint_check_runs_and_verify_says_what_it_needs(optimum_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "imported"
    manifest = _import(optimum_dir / "model.onnx", out)
    assert manifest["model"]["source"]["kind"] == "graph"  # type: ignore[index]
    assert check(out).ok
    result = CliRunner().invoke(main, ["verify", str(out)])
    assert result.exit_code == 2
    assert result.output.strip().splitlines() == [
        f"Error: {out}: imported from {optimum_dir / 'model.onnx'} without its checkpoint, so there is no "
        "PyTorch reference; import it again with --model CHECKPOINT_DIR, or run kvexport check"
    ]


def test_a_directory_without_a_graph_is_one_line_and_writes_nothing(tmp_path: Path) -> None:
    empty = tmp_path / "empty"
    empty.mkdir()
    result = CliRunner().invoke(main, ["import", str(empty), "--out", str(tmp_path / "out")])
    assert result.exit_code == 2
    assert "holds none of model.onnx" in result.output
    assert len(result.output.strip().splitlines()) == 1
    assert not (tmp_path / "out").exists()


def test_bench_times_an_import_without_checkpoint_and_says_why_pytorch_is_missing(optimum_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "imported"
    _import(optimum_dir / "model.onnx", out, "--attention", "ort")
    results = tmp_path / "bench"
    args = ["bench", str(out), "--contexts", "8", "--batches", "1", "--new-tokens", "3", "--repeats", "1", "--results", str(results)]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 0, result.output
    assert f"no PyTorch baselines: {out} was imported without its checkpoint" in result.output
    systems = {m["system"] for m in json.loads((results / "bench.json").read_text())["measurements"]}
    assert {"kvexport", "floor"} <= systems
    assert not systems & {"pytorch", "no-cache"}


def test_an_imported_graph_takes_a_quantized_cache_and_verifies(optimum_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "imported-kv8"
    manifest = _import(optimum_dir, out, "--model", str(CHECKPOINT), "--attention", "ort", "--kv-cache", "int8")
    assert manifest["cache"]["dtype"] == "int8"  # type: ignore[index]
    assert manifest["genai"]["written"] is False  # type: ignore[index]
    decode = onnx.load(str(out / "decode.onnx"), load_external_data=False)
    pasts = [i for i in decode.graph.input if i.name.startswith("past.")]
    assert len(pasts) == 6 and {i.type.tensor_type.elem_type for i in pasts} == {onnx.TensorProto.INT8}
    report = verify(out, steps=3, record=False)
    assert report.ok, report.failures()
    assert report.tolerances is not None  # judged by quality, not fp32 parity
    refused = CliRunner().invoke(main, ["import", str(optimum_dir), "--out", str(tmp_path / "o"), "--kv-cache", "int8"])
    assert refused.exit_code == 2
    assert refused.stderr.strip() == (
        "Error: --kv-cache int8 needs the in-place cache (GroupQueryAttention), not --cache concat; use ort attention (kvexport export --target ort-cpu, kvexport import --attention ort)"
    )
    assert not (tmp_path / "o").exists()
