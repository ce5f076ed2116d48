"""Export a model of any known family to the prefill and decode graphs, with manifest, weights and tokenizer.

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
import gc
import logging
import os
import signal
import sys
import tempfile
import threading
import time
import warnings
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import onnx_ir as ir
import torch
from transformers import PreTrainedModel

from kvexport.bundle.manifest import Manifest
from kvexport.bundle.model_info import ModelDims, ModelSource
from kvexport.bundle.storage import atomic_output_dir, check_output_dir
from kvexport.errors import ExportError, KvexportError, first_line
from kvexport.export.calibration import quantize_cache_step
from kvexport.export.choices import (
    EXPORT_STRATEGIES,
    TARGET_DEFAULTS,
    AttentionKind,
    ExportChoices,
    TargetKind,
)
from kvexport.export.options import ExportOptions, check_attention
from kvexport.export.writer import ExportRecord, rename_dims, write_export_directory
from kvexport.models import family_for, family_of_model
from kvexport.models.base import ModelFamily, read_config, source_of, weights_fingerprint
from kvexport.models.gguf import (
    GgufBlockIndex,
    gguf_config,
    is_gguf,
    read_gguf,
    save_gguf_tokenizer,
)
from kvexport.passes import run_pipeline
from kvexport.passes.cache_names import cache_names
from kvexport.passes.quantize_weights import BlockSource
from kvexport.progress import Progress, silent
from kvexport.runtime.cuda_support import cuda_findings

IO_INPUTS = ["input_ids", "attention_mask", "position_ids"]

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
    # op -> its ONNX translation, for torch.onnx.export(custom_translation_table=...)
    translations: dict[Any, Any] | None = None


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
        names = {name for axes in request.dynamic_axes.values() for name in axes.values()}
        for dim_name in sorted(names):
            if dim_name != "total_sequence" or "past_sequence" not in names:
                dims[dim_name] = torch.export.Dim(dim_name, min=1)
        if "past_sequence" in dims:  # the concat layout: the mask spans the past and the new token
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
            optimize=False,  # optimize_exported below: torch's optimizer less one rule
            verbose=False,
            custom_translation_table=request.translations,
        )
        assert program is not None
        model = optimize_exported(program.model)
        rename_dims(
            model,
            {str(dims["total_sequence"]): "total_sequence"} if "total_sequence" in dims else {},
        )
        return model


# onnxscript's default rewrite rules that ``optimize_exported`` leaves out, by rule name.
# SlicesSplit (two Slices of one tensor's halves -> one Split, the rotary's rotate_half) pairs
# every Slice with every other: on SmolLM2-135M's portable prefill (6,614 nodes before
# optimizing) it took 12.1 of the 15.2 s that all 46 rules took, and nothing downstream needs
# the Split.
SKIPPED_REWRITE_RULES = frozenset({"SlicesSplit"})


def optimize_exported(model: ir.Model) -> ir.Model:
    """What ``torch.onnx.export(optimize=True)`` runs on a fresh graph, without :data:`SKIPPED_REWRITE_RULES`.

    onnxscript's ``optimizer.optimize_ir`` pass list (inline; constant folding and the default
    rewrite rules, twice or until nothing changes; the clean-ups), then its ONNX fusions, as
    ``onnxscript._framework_apis.torch_2_8.optimize`` does; ``optimize_ir`` takes no rule list.
    """
    import onnx_ir.passes.common as common_passes
    from onnxscript import rewriter
    from onnxscript.optimizer import _constant_folding
    from onnxscript.rewriter import onnx_fusions

    rules = [rule for rule in rewriter._DEFAULT_REWRITE_RULES if rule.name not in SKIPPED_REWRITE_RULES]
    loop = ir.passes.PassManager(
        [
            _constant_folding.FoldConstantsPass(
                shape_inference=True,
                input_size_limit=_constant_folding.DEFAULT_CONSTANT_FOLD_INPUT_SIZE_LIMIT,
                output_size_limit=_constant_folding.DEFAULT_CONSTANT_FOLD_OUTPUT_SIZE_LIMIT,
            ),
            rewriter.RewritePass(rules),
            common_passes.RemoveUnusedNodesPass(),
            common_passes.RemoveUnusedFunctionsPass(),
            common_passes.RemoveUnusedOpsetsPass(),
        ],
        steps=2,
        early_stop=True,
    )
    ir.passes.Sequential(
        common_passes.InlinePass(),
        loop,
        common_passes.RemoveUnusedNodesPass(),
        common_passes.LiftConstantsToInitializersPass(lift_all_constants=True, size_limit=0),
        common_passes.LiftSubgraphInitializersToMainGraphPass(),
        common_passes.DeduplicateInitializersPass(),
        common_passes.CommonSubexpressionEliminationPass(),
        common_passes.OutputFixPass(),
        common_passes.NameFixPass(),
    )(model)
    onnx_fusions.fuse(model)
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
DEFAULT_STRATEGY_ORDER = EXPORT_STRATEGIES


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


def graph_requests(
    family: ModelFamily, model: PreTrainedModel, dims: ModelDims, all_logits: bool, opset: int
) -> list[GraphRequest]:
    """The prefill and decode graphs to export, with sample inputs that keep every dynamic dim dynamic."""
    gen = torch.Generator().manual_seed(0)
    batch, prompt, past = _SAMPLE_BATCH, _SAMPLE_PROMPT, _SAMPLE_PAST
    param = next(model.parameters())
    ids = torch.randint(0, dims.vocab_size, (batch, prompt), generator=gen)
    mask = torch.ones(batch, prompt, dtype=torch.int64)
    positions = torch.arange(prompt).expand(batch, prompt).contiguous()
    present = cache_names("present", dims.num_layers)
    prefill = GraphRequest(
        name="prefill",
        module=family.prefill_module(model, all_logits=all_logits),
        args=(ids, mask, positions),
        input_names=IO_INPUTS,
        output_names=["logits", *present],
        dynamic_axes={n: {0: "batch", 1: "sequence"} for n in IO_INPUTS},
        opset=opset,
        logits_length="sequence" if all_logits else 1,
    )
    cache_shape = (batch, dims.num_kv_heads, past, dims.head_dim)
    past_tensors = tuple(
        torch.randn(cache_shape, generator=gen).to(param.dtype) for _ in range(2 * dims.num_layers)
    )
    past_names = cache_names("past", dims.num_layers)
    decode_axes = {
        "input_ids": {0: "batch"},
        "attention_mask": {0: "batch", 1: "total_sequence"},
        "position_ids": {0: "batch"},
        **{n: {0: "batch", 2: "past_sequence"} for n in past_names},
    }
    decode = GraphRequest(
        name="decode",
        module=family.decode_module(model),
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


def in_place_requests(
    model: PreTrainedModel, family: ModelFamily, dims: ModelDims, all_logits: bool, opset: int
) -> list[GraphRequest]:
    """The graphs over the in-place cache, attention exported as GroupQueryAttention (see ``kvexport.models.grouped_attention``).

    The IO is the shared-buffer contract GPT-2's passes produce: prefill takes the buffers
    too, ``attention_mask`` spans ``total_sequence`` (a chunk after a past, or one token over
    a mask as wide as the buffer), the buffers are ``[batch, KV, max_sequence, D]``.

    Prefill alone unless ``all_logits``: its graph already computes any number of new tokens
    after a past and returns the last one's logits, which is what decode does, so decode is
    derived from it (:func:`decode_from_prefill`) instead of traced again, which took as long
    as prefill's (SmolLM2-135M: 28 of 83 seconds). With every position's logits, decode
    (last only) is exported on its own.
    """
    from kvexport.models.grouped_attention import ONNX_TRANSLATION

    gen = torch.Generator().manual_seed(0)
    param = next(model.parameters())
    batch, prompt, total, capacity = _SAMPLE_BATCH, _SAMPLE_PROMPT, _SAMPLE_PROMPT + 2, _SAMPLE_PROMPT + 5
    buffers = tuple(
        torch.zeros((batch, dims.num_kv_heads, capacity, dims.head_dim), dtype=param.dtype) for _ in range(2 * dims.num_layers)
    )
    past_names, present = cache_names("past", dims.num_layers), cache_names("present", dims.num_layers)
    buffer_axes = {n: {0: "batch", 2: "max_sequence"} for n in past_names}
    requests = []
    for name, tokens in (("prefill", prompt), ("decode", 1)) if all_logits else (("prefill", prompt),):
        ids = torch.randint(0, dims.vocab_size, (batch, tokens), generator=gen)
        positions = torch.arange(total - tokens, total).expand(batch, tokens).contiguous()
        token_axes = {0: "batch", 1: "sequence"} if tokens > 1 else {0: "batch"}
        every_logit = all_logits and name == "prefill"
        requests.append(
            GraphRequest(
                name=name,
                module=family.in_place_module(model, last_only=not every_logit),
                args=(ids, torch.ones(batch, total, dtype=torch.int64), positions, *buffers),
                input_names=[*IO_INPUTS, *past_names],
                output_names=["logits", *present],
                dynamic_axes={
                    "input_ids": token_axes,
                    "attention_mask": {0: "batch", 1: "total_sequence"},
                    "position_ids": token_axes,
                    **buffer_axes,
                },
                opset=opset,
                logits_length="sequence" if every_logit else 1,
                translations=ONNX_TRANSLATION,
            )
        )
    return requests


def decode_from_prefill(prefill: ir.Model) -> ir.Model:
    """An in-place prefill graph (last position's logits) as the decode graph: one token a row.

    The same nodes, with ``input_ids`` and ``position_ids`` declared ``[batch, 1]`` as the
    decode contract has them; the initializers' tensors are shared (the writer stores each
    weight once either way). The passes then run on each graph as on an exported one.
    """
    decode = prefill.clone()
    decode.graph.name = "decode"
    for value in decode.graph.inputs:
        if value.name in ("input_ids", "position_ids") and value.shape is not None:
            value.shape = ir.Shape([value.shape[0], 1])
    return decode


@contextlib.contextmanager
def quiet_exporters() -> Iterator[None]:
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


@dataclass
class _Forked:
    """A graph being exported in a forked child, which saves it as ``path``."""

    pid: int
    path: Path
    started: float = field(default_factory=time.perf_counter)


def _fork_export(strategy: ExportStrategy, request: GraphRequest, workdir: Path) -> _Forked | None:
    """Export ``request`` in a forked child while this process exports another graph; None where that can't help.

    torch.export and the ONNX translation run on one core, so two graphs traced side by side
    take little more than the time of one on a host with two (SmolLM2-135M's concat export:
    two traces of 36-44 s each, 52 s side by side). The child shares the loaded model
    copy-on-write, saves the graph in ``workdir`` and exits; a child that fails or hangs leaves
    the graph to be exported again here (:func:`_collect`), so a failure reads as it would
    without the child.

    Not where another Python thread runs (a server in the same process, say): a fork copies
    its locks but not the thread. The child never runs the garbage collector over what it
    inherited (``gc.freeze``): freeing an inherited ONNX Runtime session there waits forever
    on the parent's thread pool, which a fork does not copy.
    """
    if not hasattr(os, "fork") or len(os.sched_getaffinity(0)) < 2 or threading.active_count() > 1:
        return None
    path = workdir / f"{request.name}.forked.onnx"
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:  # the child: never returns
        gc.freeze()
        code = 1
        try:
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            signal.signal(signal.SIGINT, signal.SIG_DFL)
            torch.set_num_threads(1)  # the parent's thread pool did not survive the fork
            with quiet_exporters(), torch.no_grad():
                model = strategy.export(request, workdir)
            ir.save(model, path, external_data=f"{path.stem}.data")
            code = 0
        except BaseException:  # the parent exports it again, and reports what fails then
            pass
        finally:
            os._exit(code)
    return _Forked(pid, path)


def _collect(forked: _Forked, timeout: float) -> ir.Model | None:
    """The forked child's graph; None if it failed, or ran ``timeout`` seconds more (it is killed then)."""
    deadline = time.monotonic() + timeout
    while True:
        pid, status = os.waitpid(forked.pid, os.WNOHANG)
        if pid:
            break
        if time.monotonic() > deadline:
            os.kill(forked.pid, signal.SIGKILL)
            os.waitpid(forked.pid, 0)
            return None
        time.sleep(0.05)
    if os.waitstatus_to_exitcode(status) != 0 or not forked.path.exists():
        return None
    return ir.load(forked.path)


