"""The CLI through CliRunner: help everywhere, export + verify + inspect, exact errors."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from kvexport.cli import main
from kvexport.runtime.session import cuda_available

from .conftest import copy_with_swapped_graphs


def test_every_command_has_help() -> None:
    result = CliRunner().invoke(main, ["--help"])
    assert result.exit_code == 0
    for name, command in main.commands.items():
        assert command.help, name
        sub = CliRunner().invoke(main, [name, "--help"])
        assert sub.exit_code == 0 and "Usage:" in sub.output, name


def test_the_export_options_are_the_export_choices_fields() -> None:
    """Each ExportChoices field with a flag is an option of both export commands, its help and choices from the field."""
    import dataclasses

    from kvexport.export.choices import ExportChoices

    for command in ("export", "gpt2"):
        options = {o.name: o for o in main.commands[command].params}
        for field in dataclasses.fields(ExportChoices):
            flag = field.metadata["flag"]
            if flag is None:
                continue
            option = options[field.name]
            assert option.opts[0] == flag and option.help is not None and option.help.startswith(field.metadata["help"]), field.name
            choices = getattr(option.type, "choices", None)
            assert tuple(choices or ()) == tuple(field.metadata["choices"]), field.name
            default = field.default.value if hasattr(field.default, "value") else field.default
            assert option.default == default, field.name


def test_export_choices_refuse_a_choice_and_an_option_they_do_not_have(tmp_path: Path) -> None:
    from kvexport import export_model
    from kvexport.errors import KvexportError
    from kvexport.export.choices import ExportChoices, TargetKind

    assert ExportChoices(target="ort-cpu").target is TargetKind.ORT_CPU  # strings become the Enums
    with pytest.raises(KvexportError, match=r"^--kv-cache int3: choose from fp32, fp16, int8, int4$"):
        ExportChoices(kv_cache="int3")
    with pytest.raises(KvexportError, match=r"^unknown export option strategies; choose from random_init, "):
        export_model(tmp_path / "out", "gpt2", random_init=True, strategies=["dynamo"])
    assert not (tmp_path / "out").exists()


def test_export_verify_inspect_round_trip(tmp_path: Path, tiny_odd_config: Path) -> None:
    out = tmp_path / "model"
    runner = CliRunner()
    exported = runner.invoke(
        main, ["gpt2", "--out", str(out), "--random-init", "--model", str(tiny_odd_config)]
    )
    assert exported.exit_code == 0, exported.output
    assert f"to {out}" in exported.stdout
    assert "kvexport: exporting decode graph (dynamo)" in exported.stderr  # progress goes to stderr
    verified = runner.invoke(main, ["verify", str(out), "--steps", "3"])
    assert verified.exit_code == 0, verified.output
    assert verified.stdout.strip().splitlines()[-1].startswith("PASS: cpu, fp32, 3 steps")
    as_json = runner.invoke(main, ["verify", str(out), "--steps", "2", "--json"])
    report = json.loads(as_json.stdout)
    assert as_json.exit_code == 0 and report["ok"] is True and report["failures"] == []
    inspected = runner.invoke(main, ["inspect", str(out)])
    assert inspected.exit_code == 0
    assert "in  past.{0..2}.key|value" in inspected.stdout and "ops: " in inspected.stdout
    assert "last verify: PASS" in inspected.stdout
    single = runner.invoke(main, ["inspect", str(out / "decode.onnx"), "--json"])
    graph = json.loads(single.stdout)["graphs"]["decode"]
    assert graph["nodes"] == sum(graph["ops"].values())


def test_verify_exit_code_is_1_when_a_check_fails(tmp_path: Path, tiny_export: Path) -> None:
    out = copy_with_swapped_graphs(tiny_export, tmp_path / "broken")
    result = CliRunner().invoke(main, ["verify", str(out)])
    assert result.exit_code == 1
    assert (
        "FAIL prefill: takes past inputs; prefill and decode graphs may be swapped" in result.stdout
    )
    assert result.stdout.strip().splitlines()[-1].startswith("FAIL")


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (
            ["verify", "{tmp}/nope"],
            "Error: {tmp}/nope: no such directory; pass a directory made by `kvexport export` or `kvexport import`",
        ),
        (["inspect", "{tmp}/nope.onnx"], "Error: {tmp}/nope.onnx: no such file or directory"),
        (
            ["gpt2", "--out", "{tmp}/o", "--model", "./missing-model"],
            "Error: --model ./missing-model: no such directory; pass an existing model directory, a hub id, or --random-init",
        ),
        (
            ["gpt2", "--out", "{tmp}/o", "--random-init", "--model", "gpt5"],
            "Error: --random-init --model gpt5: not a preset (gpt2, distilgpt2, gpt2-medium, gpt2-large, gpt2-xl) "
            "and no config.json there; name a preset or a GPT-2 config file",
        ),
        (
            ["gpt2", "--out", "{tmp}/o", "--random-init", "--attention", "ort"],
            "Error: --target portable --attention ort: ONNX Runtime's fused ops are not portable; "
            "use --target ort-cpu or ort-cuda",
        ),
        (
            ["rewrite", "{tmp}/nope.onnx", "{tmp}/out.onnx"],
            "Error: {tmp}/nope.onnx: no such file; pass an .onnx graph",
        ),
        (
            ["rewrite", "{tmp}/nope.onnx", "{tmp}/out.onnx", "--passes", "rename_cache,squash"],
            "Error: --passes: unknown pass ['squash']; choose from rename_cache, transposed_weight_gemm, "
            "fold_shapes, fuse_attention, fuse_ort_block, shared_buffer_cache, pack_projections, quantize_weights, cleanup",
        ),
        (
            ["gpt2", "--out", "{tmp}/a-file/o", "--random-init"],
            "Error: --out {tmp}/a-file/o: {tmp}/a-file is not a directory; choose another path",
        ),
    ],
)
def test_bad_input_gets_one_line_and_exit_2(tmp_path: Path, args: list[str], message: str) -> None:
    (tmp_path / "a-file").write_text("not a directory")
    result = CliRunner().invoke(main, [a.format(tmp=tmp_path) for a in args])
    assert result.exit_code == 2
    assert result.stderr.strip() == message.format(tmp=tmp_path)
    assert "Traceback" not in result.output
    assert not (tmp_path / "o").exists()


def test_out_creates_missing_parents(tmp_path: Path, tiny_odd_config: Path) -> None:
    out = tmp_path / "fresh" / "clone" / "out" / "model"
    result = CliRunner().invoke(
        main, ["gpt2", "--out", str(out), "--random-init", "--model", str(tiny_odd_config)]
    )
    assert result.exit_code == 0, result.output
    assert {"prefill.onnx", "decode.onnx", "kvexport.json"} <= {p.name for p in out.iterdir()}
    assert sorted(p.name for p in out.parent.iterdir()) == ["model"]  # no temporary left beside it


def test_non_empty_out_is_refused_and_untouched(tmp_path: Path) -> None:
    out = tmp_path / "o"
    out.mkdir()
    (out / "keep.txt").write_text("precious")
    result = CliRunner().invoke(main, ["gpt2", "--out", str(out), "--random-init"])
    assert result.exit_code == 2
    assert result.stderr.strip() == (
        f"Error: --out {out.absolute()}: directory exists and is not empty; pass --force to replace it, "
        "or choose another path"
    )
    assert [p.name for p in out.iterdir()] == ["keep.txt"]


@pytest.mark.skipif(cuda_available(), reason="this machine has CUDA")
def test_cuda_provider_missing_is_an_error_not_a_fallback(tiny_export: Path) -> None:
    result = CliRunner().invoke(main, ["verify", str(tiny_export), "--provider", "cuda"])
    assert result.exit_code == 2
    assert result.stderr.strip() == (
        "Error: --provider cuda: ONNX Runtime's CUDA provider is not usable on this machine "
        "(no GPU or CUDA libraries); use --provider cpu, or auto to pick what is available"
    )
