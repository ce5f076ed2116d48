"""``kvexport import``: a decoder graph another tool made becomes a kvexport directory.

Optimum (``optimum-cli export onnx --task text-generation-with-past``) and others leave
one graph for both phases (GPT-2's, or a Llama-style family's): the prompt step passes a past of length 0. From it this
makes the two graphs of kvexport's contract (docs/export.md, "Graph IO contract"):

- **prefill**: every past input is replaced by an empty ``[batch, H, 0, D]`` tensor and
  removed from the inputs; fold_shapes then drops the ``Concat`` with it and the length
  arithmetic it fed. The LM head runs on the last position only (``logits`` [batch, 1, V]).
- **decode**: ``input_ids`` and ``position_ids`` become ``[batch, 1]``, so the passes can
  specialise the mask for one query.

Both then run the pass pipeline (rename_cache, fold_shapes, fusion for ``--attention``,
optional quantization, cleanup), dims are renamed to the contract's (``batch``,
``sequence``, ``past_sequence``, ``total_sequence``), the weights are stored once for
both graphs, and the manifest, the tokenizer and the config's numbers are written as an
export writes them. With ``model`` (the checkpoint the graph was exported from) the
manifest names it as the source, so ``kvexport verify`` can compare against PyTorch;
without it the source is the graph itself, and verify says so.
"""

from __future__ import annotations

import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import onnx_ir as ir

from kvexport.bundle.manifest import Manifest
from kvexport.bundle.model_info import ModelDims, ModelSource
from kvexport.bundle.storage import atomic_output_dir, check_output_dir, load_graph
from kvexport.errors import KvexportError
from kvexport.export.calibration import quantize_cache_step
from kvexport.export.genai_graph import from_genai, is_genai_graph
from kvexport.export.options import ExportOptions, check_attention, refuse_unfused
from kvexport.export.writer import ExportRecord, rename_dims, write_export_directory
from kvexport.extras import require_export_extra
from kvexport.models import family_for
from kvexport.models.base import ModelFamily, read_config
from kvexport.passes import (
    PassInputError,
    QuantizationConfig,
    RenameCachePass,
    run_pipeline,
)
from kvexport.passes.cache_names import canonical_slot
from kvexport.passes.choices import Attention
from kvexport.passes.values import ints
from kvexport.passes.vocabulary import GROUP_QUERY_ATTENTION
from kvexport.progress import Progress, silent

# Optimum's and torch's dim names -> the contract's, per graph.
_PREFILL_DIMS = {
    "batch_size": "batch",
    "sequence_length": "sequence",
    "past_sequence_length + sequence_length": "sequence",
    "total_sequence_length": "sequence",
}
_DECODE_DIMS = {
    "batch_size": "batch",
    "past_sequence_length": "past_sequence",
    "past_sequence_length + sequence_length": "total_sequence",
    "past_sequence_length + 1": "total_sequence",
    "total_sequence_length": "total_sequence",
}
_GRAPH_NAMES = ("model.onnx", "decoder_model_merged.onnx", "decoder_with_past_model.onnx")
_INPUTS = ("input_ids", "attention_mask", "position_ids")


def _locate(source: Path) -> tuple[Path, Path]:
    """The graph file and the directory beside it (config, tokenizer)."""
    if not source.exists():
        raise KvexportError(f"{source}: no such file or directory; pass a decoder .onnx or an Optimum export directory")
    if source.is_dir():
        for name in _GRAPH_NAMES:
            if (source / name).is_file():
                return source / name, source
        raise KvexportError(f"{source}: holds none of {', '.join(_GRAPH_NAMES)}; pass the decoder .onnx itself")
    return source, source.parent


def _check_inputs(model: ir.Model, graph_path: Path) -> None:
    found = {value.name for value in model.graph.inputs}
    missing = [name for name in _INPUTS if name not in found]
    if missing:
        raise KvexportError(
            f"{graph_path}: has no {', '.join(missing)} input; import takes a decoder with "
            "input_ids, attention_mask and position_ids (Optimum's text-generation-with-past export)"
        )


def _past_inputs(model: ir.Model) -> list[ir.Value]:
    return [value for value in model.graph.inputs if (value.name or "").startswith("past.")]


