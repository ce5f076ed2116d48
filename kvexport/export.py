"""Export GPT-2 to the prefill and decode graphs, with manifest, weights and tokenizer.

Two export roads exist, each a named strategy tried in a declared order:

- ``dynamo``: ``torch.onnx.export(dynamo=True)``. Compact graphs (about a quarter of
  TorchScript's node count for decode) and the tied embedding / LM head stored once.
  Decode has a static query length of 1 and a dynamic past length.
- ``torchscript``: the legacy tracer. Kept as the fallback for models or torch
  versions where ``torch.export`` fails.

The manifest records which strategy produced the graphs and why earlier ones failed.
"""

from __future__ import annotations

import contextlib
import logging
import tempfile
import time
import warnings
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path
from typing import Any, Literal, Protocol

import onnx_ir as ir
import torch

from kvexport import __version__
from kvexport.errors import ExportError, KvexportError, first_line
from kvexport.genai import write_genai_files
from kvexport.integrity import record_files
from kvexport.manifest import GraphSpec, Manifest, cache_names
from kvexport.models.gpt2 import (
    DecodeModule,
    Dtype,
    ModelDims,
    PrefillModule,
    load_gpt2,
    resolve_source,
    weights_fingerprint,
)
from kvexport.storage import (
    atomic_output_dir,
    check_output_dir,
    load_graph_structure,
    save_with_shared_weights,
)
from kvexport.tokenizer import choose_tokenizer
from passes import QuantizationConfig, build_pipeline, run_pipeline

Target = Literal["portable", "ort-cpu", "ort-cuda"]
Attention = Literal["unfused", "onnx", "ort"]
Progress = Callable[[str], None]

DEFAULT_OPSET = 18
CacheLayout = Literal["concat", "shared-buffer"]
# target -> (default attention, default dtype, default cache layout)
TARGET_DEFAULTS: dict[str, tuple[Attention, Dtype, CacheLayout]] = {
    "portable": ("unfused", "fp32", "concat"),
    "ort-cpu": ("ort", "fp32", "shared-buffer"),
    "ort-cuda": ("ort", "fp16", "shared-buffer"),
}
CACHE_DESCRIPTIONS = {
    "concat": "present = past + the new rows: a new [batch, H, total_sequence, D] tensor per step",
    "shared-buffer": (
        "past.* and present.* are one [batch, H, max_sequence, D] buffer per tensor, bound to "
        "both and updated in place; max_sequence is the capacity, attention_mask's length the "
        "valid length; prefill takes the empty buffers as past.* inputs"
    ),
}
IO_INPUTS = ["input_ids", "attention_mask", "position_ids"]


class TargetKind(str, Enum):
    """Where the graphs will run (``--target``)."""

    PORTABLE = "portable"
    ORT_CPU = "ort-cpu"
    ORT_CUDA = "ort-cuda"


class AttentionKind(str, Enum):
    """How attention is expressed (``--attention``)."""

    UNFUSED = "unfused"
    ONNX = "onnx"
    ORT = "ort"


class DtypeKind(str, Enum):
    """Weights and activations (``--dtype``)."""

    FP32 = "fp32"
    FP16 = "fp16"


class CacheKind(str, Enum):
    """The cache layout (``--cache``)."""

    CONCAT = "concat"
    SHARED_BUFFER = "shared-buffer"


class QuantizeKind(str, Enum):
    """Weight-only quantization scheme (``--quantize``)."""

    NONE = "none"
    INT8 = "int8"
    INT4 = "int4"


