"""The examples run against both cache layouts; onnxruntime-genai runs an in-place export as it is.

onnxruntime-genai needs the CPU ``onnxruntime`` package, which must not sit beside
``onnxruntime-gpu``: its tests run in a separate environment, ``.venv-genai`` at the
repository root, which ``scripts/install.sh`` builds with the version pinned in
``scripts/genai-requirements.txt``; they skip, saying so, where it is missing.
"""

from __future__ import annotations

import importlib.util
import json
import shutil
import subprocess
from pathlib import Path
from types import ModuleType

import pytest

from kvexport.runtime import Generator

ROOT = Path(__file__).parent.parent
GENAI_VENV = ROOT / ".venv-genai"
GENAI_REQUIREMENTS = ROOT / "scripts" / "genai-requirements.txt"
FOREIGN = ROOT / "tests" / "data" / "foreign"
PROMPT = [464, 6766, 318, 4171]


@pytest.fixture(scope="module")
def imported_export(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Optimum's one-graph decoder (tests/data/foreign) through ``kvexport import --attention ort``: in-place cache."""
    from kvexport.export.importer import import_decoder

    source = tmp_path_factory.mktemp("optimum-export")
    shutil.copy(FOREIGN / "optimum-l3.onnx", source / "model.onnx")
    for name in ("config.json", "tokenizer.json"):
        shutil.copy(FOREIGN / "checkpoint-l3" / name, source / name)
    out = tmp_path_factory.mktemp("examples") / "imported"
    import_decoder(source, out, attention="ort")
    return out


@pytest.fixture(scope="module")
def llama_ort_export(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The trained Llama (tests/data/tiny-trained-llama) exported for ort-cpu: GroupQueryAttention with 2 KV heads."""
    from kvexport import export_model

    out = tmp_path_factory.mktemp("examples") / "llama"
    export_model(out, str(ROOT / "tests" / "data" / "tiny-trained-llama"), target="ort-cpu")
    return out


def _example(name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, ROOT / "examples" / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("layout", ["concat", "shared-buffer", "shared-buffer-llama"])
def test_greedy_example_follows_the_manifest_layout(layout: str, request: pytest.FixtureRequest) -> None:
    fixture = {"concat": "tiny_export", "shared-buffer": "tiny_ort_export", "shared-buffer-llama": "llama_ort_export"}[layout]
    directory: Path = request.getfixturevalue(fixture)
    assert json.loads((directory / "kvexport.json").read_text())["cache"]["layout"] == layout.removesuffix("-llama")
    prompt = PROMPT if fixture != "llama_ort_export" else [464, 676, 318, 1171]  # position_ids too, for the Llama
    tokens = _example("greedy_onnxruntime").generate(str(directory), prompt, 10)
    expected = Generator(directory).generate([prompt], 10, eos_token_id=-1)[0, len(prompt) :]
    assert tokens == expected.tolist()


def test_genai_files_only_for_the_in_place_layout(tiny_export: Path, tiny_ort_export: Path) -> None:
    written = json.loads((tiny_ort_export / "kvexport.json").read_text())["genai"]
    assert written == {"written": True, "files": ["genai_config.json", "tokenizer_config.json"], "decoder": "prefill.onnx"}
    config = json.loads((tiny_ort_export / "genai_config.json").read_text())
    assert config["model"]["context_length"] == 64 and config["model"]["eos_token_id"] == 50256
    assert config["model"]["decoder"]["session_options"]["provider_options"] == []  # ort-cpu
    assert config["model"]["decoder"]["session_options"]["intra_op_num_threads"] == 0  # ORT picks
    assert config["search"]["past_present_share_buffer"] is True
    concat = json.loads((tiny_export / "kvexport.json").read_text())["genai"]
    assert concat["written"] is False and "concat cache layout" in concat["why"]
    assert not (tiny_export / "genai_config.json").exists()


@pytest.fixture(scope="module")
def genai_python() -> Path:
    """``.venv-genai``'s python, holding the pinned onnxruntime-genai; the test skips where the venv is missing."""
    (pinned,) = [line for line in GENAI_REQUIREMENTS.read_text().splitlines() if line and not line.startswith("#")]
    package, version = pinned.split("==")
    python = GENAI_VENV / "bin" / "python"
    if not python.exists():
        pytest.skip(f"no {GENAI_VENV.name}/ ({pinned} in an environment of its own): scripts/install.sh builds it")
    probe = f"import importlib.metadata as m, onnxruntime_genai; print(m.version({package!r}))"
    found = subprocess.run([str(python), "-c", probe], capture_output=True, text=True, timeout=120)
    assert found.returncode == 0 and found.stdout.split() == [version], (
        f"{GENAI_VENV.name}/ does not hold {pinned} ({found.stdout.strip() or found.stderr.strip()[-300:]}): "
        f"rerun scripts/install.sh"
    )
    return python


_GENAI_CASES = {"exported": "tiny_ort_export", "imported": "imported_export", "llama": "llama_ort_export"}


@pytest.mark.parametrize("which", sorted(_GENAI_CASES))
def test_onnxruntime_genai_runs_the_export_as_the_generator_does(
    which: str, genai_python: Path, request: pytest.FixtureRequest
) -> None:
    """Our own in-place exports (GPT-2 and a Llama), and Optimum's graph after ``kvexport import``."""
    directory: Path = request.getfixturevalue(_GENAI_CASES[which])
    assert json.loads((directory / "kvexport.json").read_text())["genai"]["written"]
    prompt = PROMPT if which == "exported" else [5, 17, 300, 42]
    eos = Generator(directory).eos_token_id
    done = subprocess.run(
        [str(genai_python), str(ROOT / "examples" / "genai_generate.py"), str(directory), "--ids=" + ",".join(map(str, prompt)), "12"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    tokens = json.loads(done.stdout)["tokens"]
    expected = Generator(directory).generate([prompt], 12, eos_token_id=-1)[0, len(prompt) :].tolist()
    stop = expected.index(eos) + 1 if eos in expected else 12  # onnxruntime-genai stops at EOS
    assert tokens == expected[:stop]


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_onnxruntime_genai_batches_prompts_of_different_lengths_as_the_generator_runs_each(
    family: str, genai_python: Path, request: pytest.FixtureRequest
) -> None:
    """onnxruntime-genai right-pads a batch; each row's length reaches the graph through the mask (and, for the
    Llama, each row's positions through ``position_ids``)."""
    tiny_ort_export: Path = request.getfixturevalue("tiny_ort_export" if family == "gpt2" else "llama_ort_export")
    first = PROMPT if family == "gpt2" else [464, 676, 318, 1171]  # the trained Llama has 2,048 tokens
    prompts = [first, [7, 8], [300], [5, 17, 300, 42, 9, 11]]
    done = subprocess.run(
        [str(genai_python), str(ROOT / "examples" / "genai_generate.py"), str(tiny_ort_export), "--ids=" + ";".join(",".join(map(str, p)) for p in prompts), "8"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    rows = json.loads(done.stdout)["tokens"]
    generator = Generator(tiny_ort_export)
    eos = generator.eos_token_id
    for prompt, tokens in zip(prompts, rows, strict=True):
        expected = generator.generate([prompt], 8, eos_token_id=-1)[0, len(prompt) :].tolist()
        stop = expected.index(eos) + 1 if eos in expected else 8
        assert tokens[:stop] == expected[:stop]
