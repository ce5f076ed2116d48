"""The export directory's writer: graphs, weights, tokenizer, genai files and manifest, once.

:func:`write_export_directory` is the last step of both pipelines (``kvexport export`` /
``gpt2`` and ``kvexport import``): it saves the graphs with their weights stored once,
writes the tokenizer the family ships and the onnxruntime-genai files, hashes every file
once and writes the manifest once. Everything that decides *what* is written (options,
passes, a quantized cache's calibration) has happened before it is called.
:func:`rename_dims` and :func:`tool_versions` are the small pieces both pipelines need.

Nothing here imports torch or transformers: ``rewrite`` and ``import`` run on the base
install (``pip install kvexport``); only export and verify need ``kvexport[export]``.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any

import onnx_ir as ir

from kvexport.bundle.integrity import record_files
from kvexport.bundle.manifest import GRAPH_NAMES, GraphSpec, Manifest
from kvexport.bundle.model_info import ModelDims, ModelSource
from kvexport.bundle.storage import save_with_shared_weights
from kvexport.export.genai import TOKENIZER_CONFIG, write_genai_files
from kvexport.export.options import ExportOptions
from kvexport.models.base import ModelFamily
from kvexport.progress import Progress

# The packages whose versions the manifest records, each under the distribution names it
# ships as (the first installed one counts), read from package metadata so that recording
# them imports none of them.
_VERSIONED: dict[str, tuple[str, ...]] = {
    "kvexport": ("kvexport",),
    "torch": ("torch",),
    "transformers": ("transformers",),
    "onnx": ("onnx",),
    "onnxruntime": ("onnxruntime", "onnxruntime-gpu"),
    "onnxscript": ("onnxscript",),
    "onnx_ir": ("onnx-ir",),
}


def rename_dims(model: ir.Model, mapping: dict[str, str]) -> None:
    """Rename symbolic dims everywhere (e.g. torch's ``s0 + 1`` -> ``total_sequence``)."""
    if not mapping:
        return
    values = list(model.graph.inputs) + list(model.graph.outputs)
    values += [out for node in model.graph.all_nodes() for out in node.outputs]
    for value in values:
        if value.shape is None:
            continue
        if any(isinstance(d, ir.SymbolicDim) and str(d) in mapping for d in value.shape):
            value.shape = ir.Shape(
                [ir.SymbolicDim(mapping.get(str(d), str(d))) if isinstance(d, ir.SymbolicDim) else d for d in value.shape]
            )


def tool_versions() -> dict[str, str]:
    """The installed versions of kvexport and the tools that made the graphs (absent ones left out)."""
    found: dict[str, str] = {}
    for name, distributions in _VERSIONED.items():
        for distribution in distributions:
            try:
                found[name] = version(distribution)
                break
            except PackageNotFoundError:
                continue
    return found


@dataclass(frozen=True)
class ExportRecord:
    """How the graphs were made, for the manifest: everything but the files themselves."""

    source: ModelSource
    dims: ModelDims
    weights_fingerprint: str
    options: ExportOptions
    export: dict[str, Any]  # the manifest's "export": strategy, attempts (and where imported from)
    passes: list[dict[str, Any]]
    tokenizer_dir: Path | None  # where the model's own tokenizer is, if anywhere
    started: float  # time.perf_counter() when the work began
    family: ModelFamily  # whose tokenizer and chat template ship, and who rebuilds the reference
    all_logits: bool | None = None  # None: the options' choice
    # the manifest's cache record for a quantized cache (calibration's result); None: a float cache
    cache_quantization: dict[str, Any] | None = None
    # what the manifest names as the tokenizer's source where ``tokenizer_dir`` is scratch (a GGUF's)
    tokenizer_origin: str | None = None


# a quantized cache is not known to load in onnxruntime-genai (not tried: it needs the CPU
# onnxruntime package, an environment of its own)
GENAI_NOT_TRIED = (
    "onnxruntime-genai has not been tried on {family} exports (it needs an environment of its own), "
    "so no genai_config.json is written"
)
GENAI_QUANTIZED_CACHE = "a quantized KV cache: not known to load in onnxruntime-genai, so no genai_config.json is written"


def write_export_directory(
    directory: Path, graphs: dict[str, ir.Model], record: ExportRecord, progress: Progress
) -> Manifest:
    """Write a complete export into ``directory`` (an empty temporary directory), each file once.

    The graphs and their weights (stored once for both), the tokenizer, the
    onnxruntime-genai files, and last the manifest with every file's size and sha256.
    """
    options = record.options
    opset = graphs["decode"].opset_imports.get("", options.opset)
    specs = {name: GraphSpec.from_model(f"{name}.onnx", graphs[name]) for name in GRAPH_NAMES}
    progress("writing graphs and shared weights")
    weights = save_with_shared_weights(graphs, directory)
    tokenizer_info = _write_tokenizer(directory, record, progress)
    cache = {**options.cache_record(), **(record.cache_quantization or {})}
    if not record.family.genai_tried:
        genai = {"written": False, "why": GENAI_NOT_TRIED.format(family=record.family.name)}
    elif record.cache_quantization is not None:
        genai = {"written": False, "why": GENAI_QUANTIZED_CACHE}
    else:
        genai = write_genai_files(
            directory, record.dims, options.target.value, options.cache.value, tokenizer_info, record.family.genai_tokenizer
        )
    if not genai["written"]:
        progress(f"no genai_config.json: {genai['why']}")
    progress("hashing the files for the manifest")
    manifest = Manifest(
        source=record.source,
        dims=record.dims,
        dtype=options.dtype.value,
        opset=opset,
        target=options.target.value,
        attention=options.attention.value,
        all_logits=options.all_logits if record.all_logits is None else record.all_logits,
        graphs=specs,
        weights={"file": weights.file, "bytes": weights.bytes, "tensors": weights.tensors},
        export={**record.export, "seconds": round(time.perf_counter() - record.started, 2)},
        weights_sha256=record.weights_fingerprint,
        tokenizer=tokenizer_info,
        passes=record.passes,
        versions=tool_versions(),
        files=record_files(directory),
        genai=genai,
        cache=cache,
        quantization=options.quantization_record(),
        family=record.family.name,
    )
    manifest.write(directory)
    return manifest


def _write_tokenizer(directory: Path, record: ExportRecord, progress: Progress) -> dict[str, Any]:
    """``tokenizer.json`` the family ships (and the checkpoint's chat template, if any); the manifest's ``tokenizer`` record."""
    choice = record.family.tokenizer(record.tokenizer_dir, record.dims.vocab_size)
    source = record.tokenizer_origin or choice.source
    info: dict[str, Any] = {"file": None, "source": source, "eos_token_id": choice.eos_token_id}
    if choice.eos_token_ids:
        info["eos_token_ids"] = list(choice.eos_token_ids)
    if choice.tokenizer is not None:
        choice.tokenizer.save(str(directory / "tokenizer.json"))
        info["file"] = "tokenizer.json"
        config = record.family.tokenizer_config(record.tokenizer_dir)
        if config is not None:  # with the chat template kvexport serve renders
            (directory / TOKENIZER_CONFIG).write_text(json.dumps(config, indent=2) + "\n")
            info["config"] = TOKENIZER_CONFIG
            info["chat_template"] = isinstance(config.get("chat_template"), (str, list))
    else:
        progress(f"no tokenizer exported ({choice.source})")
    return info
