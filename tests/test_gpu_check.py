"""``scripts/gpu_check.py``: its verdict on the engine's tokens, and a CPU dry run of the whole script.

The script is for a GPU machine (CI never has one); the dry run (``GPU_CHECK_PROVIDER=cpu``,
a tiny model) runs every part of it here, so it cannot rot between GPU runs.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]


def _compare() -> Any:
    spec = importlib.util.spec_from_file_location("gpu_check", ROOT / "scripts" / "gpu_check.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("gpu_check", module)  # dataclasses look their module up by name
    spec.loader.exec_module(module)
    return module


def test_the_verdict_tells_rounding_from_a_bug() -> None:
    gpu_check = _compare()
    run = gpu_check.EngineRun
    near, far = ((5, -1.0), (7, -1.1)), ((5, -0.1), (7, -3.0))
    reference = [[5, 5, 5], [5, 5, 5]]
    alone = run([[5, 5, 5], [5, 5, 5]], [[near] * 3, [near, far, far]], 1.0)
    # the 16-row engine flips row 0's second token where the reference's margin is 0.1: rounding
    flipped = run([[5, 7, 7], [5, 5, 5]], [[near] * 3] * 2, 1.0)
    verdict = gpu_check.compare_compositions("cuda", flipped, alone, reference, reference)
    assert (verdict["ok"], verdict["verdict"]) == (True, "batch-shape rounding")
    assert verdict["divergences"][0]["tokens_in"] == 1 and verdict["divergences"][0]["reference_margin"] == 0.1
    # row 1 flips where the reference's margin is 2.9: no rounding does that
    wide = run([[5, 5, 5], [5, 7, 7]], [[near] * 3] * 2, 1.0)
    assert gpu_check.compare_compositions("cuda", wide, alone, reference, reference)["ok"] is False
    # the same composition differs: an engine bug; on CPU any difference fails
    assert gpu_check.compare_compositions("cuda", alone, flipped, reference, reference)["verdict"] == "engine bug"
    assert gpu_check.compare_compositions("cpu", flipped, alone, reference, reference)["ok"] is False
    assert gpu_check.compare_compositions("cpu", alone, alone, reference, reference)["verdict"] == "agree"


def test_the_captured_path_is_cuda_graphs_on_cuda_and_the_static_step_on_cpu() -> None:
    gpu_check = _compare()
    # the CPU provider has no CUDA graphs: the dry run takes the same fixed decode step uncaptured
    assert gpu_check.captured_options("cpu") == ({"static_decode": True}, "")
    assert gpu_check.captured_options("cuda") == ({"cuda_graph": True}, "")
    assert gpu_check.engine_options("cpu") == {"static_decode": True}
    assert gpu_check.engine_options("cuda") == {"cuda_graph": True} and gpu_check._engine_flags("cuda") == ["--cuda-graph"]


# every check but the cache's device (n/a on CPU) must pass a CPU dry run
MUST_PASS = (
    "export", "verify", "no Memcpy in decode", "timing", "captured tokens == uncaptured",
    "engine tokens vs Generator", "engine throughput", "serve throughput",
)


def test_a_cpu_dry_run_of_the_whole_script_passes(tmp_path: Path) -> None:
    gpu_check = _compare()
    out = tmp_path / "gpu_check.json"
    environment = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
        "HF_HUB_OFFLINE": "1",
        "GPU_CHECK_PROVIDER": "cpu",
        "GPU_CHECK_MODELS": "gpt2",
        "GPU_CHECK_VARIANTS": "fp16",  # the CPU dry run's own defaults for the rest (contexts 16,40, batches 1,4, ...)
        "GPU_CHECK_EXPORT_WORKERS": "1",
        "GPU_CHECK_OUT": str(out),
    }
    ran = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "gpu_check.py")], env=environment, capture_output=True, text=True, timeout=300
    )
    assert ran.returncode == 0, ran.stdout[-3000:] + ran.stderr[-3000:]
    summary = json.loads(out.read_text())
    assert summary["provider"] == "cpu" and summary["ok"] is True
    assert set(summary["exports"]) == {"gpt2/fp16"}
    checks = summary["exports"]["gpt2/fp16"]["checks"]
    assert set(checks) == set(gpu_check.CHECKS)
    assert all(check["status"] in ("PASS", "SKIP") for check in checks.values()), checks
    assert all(checks[name]["status"] == "PASS" for name in MUST_PASS), checks
    assert checks["cache on device"]["status"] == "SKIP" and "n/a" in checks["cache on device"]["reason"]
    # the profile is of the graph that runs the decode steps: an in-place export's prefill graph
    assert checks["no Memcpy in decode"]["graph"] == "prefill.onnx" and checks["no Memcpy in decode"]["kernels"] > 0
    timing = summary["exports"]["gpt2/fp16"]["figures"]["timing"]
    assert {f"{kind} decode b{b}/c16 ms" for kind in ("captured", "uncaptured") for b in (1, 4)} <= set(timing)
    assert summary["exports"]["gpt2/fp16"]["figures"]["engine_verdict"]["verdict"] == "agree"
    assert {"exports", "export (sum)", "verify (sum)", "device checks", "engine tokens", "timing", "engine", "serve", "total"} <= set(summary["parts_s"])
    assert [t["status"] for t in summary["targets"]] == ["SKIP"] * 3  # timing targets are CUDA's
    # one line per check and per target, as the GPU run prints them
    lines = [line for line in ran.stdout.splitlines() if line.startswith(("PASS ", "FAIL ", "SKIP ", "TARGET "))]
    assert len(lines) == len(gpu_check.CHECKS) + 3 + 1  # the checks, the targets and the verdict line


def test_the_prompts_are_kvexport_benchs() -> None:
    from kvexport.tools.bench import bench_prompt

    gpu_check = _compare()  # its own copy, so the script's process never imports torch
    assert (gpu_check.bench_prompt(1001, 4, 16) == bench_prompt(1001, 4, 16)).all()
    assert (gpu_check.bench_prompt(50257, 16, 128) == bench_prompt(50257, 16, 128)).all()
