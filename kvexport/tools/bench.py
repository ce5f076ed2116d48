"""``kvexport bench``: prefill and decode timings, side by side with the baselines, in one run.

Systems measured in the same process, on the same weights:

- ``kvexport``: the :class:`~kvexport.runtime.Generator` over the export directory;
- ``kvexport-prepacked``: the same with ``prepacked=True`` (CPU: both sessions map one
  file of pre-packed weights);
- ``kvexport-shared``: the same with ``share_weights=True`` (least memory, slower);
- ``kvexport[<variant>]``: other exports of the same weights given with ``--compare``
  (``<variant>`` is the attention, plus the quantization scheme or dtype where they
  differ: ``kvexport[ort,int4]``);
- ``pytorch``: Hugging Face ``generate`` in eager PyTorch with its KV cache;
- ``no-cache``: PyTorch recomputing the whole sequence for every token;
- ``floor`` (and ``floor[<variant>]`` for each compared export): the memory-bandwidth
  floor of one decode step: the bytes that export's step must read (every weight once,
  plus the cache at that context) over the best read bandwidth measured in the run. A
  lower bound, so it uses the best bandwidth seen, never a cell's slower one: it cannot
  fall as the context grows.

- ``engine[cold]`` / ``engine[prefix-cached]`` (in-place exports, ``prefix`` > 0): the
  serving :class:`~kvexport.serving.Engine`'s TTFT for a prompt of ``prefix`` tokens plus
  16 more, first with a prefix it has never seen, then sharing the prefix with the
  request before it (the prefix cache reuses its rows and prefills the 16);

- ``plain[<task>]`` / ``speculative[<drafter>,<task>]`` (in-place ``--all-logits``
  exports): greedy decode ms per token of one sequence, plainly and with speculative
  decoding (prompt lookup, a ``--draft`` export if given, and ``never-right``, drafts that
  almost never pay, for what speculation costs then), on two tasks: ``repeat``
  (a passage, then its first tokens again: continuing it repeats the context, where
  lookup pays) and ``fresh`` (no passage to repeat). Acceptance rates go to
  ``speculation``;

For each batch and context it reports TTFT (prefill of ``context`` tokens and the first
token) and decode ms per step (median over the steps). Resident memory (RSS, and PSS,
which counts a page mapped by both sessions once) of each Generator is measured as it
loads, before PyTorch allocates anything. Then every system is timed
at one (batch, context) before the next, with the floor's bandwidth measured just
before, so that a machine whose speed drifts during the run treats all systems alike.
"""

from __future__ import annotations

import gc
import json
import os
import platform
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from kvexport.bundle.manifest import Manifest, read_manifest
from kvexport.errors import KvexportError
from kvexport.models import family_for
from kvexport.progress import Progress, silent
from kvexport.runtime.cache import cache_row_bytes
from kvexport.runtime.generator import Generator
from kvexport.runtime.prepacked import prepacked_graphs
from kvexport.runtime.session import resolve_provider, session_providers

DEFAULT_CONTEXTS = (128, 512, 1000)
DEFAULT_BATCHES = (1, 4)


@dataclass(frozen=True)
class Measurement:
    """One system at one batch and context."""

    system: str
    batch: int
    context: int
    ttft_ms: float | None
    decode_ms_per_token: float | None


