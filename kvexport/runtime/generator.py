"""``Generator``: text generation over an export directory with ONNX Runtime IO binding.

Design:

- Weights in memory, three ways. By default each session loads its own and ONNX Runtime
  pre-packs the GEMM weights: fastest on CPU, about 2.3-2.6x the weight bytes. With
  ``prepacked=True`` both sessions map one file of pre-packed weights that ONNX Runtime
  wrote once for this machine (:mod:`kvexport.runtime.prepacked`): the same speed at about
  1.4x (PSS). With ``share_weights=True`` the weights file is memory-mapped once and
  handed to both sessions unpacked: about 1.05x, at a cost in CPU decode speed.
- Each generation preallocates its cache (one flat buffer per ``past``/``present``
  tensor, sized for prompt + max_new_tokens) on the session's device. With the
  ``concat`` layout there are two banks: every step binds the ``past`` inputs to a
  prefix of one and the ``present`` outputs to a prefix of the other, then swaps. With
  the ``shared-buffer`` layout (``--target ort-cpu|ort-cuda``) there is one bank, bound
  as both past and present of every step, and the graphs write only the new rows. No
  cache tensor is allocated per step and the cache never leaves the device; only the
  logits row that sampling needs comes back to the host.
- The sessions are shared and read-only after construction; all per-generation state
  lives in the call. A ``Generator`` is therefore safe to use from several threads.
- With ``cuda_graph`` (or ``static_decode``, the same without capture) the cache is not the
  call's: each (rows, bucketed capacity) keeps one at fixed addresses, with the decode
  step's inputs and logits, so a captured step replays over the same memory
  (:mod:`kvexport.runtime.cuda_graph`); generations of one shape take turns on it.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Generator as Generator_
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import onnxruntime as ort
from tokenizers import Tokenizer

from kvexport.bundle.manifest import GRAPH_NAMES, Manifest
from kvexport.errors import KvexportError
from kvexport.passes.cache_names import cache_names
from kvexport.runtime.cache import CacheBanks, SlotCache, cache_layout_of, numpy_dtype
from kvexport.runtime.cuda_graph import (
    NO_CAPTURE,
    FixedDecode,
    GraphIds,
    decode_capacity,
    graph_run_options,
    require_capture,
    step_mask,
)
from kvexport.runtime.opened import check_room, check_token_ids, open_export
from kvexport.runtime.prepacked import prepacked_graphs
from kvexport.runtime.sampling import SamplingConfig, choose_tokens
from kvexport.runtime.session import open_session, prompt_session_for, session_options
from kvexport.runtime.text import text_pieces

TokenIds = Sequence[int] | Sequence[Sequence[int]] | np.ndarray


def positions_from_mask(mask: np.ndarray) -> np.ndarray:
    """``position_ids`` of a left-padded batch: the mask's cumulative sum - 1, clipped at 0."""
    return np.clip(np.cumsum(mask, axis=-1) - 1, 0, None).astype(np.int64)


@dataclass
class GenerationStats:
    """Timings of one generation: time to first token and decode time per token.

    The one stats class: :class:`~kvexport.runtime.speculative.SpeculativeStats` adds what a
    speculative generation counts, and "per token" means the same in both. ``new_tokens``
    counts one row's tokens; each decode step (``step_s``) makes one more per row.
    """

    prompt_tokens: int = 0
    new_tokens: int = 0
    batch: int = 0
    ttft_s: float = 0.0
    decode_s: float = 0.0
    step_s: list[float] = field(default_factory=list)
    # Generator(trace_cache=True) only: the device pointers each binding gave the cache
    # tensors, by name, in binding order (prefill past, prefill present, then decode's)
    cache_pointers: list[dict[str, int]] = field(default_factory=list)

    @property
    def decode_ms_per_token(self) -> float:
        """Decode time per token after the first (the prompt's call makes the first)."""
        return 1000 * self.decode_s / max(1, self.new_tokens - 1)

    @property
    def tokens_per_s(self) -> float:
        """New tokens per second over the whole generation, all rows counted."""
        total = self.ttft_s + self.decode_s
        return self.new_tokens * self.batch / total if total else 0.0


