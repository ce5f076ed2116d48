"""Every export choice, defined once: the Enums, each target's defaults, and one message per refusal.

``kvexport export`` (and ``gpt2``), ``kvexport import``, ``kvexport rewrite``, the library's
:class:`~kvexport.export.writer.ExportOptions` and the pass registry all take their choices
from here. Standard library only, so the command line lists them without loading torch,
onnx_ir or onnxscript.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import Enum
from typing import TYPE_CHECKING, Any, TypeVar

from kvexport.errors import KvexportError
from kvexport.passes.choices import Attention as AttentionKind

if TYPE_CHECKING:
    from kvexport.passes.quantize_weights import QuantizationConfig

E = TypeVar("E", bound=Enum)


class TargetKind(str, Enum):
    """Where the graphs will run (``--target``)."""

    PORTABLE = "portable"
    ORT_CPU = "ort-cpu"
    ORT_CUDA = "ort-cuda"


class DtypeKind(str, Enum):
    """Weights and activations (``--dtype``)."""

    FP32 = "fp32"
    FP16 = "fp16"


class CacheKind(str, Enum):
    """The cache layout (``--cache``); ``shared-buffer`` is the in-place cache."""

    CONCAT = "concat"
    SHARED_BUFFER = "shared-buffer"


class QuantizeKind(str, Enum):
    """Weight-only quantization scheme (``--quantize``)."""

    NONE = "none"
    INT8 = "int8"
    INT4 = "int4"


# target -> (default attention, default dtype, default cache layout)
TARGET_DEFAULTS: dict[TargetKind, tuple[AttentionKind, DtypeKind, CacheKind]] = {
    TargetKind.PORTABLE: (AttentionKind.UNFUSED, DtypeKind.FP32, CacheKind.CONCAT),
    TargetKind.ORT_CPU: (AttentionKind.ORT, DtypeKind.FP32, CacheKind.SHARED_BUFFER),
    TargetKind.ORT_CUDA: (AttentionKind.ORT, DtypeKind.FP16, CacheKind.SHARED_BUFFER),
}
CACHE_DESCRIPTIONS: dict[CacheKind, str] = {
    CacheKind.CONCAT: "present = past + the new rows: a new [batch, H, total_sequence, D] tensor per step",
    CacheKind.SHARED_BUFFER: (
        "past.* and present.* are one [batch, H, max_sequence, D] buffer per tensor, bound to "
        "both and updated in place; max_sequence is the capacity, attention_mask's length the "
        "valid length; prefill takes the empty buffers as past.* inputs"
    ),
}

# One wording per refusal, whichever command or library call meets it.
KNOBS_WITHOUT_SCHEME = "quantization options given without --quantize; add --quantize int8 or int4"
IN_PLACE_NEEDS_ORT = (
    "--cache shared-buffer --attention {attention}: the in-place cache needs ONNX Runtime's "
    "attention; use --attention ort (or --target ort-cpu / ort-cuda)"
)
QUANTIZED_NEEDS_ORT = (
    "--quantize {scheme} --attention {attention}: the quantized weights use ONNX Runtime's "
    "operators; use --target ort-cpu or ort-cuda"
)
CUDA_IN_PLACE_NEEDS_FP16 = (
    "--target ort-cuda --dtype fp32 --cache shared-buffer: ONNX Runtime's CUDA "
    "GroupQueryAttention runs fp16 only; use --dtype fp16 or --cache concat"
)
PORTABLE_REFUSES_ORT = (
    "--target portable --attention ort: ONNX Runtime's fused ops are not portable; "
    "use --target ort-cpu or ort-cuda"
)


DEFAULT_OPSET = 18
# the export roads (kvexport.export.exporter.STRATEGIES), in the order "auto" tries them
EXPORT_STRATEGIES = ("dynamo", "torchscript")
# --kv-cache: a float cache (fp32, fp16: the graph dtype) or GroupQueryAttention's quantized one
KV_CACHE_KINDS = ("fp32", "fp16", "int8", "int4")


def values(kind: type[Enum]) -> list[str]:
    """The spelled-out choices of an Enum, in order (the CLI's ``click.Choice`` lists)."""
    return [str(member.value) for member in kind]


def choose(kind: type[E], value: object, flag: str) -> E:
    """``kind(value)``, or one line naming the flag and its choices."""
    try:
        return kind(value)
    except ValueError:
        raise KvexportError(f"{flag} {value}: choose from {', '.join(values(kind))}") from None


def default_cache(target: TargetKind, attention: AttentionKind, dtype: DtypeKind) -> CacheKind:
    """The cache layout a target gets when ``--cache`` is not given.

    The in-place cache for ONNX Runtime attention (GroupQueryAttention), except on CUDA in
    fp32, where ONNX Runtime's GroupQueryAttention has no kernel; concat otherwise.
    """
    if attention is not AttentionKind.ORT:
        return CacheKind.CONCAT
    if target is TargetKind.ORT_CUDA and dtype is DtypeKind.FP32:
        return CacheKind.CONCAT
    return CacheKind.SHARED_BUFFER


def check_combination(
    target: TargetKind, attention: AttentionKind, dtype: DtypeKind, cache: CacheKind, quantize: QuantizeKind
) -> None:
    """Refuse, with one line, every combination of choices that can't work."""
    if target is TargetKind.PORTABLE and attention is AttentionKind.ORT:
        raise KvexportError(PORTABLE_REFUSES_ORT)
    if cache is CacheKind.SHARED_BUFFER:
        if attention is not AttentionKind.ORT:
            raise KvexportError(IN_PLACE_NEEDS_ORT.format(attention=attention.value))
        if target is TargetKind.ORT_CUDA and dtype is DtypeKind.FP32:
            raise KvexportError(CUDA_IN_PLACE_NEEDS_FP16)
    if quantize is not QuantizeKind.NONE and attention is not AttentionKind.ORT:
        raise KvexportError(QUANTIZED_NEEDS_ORT.format(scheme=quantize.value, attention=attention.value))


@dataclass(frozen=True)
class QuantizationChoice:
    """``--quantize`` and the knobs given beside it, as the user gave them.

    ``overrides`` holds only the knobs given (``block_size``, ``symmetric``, ``offsets``,
    ``accuracy_level``, ``head_bits``, ``per_channel``); :func:`kvexport.export.quantization.quantization_config`
    lays them over the scheme's defaults.
    """

    scheme: QuantizeKind | None = None  # None: not given (a GGUF file's own scheme, else none)
    overrides: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.scheme in (None, QuantizeKind.NONE) and self.overrides:
            raise KvexportError(KNOBS_WITHOUT_SCHEME)


def flagged(
    help: str,
    *,
    flag: str | None,
    choices: tuple[str, ...] = (),
    low: int | None = None,
    high: int | None = None,
    shown: str | None = None,
) -> dict[str, Any]:
    """An :class:`ExportChoices` field's metadata: its CLI flag (None: none), choices, bounds and help.

    ``shown`` is what the help says the default is where the value alone would not say it.
    """
    return {"help": help, "flag": flag, "choices": choices, "low": low, "high": high, "shown": shown}


@dataclass(frozen=True)
class ExportChoices:
    """What an export is asked for, as given: every option of ``kvexport export`` / ``gpt2``, declared once.

    The CLI builds its flags, defaults and help from these fields
    (:func:`kvexport.cli.options.export_options`); :func:`kvexport.export.exporter.export_model`
    takes one (or its fields as keywords); :meth:`kvexport.export.options.ExportOptions.resolve`
    fills in the target's defaults and refuses what can't work, and the manifest records the
    resolved options. Strings are accepted for the Enum fields and checked here, one line
    naming the flag.

    Attributes:
        random_init: build the architecture with seeded random weights (offline).
        seed: torch seed for ``random_init``.
        target: where the graphs will run: ``portable`` (standard ONNX ops, unfused
            attention), ``ort-cpu`` / ``ort-cuda`` (ONNX Runtime's fused ops).
        attention: override the target's attention: ``unfused``, ``onnx`` (opset-23
            ``Attention``) or ``ort`` (``com.microsoft`` fused ops).
        dtype: ``fp32`` or ``fp16`` weights and activations (None: fp16 for ``ort-cuda``, else fp32).
        cache: ``concat`` (a new present per step, the portable contract) or ``shared-buffer``
            (one in-place buffer per cache tensor; needs ``ort`` attention). None:
            ``shared-buffer`` for the ort targets, else ``concat``.
        quantize: ``int8`` / ``int4`` store the weights with ONNX Runtime's weight-only
            operators (``ort`` attention only); see :data:`kvexport.export.quantization.QUANTIZATION_SCHEMES`.
        quantization: override the scheme's knobs (a :class:`~kvexport.passes.QuantizationConfig`;
            the CLI builds it from ``--block-size``, ``--symmetric``, ...); needs ``quantize``.
        opset: ONNX opset of the graphs.
        all_logits: prefill returns logits for every position, not only the last.
        kv_cache: the cache's type: None or the graph dtype (a float cache), ``int8`` or
            ``int4`` (GroupQueryAttention's quantized cache, per-channel scales calibrated on
            text at export; needs the in-place cache and fp32 graphs).
        force: replace a non-empty output directory.
        allow_pickle: allow loading a pickle (.bin) checkpoint from a trusted directory.
        exporter: the export road: ``auto`` (dynamo, then torchscript) or one of
            :data:`EXPORT_STRATEGIES`.

    """

    random_init: bool = field(default=False, metadata=flagged("Seeded random weights for the architecture (offline).", flag="--random-init"))
    seed: int = field(default=0, metadata=flagged("Seed for --random-init.", flag="--seed"))
    target: TargetKind = field(
        default=TargetKind.PORTABLE,
        metadata=flagged(
            "Where the graphs will run: portable (standard ops), ort-cpu / ort-cuda (ONNX Runtime fused ops; "
            "ort-cuda defaults to fp16).",
            flag="--target",
            choices=tuple(values(TargetKind)),
        ),
    )
    attention: AttentionKind | None = field(
        default=None,
        metadata=flagged(
            "Attention: unfused, onnx (opset-23 Attention op) or ort (com.microsoft fused ops).",
            flag="--attention",
            choices=tuple(values(AttentionKind)),
            shown="per target",
        ),
    )
    dtype: DtypeKind | None = field(
        default=None,
        metadata=flagged(
            "Weights and activations.",
            flag="--dtype",
            choices=tuple(values(DtypeKind)),
            shown="fp16 for ort-cuda, else fp32",
        ),
    )
    cache: CacheKind | None = field(
        default=None,
        metadata=flagged(
            "Cache layout: concat (a new present per step) or shared-buffer (one buffer updated in place; needs ort attention).",
            flag="--cache",
            choices=tuple(values(CacheKind)),
            shown="shared-buffer for ort targets, else concat",
        ),
    )
    quantize: QuantizeKind | None = field(
        default=None,
        metadata=flagged(
            "Weight-only quantization with ONNX Runtime's MatMulNBits / GatherBlockQuantized (ort attention only); "
            "a GGUF file's blocks are kept where the scheme holds them.",
            flag="--quantize",
            choices=tuple(values(QuantizeKind)),
            shown="a GGUF file's own (int4 for 4-bit blocks, int8 for 8-bit; none for float weights), else none",
        ),
    )
    quantization: QuantizationConfig | None = field(default=None, metadata=flagged("The scheme's knobs.", flag=None))
    opset: int = field(default=DEFAULT_OPSET, metadata=flagged("ONNX opset.", flag="--opset", low=14, high=24))
    all_logits: bool = field(default=False, metadata=flagged("Prefill returns logits for every position.", flag="--all-logits"))
    kv_cache: str | None = field(
        default=None,
        metadata=flagged(
            "The KV cache's type; int8 / int4 quantize it in GroupQueryAttention (the in-place cache, fp32 graphs) "
            "with per-channel scales calibrated on text at export. int8 holds fp32's quality on real weights "
            "(SmolLM2-135M: +0.14% perplexity, 98% top-1); int4 does not (+13%, 78%: verify fails it) and is there "
            "by name only.",
            flag="--kv-cache",
            choices=KV_CACHE_KINDS,
            shown="the graph dtype",
        ),
    )
    force: bool = field(default=False, metadata=flagged("Replace a non-empty output directory.", flag="--force"))
    allow_pickle: bool = field(default=False, metadata=flagged("Allow a trusted pickle (.bin) checkpoint.", flag="--allow-pickle"))
    exporter: str = field(
        default="auto",
        metadata=flagged(
            "Export road; auto tries dynamo, then torchscript.",
            flag="--exporter",
            choices=("auto", *EXPORT_STRATEGIES),
        ),
    )

    def __post_init__(self) -> None:
        """Turn strings into the Enums and check every choice, one line naming the flag."""
        for name, kind in (("target", TargetKind), ("attention", AttentionKind), ("dtype", DtypeKind),
                           ("cache", CacheKind), ("quantize", QuantizeKind)):
            value = getattr(self, name)
            if value is not None:
                object.__setattr__(self, name, choose(kind, value, flag_of(name)))
        for name in ("kv_cache", "exporter"):
            value, allowed = getattr(self, name), EXPORT_FIELDS[name].metadata["choices"]
            if value is not None and value not in allowed:
                raise KvexportError(f"{flag_of(name)} {value}: choose from {', '.join(allowed)}")

    @property
    def strategies(self) -> tuple[str, ...]:
        """The export roads to try, in order (``exporter`` spelled out)."""
        return EXPORT_STRATEGIES if self.exporter == "auto" else (self.exporter,)

    def replace(self, **given: Any) -> ExportChoices:
        """These choices with some fields replaced; a name that is not a field is one clear line."""
        unknown = sorted(set(given) - set(EXPORT_FIELDS))
        if unknown:
            raise KvexportError(f"unknown export option {', '.join(unknown)}; choose from {', '.join(EXPORT_FIELDS)}")
        return dataclasses.replace(self, **given)


# name -> field of ExportChoices, in declaration order (the CLI reads its options from them)
EXPORT_FIELDS: dict[str, dataclasses.Field[Any]] = {f.name: f for f in dataclasses.fields(ExportChoices)}


def flag_of(name: str) -> str:
    """The CLI flag of an :class:`ExportChoices` field (``kv_cache`` -> ``--kv-cache``)."""
    return str(EXPORT_FIELDS[name].metadata["flag"] or "--" + name.replace("_", "-"))


__all__ = [
    "CACHE_DESCRIPTIONS",
    "EXPORT_FIELDS",
    "TARGET_DEFAULTS",
    "AttentionKind",
    "CacheKind",
    "DtypeKind",
    "ExportChoices",
    "QuantizationChoice",
    "QuantizeKind",
    "TargetKind",
    "check_combination",
    "choose",
    "default_cache",
    "flag_of",
    "flagged",
    "values",
]
