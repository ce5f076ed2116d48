"""The pass pipeline: which passes run, in which order, and what each one changed.

``build_pipeline(attention=...)`` returns the passes the export and ``kvexport rewrite``
run; ``run_pipeline`` applies them through an ``onnx_ir`` ``PassManager`` and returns one
:class:`PassReport` per pass (nodes, ``Shape`` nodes and fused attention ops before and
after, plus the pass's own counts).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import onnx_ir as ir
from onnx_ir.passes import InPlacePass, PassError, PassManager, PassResult

from .choices import Attention
from .cleanup import CleanupPass
from .fold_shapes import FoldShapesPass, count_ops
from .fuse_attention import FuseAttentionPass, count_attention_ops
from .fuse_ort_block import FuseOrtBlockPass
from .pack_projections import PackProjectionsPass
from .quantize_weights import BlockSource, QuantizationConfig, QuantizeWeightsPass
from .rename_cache import RenameCachePass
from .shared_buffer_cache import SharedBufferCachePass
from .transposed_weight_gemm import TransposedWeightGemmPass

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
    # with explain: rule -> why it matched 0 times (its closest match's failure)
    explanations: dict[str, str] = field(default_factory=dict)

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
                explanations=dict(getattr(self.inner, "explanations", {})),
            )
        )
        return PassResult(result.model, modified=result.modified)


@dataclass(frozen=True)
class PipelineOptions:
    """What the passes are built for: the attention target and the optional rewrites."""

    attention: Attention = Attention.UNFUSED
    shared_buffer: bool = False
    quantization: QuantizationConfig | None = None
    explain: bool = False
    skip_layer_norm: bool = True
    pack_projections: bool = False
    block_source: BlockSource | None = None  # the source file's blocks, for quantize_weights to keep


@dataclass(frozen=True)
class PassSpec:
    """One entry of the registry: a pass, when it runs, and what it needs.

    ``default``: in the pipeline when no passes are named. ``implied``: in the pipeline
    whatever is named (the options ask for it). ``attention``: the attention targets it
    works with; naming it for another is refused with ``requirement``. What a pass needs
    of the *graph* is its own ``requires()``.
    """

    name: str
    make: Callable[[PipelineOptions], InPlacePass]
    default: Callable[[PipelineOptions], bool] = lambda options: True
    implied: Callable[[PipelineOptions], bool] = lambda options: False
    attention: frozenset[Attention] = frozenset(Attention)
    requirement: str = ""


_FUSED = frozenset({Attention.ONNX, Attention.ORT})
_ORT = frozenset({Attention.ORT})

# The registry, in pipeline order. fold_shapes runs again after fusion (the fused ops
# leave shape chains whose inputs are now constants); that is the pipeline's doing, not
# fuse_attention's.
REGISTRY: tuple[PassSpec, ...] = (
    PassSpec("rename_cache", lambda o: RenameCachePass()),
    PassSpec("transposed_weight_gemm", lambda o: TransposedWeightGemmPass(o.explain)),
    PassSpec("fold_shapes", lambda o: FoldShapesPass()),
    PassSpec(
        "fuse_attention",
        lambda o: FuseAttentionPass("onnx" if o.attention is Attention.ONNX else "ort", o.explain),
        default=lambda o: o.attention is not Attention.UNFUSED,
        implied=lambda o: o.attention is not Attention.UNFUSED,
        attention=_FUSED,
        requirement="fuse_attention / fuse_ort_block need --attention onnx or ort",
    ),
    PassSpec(
        "fuse_ort_block",
        lambda o: FuseOrtBlockPass(o.explain, skip_layer_norm=o.skip_layer_norm),
        default=lambda o: o.attention is Attention.ORT,
        implied=lambda o: o.attention is Attention.ORT,
        attention=_ORT,
        requirement="fuse_ort_block emits ONNX Runtime ops; use it with --attention ort",
    ),
    PassSpec(
        "shared_buffer_cache",
        lambda o: SharedBufferCachePass(),
        default=lambda o: o.shared_buffer,
        implied=lambda o: o.shared_buffer,
        attention=_ORT,
        requirement="shared_buffer_cache rewrites ONNX Runtime attention; use it with --attention ort",
    ),
    PassSpec(
        "pack_projections",
        lambda o: PackProjectionsPass(),
        default=lambda o: o.pack_projections,
        implied=lambda o: o.pack_projections,
        attention=_ORT,
        requirement="pack_projections packs GroupQueryAttention's projections; use it with --attention ort",
    ),
    PassSpec(
        "quantize_weights",
        lambda o: QuantizeWeightsPass(o.quantization, o.block_source),
        default=lambda o: o.quantization is not None,
        implied=lambda o: o.quantization is not None,
        attention=_ORT,
        requirement="quantize_weights emits ONNX Runtime ops; use it with --attention ort",
    ),
    PassSpec("cleanup", lambda o: CleanupPass()),
)
PASS_NAMES = tuple(spec.name for spec in REGISTRY)


def build_pipeline(
    attention: Attention | str = Attention.UNFUSED,
    passes: Sequence[str] | None = None,
    shared_buffer: bool = False,
    quantization: QuantizationConfig | None = None,
    explain: bool = False,
    skip_layer_norm: bool = True,
    pack_projections: bool = False,
    block_source: BlockSource | None = None,
) -> list[tuple[str, InPlacePass]]:
    """The named passes to run, in pipeline order (see :data:`REGISTRY`).

    Args:
        attention: ``unfused`` leaves attention decomposed; ``onnx`` / ``ort`` add
            ``fuse_attention`` for that target (and ``fuse_ort_block`` for ``ort``).
        passes: the passes to run (any order; they run in pipeline order). None means
            everything that the options call for.
        shared_buffer: add ``shared_buffer_cache`` (needs ``attention="ort"``); it
            changes the graphs' cache IO (see :mod:`passes.shared_buffer_cache`).
        quantization: add ``quantize_weights`` with these knobs (needs ``attention="ort"``:
            its operators are ONNX Runtime's).
        explain: the rule passes record, for each rule that fired 0 times, why its
            closest match failed (onnxscript's ``MatchingTracer``); see ``PassReport``.
        skip_layer_norm: let ``fuse_ort_block`` fuse a LayerNorm's residual ``Add`` into
            ``SkipLayerNormalization`` (one kernel on CUDA); False for CPU graphs, where
            ONNX Runtime's kernel of that op is slower than the two.
        pack_projections: add ``pack_projections`` (needs ``attention="ort"``): each
            GroupQueryAttention's query, key and value from one ``MatMul``, the form ONNX
            Runtime's CUDA provider loads (see :mod:`passes.pack_projections`).
        block_source: where ``quantize_weights`` finds the blocks a source file (a GGUF's)
            stores a weight in, to keep them as they are (:class:`~passes.quantize_weights.BlockSource`).

    Raises:
        ValueError: an unknown attention or pass name, or a pass that the attention choice
            can't serve.

    """
    try:
        chosen = Attention(attention)
    except ValueError:
        raise ValueError(f"unknown attention {attention!r}; choose from {', '.join(a.value for a in Attention)}") from None
    options = PipelineOptions(chosen, shared_buffer, quantization, explain, skip_layer_norm, pack_projections, block_source)
    unknown = set(passes or ()).difference(PASS_NAMES)
    if unknown:
        raise ValueError(f"unknown pass {sorted(unknown)}; choose from {', '.join(PASS_NAMES)}")
    wanted = [
        spec
        for spec in REGISTRY
        if spec.implied(options) or (spec.default(options) if passes is None else spec.name in passes)
    ]
    for spec in wanted:
        if chosen not in spec.attention:
            raise ValueError(spec.requirement)
    pipeline = []
    for spec in wanted:
        pipeline.append((spec.name, spec.make(options)))
        if spec.name == "fuse_attention":
            pipeline.append(("fold_shapes", FoldShapesPass()))
    return pipeline


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