@dataclass(frozen=True)
class GenerationRequest:
    """One generation's inputs, checked and left-padded once (see :meth:`Generator.prepare`)."""

    ids: np.ndarray  # [batch, prompt] int64, padded slots hold the pad id
    mask: np.ndarray  # [batch, prompt] int64, left padding
    max_new_tokens: int
    sampling: SamplingConfig
    eos_token_id: int | None  # what finished rows are padded with
    # the tokens that finish a row: the export's EOS tokens (Llama 3 has several), or the one asked for
    stop_ids: tuple[int, ...] = ()


class _MappedWeights:
    """The weights file mapped once; OrtValues over it, keyed by (offset, length, dtype, shape)."""

    def __init__(self, directory: Path, file: str) -> None:
        self.data = np.memmap(directory / file, dtype=np.uint8, mode="r")
        self.file = file
        self.values: dict[tuple[int, int, int, tuple[int, ...]], ort.OrtValue] = {}

    def add_to(self, options: ort.SessionOptions, proto: onnx.ModelProto) -> None:
        for tensor in proto.graph.initializer:
            if tensor.data_location != onnx.TensorProto.EXTERNAL:
                continue
            entries = {e.key: e.value for e in tensor.external_data}
            if entries.get("location") != self.file:
                continue
            offset, length = int(entries.get("offset", 0)), int(entries["length"])
            key = (offset, length, tensor.data_type, tuple(tensor.dims))
            if key not in self.values:
                dtype = onnx.helper.tensor_dtype_to_np_dtype(tensor.data_type)
                array = self.data[offset : offset + length].view(dtype).reshape(tuple(tensor.dims))
                self.values[key] = ort.OrtValue.ortvalue_from_numpy(array)
            options.add_initializer(tensor.name, self.values[key])


def _array_prompt(input_ids: np.ndarray, attention_mask: np.ndarray | None) -> tuple[np.ndarray, np.ndarray]:
    """An array prompt as int64 [batch, sequence] with its mask (all ones when none is given)."""
    ids = input_ids.reshape(1, -1) if input_ids.ndim == 1 else input_ids
    if ids.ndim != 2:
        raise KvexportError(
            f"input_ids has shape {input_ids.shape}; pass [batch, sequence] or a list of lists"
        )
    if not np.issubdtype(ids.dtype, np.integer):
        raise KvexportError(f"input_ids has dtype {ids.dtype}; pass integer token ids")
    ids = ids.astype(np.int64)
    mask = np.ones_like(ids) if attention_mask is None else np.asarray(attention_mask, dtype=np.int64)
    return ids, mask


def _left_padded(input_ids: Sequence[int] | Sequence[Sequence[int]], pad: int) -> tuple[np.ndarray, np.ndarray]:
    """A list prompt (one row, or ragged rows) left-padded with ``pad``, and its mask."""
    rows: list[list[int]] = (
        [[int(t) for t in input_ids]]  # type: ignore[arg-type]
        if not input_ids or not isinstance(input_ids[0], (Sequence, np.ndarray))
        else [[int(t) for t in r] for r in input_ids]  # type: ignore[union-attr]
    )
    if not rows or any(len(r) == 0 for r in rows):
        raise KvexportError("the prompt is empty; pass at least one token")
    width = max(len(r) for r in rows)
    ids = np.full((len(rows), width), pad, dtype=np.int64)
    mask = np.zeros((len(rows), width), dtype=np.int64)
    for i, row in enumerate(rows):
        ids[i, width - len(row) :] = row
        mask[i, width - len(row) :] = 1
    return ids, mask