@dataclass
class BenchReport:
    """All measurements of one run, plus the machine and memory figures."""

    directory: str
    provider: str
    new_tokens: int
    bandwidth_gb_s: float
    weight_bytes: int
    rss_before_load_mb: float
    rss_after_load_mb: float  # after loading and one short warm-up generation
    rss_peak_onnx_mb: float  # every Generator loaded and warmed up, before PyTorch loads
    pss_before_load_mb: float = 0.0  # PSS: shared pages divided among their mappings
    pss_after_load_mb: float = 0.0
    # kvexport-shared / kvexport-prepacked: {"rss_mb", "pss_mb"} each added as it loaded
    variant_memory: dict[str, dict[str, float]] = field(default_factory=dict)
    # speculative[<drafter>,<task>]: {"acceptance_rate", "tokens_per_call"}
    speculation: dict[str, dict[str, float]] = field(default_factory=dict)
    rss_peak_mb: float = 0.0  # the whole run: Generators and the PyTorch reference together
    # bytes on disk of each export (graphs, weights, tokenizer, manifest), by system
    disk_bytes: dict[str, int] = field(default_factory=dict)
    measurements: list[Measurement] = field(default_factory=list)
    machine: dict[str, Any] = field(default_factory=dict)
    cuda_graph: bool = False  # the kvexport Generator's decode steps captured as CUDA graphs (--cuda-graph)

    @property
    def generator_rss_mb(self) -> float:
        """Resident memory the Generator added (both sessions and the shared weights)."""
        return self.rss_after_load_mb - self.rss_before_load_mb

    @property
    def generator_pss_mb(self) -> float:
        """The same as PSS (a page mapped twice counts once)."""
        return self.pss_after_load_mb - self.pss_before_load_mb

    def get(self, system: str, batch: int, context: int) -> Measurement | None:
        """The measurement of one system at one point, if it was taken."""
        return next(
            (
                m
                for m in self.measurements
                if (m.system, m.batch, m.context) == (system, batch, context)
            ),
            None,
        )

    def _ratio(self, system: str, baseline: str, context: int, field: str, base_context: int | None = None) -> float | None:
        """``system``'s ``field`` over ``baseline``'s at batch 1 (None when either is missing)."""
        top = self.get(system, 1, context)
        bottom = self.get(baseline, 1, context if base_context is None else base_context)
        top_value = getattr(top, field) if top else None
        bottom_value = getattr(bottom, field) if bottom else None
        return top_value / bottom_value if top_value and bottom_value else None

    def ratios(self) -> dict[str, float]:
        """The headline ratios the targets are stated in (batch 1)."""
        contexts = sorted({m.context for m in self.measurements})
        if not contexts:
            return {}
        first, last = contexts[0], contexts[-1]
        decode = "decode_ms_per_token"
        candidates = {
            f"decode_vs_floor_ctx{first}": self._ratio("kvexport", "floor", first, decode),
            f"ttft_vs_pytorch_ctx{first}": self._ratio("kvexport", "pytorch", first, "ttft_ms"),
            f"decode_vs_pytorch_ctx{first}": self._ratio("kvexport", "pytorch", first, decode),
            f"decode_ctx{last}_vs_ctx{first}": self._ratio("kvexport", "kvexport", last, decode, first),
        }
        for system in sorted({m.system for m in self.measurements if m.system.startswith(("kvexport[", "kvexport-"))}):
            candidates[f"decode_{system}_vs_kvexport_ctx{first}"] = self._ratio(system, "kvexport", first, decode)
            candidates[f"ttft_{system}_vs_kvexport_ctx{first}"] = self._ratio(system, "kvexport", first, "ttft_ms")
            candidates[f"decode_{system}_ctx{last}_vs_ctx{first}"] = self._ratio(system, system, last, decode, first)
            if system.startswith("kvexport["):
                own_floor = "floor[" + system[len("kvexport[") :]
                candidates[f"decode_{system}_vs_its_floor_ctx{first}"] = self._ratio(system, own_floor, first, decode)
        for m in self.measurements:
            if m.system.startswith("speculative["):
                task = m.system.rstrip("]").rsplit(",", 1)[1]
                ratio_name = f"decode_{m.system}_vs_plain"
                candidates[ratio_name] = self._ratio(m.system, f"plain[{task}]", m.context, decode)
        cached = next((m for m in self.measurements if m.system == "engine[prefix-cached]"), None)
        if cached is not None:
            candidates["ttft_prefix_cached_vs_cold"] = self._ratio(cached.system, "engine[cold]", cached.context, "ttft_ms")
        result = {k: v for k, v in candidates.items() if v is not None}
        weights = max(1, self.weight_bytes)
        result["generator_rss_vs_weights"] = self.generator_rss_mb * 2**20 / weights
        if self.generator_pss_mb:
            result["generator_pss_vs_weights"] = self.generator_pss_mb * 2**20 / weights
        for system, memory in self.variant_memory.items():
            for kind in ("rss", "pss"):
                if memory.get(f"{kind}_mb"):
                    result[f"{system}_{kind}_vs_weights"] = memory[f"{kind}_mb"] * 2**20 / weights
        return {k: round(v, 3) for k, v in result.items()}

    def to_dict(self) -> dict[str, Any]:
        """JSON form."""
        data = asdict(self)
        data["ratios"] = self.ratios()
        data["generator_rss_mb"] = round(self.generator_rss_mb, 1)
        data["generator_pss_mb"] = round(self.generator_pss_mb, 1)
        return data


