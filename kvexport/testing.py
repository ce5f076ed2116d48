"""Helpers for tests and benchmarks: graphs exported the way other tools leave them.

Not part of the deployment API: these produce *inputs* for the passes (foreign cache
names, no passes run) and assemble export directories around rewritten graphs so that
:func:`kvexport.verify` can check them against PyTorch.
"""

from __future__ import annotations

import shutil
from collections.abc import Callable
from pathlib import Path


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


FOREIGN_STYLES: dict[str, Callable[[str], str]] = {"optimum": _optimum, "split": _split_style, "torch_flat": _torch_flat}


def export_foreign(
    out: Path, config: Path, seed: int, style: str, exporter: str = "torchscript"
) -> Path:
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
    refresh_file_record(out)
    return out


def refresh_file_record(directory: Path) -> None:
    """Record the directory's files anew in its manifest, after a test replaced some on purpose."""
    from kvexport.integrity import record_files
    from kvexport.manifest import read_manifest

    manifest = read_manifest(directory)
    manifest.files = record_files(directory)
    manifest.write(directory)