def _export_graphs(
    requests: Sequence[GraphRequest], order: Sequence[str], workdir: Path, progress: Progress
) -> tuple[str, dict[str, ir.Model], list[StrategyAttempt]]:
    """Try each strategy in order; the first that exports *every* graph wins.

    With more than one graph, the later ones are exported in a forked child at the same time
    as the first (:func:`_fork_export`), where the host has a second core.
    """
    attempts: list[StrategyAttempt] = []
    for strategy_name in order:
        strategy = STRATEGIES[strategy_name]
        graphs: dict[str, ir.Model] = {}
        forked: dict[str, _Forked] = {}
        try:
            for request in requests[1:]:
                child = _fork_export(strategy, request, workdir)
                if child is not None:
                    forked[request.name] = child
                    progress(f"exporting {request.name} graph ({strategy_name}) in a second process")
            for request in requests:
                started = time.perf_counter()
                if request.name in forked:  # traced beside the first: given twice as long as that took, and a minute
                    child = forked.pop(request.name)
                    graph = _collect(child, timeout=60 + 2 * attempts[-1].seconds)
                    if graph is not None:
                        graphs[request.name] = graph
                        attempts.append(StrategyAttempt(request.name, strategy_name, True, time.perf_counter() - child.started))
                        continue
                progress(f"exporting {request.name} graph ({strategy_name})")
                try:
                    with quiet_exporters(), torch.no_grad():
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
        finally:
            for child in forked.values():  # a failure or an interrupt: no child outlives its export
                with contextlib.suppress(OSError):
                    os.kill(child.pid, signal.SIGKILL)
                    os.waitpid(child.pid, 0)
        if len(graphs) == len(requests):
            return strategy_name, graphs, attempts
    tried = "; ".join(f"{a.strategy}/{a.graph}: {a.error}" for a in attempts if not a.ok)
    raise ExportError(
        f"every export strategy failed ({tried}); see `kvexport export --help` for --exporter"
    )


