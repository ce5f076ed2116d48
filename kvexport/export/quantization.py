"""The quantization policy: the weight schemes, the cache kinds, and what verify holds each to.

One module for every quantization decision that export, import, verify and the runtime
share: the schemes' default knobs (:data:`QUANTIZATION_SCHEMES`), the tolerances
(:data:`QUANTIZATION_TOLERANCES`, :data:`CACHE_TOLERANCES`), what ``--kv-cache`` kinds mean
(and their calibration headroom, :data:`CACHE_HEADROOM`) and
the functions that turn the user's choices into pass configurations. No torch, no runtime.
"""

from __future__ import annotations

import dataclasses

from kvexport.errors import KvexportError
from kvexport.export.choices import (
    KNOBS_WITHOUT_SCHEME,
    KV_CACHE_KINDS,
    CacheKind,
    DtypeKind,
    QuantizationChoice,
    QuantizeKind,
)
from kvexport.models import family_for
from kvexport.passes.quantize_cache import CacheQuantization
from kvexport.passes.quantize_weights import QuantizationConfig

# Each scheme's default knobs, chosen by quality on a real checkpoint (SmolLM2-135M-Instruct,
# docs/quantization.md "Quality on real weights"): int8 is llama.cpp's Q8_0 arithmetic, 8-bit
# weights in blocks of 32 and int8 activations in blocks of 32 (accuracy level 4; level 0/1, fp32
# activations, runs MatMulNBits' dequantizing fallback, 25-130x slower), the head and the tied
# embedding too: +0.2% perplexity, 96% top-1 there, where per-channel weights with one activation
# scale per row lost +3.1% and 89%. int4 is llama.cpp's Q4_1 format: asymmetric blocks of 32
# that keep each block's float offset (``offsets``): exact on that GGUF's Q4_1 weights (+0.2%),
# where symmetric blocks of 128 (the int4 until December 2026) gave +38% and integer zero points
# alone +24%; it costs time against those blocks of 128 (2 cores: decode 10.7 against 9.1
# ms/token, a 128-token prompt 231 against 149 ms). The LM head (and the tied embedding that shares its bytes) stays 8-bit and symmetric,
# since a 4-bit head cost +1.5% perplexity on the trained test model.
QUANTIZATION_SCHEMES: dict[str, QuantizationConfig] = {
    "int8": QuantizationConfig(bits=8, block_size=32, symmetric=True, accuracy_level=4, head_bits=8),
    "int4": QuantizationConfig(bits=4, block_size=32, symmetric=False, offsets=True, accuracy_level=4, head_bits=8),
}
# Families with a gated MLP (ModelFamily.gated_mlp), per channel, get 8-bit weights (7-bit weights
# alone cost the trained Llama +0.8% perplexity) and rotate their down projection's input,
# silu(gate) * up, by Hadamard blocks of GATED_ROTATION before quantizing it per row: one
# scale per row of the raw input took the mean KL from 0.0016 to 0.0037 (until December 2026
# that product stayed in 8-bit blocks, activation scales per 32 values; 3x slower on many
# rows). GPT-2 keeps 7 bits, the faster kernel at one row.
GATED_ROTATION = 64
# What verify holds a quantized export to against PyTorch fp32, per scheme. int8's are set from
# Q8_0's arithmetic on a real checkpoint (SmolLM2-135M-Instruct, docs/quantization.md "Quality on
# real weights"): mean KL 0.0077-0.0087 over verify's random prompts (two exports), and on held-out
# text 0.0045-0.0047, top-1 95.3-96.0%, perplexity +0.78-0.79% (2,048 and 4,695 tokens; Q8_0's
# arithmetic emulated over the same 4,695: +0.21%, a text's delta is partly sampling), with
# headroom; per-channel int8 there gave 0.035-0.058, 89%, +3.1%. int4's come from the trained
# test model (tests/data/tiny-trained); the Q4_1-format int4 holds them on that real checkpoint.
QUANTIZATION_TOLERANCES: dict[str, dict[str, float]] = {
    "int8": {"min_top1_agreement": 0.94, "max_mean_kl": 0.015, "max_perplexity_delta_pct": 1.0},
    "int4": {"min_top1_agreement": 0.85, "max_mean_kl": 0.03, "max_perplexity_delta_pct": 1.0},
}
# A quantized cache's scales (``--kv-cache``) are fixed at export: each head and channel's peak
# |value| over the calibration text, times this headroom, maps to the largest code. Rows beyond it
# clip. On SmolLM2-135M-Instruct, verify's random-token prompts reached 1.5x the text's peaks, and
# the clipped keys took one prompt's KL against fp32 to 0.78 (headroom 1: steps' mean KL 0.019,
# text 0.0009); 1.25: 0.0017 and 0.0012; 1.5: 0.0024 and 0.0016; 2: 0.0053 and 0.0029
# (docs/quantization.md "Quantized cache"). A 4-bit cache has no steps to spare:
# headroom only made it worse (text KL 0.19 at 1, 0.47 at 1.5).
CACHE_HEADROOM: dict[str, float] = {"int8": 1.25, "int4": 1.0}
# What verify holds a quantized cache to (with float weights; with quantized weights too, the
# looser of both tables). int8: the trained test model's top-1 and perplexity; its mean KL of
# 0.002 the real checkpoint met only by chance with the headroom above (verify's random prompts:
# 0.0017 over 8 steps, 0.0021 over 4; the held-out text, the steadier measure: 0.0012, top-1 98.0%,
# +0.14%), so 0.004, still under a third of int8 weights' 0.015. int4: the trained test
# model's; on the real checkpoint a 4-bit cache fails them (top-1 78%, +13% perplexity).
CACHE_TOLERANCES: dict[str, dict[str, float]] = {
    "int8": {"min_top1_agreement": 0.95, "max_mean_kl": 0.004, "max_perplexity_delta_pct": 0.5},
    "int4": {"min_top1_agreement": 0.85, "max_mean_kl": 0.03, "max_perplexity_delta_pct": 1.0},
}