def _choice(kind: type[Enum], value: object, flag: str) -> Any:
    try:
        return kind(value)
    except ValueError:
        choices = ", ".join(str(member.value) for member in kind)
        raise KvexportError(f"{flag} {value}: choose from {choices}") from None


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
    ) -> ExportOptions:
        """Fill in the target's defaults and refuse what can't work (:class:`KvexportError`)."""
        target_kind = _choice(TargetKind, target, "--target")
        default_attention, default_dtype, default_cache = TARGET_DEFAULTS[target_kind.value]
        attention_kind = _choice(AttentionKind, attention or default_attention, "--attention")
        dtype_kind = _choice(DtypeKind, dtype or default_dtype, "--dtype")
        if cache is None:
            cache = default_cache if attention_kind is AttentionKind.ORT else "concat"
            if target_kind is TargetKind.ORT_CUDA and dtype_kind is DtypeKind.FP32:
                cache = "concat"  # ORT's CUDA GroupQueryAttention has fp16/bf16 kernels only
        cache_kind = _choice(CacheKind, cache, "--cache")
        if cache_kind is CacheKind.SHARED_BUFFER:
            if target_kind is TargetKind.ORT_CUDA and dtype_kind is DtypeKind.FP32:
                raise KvexportError(
                    "--target ort-cuda --dtype fp32 --cache shared-buffer: ONNX Runtime's CUDA "
                    "GroupQueryAttention runs fp16 only; use --dtype fp16 or --cache concat"
                )
            if attention_kind is not AttentionKind.ORT:
                raise KvexportError(
                    f"--cache shared-buffer --attention {attention_kind.value}: the in-place cache needs "
                    "ONNX Runtime's attention; use --attention ort (or --target ort-cpu / ort-cuda)"
                )
        if target_kind is TargetKind.PORTABLE and attention_kind is AttentionKind.ORT:
            raise KvexportError(
                "--target portable --attention ort: ONNX Runtime's fused ops are not portable; "
                "use --target ort-cpu or ort-cuda"
            )
        quantize_kind = _choice(QuantizeKind, quantize, "--quantize")
        return cls(
            target=target_kind,
            attention=attention_kind,
            dtype=dtype_kind,
            cache=cache_kind,
            quantize=quantize_kind,
            quantization=_quantization(quantize_kind.value, quantization, attention_kind.value),
            opset=opset,
            all_logits=all_logits,
        )


Quantize = Literal["none", "int8", "int4"]
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

# Sample sizes for tracing. Every dynamic dim gets a distinct value >= 2, or the
# exporter specialises it to a constant.
_SAMPLE_BATCH = 2
_SAMPLE_PROMPT = 7
_SAMPLE_PAST = 6


@dataclass(frozen=True)
class GraphRequest:
    """Everything a strategy needs to export one graph."""

    name: str
    module: torch.nn.Module
    args: tuple[torch.Tensor, ...]
    input_names: list[str]
    output_names: list[str]
    # input name -> {axis: dim name}; a dim named "total_sequence" is past_sequence + 1
    dynamic_axes: dict[str, dict[int, str]]
    opset: int
    # logits axis 1: 1 (last position only) or "sequence" (prefill --all-logits)
    logits_length: int | str = 1


class ExportStrategy(Protocol):
    """One road from a torch module to an ``ir.Model``."""

    name: str

    def export(self, request: GraphRequest, workdir: Path) -> ir.Model:
        """Export the request's module; ``workdir`` outlives the returned model's data."""
        ...


class DynamoStrategy:
    """``torch.onnx.export(dynamo=True)`` via ``torch.export``."""

    name = "dynamo"

    def export(self, request: GraphRequest, workdir: Path) -> ir.Model:
        """Export with dynamic batch / sequence / past dims."""
        dims: dict[str, Any] = {}
        for axes in request.dynamic_axes.values():
            for dim_name in axes.values():
                if dim_name != "total_sequence" and dim_name not in dims:
                    dims[dim_name] = torch.export.Dim(dim_name, min=1)
        if "past_sequence" in dims:
            dims["total_sequence"] = dims["past_sequence"] + 1
        shapes = [
            {axis: dims[d] for axis, d in request.dynamic_axes.get(n, {}).items()}
            for n in request.input_names
        ]
        n_plain = len(IO_INPUTS)
        dynamic_shapes: dict[str, Any] = dict(zip(IO_INPUTS, shapes[:n_plain], strict=True))
        if len(shapes) > n_plain:
            dynamic_shapes["past"] = tuple(shapes[n_plain:])
        program = torch.onnx.export(
            request.module,
            request.args,
            dynamo=True,
            input_names=request.input_names,
            output_names=request.output_names,
            dynamic_shapes=dynamic_shapes,
            opset_version=request.opset,
            optimize=True,
            verbose=False,
        )
        assert program is not None
        model = program.model
        _rename_dims(
            model,
            {str(dims["total_sequence"]): "total_sequence"} if "total_sequence" in dims else {},
        )
        return model