def export_model(
    out: str | Path,
    model: str,
    choices: ExportChoices | None = None,
    *,
    family: str | None = None,
    progress: Progress | None = None,
    **given: Any,
) -> ExportResult:
    """Export a model to ``out/`` (prefill.onnx, decode.onnx, weights, manifest, tokenizer).

    Args:
        out: output directory; written atomically, refused if non-empty unless ``force``.
        model: a preset or config path with ``random_init``, else a local model directory (a hub
            id with ``family="gpt2"`` only, where a hub is reachable).
        choices: what the export is asked for (:class:`~kvexport.export.choices.ExportChoices`:
            target, attention, dtype, cache, quantization, ...); None: the defaults.
        family: the model family (a ``model_type`` of :data:`kvexport.models.FAMILIES`); None:
            the one ``model``'s config (or preset) names.
        progress: called with a short message at each phase (the CLI prints them).
        **given: :class:`~kvexport.export.choices.ExportChoices` fields laid over ``choices``
            (``export_model(out, model, random_init=True, target="ort-cpu")``).

    Returns:
        An :class:`ExportResult`; the manifest is also written to ``out/kvexport.json``.

    """
    progress = progress or silent
    asked = (choices or ExportChoices()).replace(**given)
    out_path = Path(out)
    chosen = family_for(family) if family is not None else family_of_model(model, random_init=asked.random_init)
    quantize = _quantize_asked(asked, model, progress)
    options = ExportOptions.resolve(
        asked.target, asked.attention, asked.dtype, asked.cache, quantize, asked.quantization, asked.opset,
        asked.all_logits, asked.kv_cache, family=chosen.name,
    )
    strategies: Sequence[str] = asked.strategies
    check_output_dir(out_path.absolute(), asked.force)
    started = time.perf_counter()
    check_attention(chosen, options)
    source = source_of(chosen, model, random_init=asked.random_init, seed=asked.seed)
    if source.kind == "gguf":  # the file's metadata was read and checked by source_of; its config here
        chosen.check_export(gguf_config(Path(source.name)), options.attention.value, f"--model {model}")
    elif source.config is not None or source.kind == "local":  # refused before minutes of loading
        chosen.check_export(source.config or read_config(Path(source.name)), options.attention.value, f"--model {model}")
    progress(f"loading {source.describe()}")
    torch_model = chosen.load(source, options.dtype.value, allow_pickle=asked.allow_pickle)
    dims = chosen.dims(torch_model.config.to_dict())
    fingerprint = weights_fingerprint(torch_model)
    if chosen.in_place_attention and options.attention.value == "ort":
        requests = in_place_requests(torch_model, chosen, dims, options.all_logits, options.opset)
        if "dynamo" not in strategies:
            raise KvexportError(
                f"--exporter {','.join(strategies)}: {chosen.name} models' ort attention is exported by dynamo "
                "alone (its GroupQueryAttention translation); use --exporter auto or dynamo"
            )
        strategies = ("dynamo",)
    else:
        requests = graph_requests(chosen, torch_model, dims, options.all_logits, options.opset)
    with (
        atomic_output_dir(out_path, asked.force) as tmp,
        tempfile.TemporaryDirectory(prefix=f".{out_path.name}.work-", dir=tmp.parent) as work,
    ):
        strategy, graphs, attempts = _export_graphs(requests, strategies, Path(work), progress)
        if "decode" not in graphs:
            progress("decode graph: the prefill graph at one token a row")
            graphs["decode"] = decode_from_prefill(graphs["prefill"])
        blocks = None
        if source.kind == "gguf" and options.quantization is not None:
            progress("indexing the GGUF file's blocks (kept where the scheme holds them)")
            blocks = GgufBlockIndex(Path(source.name))
        passes = _run_passes(graphs, options, progress, blocks)
        tokenizer_dir, exported = _tokenizer_source(source, Path(work), blocks)
        record = ExportRecord(
            source=source,
            dims=dims,
            weights_fingerprint=fingerprint,
            options=options,
            export={"strategy": strategy, "attempts": [a.__dict__ for a in attempts], **exported},
            passes=passes,
            tokenizer_dir=tokenizer_dir,
            tokenizer_origin=f"{Path(source.name).name} (GGUF metadata)" if source.kind == "gguf" else None,
            started=started,
            family=chosen,
        )
        if options.kv_cache is not None:
            scratch = Path(work) / "calibration"
            scratch.mkdir()
            record = quantize_cache_step(graphs, record, scratch, progress)
        manifest = write_export_directory(tmp, graphs, record, progress)
        if options.target is TargetKind.ORT_CUDA:
            refuse_what_cuda_cannot_load(tmp, progress)
    progress(f"wrote {out_path}")
    return ExportResult(out_path, manifest, strategy, attempts, time.perf_counter() - started)


