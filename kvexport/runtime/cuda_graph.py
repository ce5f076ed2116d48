"""CUDA-graph decode: one decode step captured per (rows, capacity) and replayed.

At batch 1 a GPT-2 124M fp16 decode step on an H200 is launch-bound (1.77 ms a token,
measured uncaptured): the GPU waits on the host to launch a few hundred small kernels.
ONNX Runtime's CUDA provider can record a run as a CUDA graph and replay it as one launch
(the provider option ``enable_cuda_graph``). What it asks of the caller, as read in
ONNX Runtime's sources (``core/session/inference_session.cc``,
``include/onnxruntime/core/session/onnxruntime_run_options_config_keys.h``):

- every compute node on the CUDA provider, no control flow (``If``, ``Loop``, ``Scan``),
  and no ``Memcpy`` between the devices inside the graph; only shape computations may run
  on the CPU provider (their values are fixed while the shapes are);
- every input and output bound at a fixed device address with a fixed shape, its values
  updated in place between runs;
- the run option ``gpu_graph_id``: each id is captured on its first runs and replayed
  after; ``-1`` runs without capture or replay (0 is ONNX Runtime's own, the default).
  onnxruntime-genai runs its prompt on the decoder's own capturing session that way
  (``DecoderOnly_State::Run``: ``gpu_graph_id`` -1 on the first run, then one id per batch
  size), and so does kvexport: one session, its weights loaded once.

``GroupQueryAttention`` (``contrib_ops/cuda/bert/group_query_attention.cc``) reads
``seqlens_k`` on the device but ``total_sequence_length`` from host memory, and sizes its
launch from it: it must not change while a captured step replays. onnxruntime-genai does
the same with its static buffer (``past_present_share_buffer``, ``src/models``): the
cache is as long as the buffer, ``total_sequence_length`` the buffer's length, and each
row's ``seqlens_k`` is updated in place on the device. kvexport's in-place exports take
both from ``attention_mask``: ``total_sequence_length`` from its width, ``seqlens_k``
from the index of each row's last 1. A decode step over a mask as wide as the cache's
capacity, its later positions 0, therefore keeps one shape and one host value from the
first step to the last (:class:`FixedDecode`): the "static decode".

The capacity is bucketed (:func:`decode_capacity`): the next power of two that holds the
prompt and the new tokens, at least :data:`MIN_CAPACITY`, at most the model's positions.
Attention reads each row up to its own length only, but the cache buffers (and the mask)
are as wide as the capacity, so a 40-token answer to a 20-token prompt of a model with
32768 positions takes 256 positions of cache, not 32768.

``static_decode`` runs the same fixed-address, fixed-capacity step without capture, on
CPU too: that is how its logic is tested here, with no GPU.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort

from kvexport.errors import KvexportError
from kvexport.passes.vocabulary import GROUP_QUERY_ATTENTION, MS_DOMAIN
from kvexport.runtime.cache import SlotCache
from kvexport.runtime.cuda_support import kernel_findings
from kvexport.runtime.session import session_providers

MIN_CAPACITY = 256  # the smallest cache a captured generation gets: one bucket for every short request
NO_CAPTURE = -1  # the gpu_graph_id of a run that is neither captured nor replayed (prefill, prompt pieces)
GRAPH_ID = "gpu_graph_id"  # ONNX Runtime's run option (kOrtRunOptionsConfigCudaGraphAnnotation)
CONTROL_FLOW = frozenset({"If", "Loop", "Scan"})
# the inputs a fixed decode step feeds (int64 [rows, 1] or [rows, capacity]); the cache is bound by SlotCache
STEP_INPUTS = ("input_ids", "attention_mask", "position_ids")
# ops whose output, read on the host, depends only on shapes and constants (the chain that makes total_sequence_length)
_SHAPE_OPS = frozenset({"Shape", "Size"})
_TOTAL_INPUT = 6  # GroupQueryAttention's total_sequence_length (host memory on CUDA)


class CudaGraphError(KvexportError):
    """A decode graph that ONNX Runtime cannot capture as a CUDA graph, or a setup that cannot capture."""


def decode_capacity(tokens: int, max_positions: int) -> int:
    """The cache capacity of a fixed decode for ``tokens`` (prompt + new) tokens.

    The next power of two at least ``tokens``, at least :data:`MIN_CAPACITY`, at most
    ``max_positions`` (the model's); ``tokens`` beyond ``max_positions`` is an error.
    """
    if tokens < 1 or tokens > max_positions:
        raise KvexportError(f"{tokens} tokens: a fixed decode holds 1..{max_positions} (the model's positions)")
    bucket = max(MIN_CAPACITY, 1 << (tokens - 1).bit_length())
    return min(bucket, max_positions)


def graph_run_options(graph_id: int) -> ort.RunOptions:
    """Run options carrying ``gpu_graph_id``: ``graph_id`` >= 1 captures then replays, :data:`NO_CAPTURE` neither."""
    if graph_id != NO_CAPTURE and graph_id < 1:
        raise ValueError(f"gpu_graph_id {graph_id}: use 1 or more (0 is ONNX Runtime's own), or {NO_CAPTURE}")
    options = ort.RunOptions()
    options.add_run_config_entry(GRAPH_ID, str(graph_id))
    return options


def _as_model(model: onnx.ModelProto | onnx.GraphProto | str | Path) -> onnx.ModelProto:
    if isinstance(model, (str, Path)):
        return onnx.load(str(model), load_external_data=False)
    if isinstance(model, onnx.GraphProto):
        return onnx.helper.make_model(model)
    return model


def _host_total_sources(graph: onnx.GraphProto, value: str) -> list[str]:
    """The graph inputs ``value`` reads other than through a shape op (``Shape``, ``Size``); empty: shapes and constants only."""
    producers = {output: node for node in graph.node for output in node.output}
    inputs = {i.name for i in graph.input} - {t.name for t in graph.initializer}
    found, seen, pending = [], set(), [value]
    while pending:
        name = pending.pop()
        if name in seen or not name:
            continue
        seen.add(name)
        node = producers.get(name)
        if node is None:
            if name in inputs:
                found.append(name)
            continue
        if node.op_type not in _SHAPE_OPS:
            pending.extend(node.input)
    return sorted(found)


def uncapturable_nodes(model: onnx.ModelProto | onnx.GraphProto | str | Path) -> list[str]:
    """The nodes of a graph that a captured CUDA graph cannot hold, each as ``name (why)``.

    - control flow: ``If``, ``Loop``, ``Scan`` (ONNX Runtime refuses to capture them);
    - a node with no CUDA kernel for its opset and input types
      (:func:`kvexport.runtime.cuda_support.kernel_findings`): it runs on the CPU provider,
      behind copies between the devices that a capture cannot hold;
    - a ``GroupQueryAttention`` whose ``total_sequence_length`` (read from host memory)
      comes from a graph input's values rather than from shapes and constants: it changes
      with the values of each step, and a replay would keep the captured one.

    ``model``: a model, a graph, or an ``.onnx`` path (read without its weights).
    """
    proto = _as_model(model)
    graph = proto.graph
    found = [f"{node.name or node.op_type} ({node.op_type}: control flow)" for node in graph.node if node.op_type in CONTROL_FLOW]
    found += [f"{finding.node} ({finding.message})" for finding in kernel_findings(proto, "decode")]
    for node in graph.node:
        if node.op_type != GROUP_QUERY_ATTENTION or node.domain != MS_DOMAIN or len(node.input) <= _TOTAL_INPUT:
            continue
        sources = _host_total_sources(graph, node.input[_TOTAL_INPUT])
        if sources:
            found.append(
                f"{node.name or node.op_type} (GroupQueryAttention's total_sequence_length, read on the host, "
                f"comes from the values of {', '.join(sources)})"
            )
    return found


def check_fixed_decode(graph_path: Path) -> None:
    """Refuse, in one line naming the nodes, a decode graph that a CUDA graph cannot capture (:func:`uncapturable_nodes`)."""
    nodes = uncapturable_nodes(graph_path)
    if nodes:
        shown = "; ".join(nodes[:5]) + (f"; and {len(nodes) - 5} more" if len(nodes) > 5 else "")
        raise CudaGraphError(
            f"--cuda-graph: {graph_path.name} has nodes a CUDA graph cannot capture: {shown}; "
            "export with --target ort-cuda, or drop --cuda-graph"
        )


def require_capture(provider: str, graph_path: Path) -> None:
    """Refuse ``--cuda-graph`` where it cannot run, one line each: off the CUDA provider, or a decode graph it cannot capture."""
    session_providers(provider, cuda_graph=True)  # type: ignore[arg-type]
    check_fixed_decode(graph_path)


class GraphIds:
    """One ``gpu_graph_id`` per fixed set of inputs and outputs, keyed by (rows, capacity); ids from 1."""

    def __init__(self) -> None:
        self._ids: dict[tuple[int, int], int] = {}
        self._lock = threading.Lock()

    def __call__(self, rows: int, capacity: int) -> int:
        """The id of (``rows``, ``capacity``), made on first use."""
        with self._lock:
            return self._ids.setdefault((rows, capacity), len(self._ids) + 1)

    def __len__(self) -> int:
        return len(self._ids)


class FixedDecode:
    """A decode step's inputs and outputs at fixed addresses, for one (rows, capacity): captured or static.

    Holds, on the cache's device (``cuda``, or ``cpu`` for the static form), one value per
    step input (``input_ids`` [rows, 1], ``attention_mask`` [rows, capacity],
    ``position_ids`` [rows, 1], each int64, where the graph has it) and the ``logits``
    output [rows, 1, V], allocated once and bound once with rows ``0..rows-1`` of
    ``cache`` as both past and present. :meth:`run` writes the step's values in place
    (``OrtValue.update_inplace``) and runs with ``graph_id``'s run options: ONNX Runtime
    captures the first runs of an id and replays it after (``None``: no capture, the
    static form).

    ``lock`` is held by whoever is running generations through it: one at a time, since
    a replay reads these very addresses.
    """

    def __init__(self, session: ort.InferenceSession, cache: SlotCache, rows: int, graph_id: int | None) -> None:
        if not 1 <= rows <= cache.slots:
            raise ValueError(f"rows {rows}: the cache holds 1..{cache.slots}")
        self.session, self.cache, self.rows = session, cache, rows
        self.capacity = cache.row_shape[1]
        self.graph_id = graph_id
        self.device = cache.banks.device
        self.lock = threading.Lock()
        inputs = {i.name for i in session.get_inputs()}
        unknown = sorted(inputs - set(STEP_INPUTS) - set(cache.past))
        missing = [name for name in ("input_ids", "attention_mask") if name not in inputs]
        if unknown or missing:
            what = f"also takes {', '.join(unknown)}" if unknown else f"has no {', '.join(missing)}"
            raise CudaGraphError(
                f"a fixed decode step feeds input_ids, attention_mask, position_ids and the cache; this graph {what}: "
                "export with --target ort-cuda"
            )
        shapes = {"input_ids": [rows, 1], "attention_mask": [rows, self.capacity], "position_ids": [rows, 1]}
        self.inputs = {
            name: ort.OrtValue.ortvalue_from_shape_and_type(shape, np.int64, self.device, 0)
            for name, shape in shapes.items()
            if name in inputs
        }
        vocab = cache.manifest.dims.vocab_size
        self.logits = ort.OrtValue.ortvalue_from_shape_and_type([rows, 1, vocab], cache.dtype, self.device, 0)
        self.binding = session.io_binding()
        for name, value in self.inputs.items():
            self.binding.bind_ortvalue_input(name, value)
        self.binding.bind_ortvalue_output("logits", self.logits)
        cache.bind(self.binding, 0, rows)
        self.run_options = graph_run_options(graph_id if graph_id is not None else NO_CAPTURE)

    def run(self, ids: np.ndarray, mask: np.ndarray, positions: np.ndarray) -> np.ndarray:
        """One step: ``ids`` [rows, 1], ``mask`` [rows, capacity], ``positions`` [rows, 1] (int64), written in place.

        Returns the logits [rows, 1, V] on the host (the session's dtype).
        """
        values = {"input_ids": ids, "attention_mask": mask, "position_ids": positions}
        for name, value in self.inputs.items():
            value.update_inplace(np.ascontiguousarray(values[name], dtype=np.int64))
        self.session.run_with_iobinding(self.binding, self.run_options)
        logits: np.ndarray = self.logits.numpy()
        return logits


def step_mask(lengths: Sequence[int] | np.ndarray, capacity: int, prompt_mask: np.ndarray | None = None) -> np.ndarray:
    """A decode mask [rows, capacity]: row i's first ``lengths[i]`` positions 1 (``prompt_mask``'s zeros kept), the rest 0."""
    lengths = np.asarray(lengths, dtype=np.int64)
    mask = (np.arange(capacity)[None, :] < lengths[:, None]).astype(np.int64)
    if prompt_mask is not None:
        mask[:, : prompt_mask.shape[1]] = prompt_mask
    return mask
