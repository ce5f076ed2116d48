"""Shared fixtures: tiny GPT-2s built in code (seeded random weights), exported once per session."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest

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
def tiny_odd_torchscript_export(
    tmp_path_factory: pytest.TempPathFactory, tiny_odd_config: Path
) -> Path:
    """The odd-shaped model through the TorchScript strategy; treat as read-only."""
    from kvexport import export_gpt2

    out = tmp_path_factory.mktemp("exports") / "tiny-odd-ts"
    export_gpt2(out, str(tiny_odd_config), random_init=True, seed=2, strategies=["torchscript"])
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


# How other tools name the cache: canonical name -> foreign name.
def _optimum(name: str) -> str:
    return name.replace("past.", "past_key_values.", 1) if name.startswith("past.") else name


def _split_style(name: str) -> str:
    if name.startswith(("past.", "present.")):
        direction, layer, kind = name.split(".")
        return f"{direction}_{kind}_{layer}"
    return name


def _torch_flat(name: str) -> str:
    if name.startswith(("past.", "present.")):
        direction, layer, kind = name.split(".")
        prefix = "past_key_values" if direction == "past" else "present"
        return f"{prefix}_{layer}_{0 if kind == 'key' else 1}"
    return name


FOREIGN_STYLES = {"optimum": _optimum, "split": _split_style, "torch_flat": _torch_flat}


def export_foreign(out: Path, config: Path, seed: int, style: str, exporter: str = "torchscript") -> Path:
    """Export prefill.onnx / decode.onnx the way other tools do: their cache names, no passes.

    Uses kvexport's wrapper modules (transformers 5 keeps the cache in a DynamicCache that
    no exporter takes as IO) but nothing of kvexport's pipeline: the graphs come straight
    from ``torch.onnx.export``, as Optimum's or ONNX Runtime's scripts would leave them.
    """
    import dataclasses
    import tempfile

    import onnx_ir as ir
    import torch

    from kvexport.export import STRATEGIES, _graph_requests, _quiet_exporters
    from kvexport.models.gpt2 import ModelDims, load_gpt2, resolve_source

    rename = FOREIGN_STYLES[style]
    model = load_gpt2(resolve_source(str(config), random_init=True, seed=seed), "fp32")
    dims = ModelDims.from_config(model.config)
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as work:
        for request in _graph_requests(model, dims, False, 18):
            foreign = dataclasses.replace(
                request,
                input_names=[rename(n) for n in request.input_names],
                output_names=[rename(n) for n in request.output_names],
                dynamic_axes={rename(k): v for k, v in request.dynamic_axes.items()},
            )
            with _quiet_exporters(), torch.no_grad():
                graph = STRATEGIES[exporter].export(foreign, Path(work))
            ir.save(graph, out / f"{request.name}.onnx", external_data=f"{request.name}.onnx.data")
    return out


def kvexport_dir_with_graphs(export: Path, graphs: dict[str, Path], out: Path) -> Path:
    """A copy of ``export`` (its manifest names the weights' source) with other graph files.

    ``verify`` on it rebuilds PyTorch from the manifest and checks the given graphs.
    """
    out.mkdir(parents=True)
    for name in ("kvexport.json", "tokenizer.json"):
        if (export / name).exists():
            shutil.copy(export / name, out / name)
    for name, path in graphs.items():
        shutil.copy(path, out / f"{name}.onnx")
        data = path.parent / f"{path.name}.data"
        if data.exists():
            shutil.copy(data, out / data.name)
    return out
