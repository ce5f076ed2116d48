"""What ``kvexport gpt2`` and ``kvexport import`` both write, without torch.

- :class:`ExportOptions`: every choice that decides the graphs, resolved and checked by
  one resolver (:meth:`ExportOptions.resolve`) that export and import both call.
- The quantization schemes (:data:`QUANTIZATION_SCHEMES`), the tolerances verify holds
  them to, and :func:`quantization_config`, which lays the user's knobs over a scheme.
- :func:`write_export_directory`: the graphs with their weights stored once, the
  tokenizer, the onnxruntime-genai files, and the manifest with every file's hash.
- :func:`rename_dims` and :func:`tool_versions`, the small pieces both need.

Nothing here imports torch or transformers: ``rewrite`` and ``import`` run on the base
install (``pip install kvexport``); only export and verify need ``kvexport[export]``.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from dataclasses import dataclass
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any

import onnx_ir as ir

from kvexport.choices import (
    CACHE_DESCRIPTIONS,
    KNOBS_WITHOUT_SCHEME,
    TARGET_DEFAULTS,
    AttentionKind,
    CacheKind,
    DtypeKind,
    QuantizationChoice,
    QuantizeKind,
    TargetKind,
    check_combination,
    choose,
    default_cache,
)
from kvexport.errors import KvexportError
from kvexport.genai import write_genai_files
from kvexport.integrity import record_files
from kvexport.kv_cache import cache_quantization, quantize_export_cache
from kvexport.manifest import GRAPH_NAMES, GraphSpec, Manifest
from kvexport.model_info import ModelDims, ModelSource
from kvexport.storage import load_graph_structure, save_with_shared_weights
from kvexport.tokenizer import choose_tokenizer
from passes.quantize_cache import CacheQuantization
from passes.quantize_weights import QuantizationConfig

Progress = Callable[[str], None]

DEFAULT_OPSET = 18

# Each scheme's default knobs, chosen by measurement (README, "Quantized exports"): int8
# activations in the CPU kernels (accuracy level 0 ran 20x slower); the LM head (and the tied
# embedding that shares its bytes) at 8 bits in int4 too, since a 4-bit head cost +1.5%
# perplexity on the trained test model; int4 blocks of 128 (decode 8.3 vs 9.6 ms/token and
# prompt 129 vs 180 ms against blocks of 32 on 124M, for +0.25% vs +0.18% perplexity);
# int8 blocks of 32 (already faster than llama.cpp Q8_0, and the closest to fp32).
QUANTIZATION_SCHEMES: dict[str, QuantizationConfig] = {
    "int8": QuantizationConfig(bits=8, block_size=32, symmetric=True, accuracy_level=4, head_bits=8),
    "int4": QuantizationConfig(bits=4, block_size=128, symmetric=True, accuracy_level=4, head_bits=8),
}
# What verify holds a quantized export to against PyTorch fp32, per scheme, set from the
# trained test model's measured quality with headroom (tests/data/tiny-trained).
QUANTIZATION_TOLERANCES: dict[str, dict[str, float]] = {
    "int8": {"min_top1_agreement": 0.95, "max_mean_kl": 0.002, "max_perplexity_delta_pct": 0.5},
    "int4": {"min_top1_agreement": 0.85, "max_mean_kl": 0.03, "max_perplexity_delta_pct": 1.0},
}
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


def quantization_config(choice: QuantizationChoice) -> QuantizationConfig | None:
    """The scheme's knobs with the user's overrides laid over them (None for float weights)."""
    if choice.scheme is QuantizeKind.NONE:
        return None
    try:
        return dataclasses.replace(QUANTIZATION_SCHEMES[choice.scheme.value], **choice.overrides)
    except ValueError as exc:
        raise KvexportError(f"--quantize {choice.scheme.value}: {exc}") from None


def _scheme_knobs(
    quantize: QuantizeKind, knobs: QuantizationConfig | None, dtype: DtypeKind
) -> QuantizationConfig | None:
    """The knobs for ``quantize`` (None for float weights), or one clear error.

    Per-channel int8 needs fp32 weights (``MatMulIntegerToFloat`` here is an fp32 CPU kernel).
    """
    if quantize is QuantizeKind.NONE:
        if knobs is not None:
            raise KvexportError(KNOBS_WITHOUT_SCHEME)
        return None
    scheme = QUANTIZATION_SCHEMES[quantize.value]
    if knobs is not None and knobs.bits != scheme.bits:
        raise KvexportError(
            f"--quantize {quantize.value} with {knobs.bits}-bit block weights: the scheme's blocks are "
            f"{scheme.bits}-bit; pick the scheme with that width"
        )
    knobs = knobs or scheme
    if knobs.per_channel and dtype is not DtypeKind.FP32:
        raise KvexportError(
            f"--per-channel needs fp32 weights (its int8 products are an fp32 CPU kernel), not {dtype.value}; "
            "drop it for an fp16 export"
        )
    return knobs


def _kv_cache(kind: str | None, dtype: DtypeKind, cache: CacheKind) -> CacheQuantization | None:
    """``--kv-cache``'s quantization (None: a float cache of the graph's dtype), or one clear error."""
    if kind is None or kind == dtype.value:
        return None
    config = cache_quantization(kind)
    if config is None:
        raise KvexportError(
            f"--kv-cache {kind} with {dtype.value} graphs: a float cache has the graph's dtype; "
            f"use --dtype {kind}, or --kv-cache int8 / int4"
        )
    if cache is not CacheKind.SHARED_BUFFER:
        raise KvexportError(
            f"--kv-cache {kind} needs the in-place cache (GroupQueryAttention), not --cache {cache.value}; "
            "use ort attention (kvexport gpt2 --target ort-cpu, kvexport import --attention ort)"
        )
    if dtype is not DtypeKind.FP32:
        raise KvexportError(
            f"--kv-cache {kind} needs fp32 graphs (its scales are calibrated on CPU), not {dtype.value}; "
            "drop --dtype fp16"
        )
    return config


@dataclass(frozen=True)
class ExportOptions:
    """Everything that decides what graphs an export writes, resolved and checked together.

    Build it with :meth:`resolve` from what the user gave (strings or enums, None for the
    target's default); every combination that can't work is refused there, with one line.
    """

    target: TargetKind
    attention: AttentionKind
    dtype: DtypeKind
    cache: CacheKind
    quantize: QuantizeKind
    quantization: QuantizationConfig | None
    opset: int
    all_logits: bool
    kv_cache: CacheQuantization | None = None

    @classmethod
    def resolve(
        cls,
        target: str = "portable",
        attention: str | None = None,
        dtype: str | None = None,
        cache: str | None = None,
        quantize: str = "none",
        quantization: QuantizationConfig | None = None,
        opset: int = DEFAULT_OPSET,
        all_logits: bool = False,
        kv_cache: str | None = None,
    ) -> ExportOptions:
        """Fill in the target's defaults and refuse what can't work (:class:`KvexportError`)."""
        target_kind = choose(TargetKind, target, "--target")
        default_attention, default_dtype, _ = TARGET_DEFAULTS[target_kind]
        attention_kind = choose(AttentionKind, attention or default_attention, "--attention")
        dtype_kind = choose(DtypeKind, dtype or default_dtype, "--dtype")
        cache_kind = (
            default_cache(target_kind, attention_kind, dtype_kind)
            if cache is None
            else choose(CacheKind, cache, "--cache")
        )
        quantize_kind = choose(QuantizeKind, quantize, "--quantize")
        check_combination(target_kind, attention_kind, dtype_kind, cache_kind, quantize_kind)
        return cls(
            target=target_kind,
            attention=attention_kind,
            dtype=dtype_kind,
            cache=cache_kind,
            quantize=quantize_kind,
            quantization=_scheme_knobs(quantize_kind, quantization, dtype_kind),
            opset=opset,
            all_logits=all_logits,
            kv_cache=_kv_cache(kv_cache, dtype_kind, cache_kind),
        )

    @property
    def in_place_cache(self) -> bool:
        """Whether past and present share one buffer (``--cache shared-buffer``)."""
        return self.cache is CacheKind.SHARED_BUFFER

    def quantization_record(self) -> dict[str, Any] | None:
        """The manifest's ``quantization``: the scheme, its knobs and verify's tolerances (None for float)."""
        if self.quantization is None:
            return None
        scheme = self.quantize.value
        return {"scheme": scheme, **self.quantization.to_json(), "tolerances": QUANTIZATION_TOLERANCES[scheme]}

    def cache_record(self) -> dict[str, str]:
        """The manifest's ``cache``: the layout and what it means."""
        return {"layout": self.cache.value, "description": CACHE_DESCRIPTIONS[self.cache]}


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
    all_logits: bool | None = None  # None: the options' choice


def write_export_directory(
    directory: Path, graphs: dict[str, ir.Model], record: ExportRecord, report: Progress
) -> Manifest:
    """Write a complete export into ``directory`` (an empty temporary directory).

    The graphs and their weights (stored once for both), the tokenizer, the
    onnxruntime-genai files, and last the manifest with every file's size and sha256.
    ``graphs`` is emptied once the graphs are saved, so that their memory is freed.
    """
    opset = graphs["decode"].opset_imports.get("", record.options.opset)
    report("writing graphs and shared weights")
    weights = save_with_shared_weights(graphs, directory)
    graphs.clear()
    tokenizer_info = _write_tokenizer(directory, record.dims, record.tokenizer_dir, report)
    specs = {
        name: GraphSpec.from_proto(f"{name}.onnx", load_graph_structure(directory / f"{name}.onnx"))
        for name in GRAPH_NAMES
    }
    options = record.options
    genai = write_genai_files(directory, record.dims, options.target.value, options.cache.value, tokenizer_info)
    if not genai["written"]:
        report(f"no genai_config.json: {genai['why']}")
    report("hashing the files for the manifest")
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
        cache=options.cache_record(),
        quantization=options.quantization_record(),
    )
    manifest.write(directory)
    if options.kv_cache is not None:
        manifest = quantize_export_cache(directory, manifest, options.kv_cache, say=report)
    return manifest


def _write_tokenizer(directory: Path, dims: ModelDims, model_dir: Path | None, report: Progress) -> dict[str, Any]:
    """``tokenizer.json``: the model's own, else GPT-2's; the manifest's ``tokenizer`` record."""
    choice = choose_tokenizer(model_dir, dims.vocab_size)
    info: dict[str, Any] = {"file": None, "source": choice.source, "eos_token_id": choice.eos_token_id}
    if choice.tokenizer is not None:
        choice.tokenizer.save(str(directory / "tokenizer.json"))
        info["file"] = "tokenizer.json"
    else:
        report(f"no tokenizer exported ({choice.source})")
    return info
