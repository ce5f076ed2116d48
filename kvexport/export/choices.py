"""Every export choice, defined once: the Enums, each target's defaults, and one message per refusal.

``kvexport gpt2``, ``kvexport import``, ``kvexport rewrite``, the library's
:class:`~kvexport.export.writer.ExportOptions` and the pass registry all take their choices
from here. Standard library only, so the command line lists them without loading torch,
onnx_ir or onnxscript.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import Enum
from typing import Any, TypeVar

from kvexport.errors import KvexportError
from kvexport.passes.choices import Attention as AttentionKind

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

    scheme: QuantizeKind = QuantizeKind.NONE
    overrides: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.scheme is QuantizeKind.NONE and self.overrides:
            raise KvexportError(KNOBS_WITHOUT_SCHEME)


__all__ = [
    "CACHE_DESCRIPTIONS",
    "TARGET_DEFAULTS",
    "AttentionKind",
    "CacheKind",
    "DtypeKind",
    "QuantizationChoice",
    "QuantizeKind",
    "TargetKind",
    "check_combination",
    "choose",
    "default_cache",
    "values",
]
