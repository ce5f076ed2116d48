"""A quantized KV cache for an in-place export: calibrate the scales, then rewrite both graphs.

ONNX Runtime's GroupQueryAttention quantizes each cache row as it writes it, with scales
that are inputs of the op and so fixed for the life of the cache (see
:mod:`passes.quantize_cache`). kvexport chooses them by calibration at export time:

1. the float export, already written, prefills windows of a calibration text (by default
   a slice of CPython's own ``pydoc_data`` help topics, offline everywhere: the topics
   whose sorted index is a multiple of 8, none of them the trained test model's held-out
   text) into an in-place cache;
2. each cache tensor's peak magnitude is taken per head and channel (``PER_CHANNEL``) or
   over the tensor (``PER_TENSOR``), and the scale is ``peak / 127`` (int8) or ``peak / 7``
   (int4): the calibrated extremes map to the largest code, and rows beyond them clip;
3. :class:`passes.quantize_cache.QuantizeCachePass` rewrites ``prefill.onnx`` and
   ``decode.onnx`` with those scales as constants, and the manifest's ``cache`` records the
   dtype, the quantization type and where the scales came from.

The measured alternative (``docs/benchmarks.md``, "Quantized cache: quality"): per-tensor
scales, one per layer and tensor. At 8 bits both are about free; at 4 bits per-tensor scales
doubled the mean KL and tripled the perplexity change on the trained test model.
"""

from __future__ import annotations

import pydoc_data.topics
import shutil
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np
import onnx
import onnx_ir as ir

from kvexport.errors import KvexportError
from kvexport.genai import GENAI_CONFIG
from kvexport.integrity import record_files
from kvexport.manifest import GRAPH_NAMES, GraphSpec, Manifest, read_manifest
from kvexport.storage import load_graph_structure
from passes.cache_names import cache_names
from passes.quantize_cache import CacheQuantization, QuantizeCacheError, QuantizeCachePass

KV_CACHE_KINDS = ("fp32", "fp16", "int8", "int4")
CALIBRATION_TOKENS = 4096  # at most, in windows of the context
CALIBRATION_SOURCE = "pydoc_data.topics (sorted index % 8 == 0)"
# not tried with onnxruntime-genai (it needs the CPU onnxruntime package, an environment of its own)
GENAI_WHY = "a quantized KV cache: not known to load in onnxruntime-genai, so no genai_config.json is written"


def calibration_text() -> str:
    """The default calibration text: every eighth of CPython's help topics, in sorted order."""
    topics = pydoc_data.topics.topics
    return "\n".join(topics[name] for index, name in enumerate(sorted(topics)) if index % 8 == 0)


def cache_quantization(kind: str, *, per_channel: bool = True) -> CacheQuantization | None:
    """The quantization of ``--kv-cache kind`` (None for a float cache)."""
    if kind not in KV_CACHE_KINDS:
        raise KvexportError(f"--kv-cache {kind}: choose one of {', '.join(KV_CACHE_KINDS)}")
    if kind in ("fp32", "fp16"):
        return None
    return CacheQuantization(bits=8 if kind == "int8" else 4, per_channel=per_channel)


def calibrate_peaks(directory: Path, manifest: Manifest, tokens: Sequence[int]) -> dict[str, np.ndarray]:
    """Each cache tensor's peak |value| per head and channel, ``[H, D]``, over ``tokens`` prefilled in windows."""
    from kvexport.runtime.cache import SlotCache
    from kvexport.runtime.session import open_session, session_options

    dims = manifest.dims
    window = min(dims.n_positions, 512)
    session = open_session(directory / manifest.graphs["prefill"].file, "cpu", session_options())
    cache = SlotCache(manifest, "cpu", 1, window)
    names = cache_names("past", dims.n_layer)
    peaks = {name: np.zeros((dims.n_head, dims.head_dim), np.float32) for name in names}
    for start in range(0, len(tokens), window):
        piece = list(tokens[start : start + window])
        cache.run_piece(session, 0, piece, 0)
        for index, name in enumerate(names):
            rows = cache.read(index, 0, len(piece))[0].astype(np.float32)  # [H, n, D]
            peaks[name] = np.maximum(peaks[name], np.abs(rows).max(axis=1))
    return peaks


def scales_from_peaks(peaks: dict[str, np.ndarray], config: CacheQuantization) -> dict[str, np.ndarray]:
    """GroupQueryAttention's scales: ``peak / levels`` per channel ``[1, H, 1, D]``, or over the tensor ``[1]``."""
    scales = {}
    for name, peak in peaks.items():
        if config.per_channel:
            value = peak[None, :, None, :]
        else:
            value = np.array([peak.max()], np.float32)
        scales[name] = np.where(value > 0, value / config.levels, 1.0).astype(np.float32)
    return scales


def quantize_export_cache(
    directory: Path,
    manifest: Manifest,
    config: CacheQuantization,
    *,
    text: str | None = None,
    say: Callable[[str], None] = lambda message: None,
) -> Manifest:
    """Give an in-place float export (written in ``directory``) the quantized cache ``config``; returns its new manifest."""
    from kvexport.directory import QUANTIZATION_TOLERANCES
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
    kind = config.kind
    say(f"calibrating the {config.bits}-bit cache's scales on {len(tokens)} tokens of {source}")
    scales = scales_from_peaks(calibrate_peaks(directory, manifest, tokens), config)
    specs: dict[str, GraphSpec] = {}
    for name in GRAPH_NAMES:
        path = directory / manifest.graphs[name].file
        model = ir.from_proto(onnx.load(str(path), load_external_data=False))
        try:
            QuantizeCachePass(config, scales)(model)
        except QuantizeCacheError as exc:
            raise KvexportError(f"--kv-cache {kind}: {name}.onnx: {exc}") from None
        onnx.save(ir.to_proto(model), str(path))
        specs[name] = GraphSpec.from_proto(path.name, load_graph_structure(path))
    manifest.graphs = specs
    manifest.cache = {
        **manifest.cache,
        "dtype": kind,
        "quantization": {
            "bits": config.bits,
            "type": config.quant_type,
            "scales": f"calibrated: peak |value| / {config.levels} per "
            f"{'head and channel' if config.per_channel else 'tensor'}, over {len(tokens)} tokens of {source}",
            "tolerances": QUANTIZATION_TOLERANCES[kind],
        },
    }
    if (manifest.genai or {}).get("written"):
        (directory / GENAI_CONFIG).unlink(missing_ok=True)
    manifest.genai = {"written": False, "why": GENAI_WHY}
    manifest.files = record_files(directory)
    manifest.write(directory)
    return manifest


def copy_with_quantized_cache(base: Path, out: Path, config: CacheQuantization) -> Path:
    """``out``: a copy of the in-place float export ``base`` with the cache ``config`` (made again unless it already is one)."""
    if (out / "kvexport.json").exists():
        recorded = read_manifest(out).cache.get("quantization") or {}
        if recorded.get("bits") == config.bits and recorded.get("type") == config.quant_type:
            return out
    shutil.rmtree(out, ignore_errors=True)
    shutil.copytree(base, out, ignore=shutil.ignore_patterns(".*"))
    quantize_export_cache(out, read_manifest(out), config)
    return out