def _quantize_asked(asked: ExportChoices, model: str, progress: Progress) -> str:
    """``--quantize`` as given; not given: a GGUF file's own scheme (its blocks kept) where the target's attention is ONNX Runtime's, else none."""
    if asked.quantize is not None:
        return str(asked.quantize.value)
    if not is_gguf(model) or asked.random_init:
        return "none"
    scheme = read_gguf(Path(model)).scheme()
    attention = asked.attention or TARGET_DEFAULTS[asked.target][0]
    if scheme != "none" and attention is not AttentionKind.ORT:
        progress(
            f"note: {asked.target.value} graphs hold float weights, so the file's {scheme} blocks are dequantized to fp32; "
            "--target ort-cpu or ort-cuda keeps them"
        )
        return "none"
    return scheme


def _tokenizer_source(source: ModelSource, work: Path, blocks: GgufBlockIndex | None) -> tuple[Path | None, dict[str, Any]]:
    """Where the export's tokenizer comes from, and what the manifest's ``export`` record adds for the source.

    A checkpoint directory ships its own files; a GGUF file's tokenizer and chat template are
    written from its metadata into ``work`` (:func:`~kvexport.models.gguf.save_gguf_tokenizer`),
    and the manifest records the file's tensor types and which of them ``blocks`` kept
    (:meth:`~kvexport.models.gguf.GgufSummary.to_dict`).
    """
    if source.kind == "local":
        return Path(source.name), {}
    if source.kind == "gguf":
        path = Path(source.name)
        kept = blocks.kept if blocks is not None else {}
        return save_gguf_tokenizer(path, work / "gguf-tokenizer"), {"gguf": read_gguf(path).to_dict(kept)}
    return None, {}


