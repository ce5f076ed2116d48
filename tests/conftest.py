"""Shared fixtures: tiny GPT-2s built in code (seeded random weights), exported once per session."""

from __future__ import annotations

import functools
import json
import os
import shutil
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

if TYPE_CHECKING:
    from kvexport import VerifyReport

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

# 3 heads of dim 16, vocab 50257 (GPT-2's: odd, not a multiple of 8; gets the bundled tokenizer).
TINY = {
    "model_type": "gpt2",
    "n_layer": 2,
    "n_head": 3,
    "n_embd": 48,
    "vocab_size": 50257,
    "n_positions": 64,
}
# A second shape: 3 layers, 1 head of dim 32, a small odd vocab (no tokenizer).
TINY_ODD = {
    "model_type": "gpt2",
    "n_layer": 3,
    "n_head": 1,
    "n_embd": 32,
    "vocab_size": 1001,
    "n_positions": 48,
}


def write_config(directory: Path, config: dict[str, object]) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / "config.json"
    path.write_text(json.dumps(config))
    return path


@pytest.fixture(scope="session")
def tiny_config(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_config(tmp_path_factory.mktemp("tiny-config"), TINY)


@pytest.fixture(scope="session")
def tiny_odd_config(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_config(tmp_path_factory.mktemp("tiny-odd-config"), TINY_ODD)


@pytest.fixture(scope="session")
def tiny_export(tmp_path_factory: pytest.TempPathFactory, tiny_config: Path) -> Path:
    """The tiny model exported with the default (dynamo) strategy; treat as read-only."""
    from kvexport import export_gpt2

    out = tmp_path_factory.mktemp("exports") / "tiny"
    export_gpt2(out, str(tiny_config), random_init=True, seed=1)
    return out


@pytest.fixture(scope="session")
def tiny_ort_export(tmp_path_factory: pytest.TempPathFactory, tiny_config: Path) -> Path:
    """The tiny model (seed 1, as ``tiny_export``) for --target ort-cpu: fused, in-place cache; read-only."""
    from kvexport import export_gpt2

    out = tmp_path_factory.mktemp("exports") / "tiny-ort-cpu"
    export_gpt2(out, str(tiny_config), random_init=True, seed=1, target="ort-cpu")
    return out


TRAINED = Path(__file__).parent / "data" / "tiny-trained"
SMOLLM2_EXPORT = Path(__file__).resolve().parent.parent / "out" / "smollm2"


@pytest.fixture(scope="session")
def smollm2_export() -> Path:
    """``out/smollm2``: SmolLM2-135M-Instruct from its GGUF, as ``scripts/demo.sh`` (CI's main job) leaves it; exported here where it is missing."""
    if not (SMOLLM2_EXPORT / "kvexport.json").is_file():
        from kvexport import export_model
        from kvexport.runtime.kernels import cache_root
        from kvexport.testing import smollm2_gguf

        export_model(SMOLLM2_EXPORT, str(smollm2_gguf(cache_root() / "smollm2")), target="ort-cpu", force=True)
    return SMOLLM2_EXPORT


@pytest.fixture(scope="session")
def trained_exports(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The trained test model as ort-cpu exports (in-place cache); read-only.

    Float and int4 weights; int8 in blocks (``int8``: what ``--quantize int8`` gives) and per channel
    (``int8-pc``, asked for by name: ``--per-channel``); fp32 weights with an int8
    and an int4 cache (``kv-int8``, ``kv-int4``).
    """
    import dataclasses

    from kvexport import export_gpt2
    from kvexport.export.quantization import QUANTIZATION_SCHEMES

    root = tmp_path_factory.mktemp("trained")
    exports = {
        scheme: export_gpt2(root / scheme, str(TRAINED), target="ort-cpu", quantize=scheme).out_dir  # type: ignore[arg-type]
        for scheme in ("none", "int4")
    }
    exports["int8"] = export_gpt2(root / "int8", str(TRAINED), target="ort-cpu", quantize="int8").out_dir
    per_channel = dataclasses.replace(QUANTIZATION_SCHEMES["int8"], per_channel=True)
    exports["int8-pc"] = export_gpt2(
        root / "int8-pc", str(TRAINED), target="ort-cpu", quantize="int8", quantization=per_channel
    ).out_dir
    for kind in ("int8", "int4"):
        exports[f"kv-{kind}"] = export_gpt2(root / f"kv-{kind}", str(TRAINED), target="ort-cpu", kv_cache=kind).out_dir
    return exports


@pytest.fixture(scope="session")
def trained_all_logits(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The trained test model as an in-place ort-cpu export with --all-logits (speculative decoding); read-only."""
    from kvexport import export_gpt2

    return export_gpt2(tmp_path_factory.mktemp("trained") / "all-logits", str(TRAINED), target="ort-cpu", all_logits=True).out_dir


@pytest.fixture(scope="session")
def tiny_odd_torchscript_export(
    tmp_path_factory: pytest.TempPathFactory, tiny_odd_config: Path
) -> Path:
    """The odd-shaped model through the TorchScript strategy; treat as read-only."""
    from kvexport import export_gpt2

    out = tmp_path_factory.mktemp("exports") / "tiny-odd-ts"
    export_gpt2(out, str(tiny_odd_config), random_init=True, seed=2, exporter="torchscript")
    return out


def copy_with_swapped_graphs(export: Path, out: Path) -> Path:
    """A copy of an export whose manifest names prefill.onnx as decode and the reverse."""
    shutil.copytree(export, out)
    data = json.loads((out / "kvexport.json").read_text())
    data["graphs"]["prefill"]["file"], data["graphs"]["decode"]["file"] = (
        "decode.onnx",
        "prefill.onnx",
    )
    (out / "kvexport.json").write_text(json.dumps(data))
    return out





@functools.cache
def heldout_report(export: Path, steps: int) -> VerifyReport:
    """``verify`` of a read-only session export over ``steps`` steps and the trained model's whole held-out text, once
    a session: tests that compare exports read the same report."""
    from kvexport import verify

    return verify(export, steps=steps, text=TRAINED / "heldout.txt", text_tokens=100_000, record=False)
