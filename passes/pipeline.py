"""The pass pipeline: which passes run, in which order, and what each one changed.

``build_pipeline(attention=...)`` returns the passes the export and ``kvexport rewrite``
run; ``run_pipeline`` applies them through an ``onnx_ir`` ``PassManager`` and returns one
:class:`PassReport` per pass (nodes, ``Shape`` nodes and fused attention ops before and
after, plus the pass's own counts).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any, Literal

import onnx_ir as ir
from onnx_ir.passes import InPlacePass, PassError, PassManager, PassResult

from passes.cleanup import CleanupPass
from passes.fold_shapes import FoldShapesPass, count_ops
from passes.fuse_attention import FuseAttentionPass, count_attention_ops
from passes.fuse_ort_block import FuseOrtBlockPass
from passes.quantize_weights import QuantizationConfig, QuantizeWeightsPass
from passes.rename_cache import RenameCachePass
from passes.shared_buffer_cache import SharedBufferCachePass
from passes.transposed_weight_gemm import TransposedWeightGemmPass

AttentionChoice = Literal["unfused", "onnx", "ort"]
PASS_NAMES = (
    "rename_cache",
    "transposed_weight_gemm",
    "fold_shapes",
    "fuse_attention",
    "fuse_ort_block",
    "shared_buffer_cache",
    "quantize_weights",
    "cleanup",
)
DEFAULT_REWRITE_PASSES = ("rename_cache", "fold_shapes", "cleanup")


@dataclass
class PassReport:
    """What one pass did to one graph."""

    name: str
    modified: bool
    nodes_before: int
    nodes_after: int
    shape_nodes_before: int
    shape_nodes_after: int
    fused_attention_after: int
    softmax_after: int
    counts: dict[str, int] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        """A plain dict for the manifest."""
        return asdict(self)


class _Measured(InPlacePass):
    """Runs one pass and records a :class:`PassReport` for it."""

    def __init__(self, name: str, inner: InPlacePass, reports: list[PassReport]) -> None:
        super().__init__()
        self.name = name
        self.inner = inner
        self.reports = reports

    def call(self, model: ir.Model) -> PassResult:
        nodes, shapes = len(model.graph), count_ops(model, "Shape")
        result = self.inner(model)
        self.reports.append(
            PassReport(
                name=self.name,
                modified=result.modified,
                nodes_before=nodes,
                nodes_after=len(model.graph),
                shape_nodes_before=shapes,
                shape_nodes_after=count_ops(model, "Shape"),
                fused_attention_after=count_attention_ops(model),
                softmax_after=count_ops(model, "Softmax"),
                counts=dict(getattr(self.inner, "counts", {})),
            )
        )
        return PassResult(result.model, modified=result.modified)


def build_pipeline(
    attention: AttentionChoice = "unfused",
    passes: Sequence[str] | None = None,
    shared_buffer: bool = False,
    quantization: QuantizationConfig | None = None,
) -> list[tuple[str, InPlacePass]]:
    """The named passes to run, in pipeline order.

    Args:
        attention: ``unfused`` leaves attention decomposed; ``onnx`` / ``ort`` add
            ``fuse_attention`` for that target (and ``fuse_ort_block`` for ``ort``).
        passes: the passes to run (any order; they run in pipeline order). None means
            everything that ``attention`` calls for.
        shared_buffer: add ``shared_buffer_cache`` (needs ``attention="ort"``); it
            changes the graphs' cache IO (see :mod:`passes.shared_buffer_cache`).
        quantization: add ``quantize_weights`` with these knobs (needs ``attention="ort"``:
            its operators are ONNX Runtime's).

    Raises:
        ValueError: an unknown pass name, or a pass whose prerequisite is not chosen.

    """
    wanted = set(PASS_NAMES if passes is None else passes)
    if passes is None and not shared_buffer:
        wanted.discard("shared_buffer_cache")
    if passes is None and quantization is None:
        wanted.discard("quantize_weights")
    if shared_buffer:
        wanted.add("shared_buffer_cache")
    if quantization is not None:
        wanted.add("quantize_weights")
    if "quantize_weights" in wanted and attention != "ort":
        raise ValueError("quantize_weights emits ONNX Runtime ops; use it with --attention ort")
    if "shared_buffer_cache" in wanted and attention != "ort":
        raise ValueError("shared_buffer_cache rewrites ONNX Runtime attention; use it with --attention ort")
    unknown = wanted.difference(PASS_NAMES)
    if unknown:
        raise ValueError(f"unknown pass {sorted(unknown)}; choose from {', '.join(PASS_NAMES)}")
    if attention == "unfused":
        if passes is not None and wanted & {"fuse_attention", "fuse_ort_block"}:
            raise ValueError("fuse_attention / fuse_ort_block need --attention onnx or ort")
        wanted -= {"fuse_attention", "fuse_ort_block"}
    elif attention == "onnx":
        if passes is not None and "fuse_ort_block" in wanted:
            raise ValueError("fuse_ort_block emits ONNX Runtime ops; use it with --attention ort")
        wanted.discard("fuse_ort_block")
        wanted.add("fuse_attention")
    else:
        wanted |= {"fuse_attention", "fuse_ort_block"}
    factories: dict[str, Any] = {
        "rename_cache": RenameCachePass,
        "transposed_weight_gemm": TransposedWeightGemmPass,
        "fold_shapes": FoldShapesPass,
        "fuse_attention": lambda: FuseAttentionPass("onnx" if attention == "onnx" else "ort"),
        "fuse_ort_block": FuseOrtBlockPass,
        "shared_buffer_cache": SharedBufferCachePass,
        "quantize_weights": lambda: QuantizeWeightsPass(quantization),
        "cleanup": CleanupPass,
    }
    return [(name, factories[name]()) for name in PASS_NAMES if name in wanted]


def run_pipeline(model: ir.Model, pipeline: Sequence[tuple[str, InPlacePass]]) -> list[PassReport]:
    """Apply ``pipeline`` to ``model`` in place; one report per pass, in order."""
    reports: list[PassReport] = []
    manager = PassManager([_Measured(name, graph_pass, reports) for name, graph_pass in pipeline])
    try:
        manager(model)
    except PassError as exc:
        # The manager wraps what a pass raised ("An error occurred at step 0"); callers
        # need the pass's own error, e.g. rename_cache's NoCacheError with its message.
        cause: BaseException = exc
        while isinstance(cause, PassError) and cause.__cause__ is not None:
            cause = cause.__cause__
        raise cause from None
    return reports