class Generator:
    """Generate from a kvexport directory on ONNX Runtime (CPU or CUDA) with IO binding.

    Args:
        directory: a directory written by ``kvexport export`` (or ``gpt2``, ``import``).
        provider: ``cpu``, ``cuda`` (an error where CUDA is unusable) or ``auto``.
        intra_op_threads: ONNX Runtime threads per session (default: ORT's choice).
        share_weights: give both sessions one memory-mapped copy of the weights and turn
            off ONNX Runtime's weight pre-packing (which makes private re-laid copies):
            about 1.05x the weight bytes resident instead of about 2.3-2.6x, at a cost in CPU
            decode speed (``kvexport bench`` measures both). Default: off (fastest).
        prepacked: CPU only. Load both graphs from a cache of ONNX Runtime's pre-packed
            weights, one file both sessions map (built once per machine, in a child
            process, under ``prepack_dir``): the default's speed at about 1.4x the weight
            bytes (PSS; RSS counts the file once per session). See
            :mod:`kvexport.runtime.prepacked`.
        prepack_dir: where that cache lives (default: ``<directory>/.ort-prepacked``).
        check: before loading, compare every file's size and sha256 with the manifest's
            record (the cheap part of ``kvexport check``); a damaged copy is refused with
            one line.
        trace_cache: record in ``last_stats.cache_pointers`` the device pointers each
            binding gives the cache (for tests and ``gpu_check``; off in serving).
        decode_graph: for an in-place export, run the decode steps through ``decode.onnx`` in
            a second session, as exports with the concat layout always do. By default the
            prefill graph serves them (it takes a past too): one session, spinning threads
            on CPU, the weights loaded once.
        cuda_graph: CUDA, in-place exports: capture the decode step as a CUDA graph once per
            (rows, capacity) and replay it (:mod:`kvexport.runtime.cuda_graph`); the prompt runs
            uncaptured. The capacity is the next power of two that holds prompt + new tokens
            (at least 256, at most the model's positions), and each (rows, capacity) keeps its
            own cache buffers and inputs, at fixed addresses, for the Generator's life;
            generations of one (rows, capacity) take turns. Refused on CPU, and for a graph
            with nodes a capture cannot hold (named).
        static_decode: the same fixed-capacity, fixed-address decode step, without capture
            (any provider): what ``cuda_graph`` replays, testable on CPU.
        prompt_products: an in-place export with int8/int4 blocks, on a CPU with AMX (or
            KVEXPORT_PROMPT_GEMM=avx512bf16) and kvexport's kernels built: run the prompt through a second session
            whose block products are bf16 (:func:`~kvexport.runtime.session.prompt_session_for`),
            the decode steps on the blocks; ``prompt_products`` (the attribute) then names the
            kernel path, else why there is none. Not with the memory modes, ``decode_graph``,
            ``cuda_graph`` or ``static_decode``. The serving engine's prompts run the same way
            (``EngineConfig.prompt_products``).

    """

    def __init__(
        self,
        directory: str | Path,
        provider: str = "cpu",
        *,
        intra_op_threads: int | None = None,
        share_weights: bool = False,
        prepacked: bool = False,
        prepack_dir: str | Path | None = None,
        check: bool = False,
        trace_cache: bool = False,
        decode_graph: bool = False,
        cuda_graph: bool = False,
        static_decode: bool = False,
        prompt_products: bool = True,
    ) -> None:
        opened = open_export(directory, provider, check=check)
        self.directory = opened.directory
        self.manifest: Manifest = opened.manifest
        self.provider = opened.provider
        if prepacked and share_weights:
            raise KvexportError("prepacked and share_weights are two ways to hold the weights; pick one")
        if prepacked and self.provider != "cpu":
            raise KvexportError(
                f"prepacked: pre-packing is ONNX Runtime's CPU GEMM layout; it does not apply to {self.provider}"
            )
        self.dtype = numpy_dtype(self.manifest.dtype)
        # the cache's own type and row width: the graph's float, or an int8 / int4 cache
        self.cache_dtype, self._stored_dim = cache_layout_of(self.manifest)
        dims = self.manifest.dims
        self.num_layers, self.num_kv_heads, self.head_dim = dims.num_layers, dims.num_kv_heads, dims.head_dim
        self.vocab_size, self.max_positions = dims.vocab_size, dims.max_positions
        self._past_names = cache_names("past", self.num_layers)
        self._present_names = cache_names("present", self.num_layers)
        protos = opened.protos
        self._weights = (
            _MappedWeights(self.directory, self.manifest.weights["file"]) if share_weights else None
        )
        paths = {graph: self.directory / self.manifest.graphs[graph].file for graph in GRAPH_NAMES}
        if prepacked:
            paths = prepacked_graphs(self.directory, prepack_dir)
        # the in-place layout: past and present are one buffer, bound once for every step
        self._in_place = self.manifest.cache_layout == "shared-buffer"
        # An in-place prefill graph also takes a past, so it serves the decode steps too:
        # one session (the weights once), whose threads may spin between a run's nodes since
        # no second session's pool competes with them for the cores.
        graphs = ("prefill",) if self._in_place and not decode_graph else GRAPH_NAMES
        self.cuda_graph, self.static_decode = cuda_graph, static_decode
        if cuda_graph or static_decode:
            opened.require_in_place("--cuda-graph and static_decode need a decode step of one shape")
        if cuda_graph:
            require_capture(self.provider, paths[graphs[-1]])  # the graph the decode steps run
        self.sessions: dict[str, ort.InferenceSession] = {}
        for graph in graphs:
            options = session_options(intra_op_threads, spinning=len(graphs) == 1 and self.provider == "cpu")
            if self._weights is not None:
                self._weights.add_to(options, protos[graph])
                # pre-packing would give each session a private re-laid copy of every weight
                options.add_session_config_entry("session.disable_prepacking", "1")
            captures = cuda_graph and graph == graphs[-1]  # the session that runs the decode steps
            self.sessions[graph] = open_session(paths[graph], self.provider, options, cuda_graph=captures)
        self.sessions.setdefault("decode", self.sessions["prefill"])
        self.prompt_products = "not asked for"  # the prompt session's kernel path, or why there is none
        if prompt_products and len(graphs) == 1 and not (cuda_graph or static_decode or share_weights or prepacked):
            options = session_options(intra_op_threads, spinning=self.provider == "cpu")
            prompt, self.prompt_products = prompt_session_for(paths["prefill"], self.provider, options, self.vocab_size)
            if prompt is not None:  # the prompt runs in bf16, the decode steps on the export's blocks
                self.sessions["prefill"] = prompt
        # the prompt's runs on a capturing session are neither captured nor replayed
        self._prompt_run_options = graph_run_options(NO_CAPTURE) if cuda_graph else None
        self._fixed: dict[tuple[int, int], FixedDecode] = {}  # (rows, capacity) -> its fixed step
        self._fixed_lock = threading.Lock()
        self._graph_ids = GraphIds()
        self._tokenizer = opened.tokenizer
        self.tokenizer: Tokenizer | None = self._tokenizer.tokenizer
        self.eos_token_id: int | None = opened.eos_token_id
        self.eos_token_ids: tuple[int, ...] = opened.eos_token_ids
        self.trace_cache = trace_cache
        self.last_stats = GenerationStats()

    # ---------------------------------------------------------------- inputs

    def _checked_prompt(
        self,
        input_ids: TokenIds,
        attention_mask: np.ndarray | None,
        max_new_tokens: int,
        truncate: bool = False,
    ) -> tuple[np.ndarray, np.ndarray]:
        """``input_ids`` and ``attention_mask`` as left-padded int64 [batch, prompt], checked.

        Refuses (one line each) a bad token count, an empty prompt, a mask that is not
        left padding, ids outside the vocabulary, and a prompt with no room for the new
        tokens unless ``truncate``.
        """
        if (
            isinstance(max_new_tokens, bool)
            or not isinstance(max_new_tokens, (int, np.integer))
            or max_new_tokens < 1
        ):
            raise KvexportError(f"max_new_tokens {max_new_tokens!r}: must be a positive integer")
        pad = self.eos_token_id if self.eos_token_id is not None else 0
        if isinstance(input_ids, np.ndarray):
            ids, mask = _array_prompt(input_ids, attention_mask)
        else:
            ids, mask = _left_padded(input_ids, pad)
            if attention_mask is not None:
                mask = np.asarray(attention_mask, dtype=np.int64)
        self._check_mask_and_ids(ids, mask)
        ids = np.where(mask == 1, ids, pad).astype(np.int64)
        return self._fit_positions(ids, mask, max_new_tokens, truncate)

    def _check_mask_and_ids(self, ids: np.ndarray, mask: np.ndarray) -> None:
        """A non-empty prompt, a left-padding mask of its shape, every real id in the vocabulary."""
        if ids.shape[1] == 0 or ids.shape[0] == 0:
            raise KvexportError("the prompt is empty; pass at least one token")
        if mask.shape != ids.shape:
            raise KvexportError(
                f"attention_mask shape {mask.shape} does not match input_ids {ids.shape}"
            )
        if (mask[:, -1] != 1).any() or (mask.sum(-1) == 0).any():
            raise KvexportError(
                "attention_mask must be left-padded: every row's last position must be a real token"
            )
        check_token_ids(ids[mask == 1], self.vocab_size)

    def _fit_positions(
        self, ids: np.ndarray, mask: np.ndarray, max_new_tokens: int, truncate: bool
    ) -> tuple[np.ndarray, np.ndarray]:
        """The prompt as it is when prompt + new tokens fit the model's positions, else refused or truncated."""
        if ids.shape[1] + max_new_tokens <= self.max_positions:
            return ids, mask
        keep = self.max_positions - max_new_tokens
        if not truncate or keep < 1:
            hint = "; or truncate the prompt (truncate=True, --truncate)" if keep >= 1 else ""
            check_room(ids.shape[1], max_new_tokens, self.max_positions, hint=hint)
        # keep each row's most recent tokens: the left-padded tail of the batch
        return ids[:, -keep:], mask[:, -keep:]

    # ---------------------------------------------------------------- loop

    def stream(self, input_ids: TokenIds, max_new_tokens: int = 20, **options: Any) -> Iterator[np.ndarray]:
        """Yield the next token of every row ([batch] int64) as each step finishes.

        Takes the options of :meth:`prepare` (sampling, ``eos_token_id``,
        ``attention_mask``, ``truncate``). Rows that have produced ``eos_token_id``
        (default: the tokenizer's) get it again as padding; the stream ends when every row
        has finished or after ``max_new_tokens``.
        """
        return self._run(self.prepare(input_ids, max_new_tokens, **options))

    def prepare(
        self,
        input_ids: TokenIds,
        max_new_tokens: int = 20,
        *,
        do_sample: bool = False,
        temperature: float = 1.0,
        top_k: int = 0,
        top_p: float = 1.0,
        seed: int | None = None,
        eos_token_id: int | None = None,
        attention_mask: np.ndarray | None = None,
        truncate: bool = False,
    ) -> GenerationRequest:
        """Check and left-pad one generation's inputs (what :meth:`stream` runs).

        A prompt that leaves no room for ``max_new_tokens`` within the model's positions
        is an error, unless ``truncate``: then only its last ``max_positions -
        max_new_tokens`` tokens are used. Sampling is greedy unless ``do_sample``.
        """
        sampling = SamplingConfig(do_sample, temperature, top_k, top_p, seed)
        sampling.validate()
        ids, mask = self._checked_prompt(input_ids, attention_mask, max_new_tokens, truncate)
        eos = self.eos_token_id if eos_token_id is None else eos_token_id
        return GenerationRequest(ids, mask, max_new_tokens, sampling, eos, self._stop_ids(eos_token_id))

    def _stop_ids(self, eos_token_id: int | None) -> tuple[int, ...]:
        """The tokens that end a row: the one asked for, else every EOS of the export (its one, in old manifests)."""
        return self.eos_token_ids if eos_token_id is None else (eos_token_id,)

    def fixed_decode(self, rows: int, capacity: int) -> FixedDecode:
        """The fixed decode step of ``rows`` rows over a cache of ``capacity`` positions, made on first use and kept.

        With ``cuda_graph`` its runs are captured under a ``gpu_graph_id`` of its own.
        """
        with self._fixed_lock:
            fixed = self._fixed.get((rows, capacity))
            if fixed is None:
                cache = SlotCache(self.manifest, self.provider, rows, capacity)
                graph_id = self._graph_ids(rows, capacity) if self.cuda_graph else None
                fixed = self._fixed[(rows, capacity)] = FixedDecode(self.sessions["decode"], cache, rows, graph_id)
            return fixed

    def _run(self, request: GenerationRequest) -> Iterator[np.ndarray]:
        """Prefill, then the decode loop; ``last_stats`` is this call's once it finishes.

        With ``cuda_graph`` or ``static_decode`` the steps run through :meth:`fixed_decode`
        (its cache and inputs, one generation at a time).
        """
        if not (self.cuda_graph or self.static_decode):
            yield from self._loop(request, None)
            return
        batch, prompt = request.ids.shape
        fixed = self.fixed_decode(batch, decode_capacity(prompt + request.max_new_tokens, self.max_positions))
        with fixed.lock:
            yield from self._loop(request, fixed)

    def _loop(self, request: GenerationRequest, fixed: FixedDecode | None) -> Iterator[np.ndarray]:
        """Prefill, then the decode loop: into per-call cache banks, or through ``fixed``'s cache and step."""
        batch, prompt = request.ids.shape
        stats = GenerationStats(prompt_tokens=prompt, batch=batch)
        logits_length = prompt if self.manifest.all_logits else 1
        logits = np.empty((batch, logits_length, self.vocab_size), dtype=self.dtype)
        step_logits = logits if logits_length == 1 else np.empty((batch, 1, self.vocab_size), dtype=self.dtype)
        started = time.perf_counter()
        if fixed is None:
            banks = CacheBanks(
                len(self._past_names),
                int(np.prod(self._full_shape(request))),
                self.cache_dtype,
                "cuda" if self.provider == "cuda" else "cpu",
                banks=1 if self._in_place else 2,
            )
            self._prefill(request, banks, logits, stats)
            steps = self._decode_steps(request, banks, step_logits, stats)
        else:
            self._prefill_fixed(request, fixed, logits, stats)
            steps = self._fixed_steps(request, fixed, step_logits)
        next(steps)  # binds what stays bound for every step
        rng = np.random.default_rng(request.sampling.seed)
        finished = np.zeros(batch, dtype=bool)
        last = logits[:, -1, :]
        try:
            for step in range(request.max_new_tokens):
                tokens = choose_tokens(last.astype(np.float32), request.sampling, rng)
                if request.eos_token_id is not None:
                    tokens = np.where(finished, request.eos_token_id, tokens)
                    finished |= np.isin(tokens, request.stop_ids)
                now = time.perf_counter()
                if step == 0:
                    stats.ttft_s = now - started
                else:
                    stats.step_s.append(now - started)
                    stats.decode_s += now - started
                stats.new_tokens = step + 1
                yield tokens
                if step == request.max_new_tokens - 1 or finished.all():
                    return
                started = time.perf_counter()
                steps.send(tokens)
                last = step_logits[:, -1, :]
        finally:
            self.last_stats = stats

    def _prefill(
        self, request: GenerationRequest, banks: CacheBanks, logits: np.ndarray, stats: GenerationStats
    ) -> None:
        """Run the prompt: the cache's first rows land in bank 0."""
        batch, prompt = request.ids.shape
        full = self._full_shape(request)
        binding = self.sessions["prefill"].io_binding()
        binding.bind_cpu_input("input_ids", request.ids)
        binding.bind_cpu_input("attention_mask", request.mask)
        binding.bind_cpu_input("position_ids", positions_from_mask(request.mask))
        self._bind_logits(binding, logits)
        if self._in_place:
            self._bind_cache(binding, self._past_names, banks, 0, full, stats, output=False)
        present = full if self._in_place else (batch, self.num_kv_heads, prompt, self.head_dim)
        self._bind_cache(binding, self._present_names, banks, 0, present, stats, output=True)
        self.sessions["prefill"].run_with_iobinding(binding)

    def _decode_steps(
        self, request: GenerationRequest, banks: CacheBanks, logits: np.ndarray, stats: GenerationStats
    ) -> Generator_[None, np.ndarray, None]:
        """A coroutine: send it each step's tokens; it runs decode, leaving logits in ``logits``.

        Shared-buffer: the one bank is bound as past and present once, for every step.
        Concat: each step reads a prefix of one bank and writes one row longer into the other.
        """
        batch, prompt = request.ids.shape
        full = self._full_shape(request)
        decode = self.sessions["decode"]
        binding = decode.io_binding()
        self._bind_logits(binding, logits)
        if self._in_place:
            self._bind_cache(binding, self._past_names, banks, 0, full, stats, output=False)
            self._bind_cache(binding, self._present_names, banks, 0, full, stats, output=True)
        mask, current, length = request.mask, 0, prompt
        while True:
            tokens = yield
            positions = mask.sum(-1, keepdims=True).astype(np.int64)
            mask = np.concatenate([mask, np.ones((batch, 1), dtype=np.int64)], axis=1)
            binding.bind_cpu_input("input_ids", tokens.reshape(batch, 1))
            binding.bind_cpu_input("attention_mask", mask)
            binding.bind_cpu_input("position_ids", positions)
            if not self._in_place:
                shape = (batch, self.num_kv_heads, length, self.head_dim)
                self._bind_cache(binding, self._past_names, banks, current, shape, stats, output=False)
                grown = (batch, self.num_kv_heads, length + 1, self.head_dim)
                self._bind_cache(binding, self._present_names, banks, 1 - current, grown, stats, output=True)
                current = 1 - current
            decode.run_with_iobinding(binding)
            length += 1

    def _prefill_fixed(self, request: GenerationRequest, fixed: FixedDecode, logits: np.ndarray, stats: GenerationStats) -> None:
        """Run the prompt into ``fixed``'s cache (uncaptured): its rows, bound as past and present at its capacity."""
        binding = self.sessions["prefill"].io_binding()
        binding.bind_cpu_input("input_ids", request.ids)
        binding.bind_cpu_input("attention_mask", request.mask)
        binding.bind_cpu_input("position_ids", positions_from_mask(request.mask))
        self._bind_logits(binding, logits)
        fixed.cache.bind(binding, 0, fixed.rows)
        if self.trace_cache:
            pointers = fixed.cache.banks.pointers[0]
            stats.cache_pointers += [dict(zip(names, pointers, strict=True)) for names in (self._past_names, self._present_names)]
        self.sessions["prefill"].run_with_iobinding(binding, self._prompt_run_options)

    def _fixed_steps(self, request: GenerationRequest, fixed: FixedDecode, logits: np.ndarray) -> Generator_[None, np.ndarray, None]:
        """A coroutine as :meth:`_decode_steps`, through ``fixed``: a mask as wide as its capacity, written in place."""
        batch, prompt = request.ids.shape
        mask = step_mask(np.full(batch, prompt), fixed.capacity, request.mask)
        length = prompt
        while True:
            tokens = yield
            positions = mask.sum(-1, keepdims=True).astype(np.int64)
            mask[:, length] = 1
            logits[...] = fixed.run(tokens.reshape(batch, 1), mask, positions)
            length += 1

    def _full_shape(self, request: GenerationRequest) -> tuple[int, int, int, int]:
        """A cache tensor at the request's capacity: [batch, H, prompt + max_new_tokens, D]."""
        batch, prompt = request.ids.shape
        return (batch, self.num_kv_heads, prompt + request.max_new_tokens, self._stored_dim)

    def _bind_logits(self, binding: ort.IOBinding, logits: np.ndarray) -> None:
        # logits always land in host memory: they are what sampling needs
        binding.bind_output("logits", "cpu", 0, self.dtype, list(logits.shape), logits.ctypes.data)

    def _bind_cache(
        self,
        binding: ort.IOBinding,
        names: list[str],
        banks: CacheBanks,
        bank: int,
        shape: tuple[int, int, int, int],
        stats: GenerationStats,
        *,
        output: bool,
    ) -> None:
        """Bind cache tensor i (``past.*`` or ``present.*``, same order) to the front of buffer i of ``bank``."""
        banks.bind(binding, names, bank, shape, output=output)
        if self.trace_cache:
            stats.cache_pointers.append(dict(zip(names, banks.pointers[bank], strict=True)))

    def generate(
        self,
        input_ids: TokenIds,
        max_new_tokens: int = 20,
        **options: Any,
    ) -> np.ndarray:
        """Full sequences [batch, prompt + new] like Hugging Face ``generate`` (left-padded).

        Takes the same options as :meth:`stream`. Generation stops early when every row
        has produced EOS; finished rows are padded with EOS. With ``truncate=True`` the
        returned sequences start with the kept part of the prompt.
        """
        request = self.prepare(input_ids, max_new_tokens, **options)
        steps = list(self._run(request))
        return np.concatenate([request.ids, np.stack(steps, axis=1)], axis=1)

    # ---------------------------------------------------------------- text

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text`` with the exported tokenizer."""
        return self._tokenizer.encode(text)

    def stream_text(self, prompt: str, max_new_tokens: int = 20, **options: Any) -> Iterator[str]:
        """Yield decoded text pieces as tokens arrive (batch 1); stops at EOS."""
        tokenizer = self._tokenizer.require()
        if not prompt:
            raise KvexportError("the prompt is empty; pass some text")
        tokens = (int(step[0]) for step in self.stream(self.encode(prompt), max_new_tokens, **options))
        yield from text_pieces(tokenizer, tokens, self._stop_ids(options.get("eos_token_id")))

    def generate_text(self, prompt: str, max_new_tokens: int = 20, **options: Any) -> str:
        """The prompt followed by the generated text (batch 1)."""
        return prompt + "".join(self.stream_text(prompt, max_new_tokens, **options))
