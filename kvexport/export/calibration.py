"""A quantized KV cache for an in-place export: calibrate the scales, then rewrite both graphs.

ONNX Runtime's GroupQueryAttention quantizes each cache row as it writes it, with scales
that are inputs of the op and so fixed for the life of the cache (see
:mod:`kvexport.passes.quantize_cache`). kvexport chooses them by calibration at export time:

1. a float export of the same graphs (the pipeline writes one to a scratch directory, or an
   existing export is read) prefills windows of a calibration text (by default
   a slice of CPython's own ``pydoc_data`` help topics, offline everywhere: the topics
   whose sorted index is a multiple of 8, none of them the trained test model's held-out
   text) into an in-place cache;
2. each cache tensor's peak magnitude is taken per head and channel (``PER_CHANNEL``) or
   over the tensor (``PER_TENSOR``), and the scale is ``1.25 x peak / 127`` (int8) or
   ``peak / 7`` (int4; :data:`~kvexport.export.quantization.CACHE_HEADROOM`): the calibrated
   extremes, with room above them for prompts unlike the text, map to the largest code, and rows
   beyond that clip;
3. :class:`kvexport.passes.quantize_cache.QuantizeCachePass` rewrites both graphs in memory
   with those scales as constants, and the manifest's ``cache`` records the dtype, the
   quantization type and where the scales came from (:func:`cache_record`).

The export and import pipelines call :func:`quantize_cache_step` before the writer, which then
writes the quantized export once; :func:`copy_with_quantized_cache` gives an existing float
export a quantized cache (the benchmarks compare the two).

The measured alternative (``docs/benchmarks.md``, "Quantized cache: quality"): per-tensor
scales, one per layer and tensor. At 8 bits both are about free; at 4 bits per-tensor scales
doubled the mean KL and tripled the perplexity change on the trained test model.
"""

from __future__ import annotations

import dataclasses
import pydoc_data.topics
import shutil
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import onnx_ir as ir

from kvexport.bundle.integrity import record_files
from kvexport.bundle.manifest import GRAPH_NAMES, GraphSpec, Manifest, read_manifest
from kvexport.bundle.storage import load_graph_structure
from kvexport.errors import KvexportError
from kvexport.export.genai import GENAI_CONFIG
from kvexport.export.quantization import CACHE_HEADROOM, CACHE_TOLERANCES
from kvexport.export.writer import (
    GENAI_QUANTIZED_CACHE,
    ExportRecord,
    write_export_directory,
)
from kvexport.passes.cache_names import cache_names
from kvexport.passes.quantize_cache import CacheQuantization, QuantizeCacheError, QuantizeCachePass
from kvexport.progress import Progress, silent

CALIBRATION_TOKENS = 4096  # at most, in windows of the context
CALIBRATION_SOURCE = "pydoc_data.topics (sorted index % 8 == 0)"


def calibration_text() -> str:
    """The default calibration text: every eighth of CPython's help topics, in sorted order."""
    topics = pydoc_data.topics.topics
    return "\n".join(topics[name] for index, name in enumerate(sorted(topics)) if index % 8 == 0)


def calibrate_peaks(directory: Path, manifest: Manifest, tokens: Sequence[int]) -> dict[str, np.ndarray]:
    """Each cache tensor's peak |value| per head and channel, ``[H, D]``, over ``tokens`` prefilled in windows."""
    from kvexport.runtime.cache import SlotCache
    from kvexport.runtime.session import open_session, session_options

    dims = manifest.dims
    window = min(dims.max_positions, 512)
    session = open_session(directory / manifest.graphs["prefill"].file, "cpu", session_options())
    cache = SlotCache(manifest, "cpu", 1, window)
    names = cache_names("past", dims.num_layers)
    peaks = {name: np.zeros((dims.num_kv_heads, dims.head_dim), np.float32) for name in names}
    for start in range(0, len(tokens), window):
        piece = list(tokens[start : start + window])
        cache.run_piece(session, 0, piece, 0)
        for index, name in enumerate(names):
            rows = cache.read(index, 0, len(piece))[0].astype(np.float32)  # [H, n, D]
            peaks[name] = np.maximum(peaks[name], np.abs(rows).max(axis=1))
    return peaks


def scales_from_peaks(peaks: dict[str, np.ndarray], config: CacheQuantization) -> dict[str, np.ndarray]:
    """GroupQueryAttention's scales: ``peak * headroom / levels`` per channel ``[1, H, 1, D]``, or over the tensor ``[1]``.

    The headroom is the cache kind's :data:`~kvexport.export.quantization.CACHE_HEADROOM`.
    """
    scales = {}
    headroom = CACHE_HEADROOM[config.kind]
    for name, peak in peaks.items():
        if config.per_channel:
            value = peak[None, :, None, :] * headroom
        else:
            value = np.array([peak.max() * headroom], np.float32)
        scales[name] = np.where(value > 0, value / config.levels, 1.0).astype(np.float32)
    return scales


