"""``kvexport rewrite``: run the passes on any decoder graph file.

The input may come from any exporter (Optimum, TorchScript, ``torch.export``); its
external data is checked to stay inside its directory before anything is read. The
output is written atomically: graph and weights go to a temporary sibling and are
renamed into place only when both are complete. Weights go to ``OUT.data`` beside the
graph (or inside the graph when they are small).
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

import onnx_ir as ir

from kvexport.bundle.storage import (
    EXTERNAL_THRESHOLD_BYTES,
    check_parent_path,
    created_parents,
    load_graph,
)
from kvexport.errors import KvexportError
from kvexport.export.options import refuse_unfused
from kvexport.export.quantization import GATED_ROTATION
from kvexport.passes import (
    DEFAULT_REWRITE_PASSES,
    PassInputError,
    PassReport,
    QuantizationConfig,
    RenameCachePass,
    build_pipeline,
    run_pipeline,
)
from kvexport.passes.cache_names import Style
from kvexport.passes.choices import Attention
from kvexport.passes.quantize_weights import has_gated_products


@dataclass
class RewriteResult:
    """What :func:`rewrite_graph` wrote and what each pass changed."""

    source: Path
    output: Path
    data_file: Path | None
    reports: list[PassReport] = field(default_factory=list)


def rewrite_graph(
    source: str | Path,
    output: str | Path,
    *,
    passes: Sequence[str] | None = None,
    attention: Attention | str = Attention.UNFUSED,
    quantization: QuantizationConfig | None = None,
    names: Style = "canonical",
    force: bool = False,
    explain: bool = False,
) -> RewriteResult:
    """Run the passes on the graph at ``source`` and write the result to ``output``.

    Args:
        source: an ``.onnx`` decoder graph (prefill or decode) with a KV cache.
        output: where to write the rewritten graph; its weights go to ``<output>.data``.
        passes: passes to run (default: rename_cache, fold_shapes, cleanup; see
            :data:`passes.PASS_NAMES`).
        attention: ``onnx`` / ``ort`` adds attention fusion for that target.
        quantization: add ``quantize_weights`` with these knobs (needs ``ort``). Per channel,
            a graph with a gated MLP gets the gated families' recipe, as their exports do
            (8-bit weights, the down projections' input rotated by Hadamard blocks;
            :func:`has_gated_products`).
        names: ``canonical`` (``past.<l>.key``) or ``optimum`` (``past_key_values.<l>.key``).
        force: replace an existing ``output``.
        explain: each report says why a fusion rule that fired 0 times did not match.

    Raises:
        KvexportError: bad paths, an unreadable graph, a graph with no KV cache,
            cache names that can't be mapped without guessing, or attention that
            ``attention`` asked to fuse and no rule could (:func:`refuse_unfused`).

    """
    source, output = Path(source), Path(output)
    if output.exists() and not force:
        raise KvexportError(f"{output}: exists; pass --force to replace it, or choose another path")
    if output.is_dir():
        raise KvexportError(f"{output}: is a directory; give a file name such as decode.onnx")
    check_parent_path(output)
    chosen = DEFAULT_REWRITE_PASSES if passes is None else passes
    # per-channel int8 is a CPU kernel: such a graph keeps LayerNorm(Add) unfused, as ort-cpu exports do
    cpu_only = quantization is not None and quantization.per_channel
    try:  # bad names fail before the graph loads
        pipeline = build_pipeline(attention, chosen, quantization=quantization, explain=explain, skip_layer_norm=not cpu_only)
    except ValueError as exc:
        raise KvexportError(f"--passes: {exc}") from exc
    model = load_graph(source)
    if quantization is not None and quantization.per_channel and has_gated_products(model):
        # no family here: a gated MLP in the graph asks for the gated families' recipe, as export gives them
        rotation = 0 if quantization.gated_blocks else quantization.gated_rotation or GATED_ROTATION
        gated = replace(quantization, channel_bits=8, gated_rotation=rotation)
        pipeline = build_pipeline(attention, chosen, quantization=gated, explain=explain, skip_layer_norm=not cpu_only)
    try:
        reports = run_pipeline(model, pipeline)
        refuse_unfused(model, attention, str(source))
        if names != "canonical":
            RenameCachePass(style=names)(model)
    except PassInputError as exc:  # any pass's refusal of this graph: one line
        raise KvexportError(f"{source}: {exc}") from None
    data_name = f"{output.name}.data"
    with created_parents(output):
        data_file = _write_atomically(model, output, data_name)
    return RewriteResult(source, output, data_file, reports)


def _write_atomically(model: ir.Model, output: Path, data_name: str) -> Path | None:
    """Save graph and weights in a temporary sibling, then rename both into place."""
    work = Path(tempfile.mkdtemp(prefix=f".{output.name}.tmp-", dir=output.parent))
    try:
        ir.save(model, work / output.name, external_data=data_name, size_threshold_bytes=EXTERNAL_THRESHOLD_BYTES)
        data_file: Path | None = output.parent / data_name
        if (work / data_name).exists():
            os.replace(work / data_name, output.parent / data_name)
        else:
            data_file = None
        os.replace(work / output.name, output)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return data_file
