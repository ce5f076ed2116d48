"""quantize_cache: an int8 / int4 KV cache through ONNX Runtime's GroupQueryAttention.

Since ONNX Runtime 1.31 ``com.microsoft.GroupQueryAttention`` keeps its cache quantized:
``T_CACHE`` int8 (8 bits) or uint8 (4 bits, two values a byte), the attributes
``k_quant_type`` / ``v_quant_type`` (``PER_TENSOR`` or ``PER_CHANNEL``) and
``kv_cache_bit_width``, and the float inputs ``k_scale`` / ``v_scale`` (inputs 12 and 13).
This pass sets them on every GroupQueryAttention of an in-place graph and retypes the
``past.<l>.key|value`` inputs and ``present.<l>.key|value`` outputs::

    GroupQueryAttention(q, k, v, past.l.key fp32 [B, H, cap, D], ...)
      -> GroupQueryAttention(q, k, v, past.l.key int8 [B, H, cap, D], ..., k_scale, v_scale)
         k_quant_type = v_quant_type = PER_CHANNEL, kv_cache_bit_width = 8

    (4 bits: past uint8 [B, H, cap, D/2], kv_cache_bit_width = 4)

The kernel quantizes each new row symmetrically, ``q = clamp(rint(x / scale))``, and reads
the rows back as ``q * scale``; a row written once is never quantized again, so the scales
are fixed for the life of the cache: constants of the graph, chosen before it runs (see
:mod:`kvexport.export.calibration` for how kvexport calibrates them). ``PER_TENSOR`` takes one scale
per layer and tensor, ``PER_CHANNEL`` one per head and channel (``[1, H, 1, D]``); on CPU K
and V use the same type.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np
import onnx_ir as ir
from onnx_ir.passes import InPlacePass, PassResult

from .cache_names import canonical_slot
from .errors import PassInputError
from .values import initializer
from .vocabulary import GROUP_QUERY_ATTENTION, MS_DOMAIN

_K_SCALE, _V_SCALE = 12, 13


class QuantizeCacheError(PassInputError):
    """The graph can't take a quantized cache (no GroupQueryAttention, or not over canonical in-place buffers)."""


@dataclass(frozen=True)
class CacheQuantization:
    """How the cache is quantized.

    Attributes:
        bits: 8 (int8 rows) or 4 (two 4-bit values a byte).
        per_channel: one scale per head and channel (``PER_CHANNEL``); else one per tensor.

    """

    bits: int = 8
    per_channel: bool = True

    def __post_init__(self) -> None:
        if self.bits not in (4, 8):
            raise ValueError(f"a {self.bits}-bit cache: choose 8 or 4")

    @property
    def kind(self) -> str:
        """The cache's kind as ``--kv-cache`` and the manifest name it: ``int8`` or ``int4``."""
        return f"int{self.bits}"

    @property
    def quant_type(self) -> str:
        """GroupQueryAttention's ``k_quant_type`` / ``v_quant_type``."""
        return "PER_CHANNEL" if self.per_channel else "PER_TENSOR"

    @property
    def dtype(self) -> ir.DataType:
        """The cache tensors' element type: int8 for 8 bits, uint8 (packed pairs) for 4."""
        return ir.DataType.INT8 if self.bits == 8 else ir.DataType.UINT8

    @property
    def levels(self) -> int:
        """The largest quantized magnitude a scale maps the calibrated peak to (127 or 7)."""
        return 127 if self.bits == 8 else 7

    def stored_dim(self, head_dim: int) -> int:
        """Elements per cached row of one head: ``head_dim``, halved at 4 bits."""
        return head_dim if self.bits == 8 else head_dim // 2


def _attention(graph: ir.Graph) -> list[ir.Node]:
    return [n for n in graph if n.op_type == GROUP_QUERY_ATTENTION and n.domain == MS_DOMAIN]


class QuantizeCachePass(InPlacePass):
    """Give every GroupQueryAttention a quantized cache with the given scales.

    Args:
        config: bits and per-channel or per-tensor.
        scales: by cache name (``past.<l>.key|value``), the float32 scales: ``[1, H, 1, D]``
            per channel, one element per tensor.

    """

    def __init__(self, config: CacheQuantization, scales: Mapping[str, np.ndarray]) -> None:
        super().__init__()
        self.config = config
        self.scales = dict(scales)
        self.counts: dict[str, int] = {}

    def requires(self, model: ir.Model) -> None:
        """GroupQueryAttention over graph-input pasts with canonical names and a scale each, still float."""
        nodes = _attention(model.graph)
        if not nodes:
            raise QuantizeCacheError(
                "a quantized cache needs GroupQueryAttention (the in-place cache of --attention ort); "
                "this graph has none"
            )
        for node in nodes:
            for index in (3, 4):
                past = node.inputs[index] if len(node.inputs) > index else None
                slot = canonical_slot(past.name or "") if past is not None else None
                if past is None or not past.is_graph_input() or slot is None or slot.direction != "past":
                    raise QuantizeCacheError(
                        f"{node.name}: its cache is not a past.<l>.key|value graph input (export with --cache shared-buffer)"
                    )
                if past.dtype not in (ir.DataType.FLOAT, ir.DataType.FLOAT16):
                    raise QuantizeCacheError(f"{past.name}: the cache is {past.dtype} already")
                if past.name not in self.scales:
                    raise QuantizeCacheError(f"{past.name}: no scale was given for it")
                head_dim = past.shape[3] if past.shape is not None and len(past.shape) == 4 else None
                if self.config.bits == 4 and (not isinstance(head_dim, int) or head_dim % 2):
                    raise QuantizeCacheError(f"{past.name}: a 4-bit cache needs an even head size, not {head_dim}")

    def call(self, model: ir.Model) -> PassResult:
        """Retype the cache and set the attention ops' quantization (what :meth:`requires` checked holds)."""
        graph = model.graph
        config = self.config
        self.counts = {"attention_quantized": 0}
        for node in _attention(graph):
            inputs = list(node.inputs) + [None] * max(0, _V_SCALE + 1 - len(node.inputs))
            for index, scale_index in ((3, _K_SCALE), (4, _V_SCALE)):
                past = inputs[index]
                assert past is not None and past.name is not None  # requires() checked
                inputs[scale_index] = initializer(
                    graph, f"kvexport.kv_scale.{past.name}", np.asarray(self.scales[past.name], np.float32)
                )
                present = node.outputs[index - 2]
                for value in (past, present):
                    value.type = ir.TensorType(config.dtype)
                    if value.shape is not None and len(value.shape) == 4 and isinstance(value.shape[3], int):
                        dims = list(value.shape)
                        value.shape = ir.Shape([*dims[:3], config.stored_dim(value.shape[3])])
            for index, wanted in enumerate(inputs):
                if index >= len(node.inputs):
                    node.resize_inputs(index + 1)
                if node.inputs[index] is not wanted:
                    node.replace_input_with(index, wanted)
            node.attributes["k_quant_type"] = ir.AttrString("k_quant_type", config.quant_type)
            node.attributes["v_quant_type"] = ir.AttrString("v_quant_type", config.quant_type)
            node.attributes["kv_cache_bit_width"] = ir.AttrInt64("kv_cache_bit_width", config.bits)
            self.counts["attention_quantized"] += 1
        return PassResult(model, modified=bool(self.counts["attention_quantized"]))