class TorchScriptStrategy:
    """The legacy TorchScript tracer (``dynamo=False``)."""

    name = "torchscript"

    def export(self, request: GraphRequest, workdir: Path) -> ir.Model:
        """Trace and export; reload as IR with weights read lazily from ``workdir``."""
        path = workdir / f"{request.name}.torchscript.onnx"
        dynamic_axes: dict[str, dict[int, str]] = dict(request.dynamic_axes)
        for name in request.output_names:
            if name == "logits":
                dynamic_axes[name] = {0: "batch", 1: "logits_length"}
            else:
                length = "total_sequence" if request.name == "decode" else "sequence"
                dynamic_axes[name] = {0: "batch", 2: length}
        torch.onnx.export(
            request.module,
            request.args,
            str(path),
            dynamo=False,
            input_names=request.input_names,
            output_names=request.output_names,
            dynamic_axes=dynamic_axes,
            opset_version=request.opset,
            do_constant_folding=True,
        )
        model = ir.load(path)
        # The tracer leaves the logits length unnamed; state what the contract says.
        logits = next(v for v in model.graph.outputs if v.name == "logits")
        if logits.shape is not None:
            logits.shape = ir.Shape([logits.shape[0], request.logits_length, logits.shape[2]])
        return model


STRATEGIES: dict[str, ExportStrategy] = {
    s.name: s for s in (DynamoStrategy(), TorchScriptStrategy())
}
DEFAULT_STRATEGY_ORDER = ("dynamo", "torchscript")


def _rename_dims(model: ir.Model, mapping: dict[str, str]) -> None:
    """Rename symbolic dims everywhere (e.g. torch's ``s0 + 1`` -> ``total_sequence``)."""
    if not mapping:
        return
    values = list(model.graph.inputs) + list(model.graph.outputs)
    values += [out for node in model.graph.all_nodes() for out in node.outputs]
    for value in values:
        if value.shape is None:
            continue
        dims = [
            ir.SymbolicDim(mapping.get(str(d), str(d))) if isinstance(d, ir.SymbolicDim) else d
            for d in value.shape
        ]
        if any(isinstance(d, ir.SymbolicDim) and str(d) in mapping for d in value.shape):
            value.shape = ir.Shape(dims)


@dataclass(frozen=True)
class StrategyAttempt:
    """One strategy tried on one graph."""

    graph: str
    strategy: str
    ok: bool
    seconds: float
    error: str | None = None


@dataclass
class ExportResult:
    """What :func:`export_gpt2` produced."""

    out_dir: Path
    manifest: Manifest
    strategy: str
    attempts: list[StrategyAttempt] = field(default_factory=list)
    seconds: float = 0.0

    @property
    def node_counts(self) -> dict[str, int]:
        """Nodes per graph after the passes."""
        return {name: spec.nodes for name, spec in self.manifest.graphs.items()}