def _proc_mib(file: str, key: str) -> float:
    """A ``key: N kB`` line of ``/proc/self/<file>`` in MiB (0.0 where /proc is absent)."""
    try:
        with open(f"/proc/self/{file}") as lines:
            return next(int(line.split()[1]) / 1024 for line in lines if line.startswith(key))
    except (OSError, StopIteration):  # pragma: no cover - non-Linux
        return 0.0


def rss_mb(peak: bool = False) -> float:
    """Resident memory of this process in MiB, now or at its peak (0.0 where /proc is absent)."""
    return _proc_mib("status", "VmHWM:" if peak else "VmRSS:")


def pss_mb() -> float:
    """Proportional set size of this process in MiB (0.0 where /proc lacks smaps_rollup).

    Unlike RSS, a page mapped twice (two sessions mapping one weights file) counts once.
    """
    return _proc_mib("smaps_rollup", "Pss:")


def memory_mb() -> tuple[float, float]:
    """The (RSS, PSS) of this process in MiB from one reading of ``smaps_rollup`` ((0.0, 0.0) where absent).

    Read together, PSS is never above RSS; two separate readings can disagree under load.
    """
    found: dict[str, float] = {}
    try:
        with open("/proc/self/smaps_rollup") as lines:
            for line in lines:
                key = line.split(":", 1)[0]
                if key in ("Rss", "Pss"):
                    found[key] = int(line.split()[1]) / 1024
    except OSError:  # pragma: no cover - non-Linux
        pass
    return found.get("Rss", 0.0), found.get("Pss", 0.0)