def refuse_what_cuda_cannot_load(directory: Path, progress: Progress) -> None:
    """Refuse, in one line, graphs the CUDA provider would fail on; the notes go to ``progress``.

    Read without a GPU (:mod:`kvexport.runtime.cuda_support`): the shapes CUDA's graph
    transformers break, and ONNX Runtime ops with no CUDA kernel for their types.
    """
    findings = cuda_findings(directory)
    errors = [f for f in findings if f.level == "error"]
    if errors:
        more = f" (and {len(errors) - 1} more)" if len(errors) > 1 else ""
        raise KvexportError(f"--target ort-cuda: {errors[0]}{more}; nothing written")
    on_cpu = sorted({f.message.split(" ", 1)[0] for f in findings})
    if on_cpu:
        progress(f"note: under CUDA these ops run on the CPU provider (no CUDA kernel for their types): {', '.join(on_cpu)}")


def export_gpt2(out: str | Path, model: str = "gpt2", **options: Any) -> ExportResult:
    """Export a GPT-2 model (``kvexport gpt2``): :func:`export_model` with the GPT-2 family.

    Takes :func:`export_model`'s keywords; ``model`` defaults to the ``gpt2`` preset (with
    ``random_init``) or hub id, and a config of another family is refused.
    """
    return export_model(out, model, family="gpt2", **options)


def _run_passes(
    graphs: dict[str, ir.Model], options: ExportOptions, progress: Progress, block_source: BlockSource | None = None
) -> list[dict[str, Any]]:
    """The pass pipeline the options call for, on each graph; the manifest's pass reports."""
    pass_reports = []
    for name, graph in graphs.items():
        progress(f"running passes on {name}")
        for pass_report in run_pipeline(graph, options.pipeline(block_source)):
            pass_reports.append({"graph": name, **pass_report.to_json()})
    return pass_reports
