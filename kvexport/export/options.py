"""Every choice that decides what graphs an export writes, resolved and checked by one resolver.

:meth:`ExportOptions.resolve` is what export and import both call; every combination that
can't work is refused there, with one line. No torch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from kvexport.errors import KvexportError
from kvexport.export.choices import (
    CACHE_DESCRIPTIONS,
    DEFAULT_OPSET,
    TARGET_DEFAULTS,
    AttentionKind,
    CacheKind,
    DtypeKind,
    QuantizeKind,
    TargetKind,
    check_combination,
    choose,
    default_cache,
)
from kvexport.export.quantization import (
    QUANTIZATION_TOLERANCES,
    kv_cache_quantization,
    scheme_knobs,
)
from kvexport.passes.choices import Attention
from kvexport.passes.fuse_attention import unfused_attention
from kvexport.passes.pipeline import build_pipeline
from kvexport.passes.quantize_cache import CacheQuantization
from kvexport.passes.quantize_weights import BlockSource, QuantizationConfig

if TYPE_CHECKING:
    import onnx_ir as ir
    from onnx_ir.passes import InPlacePass

    from kvexport.models.base import ModelFamily


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
        family: str | None = None,
    ) -> ExportOptions:
        """Fill in the target's defaults and refuse what can't work (:class:`KvexportError`).

        ``family`` (the manifest's name of the model's family) picks the per-channel recipe when
        per-channel int8 is asked for (:func:`~kvexport.export.quantization.scheme_knobs`).
        """
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
            quantization=scheme_knobs(quantize_kind, quantization, dtype_kind, family=family),
            opset=opset,
            all_logits=all_logits,
            kv_cache=kv_cache_quantization(kv_cache, dtype_kind, cache_kind),
        )

    @property
    def in_place_cache(self) -> bool:
        """Whether past and present share one buffer (``--cache shared-buffer``)."""
        return self.cache is CacheKind.SHARED_BUFFER

    def pipeline(self, block_source: BlockSource | None = None) -> list[tuple[str, InPlacePass]]:
        """The passes these options call for, on each graph an export or import writes.

        An ``ort-cpu`` graph keeps a LayerNorm's residual ``Add`` unfused: ONNX Runtime's CPU
        ``SkipLayerNormalization`` is slower than the two ops (see :mod:`kvexport.passes.fuse_ort_block`).
        An ``ort-cuda`` graph computes each attention's query, key and value with one ``MatMul``: the
        form ONNX Runtime's CUDA provider loads (see :mod:`kvexport.passes.pack_projections`).
        ``block_source``: a GGUF file's blocks, which the weight quantization keeps where its scheme holds them.
        """
        return build_pipeline(
            self.attention.value,
            shared_buffer=self.in_place_cache,
            quantization=self.quantization,
            skip_layer_norm=self.target is not TargetKind.ORT_CPU,
            pack_projections=self.target is TargetKind.ORT_CUDA,
            block_source=block_source,
        )

    def quantization_record(self) -> dict[str, Any] | None:
        """The manifest's ``quantization``: the scheme, its knobs and verify's tolerances (None for float)."""
        if self.quantization is None:
            return None
        scheme = self.quantize.value
        return {"scheme": scheme, **self.quantization.to_json(), "tolerances": QUANTIZATION_TOLERANCES[scheme]}

    def cache_record(self) -> dict[str, str]:
        """The manifest's ``cache``: the layout and what it means."""
        return {"layout": self.cache.value, "description": CACHE_DESCRIPTIONS[self.cache]}


def check_attention(family: ModelFamily, options: ExportOptions) -> None:
    """Refuse, in one line, an attention or cache choice the family can't export."""
    if options.attention.value not in family.attention_kinds:
        raise KvexportError(
            f"--attention {options.attention.value}: not available for {family.name} models; "
            f"choose {' or '.join(sorted(family.attention_kinds))} (or the --target that implies it)"
        )
    if family.in_place_attention and options.attention.value == "ort" and not options.in_place_cache:
        raise KvexportError(
            f"--cache {options.cache.value} with ort attention: {family.name} models take ort attention with "
            "the in-place cache only; drop --cache (or use --cache shared-buffer)"
        )


def refuse_unfused(model: ir.Model, attention: Attention | str, where: str) -> None:
    """Refuse, in one line, a graph whose attention ``--attention onnx|ort`` asked to fuse but no rule could.

    Raises:
        KvexportError: Softmax nodes are left; the message has the closest rule's reason.

    """
    chosen = Attention(attention)
    if chosen is Attention.UNFUSED:
        return
    why = unfused_attention(model, chosen.value)
    if why:
        raise KvexportError(
            f"{where}: --attention {chosen.value}: {why}; nothing written (--attention unfused keeps the attention as it is)"
        )