def measure_read_bandwidth(
    megabytes: int = 1024, threads: int | None = None, repeats: int = 5
) -> float:
    """Sustained read bandwidth of this machine in GB/s (numpy sums over a large array)."""
    threads = threads or os.cpu_count() or 1
    data = np.ones(megabytes * 2**20 // 4, dtype=np.float32)
    parts = np.array_split(data, threads)
    best = 0.0
    for _ in range(repeats):
        workers = [threading.Thread(target=np.sum, args=(part,)) for part in parts]
        started = time.perf_counter()
        for worker in workers:
            worker.start()
        for worker in workers:
            worker.join()
        best = max(best, data.nbytes / (time.perf_counter() - started) / 1e9)
    return best


def export_bytes(directory: Path) -> int:
    """Bytes on disk of an export: its files, not caches kept beside them (``.ort-prepacked``)."""
    return sum(f.stat().st_size for f in directory.iterdir() if f.is_file())


def variant_label(manifest: Any) -> str:
    """How a compared export is named in the table: attention, then scheme or dtype, then a quantized cache."""
    parts = [manifest.attention]
    if manifest.quantization:
        parts.append(manifest.quantization["scheme"])
    elif manifest.dtype != "fp32":
        parts.append(manifest.dtype)
    if manifest.cache_dtype != manifest.dtype:
        parts.append(f"kv-{manifest.cache_dtype}")
    return ",".join(parts)


def bench_prompt(vocab: int, batch: int, context: int) -> np.ndarray:
    """The seeded random prompt every system gets at one (batch, context) cell."""
    return np.random.default_rng(context * 10 + batch).integers(
        0, vocab, (batch, context), dtype=np.int64
    )


def time_generator(
    generator: Generator,
    batch: int,
    context: int,
    new_tokens: int,
    repeats: int,
    system: str = "kvexport",
) -> Measurement:
    """TTFT (best of ``repeats``) and the median decode step of a Generator at one cell."""
    ids = bench_prompt(generator.vocab_size, batch, context)
    ttfts, steps = [], []
    for _ in range(repeats):
        for _ in generator.stream(ids, new_tokens, eos_token_id=-1):
            pass
        ttfts.append(generator.last_stats.ttft_s)
        steps.extend(generator.last_stats.step_s)
    return Measurement(system, batch, context, 1000 * min(ttfts), 1000 * float(np.median(steps)))


PREFIX_SUFFIX = 16  # the tokens after the shared prefix in the prefix-cache rows
SPECULATION_TOKENS = 64  # greedy tokens per speculative measurement


def speculation_prompts(vocab: int, positions: int, text: list[int] | None = None) -> dict[str, list[int]]:
    """The speculative rows' tasks: a passage and its first tokens again (``repeat``), and a fresh one.

    The passages are windows of ``text`` (token ids) where given, random ids otherwise.
    """
    rng = np.random.default_rng(0)
    room = min(256, positions - SPECULATION_TOKENS - 1)
    body = room - room // 6
    if text is not None and len(text) >= 2 * room:
        passage, fresh = text[:body], text[room : 2 * room]
    else:
        passage, fresh = rng.integers(0, vocab, body).tolist(), rng.integers(0, vocab, room).tolist()
    return {"repeat": passage + passage[: room // 6], "fresh": fresh}


class _NeverRight:
    """A drafter that rarely pays: it proposes the token after the last one, by id (speculation's cost row)."""

    def __init__(self, vocab: int) -> None:
        self.vocab = vocab

    def propose(self, tokens: Sequence[int], count: int, sampling: Any, rng: Any) -> tuple[list[int], None]:
        """``count`` copies of the last token's id plus one."""
        return [(tokens[-1] + 1) % self.vocab] * count, None


def time_speculation(
    report: BenchReport,
    directory: str | Path,
    provider: str,
    repeats: int,
    drafts: Sequence[str | Path] = (),
    text: Path | None = None,
) -> None:
    """Plain and speculative greedy decode of one sequence per task, interleaved (see the module docstring)."""
    from kvexport.runtime.speculative import DraftModel, PromptLookup, SpeculativeGenerator

    plain = Generator(directory, provider=provider)
    drafters: dict[str, Any] = {"lookup": PromptLookup(), "never-right": _NeverRight(plain.vocab_size)}
    drafters.update({f"draft:{Path(d).name}": DraftModel(d, provider) for d in drafts})
    speculative = {name: SpeculativeGenerator(directory, drafter, provider=provider) for name, drafter in drafters.items()}
    ids = plain.encode(text.read_text(encoding="utf-8")) if text is not None else None
    for task, prompt in speculation_prompts(plain.vocab_size, plain.manifest.dims.max_positions, ids).items():
        plain_steps: list[float] = []
        samples: dict[str, list[float]] = {name: [] for name in speculative}
        for _ in range(repeats + 1):  # the first round warms up and is dropped
            for _ in plain.stream([prompt], SPECULATION_TOKENS, eos_token_id=-1):
                pass
            plain_steps.append(plain.last_stats.decode_ms_per_token)
            for name, generator in speculative.items():
                generator.generate(prompt, SPECULATION_TOKENS, eos_token_id=-1)
                samples[name].append(generator.last_stats.decode_ms_per_token)
        report.measurements.append(Measurement(f"plain[{task}]", 1, len(prompt), None, float(np.median(plain_steps[1:]))))
        for name, generator in speculative.items():
            system = f"speculative[{name},{task}]"
            report.measurements.append(Measurement(system, 1, len(prompt), None, float(np.median(samples[name][1:]))))
            stats = generator.last_stats
            report.speculation[system] = {
                "acceptance_rate": round(stats.acceptance_rate, 3),
                "tokens_per_call": round(sum(stats.round_tokens) / max(1, stats.rounds), 3),
            }


def time_prefix_cache(directory: str | Path, provider: str, prefix: int, repeats: int) -> list[Measurement]:
    """The engine's TTFT for ``prefix`` + 16 tokens: a new prefix, then the same prefix again (best of ``repeats``)."""
    from kvexport.serving.engine import Engine
    from kvexport.serving.request import SamplingParams

    first_token = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
    length = prefix + PREFIX_SUFFIX
    times: dict[str, list[float]] = {"engine[cold]": [], "engine[prefix-cached]": []}
    with Engine(directory, slots=2, max_context=length + 1, provider=provider) as engine:
        rng = np.random.default_rng(0)
        for _ in range(repeats + 1):  # the first round warms the engine up and is dropped
            shared = rng.integers(0, engine.vocab_size, prefix).tolist()
            for system in times:
                prompt = shared + rng.integers(0, engine.vocab_size, PREFIX_SUFFIX).tolist()
                started = time.perf_counter()
                next(iter(engine.submit(prompt, first_token)))
                times[system].append(time.perf_counter() - started)
    return [Measurement(system, 1, length, 1000 * min(samples[1:]), None) for system, samples in times.items()]


def warm_up(generator: Generator) -> None:
    """One short generation, so every weight has been read and every arena sized."""
    for _ in generator.stream(bench_prompt(generator.vocab_size, 1, 8), 2, eos_token_id=-1):
        pass


def _time(call: Callable[[], object], repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        started = time.perf_counter()
        call()
        best = min(best, time.perf_counter() - started)
    return best


def _bench_torch(
    model: Any, batch: int, context: int, new_tokens: int, repeats: int
) -> list[Measurement]:
    ids = torch.from_numpy(bench_prompt(model.config.vocab_size, batch, context))
    mask = torch.ones_like(ids)

    def run(tokens: int) -> None:
        model.generate(
            ids,
            attention_mask=mask,
            max_new_tokens=tokens,
            min_new_tokens=tokens,
            do_sample=False,
            pad_token_id=0,
        )

    with torch.inference_mode():
        ttft = _time(lambda: run(1), repeats)
        whole = _time(lambda: run(new_tokens), repeats)
        decode = (whole - ttft) / (new_tokens - 1)
        no_cache_ttft = _time(lambda: model(ids, attention_mask=mask, use_cache=False), repeats)
        longer = torch.cat([ids, ids[:, :1]], 1)
        no_cache_step = _time(
            lambda: model(longer, attention_mask=torch.ones_like(longer), use_cache=False), 1
        )
    return [
        Measurement("pytorch", batch, context, 1000 * ttft, 1000 * decode),
        Measurement("no-cache", batch, context, 1000 * no_cache_ttft, 1000 * no_cache_step),
    ]


Loaded = list[tuple[str, Generator]]


def _load_measured(system: str, directory: str | Path, provider: str, **options: Any) -> tuple[Generator, dict[str, float]]:
    """A warmed-up Generator and the RSS and PSS its loading added (MiB)."""
    before_rss, before_pss = memory_mb()
    generator = Generator(directory, provider=provider, **options)
    warm_up(generator)  # mapped weights count once they are read
    after_rss, after_pss = memory_mb()
    return generator, {"rss_mb": round(after_rss - before_rss, 1), "pss_mb": round(after_pss - before_pss, 1)}


def _checked_inputs(
    directory: str | Path, compare: Sequence[str | Path], contexts: Sequence[int], new_tokens: int
) -> tuple[Manifest, list[tuple[Path, Manifest]]]:
    """The export's manifest and the compared ones', refusing other weights and contexts that don't fit."""
    if new_tokens < 2:
        raise KvexportError(f"--new-tokens {new_tokens}: must be at least 2")
    manifest = read_manifest(Path(directory))
    others = [(Path(d), read_manifest(Path(d))) for d in compare]
    for other_dir, other in others:
        if other.weights_sha256 != manifest.weights_sha256:
            raise KvexportError(
                f"--compare {other_dir}: holds other weights than {directory}; "
                "compare exports of the same model"
            )
    too_long = [c for c in contexts if c < 1 or c + new_tokens > manifest.dims.max_positions]
    if too_long:
        raise KvexportError(
            f"--contexts {too_long}: each context + {new_tokens} new tokens must fit the model's "
            f"{manifest.dims.max_positions} positions"
        )
    return manifest, others


def _load_memory_variants(
    directory: str | Path, provider: str, memory: dict[str, dict[str, float]], progress: Progress
) -> Loaded:
    """The memory-saving Generators (pre-packed on CPU, shared weights), each measured as it loads."""
    options: list[tuple[str, dict[str, Any]]] = [("kvexport-shared", {"share_weights": True})]
    if resolve_provider(provider) == "cpu":
        progress("building (or finding) the pre-packed weights cache")
        prepacked_graphs(directory)  # in a child process: not counted in this one
        options.insert(0, ("kvexport-prepacked", {"prepacked": True}))
    loaded: Loaded = []
    for system, kwargs in options:
        progress(f"loading {system}")
        generator, memory[system] = _load_measured(system, directory, provider, **kwargs)
        loaded.append((system, generator))
    return loaded


def _load_compared(
    others: list[tuple[Path, Manifest]], provider: str, report: BenchReport, taken: set[str], progress: Progress
) -> tuple[Loaded, list[tuple[str, int, int]]]:
    """The compared exports' Generators, with their memory, disk bytes and floors recorded."""
    loaded: Loaded = []
    floors = []
    for other_dir, other in others:
        system = f"kvexport[{variant_label(other)}]"
        if system in taken:
            system = f"kvexport[{variant_label(other)},{other_dir.name}]"
        taken.add(system)
        progress(f"loading {system} from {other_dir}")
        generator, report.variant_memory[system] = _load_measured(system, other_dir, provider)
        loaded.append((system, generator))
        report.disk_bytes[system] = export_bytes(other_dir)
        floors.append((f"floor[{system[len('kvexport['):-1]}]", int(other.weights["bytes"]), cache_row_bytes(other, 1)))
    return loaded, floors


def _time_cells(
    report: BenchReport,
    systems: Loaded,
    model: Any,
    batches: Sequence[int],
    contexts: Sequence[int],
    new_tokens: int,
    repeats: int,
    progress: Progress,
) -> list[float]:
    """Every system at each (batch, context) before the next cell starts; the bandwidth samples.

    A machine whose speed drifts during the run (shared hosts do) so treats them alike.
    Bandwidth is sampled before each cell; the floors use the best sample of the run.
    """
    bandwidths = []
    for batch in batches:
        for context in contexts:
            bandwidths.append(measure_read_bandwidth(repeats=3))
            for system, generator in systems:
                progress(f"{system}: batch {batch}, context {context}")
                report.measurements.append(time_generator(generator, batch, context, new_tokens, repeats, system))
            if model is not None:
                progress(f"pytorch and no-cache: batch {batch}, context {context}")
                report.measurements.extend(_bench_torch(model, batch, context, new_tokens, repeats))
                time.sleep(0.5)  # let PyTorch's worker threads stop spinning before ORT runs again
    return bandwidths


def _floors(
    report: BenchReport,
    floors: list[tuple[str, int, int]],
    bandwidth: float,
    dims: Any,
    batches: Sequence[int],
    contexts: Sequence[int],
) -> None:
    """Each export's memory-bandwidth floor: its weight and cache bytes over the best bandwidth.

    ``floors`` holds (system, weight bytes, bytes one token takes in one cache tensor: KV
    heads x stored head dim x the cache's element size).
    """
    for batch in batches:
        for context in contexts:
            for system, weight_bytes, token_bytes in floors:
                cache_bytes = 2 * dims.num_layers * batch * context * token_bytes
                floor_ms = 1000 * (weight_bytes + cache_bytes) / (bandwidth * 1e9)
                report.measurements.append(Measurement(system, batch, context, None, floor_ms))


def run_bench(
    directory: str | Path,
    *,
    provider: str = "cpu",
    contexts: Sequence[int] = DEFAULT_CONTEXTS,
    batches: Sequence[int] = DEFAULT_BATCHES,
    new_tokens: int = 16,
    repeats: int = 2,
    baselines: bool = True,
    memory_variants: bool = True,
    compare: Sequence[str | Path] = (),
    prefix: int = 512,
    drafts: Sequence[str | Path] = (),
    text: Path | None = None,
    progress: Progress | None = None,
    cuda_graph: bool = False,
) -> BenchReport:
    """Measure kvexport and the baselines; see the module docstring.

    ``cuda_graph``: the ``kvexport`` Generator captures its decode steps as CUDA graphs
    (:mod:`kvexport.runtime.cuda_graph`); the report records it. Refused on CPU before
    anything is measured.

    ``memory_variants`` adds the memory-saving Generators (pre-packed, shared weights).
    ``prefix`` > 0 adds the engine's prefix-cache rows for an in-place export (the prefix
    shortened to fit the model's positions). An in-place ``--all-logits`` export also gets
    the speculative rows: prompt lookup, and each export in ``drafts`` as a draft model, on
    passages of ``text`` (random ids without it).
    ``compare`` names other exports of the same weights (e.g. ``--target ort-cpu``);
    each is timed in the same run as system ``kvexport[<attention>]``.
    """
    progress = progress or silent
    if cuda_graph:
        session_providers(resolve_provider(provider), cuda_graph=True)  # refused on CPU, in one line
    manifest, others = _checked_inputs(directory, compare, contexts, new_tokens)
    if baselines and manifest.source.kind == "graph":
        progress(f"no PyTorch baselines: {directory} was imported without its checkpoint")
        baselines = False
    progress("measuring memory read bandwidth")
    bandwidth = measure_read_bandwidth()
    gc.collect()
    # the memory-saving variants load first, each measured as it loads, and stay loaded to
    # be timed beside the default Generator in every cell
    variant_memory: dict[str, dict[str, float]] = {}
    variants = _load_memory_variants(directory, provider, variant_memory, progress) if memory_variants else []
    progress("loading the kvexport Generator")
    rss_before, pss_before = memory_mb()
    generator = Generator(directory, provider=provider, cuda_graph=cuda_graph)
    warm_up(generator)
    rss_after, pss_after = memory_mb()
    report = BenchReport(
        directory=str(directory),
        provider=generator.provider,
        new_tokens=new_tokens,
        bandwidth_gb_s=round(bandwidth, 2),
        weight_bytes=int(manifest.weights["bytes"]),
        rss_before_load_mb=round(rss_before, 1),
        rss_after_load_mb=round(rss_after, 1),
        rss_peak_onnx_mb=0.0,
        pss_before_load_mb=round(pss_before, 1),
        pss_after_load_mb=round(pss_after, 1),
        variant_memory=variant_memory,
        machine={"cpus": os.cpu_count(), "platform": platform.platform(), "processor": platform.processor()},
        cuda_graph=cuda_graph,
    )
    report.disk_bytes["kvexport"] = export_bytes(Path(directory))
    compared, floors = _load_compared(others, provider, report, {system for system, _ in variants}, progress)
    floors.insert(0, ("floor", report.weight_bytes, cache_row_bytes(manifest, 1)))
    report.rss_peak_onnx_mb = round(rss_mb(peak=True), 1)
    model = None
    if baselines:
        progress("loading the PyTorch reference")
        model = family_for(manifest.family).load(manifest.source, manifest.dtype)  # type: ignore[arg-type]
    systems = [("kvexport", generator), *variants, *compared]
    bandwidths = [bandwidth, *_time_cells(report, systems, model, batches, contexts, new_tokens, repeats, progress)]
    report.bandwidth_gb_s = round(max(bandwidths), 2)
    _floors(report, floors, max(bandwidths), manifest.dims, batches, contexts)
    if prefix > 0 and manifest.cache_layout == "shared-buffer":
        prefix = min(prefix, manifest.dims.max_positions - PREFIX_SUFFIX - 1)
        progress(f"engine: TTFT with and without a cached {prefix}-token prefix")
        report.measurements.extend(time_prefix_cache(directory, provider, prefix, repeats))
    if manifest.cache_layout == "shared-buffer" and manifest.all_logits:
        progress("speculative decoding against plain decode, one sequence")
        time_speculation(report, directory, provider, repeats, drafts, text)
    report.rss_peak_mb = round(rss_mb(peak=True), 1)
    del generator, systems, variants, compared
    gc.collect()
    return report


def write_plot(report: BenchReport, path: Path) -> None:
    """Decode ms/token against context, one line per system (and batch)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(figsize=(7, 4.5))
    series: dict[tuple[str, int], list[Measurement]] = {}
    for m in report.measurements:
        if m.decode_ms_per_token is not None:
            series.setdefault((m.system, m.batch), []).append(m)
    for (system, batch), points in sorted(series.items()):
        points.sort(key=lambda m: m.context)
        axes.plot(
            [m.context for m in points],
            [m.decode_ms_per_token or 0.0 for m in points],
            marker="o",
            linestyle="--" if system == "floor" else "-",
            label=f"{system} (batch {batch})",
        )
    axes.set_xlabel("context (tokens)")
    axes.set_ylabel("decode ms / token step")
    axes.set_yscale("log")
    axes.set_title(f"{Path(report.directory).name}: decode cost vs context ({report.provider})")
    axes.grid(True, which="both", alpha=0.3)
    axes.legend(fontsize=8)
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)


def write_json(report: BenchReport, path: Path) -> None:
    """Write the report as JSON."""
    path.write_text(json.dumps(report.to_dict(), indent=2) + "\n")
