"""CUDA checks for a GPU machine: parity, device-resident cache, no Memcpy in decode, fp16, TPOT.

Run by ``scripts/gpu_check.sh``; never by CI. Exports random-init GPT-2s (fp32 and fp16,
portable and ort-cuda), then for each export:

1. ``verify(provider="cuda")``: parity with PyTorch, step by step (batch 1 and a
   left-padded batch 2);
2. a Generator on CUDA: greedy tokens equal to the CPU provider's (fp32), and every cache
   buffer it binds is CUDA device memory (``cudaPointerGetAttributes``), the same buffers
   at every step for the in-place layout;
3. ORT profiling of the decode session: no ``Memcpy`` node runs inside a decode step, and
   which ops (if any) fell back to the CPU provider;
4. TTFT and decode ms/token (TPOT) at contexts 128 and 1000, batch 1 and 4, side by side
   with PyTorch eager ``generate`` (cache on) on the same GPU, same weights and dtype.

One PASS/FAIL line per check; ``gpu_check.json`` (all figures) lands in ``$GPU_CHECK_OUT``
(default: a temp dir). Exit 1 if any check fails. A failing export does not stop the others.

Environment: ``GPU_CHECK_PROVIDER=cpu`` dry-runs the script's logic without CUDA;
``GPU_CHECK_VARIANTS`` (e.g. ``ort-cuda/fp16,ort-cuda/fp16/int4,portable/fp32``: target,
dtype and optionally ``--quantize``) picks the exports; a quantized export's verify is
judged by quality (top-1 agreement, KL) within its scheme's tolerances;
``GPU_CHECK_CONTEXTS`` / ``GPU_CHECK_BATCHES`` the timing grid.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")

DEFAULT_VARIANTS = (
    "ort-cuda/fp16,ort-cuda/fp16/int4,ort-cuda/fp16/int8,ort-cuda/fp32,portable/fp32,portable/fp16"
)


def _pointer_kinds(pointers: set[int]) -> set[str]:
    """What CUDA says each pointer is: 'device', 'host', 'managed' or 'unregistered'."""
    import ctypes

    import torch

    torch.cuda.init()  # loads libcudart into the process
    cudart = None
    for name in ("libcudart.so.13", "libcudart.so.12", "libcudart.so"):
        try:
            cudart = ctypes.CDLL(name)
            break
        except OSError:
            continue
    if cudart is None:
        return {"unknown (no libcudart)"}

    # cudaPointerAttributes starts {int type; int device; ...}; later CUDA versions append
    # fields, so give the call ample room rather than a struct of one version's size
    names = {0: "unregistered", 1: "host", 2: "device", 3: "managed"}
    kinds = set()
    for pointer in pointers:
        attributes = ctypes.create_string_buffer(1024)
        code = cudart.cudaPointerGetAttributes(attributes, ctypes.c_void_p(pointer))
        kind = ctypes.c_int.from_buffer(attributes).value
        kinds.add(names.get(kind, str(kind)) if code == 0 else f"error {code}")
    return kinds


def _copy_edges(optimized: Path) -> list[str]:
    """``producer -> Memcpy* -> consumers`` for each copy node ORT inserted into the graph."""
    import onnx

    try:
        graph = onnx.load(str(optimized), load_external_data=False).graph
    except Exception as exc:  # a diagnostic only
        return [f"unreadable: {exc}"[:200]]
    producers = {out: node for node in graph.node for out in node.output}
    edges = []
    for node in graph.node:
        if node.op_type.startswith("Memcpy"):
            source = producers.get(node.input[0])
            consumers = sorted({n.op_type for n in graph.node if node.output[0] in n.input})
            origin = f"{source.op_type}({node.input[0]})" if source is not None else f"input {node.input[0]}"
            edges.append(f"{origin} -> {node.op_type} -> {consumers}")
    return edges


def _torch_timing(source: Any, dtype: str, device: str, grid: list[tuple[int, int]], vocab: int) -> dict[str, Any]:
    """PyTorch eager generate (cache on): TTFT and ms/token per (batch, context)."""
    import torch

    from kvexport.models.gpt2 import load_gpt2
    from kvexport.tools.bench import bench_prompt

    model = load_gpt2(source, dtype).to(device)  # type: ignore[arg-type]
    out: dict[str, Any] = {}
    for batch, context in grid:
        ids = torch.from_numpy(bench_prompt(vocab, batch, context)).to(device)
        mask = torch.ones_like(ids)

        def run(tokens: int, ids: Any = ids, mask: Any = mask) -> float:
            if device == "cuda":
                torch.cuda.synchronize()
            started = time.perf_counter()
            model.generate(ids, attention_mask=mask, max_new_tokens=tokens, min_new_tokens=tokens, do_sample=False, pad_token_id=0)
            if device == "cuda":
                torch.cuda.synchronize()
            return time.perf_counter() - started

        with torch.inference_mode():
            run(4)
            ttft = min(run(1) for _ in range(3))
            whole = min(run(33) for _ in range(3))
        out[f"b{batch}/c{context}"] = {"ttft_ms": round(1000 * ttft, 3), "tpot_ms": round(1000 * (whole - ttft) / 32, 3)}
    return out


def main() -> int:
    """Run every check; 0 when all pass."""
    import numpy as np
    import onnxruntime as ort

    from kvexport import export_gpt2, verify
    from kvexport.bundle.manifest import read_manifest
    from kvexport.runtime import Generator
    from kvexport.runtime.session import session_options, session_providers
    from kvexport.tools.bench import bench_prompt, time_generator

    model = sys.argv[1] if len(sys.argv) > 1 else "gpt2"
    provider = os.environ.get("GPU_CHECK_PROVIDER", "cuda")
    ort_provider = {"cuda": "CUDAExecutionProvider", "cpu": "CPUExecutionProvider"}[provider]
    default_variants = DEFAULT_VARIANTS if provider == "cuda" else "portable/fp32,ort-cpu/fp32,ort-cpu/fp32/int4"
    variants = [([*v.split("/"), "none"])[:3] for v in os.environ.get("GPU_CHECK_VARIANTS", default_variants).split(",")]
    contexts = [int(c) for c in os.environ.get("GPU_CHECK_CONTEXTS", "128,960").split(",")]
    batches = [int(b) for b in os.environ.get("GPU_CHECK_BATCHES", "1,4").split(",")]
    out_dir = Path(os.environ.get("GPU_CHECK_OUT") or tempfile.mkdtemp(prefix="kvexport-gpu-out-"))
    out_dir.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="kvexport-gpu-"))
    results: list[dict[str, Any]] = []
    timings: dict[str, Any] = {}
    failed = False

    def check(name: str, ok: bool, **details: Any) -> None:
        nonlocal failed
        failed |= not ok
        results.append({"check": name, "ok": ok, **details})
        print(f"{'PASS' if ok else 'FAIL'} {name} {details}", flush=True)

    def save() -> None:
        summary = {"model": model, "provider": provider, "ort": ort.__version__, "checks": results, "timings": timings}
        try:
            import torch

            summary["torch"] = torch.__version__
            if torch.cuda.is_available():
                summary["gpu"] = torch.cuda.get_device_name(0)
        except Exception:  # the summary is still worth writing
            pass
        (out_dir / "gpu_check.json").write_text(json.dumps(summary, indent=2, default=str))

    check(f"{provider} provider available", ort_provider in ort.get_available_providers(), ort=ort.__version__, providers=ort.get_available_providers())
    source = None
    vocab = 0
    for target, dtype, quantize in variants:
        label = f"{target}/{dtype}" + (f"/{quantize}" if quantize != "none" else "")
        out = work / label.replace("/", "-")
        try:
            started = time.perf_counter()
            export_gpt2(out, model, random_init=True, seed=0, target=target, dtype=dtype, quantize=quantize)
            manifest = read_manifest(out)
            source = manifest.source
            vocab = manifest.dims.vocab_size
            check(f"{label}: export", True, seconds=round(time.perf_counter() - started, 1), cache=manifest.cache_layout, attention=manifest.attention)

            report = verify(out, steps=8, provider=provider, record=False)
            worst = report.worst()
            check(
                f"{label}: verify on {provider}",
                report.ok,
                logits_max_abs=float(worst["logits"].max_abs_diff) if "logits" in worst else None,
                cache_max_abs=float(worst["cache"].max_abs_diff) if "cache" in worst else None,
                tokens_agree=all(t.ok for t in report.tokens),
                quality=report.overall_quality() or None,
                failures=report.failures()[:3],
            )

            generator = Generator(out, provider=provider, trace_cache=True)
            length = min(128, generator.max_positions - 40)
            prompt = [int(t) for t in np.random.default_rng(0).integers(0, generator.vocab_size, length)]
            tokens = generator.generate([prompt], 16, eos_token_id=-1)
            trace = generator.last_stats.cache_pointers
            pointers = {p for step in trace for p in step.values()}
            if provider == "cuda":
                kinds = _pointer_kinds(pointers)
                check(f"{label}: cache buffers are CUDA device memory", kinds == {"device"}, kinds=sorted(kinds), buffers=len(pointers))
            if manifest.cache_layout == "shared-buffer":
                per_step = [tuple(sorted(step.values())) for step in trace]
                check(f"{label}: in-place cache: one set of buffers, bound once for every step", len(set(per_step)) == 1 and len(per_step) == 4, bindings=len(per_step), buffers=len(pointers))
            if dtype == "fp32" and quantize == "none" and provider != "cpu":
                reference = Generator(out, provider="cpu").generate([prompt], 16, eos_token_id=-1)
                check(f"{label}: cuda greedy tokens == cpu greedy tokens", bool((tokens == reference).all()))

            grid = [(b, c) for b in batches for c in contexts if c + 40 <= generator.max_positions]
            cells: dict[str, Any] = {}
            for batch, context in grid:  # as kvexport bench times it: min TTFT, median step
                generator.generate(bench_prompt(generator.vocab_size, batch, context), 4, eos_token_id=-1)
                measured = time_generator(generator, batch, context, 33, 3)
                cells[f"b{batch}/c{context}"] = {
                    "ttft_ms": round(measured.ttft_ms or 0.0, 3),
                    "tpot_ms": round(measured.decode_ms_per_token or 0.0, 3),
                }
            timings[f"kvexport {label}"] = cells
            check(f"{label}: timing", True, **cells)
            if provider == "cuda" and f"pytorch eager {dtype}" not in timings:
                try:  # the baseline, same weights and dtype, same GPU, timed beside this export
                    timings[f"pytorch eager {dtype}"] = torch_cells = _torch_timing(source, dtype, "cuda", grid, vocab)
                    check(f"pytorch eager {dtype}: timing", True, **torch_cells)
                except Exception as exc:
                    check(f"pytorch eager {dtype}: ran", False, error=f"{type(exc).__name__}: {exc}"[:500])

            options = session_options()
            options.enable_profiling = True
            options.profile_file_prefix = str(work / f"profile-{out.name}")
            optimized = work / f"decode-optimized-{out.name}.onnx"
            options.optimized_model_filepath = str(optimized)  # shows where ORT put its copies
            profiled = ort.InferenceSession(str(out / "decode.onnx"), options, providers=session_providers(provider))  # type: ignore[arg-type]
            generator.sessions["decode"] = profiled
            generator.generate([prompt], 8, eos_token_id=-1)
            events = json.loads(Path(profiled.end_profiling()).read_text())
            nodes = [e for e in events if e.get("cat") == "Node" and e.get("name", "").endswith("_kernel_time")]
            memcpy = sorted({e["name"] for e in nodes if "Memcpy" in e["name"]})
            on_cpu = sorted({e["args"].get("op_name", "") for e in nodes if e.get("args", {}).get("provider") == "CPUExecutionProvider"}) if provider != "cpu" else []
            check(f"{label}: no Memcpy in the decode step", not memcpy, memcpy=memcpy[:5], ops_on_cpu=on_cpu[:10], kernels=len(nodes), copies=_copy_edges(optimized))
            del generator, profiled
        except Exception as exc:  # one broken variant must not hide the others' figures
            check(f"{label}: ran", False, error=f"{type(exc).__name__}: {exc}"[:500], where=traceback.format_exc().splitlines()[-6:])
        save()

    save()
    print(f"summary: {out_dir / 'gpu_check.json'}")
    return 1 if failed else 0


if __name__ == "__main__":
    started = time.perf_counter()
    code = main()
    print(f"gpu_check took {time.perf_counter() - started:.0f} s")
    sys.exit(code)