def _cache_in_layer_order(model: ir.Model) -> None:
    """Cache inputs and outputs in the contract's order (layer by layer, key before value); others keep their places.

    onnxruntime-genai's builder lists every key before every value.
    """
    for values in (model.graph.inputs, model.graph.outputs):
        slots = [(index, canonical_slot(value.name or "")) for index, value in enumerate(values)]
        cache = [(index, slot) for index, slot in slots if slot is not None]
        ordered = sorted(cache, key=lambda item: (item[1].layer, item[1].kind != "key"))
        chosen = [values[index] for index, _ in ordered]
        for (index, _), value in zip(cache, chosen, strict=True):
            values[index] = value


def _dims(model: ir.Model, config_dir: Path | None, graph_path: Path) -> ModelDims:
    """The architecture's numbers: from config.json when there is one, else read off the graph."""
    past = _past_inputs(model)
    if not past or past[0].shape is None or not isinstance(past[0].shape[1], int):
        raise KvexportError(f"{graph_path}: past inputs have no static head count; import needs [batch, H, past, D] caches")
    heads, head_dim = int(past[0].shape[1]), int(past[0].shape[3])  # type: ignore[arg-type]
    config_file = config_dir / "config.json" if config_dir is not None else None
    if config_file is not None and config_file.is_file():
        dims = _family(config_dir).dims(read_config(config_file))
        if (dims.num_layers * 2, dims.num_kv_heads, dims.head_dim) != (len(past), heads, head_dim):
            raise KvexportError(f"{config_file}: does not describe {graph_path} (layers, heads or head size differ)")
        return dims
    logits = next((v for v in model.graph.outputs if v.name == "logits"), None)
    vocab = logits.shape[-1] if logits is not None and logits.shape is not None else None
    positions = [
        int(v.shape[0])  # type: ignore[arg-type]
        for v in model.graph.initializers.values()
        if v.shape is not None and len(v.shape) == 2 and v.shape[1] == heads * head_dim and v.shape[0] != vocab
    ]
    if not isinstance(vocab, int) or len(positions) != 1:
        raise KvexportError(f"{graph_path}: can't read vocab and positions off the graph; put its config.json beside it")
    # no config: read as GPT-2 reads (multi-head attention, learned positions)
    return ModelDims(len(past) // 2, heads, heads, head_dim, heads * head_dim, vocab, positions[0])


def _family(config_dir: Path | None) -> ModelFamily:
    """The family the checkpoint's config names; GPT-2's where there is no config to read."""
    if config_dir is None or not (config_dir / "config.json").is_file():
        return family_for("gpt2")
    config_file = config_dir / "config.json"
    return family_for(read_config(config_file).get("model_type"), str(config_file))


def _empty_past(model: ir.Model) -> None:
    """Prefill: each past input becomes an empty ``[batch, H, 0, D]`` tensor made in the graph."""
    graph = model.graph
    ids = next(v for v in graph.inputs if v.name == "input_ids")
    batch = ir.node("Shape", [ids], attributes={"start": 0, "end": 1})
    graph.insert_before(graph[0], batch)
    for past in _past_inputs(model):
        assert past.shape is not None
        rest = ints(graph, [int(past.shape[1]), 0, int(past.shape[3])])  # type: ignore[arg-type]
        shape = ir.node("Concat", [batch.outputs[0], rest], attributes={"axis": 0})
        dtype = past.dtype.numpy() if past.dtype is not None else np.float32
        empty = ir.node("ConstantOfShape", [shape.outputs[0]], attributes={"value": ir.tensor(np.zeros(1, dtype))})
        graph.insert_after(batch, [shape, empty])
        empty.outputs[0].type = past.type
        empty.outputs[0].shape = ir.Shape([past.shape[0], past.shape[1], 0, past.shape[3]])
        past.replace_all_uses_with(empty.outputs[0])
        graph.inputs.remove(past)


def _one_token(model: ir.Model) -> None:
    """Decode: ``input_ids`` and ``position_ids`` are ``[batch, 1]``, and so are the logits' first dims."""
    for value in [*model.graph.inputs, *model.graph.outputs]:
        if value.name in ("input_ids", "position_ids", "logits") and value.shape is not None:
            value.shape = ir.Shape([value.shape[0], 1, *value.shape[2:]])


def _last_position_logits(model: ir.Model) -> bool:
    """Prefill: the LM head reads the last position only; False if the head is not found.

    The head is the MatMul / Gemm / MatMulNBits that makes ``logits`` (through Reshapes, as
    when a Gemm is flattened around), or a per-channel int8 head, ``Mul(MatMulIntegerToFloat(
    QuantizeLinear(x, r, ...)), r)`` (or ``QuantizeLinear(Div(x, r))``, before opset 21); the
    [batch, sequence, E] activation it reads is sliced
    to its last row for every node of the head that reads it (the row scale's too).
    """
    graph = model.graph
    logits = next((v for v in graph.outputs if v.name == "logits"), None)
    head = logits.producer() if logits is not None else None
    while head is not None and head.op_type == "Reshape" and head.inputs[0] is not None:
        head = head.inputs[0].producer()
    if logits is None or head is None:
        return False
    if head.op_type == "Mul":
        head = _row_quantized_input(head)
    if head is None or head.op_type not in ("MatMul", "MatMulNBits", "Gemm", "Div", "QuantizeLinear"):
        return False
    hidden = head.inputs[0]
    flatten = hidden.producer() if hidden is not None else None
    if flatten is not None and flatten.op_type == "Reshape":
        hidden = flatten.inputs[0]
    if hidden is None or hidden.is_graph_output() or (hidden.shape is not None and len(hidden.shape) != 3):
        return False
    consts = [ints(graph, [-1]), ints(graph, [int(np.iinfo(np.int64).max)]), ints(graph, [1])]
    uses = list(hidden.uses())
    last = ir.node("Slice", [hidden, *consts])
    graph.insert_before(min((u.node for u in uses), key=list(graph).index), last)
    last.outputs[0].type = hidden.type
    if hidden.shape is not None:
        last.outputs[0].shape = ir.Shape([hidden.shape[0], 1, hidden.shape[2]])
    for use in uses:
        use.node.replace_input_with(use.idx, last.outputs[0])
    if logits.shape is not None:
        logits.shape = ir.Shape([logits.shape[0], 1, logits.shape[2]])
    return True


def _row_quantized_input(scaled: ir.Node) -> ir.Node | None:
    """The node that reads a per-channel head's activation rows first, from the head's last ``Mul``.

    ``quantize_weights`` writes ``Mul(MatMulIntegerToFloat(QuantizeLinear(x, r, ..., block_size)), r)``
    (opset 21), or ``Mul(MatMulIntegerToFloat(QuantizeLinear(Div(x, r), ...)), r)``: the
    ``QuantizeLinear`` or the ``Div`` reads ``x`` first, as the other heads do. None when the
    ``Mul`` is not that.
    """
    node: ir.Node | None = scaled
    for op_type in ("Mul", "MatMulIntegerToFloat", "QuantizeLinear"):
        if node is None or node.op_type != op_type or not node.inputs or node.inputs[0] is None:
            return None
        if op_type == "QuantizeLinear" and "block_size" in node.attributes:
            return node
        node = node.inputs[0].producer()
    return node if node is not None and node.op_type == "Div" else None


def _windows(family: ModelFamily, config_dir: Path | None) -> list[int]:
    """Each layer's sliding window (-1: none), as the checkpoint's config sets them; empty without a config."""
    if config_dir is None or not (config_dir / "config.json").is_file():
        return []
    return family.layer_windows(read_config(config_dir / "config.json"))


def _set_windows(graph: ir.Model, windows: list[int]) -> None:
    """Give each layer's GroupQueryAttention its sliding window (``local_window_size``).

    Over the in-place cache the exporter's mask, which held the window, is replaced by the
    padding alone, so the op must apply the window itself.
    """
    for node in graph.graph:
        slot = canonical_slot(node.outputs[1].name or "") if node.op_type == GROUP_QUERY_ATTENTION and len(node.outputs) > 1 else None
        if slot is not None and slot.layer < len(windows) and windows[slot.layer] >= 0:
            node.attributes["local_window_size"] = ir.AttrInt64("local_window_size", windows[slot.layer])


def _source(model_dir: Path | None, graph_path: Path) -> tuple[ModelSource, str]:
    """The manifest's source and weights fingerprint.

    With a checkpoint, its PyTorch weights are fingerprinted (torch is loaded), as an
    export does: verify and bench compare the fingerprint with what they rebuild.
    """
    if model_dir is None:
        return ModelSource("graph", str(graph_path)), ""
    from kvexport.models.base import source_of, weights_fingerprint

    family = _family(model_dir)
    source = source_of(family, str(model_dir), random_init=False, seed=0)
    torch_model = family.load(source, "fp32")
    return source, weights_fingerprint(torch_model)


def _specialise(
    graph_path: Path, name: str, options: ExportOptions, config_dir: Path | None, progress: Progress, notes: dict[str, Any]
) -> tuple[ir.Model, ModelDims, list[dict[str, Any]], bool]:
    """One graph of the pair made from the one-graph decoder, passes run.

    Returns the graph, the architecture's numbers, the pass reports and whether the
    logits are the last position's only. ``notes["converted"]`` says what an
    onnxruntime-genai graph computed itself and computes now (:mod:`genai_graph`).
    """
    progress(f"specialising {graph_path.name} into {name}")
    graph = load_graph(graph_path)
    if is_genai_graph(graph):
        if options.attention is not Attention.ORT or not options.in_place_cache:
            raise KvexportError(
                f"{graph_path}: onnxruntime-genai's graph is fused already (ONNX Runtime's GroupQueryAttention): "
                "import it with --attention ort and the in-place cache"
            )
        notes["converted"] = from_genai(graph, str(graph_path))
    _check_inputs(graph, graph_path)
    try:
        RenameCachePass()(graph)
        _cache_in_layer_order(graph)
        dims = _dims(graph, config_dir, graph_path)
        if name == "prefill":
            _empty_past(graph)
        else:
            _one_token(graph)
        rename_dims(graph, _PREFILL_DIMS if name == "prefill" else _DECODE_DIMS)
        reports = [{"graph": name, **report.to_json()} for report in run_pipeline(graph, options.pipeline())]
        refuse_unfused(graph, options.attention, str(graph_path))
    except PassInputError as exc:  # any pass's refusal of this graph: one line
        raise KvexportError(f"{graph_path}: {exc}") from None
    last_only = _last_position_logits(graph) if name == "prefill" else True
    return graph, dims, reports, last_only


def import_decoder(
    source: str | Path,
    out: str | Path,
    *,
    model: str | Path | None = None,
    attention: str = "unfused",
    cache: str | None = None,
    quantize: str = "none",
    quantization: QuantizationConfig | None = None,
    kv_cache: str | None = None,
    force: bool = False,
    progress: Progress | None = None,
) -> Manifest:
    """Turn a one-graph decoder (``source``: an .onnx or an Optimum directory) into a kvexport directory ``out``.

    GPT-2 or a Llama-style family (the one ``config.json`` names); with ``attention="ort"``
    a Llama-style graph's grouped-query attention becomes GroupQueryAttention over the
    in-place cache, each layer's sliding window set from the config.

    Args:
        source: the decoder graph, or the directory holding it (``model.onnx``) with its
            ``config.json`` and tokenizer files.
        out: the directory to write (atomically; refused if non-empty unless ``force``).
        model: the checkpoint the graph was exported from (a local directory): recorded
            as the source, so ``verify`` can compare against PyTorch. Fingerprinting its
            weights needs torch (``kvexport[export]``); without ``model`` nothing here does.
        attention: ``unfused``, ``onnx`` or ``ort``, as for ``kvexport rewrite``.
        cache: ``concat`` or ``shared-buffer`` (the in-place cache; needs ``ort``; the
            directory then also loads in onnxruntime-genai). None: ``shared-buffer`` for
            ``ort``, else ``concat``, as ``kvexport gpt2`` chooses for its targets.
        quantize: ``none``, ``int8`` or ``int4`` (needs ``ort``), as for ``kvexport gpt2``.
        quantization: override the scheme's knobs.
        kv_cache: ``int8`` / ``int4`` for a quantized cache (the in-place cache only), as for
            ``kvexport gpt2``; None or ``fp32``: a float cache.
        force: replace a non-empty ``out``.
        progress: called with a short message at each phase.

    Returns:
        The manifest written to ``out/kvexport.json``.

    Raises:
        KvexportError: a missing or unreadable graph, a family kvexport does not know,
            attention that ``attention`` asked to fuse and no rule could, a graph that is not a decoder
            with a cache, or a config that does not describe it.

    """
    progress = progress or silent
    started = time.perf_counter()
    out_path = Path(out)
    graph_path, source_dir = _locate(Path(source))
    target = "ort-cpu" if attention == Attention.ORT else "portable"
    ExportOptions.resolve(target, attention, "fp32", cache, quantize, quantization, kv_cache=kv_cache)  # refused first
    check_output_dir(out_path.absolute(), force)
    model_dir = _checkpoint(model)
    config_dir = _config_dir(source_dir, model_dir)
    family = _family(config_dir)
    options = ExportOptions.resolve(  # again, now that the family decides what --quantize int8 means
        target, attention, "fp32", cache, quantize, quantization, kv_cache=kv_cache, family=family.name
    )
    check_attention(family, options)
    pair = _specialise_pair(graph_path, options, config_dir, _windows(family, config_dir), progress)
    model_source, fingerprint = _source(model_dir, graph_path)
    record = ExportRecord(
        source=model_source,
        dims=pair.dims,
        weights_fingerprint=fingerprint,
        options=options,
        export={"strategy": "import", "imported_from": str(graph_path), "attempts": [], **pair.notes},
        passes=pair.reports,
        tokenizer_dir=source_dir if (source_dir / "tokenizer.json").is_file() else model_dir,
        started=started,
        family=family,
        all_logits=not pair.last_only,
    )
    manifest = _write(out_path, force, pair.graphs, record, progress)
    progress(f"wrote {out_path}")
    return manifest


def _checkpoint(model: str | Path | None) -> Path | None:
    """``--model``'s directory, checked: it holds a ``config.json``, and torch is there to fingerprint its weights."""
    if model is None:
        return None
    model_dir = Path(model)
    if not (model_dir / "config.json").is_file():
        raise KvexportError(f"--model {model_dir}: not a checkpoint directory (no config.json)")
    require_export_extra("kvexport import --model")  # its weights are fingerprinted with torch, as an export does
    return model_dir


def _config_dir(source_dir: Path, model_dir: Path | None) -> Path | None:
    """Where the ``config.json`` that names the family is: beside the graph, else the checkpoint's."""
    config_dir = source_dir if (source_dir / "config.json").is_file() else model_dir
    if config_dir is None and (source_dir / "genai_config.json").is_file():
        raise KvexportError(
            f"{source_dir}: onnxruntime-genai's export has no config.json; pass --model CHECKPOINT (the checkpoint "
            "it was built from: its config names the family, and verify compares with it)"
        )
    return config_dir


@dataclass
class _Pair:
    """The prefill and decode graphs made from one decoder, and what the manifest says of them."""

    graphs: dict[str, ir.Model]
    dims: ModelDims
    reports: list[dict[str, Any]]
    last_only: bool  # the prefill graph's logits are the last position's only
    notes: dict[str, Any]  # what an onnxruntime-genai graph computed itself (see _specialise)


def _specialise_pair(
    graph_path: Path, options: ExportOptions, config_dir: Path | None, windows: list[int], progress: Progress
) -> _Pair:
    """Both graphs of the contract from the one at ``graph_path`` (:func:`_specialise`), each layer's window set."""
    graphs: dict[str, ir.Model] = {}
    reports: list[dict[str, Any]] = []
    last_only = True
    notes: dict[str, Any] = {}
    for name in ("prefill", "decode"):
        graphs[name], dims, graph_reports, graph_last_only = _specialise(graph_path, name, options, config_dir, progress, notes)
        _set_windows(graphs[name], windows)
        reports += graph_reports
        last_only &= graph_last_only
    return _Pair(graphs, dims, reports, last_only, notes)


def _write(out_path: Path, force: bool, graphs: dict[str, ir.Model], record: ExportRecord, progress: Progress) -> Manifest:
    """Write the directory atomically, the quantized cache calibrated first where the options ask for one."""
    with (
        atomic_output_dir(out_path, force) as tmp,
        tempfile.TemporaryDirectory(prefix=f".{out_path.name}.work-", dir=tmp.parent) as work,
    ):
        if record.options.kv_cache is not None:
            record = quantize_cache_step(graphs, record, Path(work), progress)
        return write_export_directory(tmp, graphs, record, progress)