def _graph_requests(
    model: torch.nn.Module, dims: ModelDims, all_logits: bool, opset: int
) -> list[GraphRequest]:
    gen = torch.Generator().manual_seed(0)
    batch, prompt, past = _SAMPLE_BATCH, _SAMPLE_PROMPT, _SAMPLE_PAST
    param = next(model.parameters())
    ids = torch.randint(0, dims.vocab_size, (batch, prompt), generator=gen)
    mask = torch.ones(batch, prompt, dtype=torch.int64)
    positions = torch.arange(prompt).expand(batch, prompt).contiguous()
    present = cache_names("present", dims.n_layer)
    prefill = GraphRequest(
        name="prefill",
        module=PrefillModule(model, all_logits=all_logits),  # type: ignore[arg-type]
        args=(ids, mask, positions),
        input_names=IO_INPUTS,
        output_names=["logits", *present],
        dynamic_axes={n: {0: "batch", 1: "sequence"} for n in IO_INPUTS},
        opset=opset,
        logits_length="sequence" if all_logits else 1,
    )
    cache_shape = (batch, dims.n_head, past, dims.head_dim)
    past_tensors = tuple(
        torch.randn(cache_shape, generator=gen).to(param.dtype) for _ in range(2 * dims.n_layer)
    )
    past_names = cache_names("past", dims.n_layer)
    decode_axes = {
        "input_ids": {0: "batch"},
        "attention_mask": {0: "batch", 1: "total_sequence"},
        "position_ids": {0: "batch"},
        **{n: {0: "batch", 2: "past_sequence"} for n in past_names},
    }
    decode = GraphRequest(
        name="decode",
        module=DecodeModule(model),  # type: ignore[arg-type]
        args=(
            ids[:, :1].contiguous(),
            torch.ones(batch, past + 1, dtype=torch.int64),
            torch.full((batch, 1), past, dtype=torch.int64),
            *past_tensors,
        ),
        input_names=[*IO_INPUTS, *past_names],
        output_names=["logits", *present],
        dynamic_axes=decode_axes,
        opset=opset,
    )
    return [prefill, decode]


@contextlib.contextmanager
def _quiet_exporters() -> Iterator[None]:
    """Silence the exporters' warnings and progress chatter; kvexport reports progress itself."""
    loggers = [
        logging.getLogger(n) for n in ("torch.onnx", "torch._dynamo", "torch.export", "onnxscript")
    ]
    levels = [lg.level for lg in loggers]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for lg in loggers:
            lg.setLevel(logging.ERROR)
        try:
            yield
        finally:
            for lg, level in zip(loggers, levels, strict=True):
                lg.setLevel(level)


def _export_graphs(
    requests: Sequence[GraphRequest], order: Sequence[str], workdir: Path, progress: Progress
) -> tuple[str, dict[str, ir.Model], list[StrategyAttempt]]:
    """Try each strategy in order; the first that exports *both* graphs wins."""
    attempts: list[StrategyAttempt] = []
    for strategy_name in order:
        strategy = STRATEGIES[strategy_name]
        graphs: dict[str, ir.Model] = {}
        for request in requests:
            progress(f"exporting {request.name} graph ({strategy_name})")
            started = time.perf_counter()
            try:
                with _quiet_exporters(), torch.no_grad():
                    graphs[request.name] = strategy.export(request, workdir)
            except Exception as exc:  # any exporter failure means: try the next road
                message = first_line(exc)
                attempts.append(
                    StrategyAttempt(
                        request.name, strategy_name, False, time.perf_counter() - started, message
                    )
                )
                progress(f"{strategy_name} failed on {request.name}: {message}")
                break
            attempts.append(
                StrategyAttempt(request.name, strategy_name, True, time.perf_counter() - started)
            )
        if len(graphs) == len(requests):
            return strategy_name, graphs, attempts
    tried = "; ".join(f"{a.strategy}/{a.graph}: {a.error}" for a in attempts if not a.ok)
    raise ExportError(
        f"every export strategy failed ({tried}); see `kvexport gpt2 --help` for --exporter"
    )


def _versions() -> dict[str, str]:
    import onnx
    import onnxruntime
    import onnxscript
    import transformers

    return {
        "kvexport": __version__,
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "onnx": onnx.__version__,
        "onnxruntime": onnxruntime.__version__,
        "onnxscript": onnxscript.__version__,
        "onnx_ir": ir.__version__,
    }