def calibrate(
    directory: Path, manifest: Manifest, config: CacheQuantization, *, text: str | None = None, progress: Progress
) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
    """The scales of the cache ``config`` for the float export in ``directory``, and the manifest's cache record."""
    from kvexport.runtime.text import ExportTokenizer

    if manifest.cache_layout != "shared-buffer":
        raise KvexportError(
            "--kv-cache int8/int4 needs the in-place cache (GroupQueryAttention); "
            "export with --target ort-cpu (or --cache shared-buffer) instead of the concat layout"
        )
    tokenizer = ExportTokenizer(directory, manifest).tokenizer
    source = CALIBRATION_SOURCE if text is None else "the given text"
    if tokenizer is not None:
        tokens = tokenizer.encode(text if text is not None else calibration_text()).ids[:CALIBRATION_TOKENS]
        tokens = [t for t in tokens if t < manifest.dims.vocab_size]
    else:  # no tokenizer to read a text with: seeded random ids
        tokens = np.random.default_rng(0).integers(0, manifest.dims.vocab_size, CALIBRATION_TOKENS).tolist()
        source = "seeded random token ids (the export has no tokenizer)"
    progress(f"calibrating the {config.bits}-bit cache's scales on {len(tokens)} tokens of {source}")
    scales = scales_from_peaks(calibrate_peaks(directory, manifest, tokens), config)
    return scales, cache_record(config, f"over {len(tokens)} tokens of {source}")


def cache_record(config: CacheQuantization, calibrated_on: str) -> dict[str, Any]:
    """What the manifest's ``cache`` adds for a quantized cache: its dtype and quantization."""
    return {
        "dtype": config.kind,
        "quantization": {
            "bits": config.bits,
            "type": config.quant_type,
            "scales": f"calibrated: {CACHE_HEADROOM[config.kind]:g} x peak |value| / {config.levels} per "
            f"{'head and channel' if config.per_channel else 'tensor'}, {calibrated_on}",
            "tolerances": CACHE_TOLERANCES[config.kind],
        },
    }


def quantize_graphs(graphs: dict[str, ir.Model], config: CacheQuantization, scales: dict[str, np.ndarray]) -> None:
    """Rewrite each graph (in memory) for the quantized cache, or one clear error."""
    for name, model in graphs.items():
        try:
            QuantizeCachePass(config, scales)(model)
        except QuantizeCacheError as exc:
            raise KvexportError(f"--kv-cache {config.kind}: {name}.onnx: {exc}") from None


def quantize_cache_step(
    graphs: dict[str, ir.Model], record: ExportRecord, scratch: Path, progress: Progress
) -> ExportRecord:
    """The pipelines' step before the writer: calibrate on a float export of ``graphs`` written to ``scratch``, quantize.

    ``graphs`` are rewritten in place; their weights then live in ``scratch``, which must
    outlive the final write. Returns the record with the manifest's cache record.
    """
    config = record.options.kv_cache
    assert config is not None, "called only for a quantized cache"
    progress("writing a float export to calibrate the cache on")
    float_record = dataclasses.replace(record, cache_quantization=None)
    manifest = write_export_directory(scratch, graphs, float_record, silent)
    scales, cache = calibrate(scratch, manifest, config, progress=progress)
    quantize_graphs(graphs, config, scales)
    return dataclasses.replace(record, cache_quantization=cache)


def copy_with_quantized_cache(base: Path, out: Path, config: CacheQuantization) -> Path:
    """``out``: a copy of the in-place float export ``base`` with the cache ``config`` (made again unless it already is one)."""
    if (out / "kvexport.json").exists():
        recorded = read_manifest(out).cache.get("quantization") or {}
        if recorded.get("bits") == config.bits and recorded.get("type") == config.quant_type:
            return out
    manifest = read_manifest(base)
    scales, cache = calibrate(base, manifest, config, progress=silent)
    shutil.rmtree(out, ignore_errors=True)
    shutil.copytree(base, out, ignore=shutil.ignore_patterns(".*"))
    for name in GRAPH_NAMES:
        path = out / manifest.graphs[name].file
        model = ir.from_proto(onnx.load(str(path), load_external_data=False))
        quantize_graphs({name: model}, config, scales)
        onnx.save(ir.to_proto(model), str(path))
        manifest.graphs[name] = GraphSpec.from_proto(path.name, load_graph_structure(path))
    manifest.cache = {**manifest.cache, **cache}
    (out / GENAI_CONFIG).unlink(missing_ok=True)
    manifest.genai = {"written": False, "why": GENAI_QUANTIZED_CACHE}
    manifest.files = record_files(out)
    manifest.write(out)
    return out