def quantization_config(choice: QuantizationChoice) -> QuantizationConfig | None:
    """The scheme's knobs with the user's overrides laid over them (None for float weights)."""
    if choice.scheme in (None, QuantizeKind.NONE):
        return None
    overrides = dict(choice.overrides)
    if (overrides.get("symmetric") or overrides.get("per_channel")) and "offsets" not in overrides:
        overrides["offsets"] = False  # a scheme's offsets go with its asymmetric blocks, not with what replaced them
    try:
        return dataclasses.replace(QUANTIZATION_SCHEMES[choice.scheme.value], **overrides)
    except ValueError as exc:
        raise KvexportError(f"--quantize {choice.scheme.value}: {exc}") from None


def scheme_knobs(
    quantize: QuantizeKind,
    knobs: QuantizationConfig | None,
    dtype: DtypeKind,
    *,
    family: str | None = None,
) -> QuantizationConfig | None:
    """The knobs for ``quantize`` (None for float weights), or one clear error.

    Without ``knobs``, the scheme's blocks (:data:`QUANTIZATION_SCHEMES`) on every target; per-channel
    int8 is asked for by name (``--per-channel``: faster prompts on CPU, further from fp32 on real
    weights, see docs/quantization.md "Which int8"). Per-channel int8 needs fp32 weights
    (``MatMulIntegerToFloat`` here is an fp32 CPU kernel). Per channel, a family with a gated
    MLP (:attr:`~kvexport.models.base.ModelFamily.gated_mlp`) gets 8-bit weights (``channel_bits``) and its
    down projection's input rotated by Hadamard blocks of :data:`GATED_ROTATION`
    (``gated_rotation``), given knobs included unless they keep that product in blocks
    (``gated_blocks``): 7 bits, or every product per channel unrotated, are outside the int8
    tolerances there.
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
    if knobs.per_channel and family is not None and family_for(family).gated_mlp:
        rotation = 0 if knobs.gated_blocks else knobs.gated_rotation or GATED_ROTATION
        return dataclasses.replace(knobs, channel_bits=8, gated_rotation=rotation)
    return knobs


def kv_cache_quantization(kind: str | None, dtype: DtypeKind, cache: CacheKind) -> CacheQuantization | None:
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
            "use ort attention (kvexport export --target ort-cpu, kvexport import --attention ort)"
        )
    # an int8 cache under fp16 graphs is what ONNX Runtime's CUDA GroupQueryAttention takes (T float16,
    # T_CACHE int8, k_scale / v_scale); calibrated on CPU, where the op runs that pair too
    if dtype is not DtypeKind.FP32 and kind != "int8":
        raise KvexportError(
            f"--kv-cache {kind} needs fp32 graphs (its scales are calibrated on CPU), not {dtype.value}; "
            "drop --dtype fp16"
        )
    return config


def cache_quantization(kind: str, *, per_channel: bool = True) -> CacheQuantization | None:
    """The quantization of ``--kv-cache kind`` (None for a float cache)."""
    if kind not in KV_CACHE_KINDS:
        raise KvexportError(f"--kv-cache {kind}: choose one of {', '.join(KV_CACHE_KINDS)}")
    if kind in ("fp32", "fp16"):
        return None
    return CacheQuantization(bits=8 if kind == "int8" else 4, per_channel=per_channel)