def _quantization(
    quantize: str, knobs: QuantizationConfig | None, attention: str
) -> QuantizationConfig | None:
    """The knobs for ``quantize`` (None for float weights), or one clear error."""
    if quantize == "none":
        if knobs is not None:
            raise KvexportError("quantization knobs given without --quantize; add --quantize int8 or int4")
        return None
    if attention != "ort":
        raise KvexportError(
            f"--quantize {quantize} --attention {attention}: the quantized weights use ONNX Runtime's "
            "operators; use --target ort-cpu or ort-cuda"
        )
    scheme = QUANTIZATION_SCHEMES[quantize]
    if knobs is not None and knobs.bits != scheme.bits:
        raise KvexportError(
            f"--quantize {quantize} with {knobs.bits}-bit block weights: the scheme's blocks are "
            f"{scheme.bits}-bit; pick the scheme with that width"
        )
    return knobs or scheme


def write_directory_files(
    directory: Path,
    dims: ModelDims,
    model_dir: Path | None,
    target: str,
    cache_layout: str,
    report: Progress,
) -> tuple[dict[str, Any], dict[str, GraphSpec], dict[str, Any]]:
    """Beside the saved graphs: the tokenizer and the onnxruntime-genai files.

    Returns the manifest's ``tokenizer`` record, the graphs' IO specs (read back from
    the written files) and the ``genai`` record.
    """
    choice = choose_tokenizer(model_dir, dims.vocab_size)
    tokenizer_info: dict[str, Any] = {"file": None, "source": choice.source, "eos_token_id": choice.eos_token_id}
    if choice.tokenizer is not None:
        choice.tokenizer.save(str(directory / "tokenizer.json"))
        tokenizer_info["file"] = "tokenizer.json"
    else:
        report(f"no tokenizer exported ({choice.source})")
    specs = {
        name: GraphSpec.from_proto(f"{name}.onnx", load_graph_structure(directory / f"{name}.onnx"))
        for name in ("prefill", "decode")
    }
    genai = write_genai_files(directory, dims, target, cache_layout, tokenizer_info)
    if not genai["written"]:
        report(f"no genai_config.json: {genai['why']}")
    return tokenizer_info, specs, genai


def quantization_record(scheme: str, config: QuantizationConfig | None) -> dict[str, Any] | None:
    """The manifest's ``quantization``: the scheme, its knobs and verify's tolerances (None for float)."""
    if config is None:
        return None
    return {"scheme": scheme, **config.to_json(), "tolerances": QUANTIZATION_TOLERANCES[scheme]}


