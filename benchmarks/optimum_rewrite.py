"""Optimum's GPT-2 graph against kvexport's rewrite and import of it, in one run (outside CI).

Builds (once, under --work) a random-init GPT-2 checkpoint of the chosen architecture,
exports it with ``optimum-cli export onnx --task text-generation-with-past`` in the venv
that ``scripts/build_foreign_fixtures.py`` makes (optimum-onnx 0.1.0, transformers
4.57.6), then measures, side by side and in interleaved rounds:

- ``optimum``: Optimum's graph as it is;
- ``rewrite``: ``kvexport rewrite --attention ort`` of it (still one graph);
- ``import``: ``kvexport import --attention ort --cache concat`` of it: its decode.onnx, and the
  Generator on the directory;
- ``kvexport``: kvexport's own ``--target ort-cpu --cache concat`` export of the same checkpoint.

Graph columns: nodes, Shape nodes, fused attention ops, Softmax left, MB on disk
(graphs, weights, and for the directories the tokenizer and manifest). Timing: decode
ms/token of a naive ONNX Runtime loop (numpy feeds, a new present each step) after a
128-token prompt, batch 1, median over the rounds; the Generator (IO binding) beside it.
Ratios are taken within each round (every system timed back to back), then the median.

Usage: python benchmarks/optimum_rewrite.py [--model gpt2] [--work /tmp/optimum-bench] [--rounds 3]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))

CHECKPOINT = """
import sys, torch
from transformers import GPT2Config, GPT2LMHeadModel
out, preset = sys.argv[1], sys.argv[2]
torch.manual_seed(0)
config = GPT2Config() if preset == "gpt2" else GPT2Config.from_pretrained(preset)
GPT2LMHeadModel(config).eval().save_pretrained(out)
"""


def _kvexport(*args: str) -> None:
    subprocess.run([str(ROOT / ".venv" / "bin" / "kvexport"), *args], check=True, env={**os.environ, "HF_HUB_OFFLINE": "1"})


def graph_counts(path: Path) -> dict[str, int]:
    """Nodes, Shape nodes, fused attention ops and Softmax nodes of a graph."""
    import onnx

    graph = onnx.load(str(path), load_external_data=False).graph
    ops = [node.op_type for node in graph.node]
    fused = sum(ops.count(op) for op in ("Attention", "MultiHeadAttention", "GroupQueryAttention"))
    return {"nodes": len(ops), "shape": ops.count("Shape"), "fused": fused, "softmax": ops.count("Softmax")}


def naive_decode_ms(path: Path, context: int, steps: int) -> float:
    """Median ms per decode step of a plain session.run loop after a ``context``-token prompt."""
    import onnxruntime as ort

    from kvexport.testing import cache_by_slot, past_inputs

    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    past_names = past_inputs(session)
    rng = np.random.default_rng(0)
    # the prompt's cache: random rows of the right shape (timing only)
    feeds = {name: rng.standard_normal((1, h, context, d), dtype=np.float32) for name, h, d in past_names.values()}
    names = {arg.name for arg in session.get_inputs()}
    times = []
    for step in range(steps):
        total = context + step + 1
        feeds.update(
            {
                "input_ids": np.array([[int(rng.integers(0, 1000))]], np.int64),
                "attention_mask": np.ones((1, total), np.int64),
                "position_ids": np.array([[total - 1]], np.int64),
            }
        )
        started = time.perf_counter()
        outputs = session.run(None, {k: v for k, v in feeds.items() if k in names})
        times.append(time.perf_counter() - started)
        named = dict(zip([o.name for o in session.get_outputs()], outputs, strict=True))
        for slot, array in cache_by_slot(named).items():
            feeds[past_names[slot][0]] = array
    return 1000 * statistics.median(times[2:])


def generator_decode_ms(directory: Path, context: int, steps: int) -> float:
    """The Generator's decode ms/token after a ``context``-token prompt."""
    from kvexport import Generator

    generator = Generator(directory)
    ids = np.random.default_rng(1).integers(0, 1000, (1, context))
    generator.generate(ids, max_new_tokens=steps, eos_token_id=-1)
    stats = generator.last_stats
    assert stats is not None
    return 1000 * stats.decode_s / max(1, stats.new_tokens - 1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="gpt2")
    parser.add_argument("--work", type=Path, default=Path("/tmp/optimum-bench"))
    parser.add_argument("--venvs", type=Path, default=Path("/tmp/fx"), help="where build_foreign_fixtures keeps its venvs")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--context", type=int, default=128)
    parser.add_argument("--steps", type=int, default=24)
    parser.add_argument("--results", type=Path, default=ROOT / "benchmarks" / "results")
    args = parser.parse_args()
    import build_foreign_fixtures as fixtures

    work: Path = args.work
    work.mkdir(parents=True, exist_ok=True)
    optimum_python = fixtures.venv_python(args.venvs, "optimum")
    checkpoint, exported = work / "checkpoint", work / "optimum"
    if not (checkpoint / "config.json").exists():
        subprocess.run([str(optimum_python), "-c", CHECKPOINT, str(checkpoint), args.model], check=True)
    if not (exported / "model.onnx").exists():
        subprocess.run(
            [str(optimum_python.parent / "optimum-cli"), "export", "onnx", "--model", str(checkpoint),
             "--task", "text-generation-with-past", str(exported)],
            check=True, capture_output=True,
        )
    rewritten, imported, own = work / "rewrite.onnx", work / "imported", work / "kvexport"
    _kvexport("rewrite", str(exported / "model.onnx"), str(rewritten), "--attention", "ort", "--force")
    _kvexport("import", str(exported), "--out", str(imported), "--attention", "ort", "--cache", "concat", "--model", str(checkpoint), "--force")
    _kvexport("gpt2", "--model", str(checkpoint), "--out", str(own), "--target", "ort-cpu", "--cache", "concat", "--force")
    graphs = {
        "optimum": exported / "model.onnx",
        "rewrite": rewritten,
        "import": imported / "decode.onnx",
        "kvexport": own / "decode.onnx",
    }
    table: dict[str, dict[str, object]] = {name: {**graph_counts(path)} for name, path in graphs.items()}
    on_disk = {"optimum": [exported / "model.onnx"], "rewrite": [rewritten, Path(f"{rewritten}.data")],
               "import": list(imported.iterdir()), "kvexport": list(own.iterdir())}
    for name, files in on_disk.items():
        table[name]["disk_mb"] = round(sum(f.stat().st_size for f in files if f.is_file()) / 1e6, 1)
    naive: dict[str, list[float]] = {name: [] for name in graphs}
    generator: dict[str, list[float]] = {"import": [], "kvexport": []}
    for round_ in range(args.rounds):
        for name, path in graphs.items():
            naive[name].append(naive_decode_ms(path, args.context, args.steps))
        for name, directory in (("import", imported), ("kvexport", own)):
            generator[name].append(generator_decode_ms(directory, args.context, args.steps))
        print(f"round {round_ + 1}: naive {({k: round(v[-1], 2) for k, v in naive.items()})}, "
              f"generator {({k: round(v[-1], 2) for k, v in generator.items()})}", flush=True)
    for name in graphs:
        table[name]["naive_decode_ms"] = round(statistics.median(naive[name]), 2)
    for name in generator:
        table[name]["generator_decode_ms"] = round(statistics.median(generator[name]), 2)
    # this host drifts within minutes: the ratio of each round, then their median
    for name in graphs:
        ratios = [mine / base for mine, base in zip(naive[name], naive["optimum"], strict=True)]
        table[name]["naive_vs_optimum"] = round(statistics.median(ratios), 3)
    ratios = [mine / base for mine, base in zip(generator["import"], generator["kvexport"], strict=True)]
    table["import"]["generator_vs_kvexport"] = round(statistics.median(ratios), 3)
    result = {"model": args.model, "context": args.context, "rounds": args.rounds, "table": table,
              "naive_rounds": naive, "generator_rounds": generator}
    args.results.mkdir(parents=True, exist_ok=True)
    (args.results / f"optimum_rewrite-{args.model}.json").write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(table, indent=2))


if __name__ == "__main__":
    main()