def export_gpt2(
    out: str | Path,
    model: str = "gpt2",
    *,
    random_init: bool = False,
    seed: int = 0,
    target: Target = "portable",
    attention: Attention | None = None,
    dtype: Dtype | None = None,
    cache: CacheLayout | None = None,
    quantize: Quantize = "none",
    quantization: QuantizationConfig | None = None,
    opset: int = DEFAULT_OPSET,
    all_logits: bool = False,
    force: bool = False,
    allow_pickle: bool = False,
    strategies: Sequence[str] = DEFAULT_STRATEGY_ORDER,
    progress: Progress | None = None,
) -> ExportResult:
    """Export a GPT-2 model to ``out/`` (prefill.onnx, decode.onnx, weights, manifest, tokenizer).

    Args:
        out: output directory; written atomically, refused if non-empty unless ``force``.
        model: a preset or config path with ``random_init``, else a model directory or hub id.
        random_init: build the architecture with seeded random weights (offline default).
        seed: torch seed for ``random_init``.
        target: where the graphs will run: ``portable`` (standard ONNX ops, unfused
            attention), ``ort-cpu`` / ``ort-cuda`` (ONNX Runtime's fused ops).
        attention: override the target's attention: ``unfused``, ``onnx`` (opset-23
            ``Attention``) or ``ort`` (``com.microsoft`` fused ops).
        dtype: ``fp32`` or ``fp16`` weights and activations (None: fp16 for ``ort-cuda``,
            else fp32).
        cache: ``concat`` (a new present per step, the portable contract) or
            ``shared-buffer`` (one in-place buffer per cache tensor; needs ``ort``
            attention). None: ``shared-buffer`` for the ort targets, else ``concat``.
        quantize: ``int8`` / ``int4`` store the weights with ONNX Runtime's weight-only
            operators (``ort`` attention only); see :data:`QUANTIZATION_SCHEMES`.
        quantization: override the scheme's knobs (block size, symmetric, accuracy
            level, LM-head bits); needs ``quantize``.
        opset: ONNX opset of the graphs.
        all_logits: prefill returns logits for every position, not only the last.
        force: replace a non-empty ``out``.
        allow_pickle: allow loading a pickle (.bin) checkpoint from a trusted directory.
        strategies: export strategies to try, in order (see :data:`STRATEGIES`).
        progress: called with a short message at each phase (the CLI prints them).

    Returns:
        An :class:`ExportResult`; the manifest is also written to ``out/kvexport.json``.

    """
    report = progress or (lambda message: None)
    out_path = Path(out)
    options = ExportOptions.resolve(
        target, attention, dtype, cache, quantize, quantization, opset, all_logits
    )
    unknown = [s for s in strategies if s not in STRATEGIES]
    if unknown or not strategies:
        raise KvexportError(
            f"unknown export strategy {unknown}; choose from {', '.join(STRATEGIES)}"
        )
    check_output_dir(out_path.absolute(), force)
    started = time.perf_counter()
    source = resolve_source(model, random_init=random_init, seed=seed)
    report(f"loading {source.describe()}")
    torch_model = load_gpt2(source, options.dtype.value, allow_pickle=allow_pickle)
    dims = ModelDims.from_config(torch_model.config)
    fingerprint = weights_fingerprint(torch_model)
    requests = _graph_requests(torch_model, dims, options.all_logits, options.opset)

    with (
        atomic_output_dir(out_path, force) as tmp,
        tempfile.TemporaryDirectory(prefix=f".{out_path.name}.work-", dir=tmp.parent) as work,
    ):
        strategy, graphs, attempts = _export_graphs(requests, strategies, Path(work), report)
        pass_reports = []
        for name, graph in graphs.items():
            report(f"running passes on {name}")
            pipeline = build_pipeline(
                options.attention.value,
                shared_buffer=options.cache is CacheKind.SHARED_BUFFER,
                quantization=options.quantization,
            )
            for pass_report in run_pipeline(graph, pipeline):
                pass_reports.append({"graph": name, **pass_report.to_json()})
        opset = graphs["decode"].opset_imports.get("", options.opset)
        report("writing graphs and shared weights")
        weights = save_with_shared_weights(graphs, tmp)
        del graphs
        tokenizer_info, specs, genai = write_directory_files(
            tmp,
            dims,
            Path(source.name) if source.kind == "local" else None,
            options.target.value,
            options.cache.value,
            report,
        )
        report("hashing the files for the manifest")
        files = record_files(tmp)
        manifest = Manifest(
            source=source,
            dims=dims,
            dtype=options.dtype.value,
            opset=opset,
            target=options.target.value,
            attention=options.attention.value,
            all_logits=options.all_logits,
            graphs=specs,
            weights={"file": weights.file, "bytes": weights.bytes, "tensors": weights.tensors},
            export={
                "strategy": strategy,
                "attempts": [a.__dict__ for a in attempts],
                "seconds": round(time.perf_counter() - started, 2),
            },
            weights_sha256=fingerprint,
            tokenizer=tokenizer_info,
            passes=pass_reports,
            versions=_versions(),
            files=files,
            genai=genai,
            cache={"layout": options.cache.value, "description": CACHE_DESCRIPTIONS[options.cache.value]},
            quantization=quantization_record(options.quantize.value, options.quantization),
        )
        manifest.write(tmp)
    report(f"wrote {out_path}")
    return ExportResult(out_path, manifest, strategy, attempts, time.perf_counter() - started)
