"""Optimum's graph against kvexport's rewrite and import of it, in one run (outside CI).

GPT-2 (``--model gpt2``) or a Llama-style preset (``--model smollm2-135m``: SmolLM2-135M's
architecture, grouped-query attention). Builds (once, under --work) a random-init checkpoint of the chosen architecture,
exports it with ``optimum-cli export onnx --task text-generation-with-past`` in the venv
that ``scripts/build_foreign_fixtures.py`` makes (optimum-onnx 0.1.0, transformers
4.57.6), then measures, side by side and in interleaved rounds:

- ``optimum``: Optimum's graph as it is;
- ``rewrite``: ``kvexport rewrite --attention ort`` of it (still one graph);
- ``import``: ``kvexport import --attention ort --cache concat`` of it (Llama-style: the
  in-place cache, the only one their GroupQueryAttention takes): its decode.onnx, and the
  Generator on the directory; ``import-int8``: the same with ``--quantize int8`` (Llama-style);
- ``kvexport``: kvexport's own ``--target ort-cpu --cache concat`` export of the same checkpoint
  (Llama-style: ``kvexport export --target ort-cpu``);
- with ``--dynamo`` (Llama-style only): ``dynamo``, a plain ``torch.onnx.export(dynamo=True)``
  of the checkpoint (prefill and decode graphs, cache as IO, opset 18: what
  ``kvexport.testing.export_foreign`` makes), and ``dynamo-rewrite``, both graphs after
  ``kvexport rewrite --attention ort``; TTFT is the prefill graph's, decode the decode graph's;
- with ``--genai-python`` (a python with onnxruntime-genai's model builder; Llama-style only):
  ``genai``, the builder's fp32 CPU graph as it is, and ``genai-import``, its
  ``kvexport import --attention ort``.

Graph columns: nodes, Shape nodes, fused attention ops, Softmax left, MB on disk
(graphs, weights, and for the directories the tokenizer and manifest). Timing: decode
ms/token of a naive ONNX Runtime loop (numpy feeds, a new present each step) after a
128-token prompt, batch 1, median over the rounds, and the one-graph decoders' time for that
prompt (TTFT, past of length 0); the Generator (IO binding) beside them, TTFT and decode. The
naive loop can't drive an in-place graph, so Llama-style imports have Generator columns only.
Ratios are taken within each round (every system timed back to back), then the median.

Usage: python benchmarks/optimum_rewrite.py [--model gpt2|smollm2-135m] [--work /tmp/optimum-bench] [--rounds 3]
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
from typing import Any

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
LLAMA_CHECKPOINT = """
import sys, json, torch
from transformers import LlamaConfig, LlamaForCausalLM
out, preset = sys.argv[1], sys.argv[2]
assert preset == "smollm2-135m", preset
torch.manual_seed(0)
config = LlamaConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
                     num_key_value_heads=3, hidden_act="silu", max_position_embeddings=8192, rms_norm_eps=1e-5, bos_token_id=0,
                     eos_token_id=0, tie_word_embeddings=True, rope_theta=100000.0, head_dim=64)
LlamaForCausalLM(config).eval().save_pretrained(out)
json.dump({"tokenizer_class": "PreTrainedTokenizerFast"}, open(f"{out}/tokenizer_config.json", "w"))
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


HEAD_DIM: list[int] = []  # the checkpoint's, for graphs that leave the cache's head size symbolic (genai's)


def _past_inputs(session: Any, read: Any) -> dict[Any, tuple[str, int, int]]:
    """``kvexport.testing.past_inputs``, with the checkpoint's head size where the graph names it symbolically."""
    import onnxruntime as ort

    assert isinstance(session, ort.InferenceSession)
    for arg in session.get_inputs():
        if arg.name.startswith("past") and not isinstance(arg.shape[3], int):
            from kvexport.passes.rename_cache import parse_cache_name

            slots = {arg.name: parse_cache_name(arg.name, "past") for arg in session.get_inputs()}
            return {(s.layer, s.kind): (n, int(a.shape[1]), HEAD_DIM[0]) for a in session.get_inputs()
                    for n, s in [(a.name, slots[a.name])] if s is not None}  # fmt: skip
    return dict(read(session))


def naive_decode_ms(path: Path, context: int, steps: int) -> float:
    """Median ms per decode step of a plain session.run loop after a ``context``-token prompt."""
    import onnxruntime as ort

    from kvexport.testing import cache_by_slot, past_inputs

    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    past_names = _past_inputs(session, past_inputs)
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


def naive_prefill_ms(path: Path, context: int) -> float:
    """A one-graph decoder's time for a ``context``-token prompt with a past of length 0 (the better of two runs)."""
    import onnxruntime as ort

    from kvexport.testing import past_inputs

    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    feeds = {name: np.zeros((1, h, 0, d), np.float32) for name, h, d in _past_inputs(session, past_inputs).values()}
    feeds.update(
        {
            "input_ids": np.random.default_rng(2).integers(0, 1000, (1, context)).astype(np.int64),
            "attention_mask": np.ones((1, context), np.int64),
            "position_ids": np.arange(context, dtype=np.int64)[None],
        }
    )
    names = {arg.name for arg in session.get_inputs()}
    times = []
    for _ in range(2):
        started = time.perf_counter()
        session.run(None, {k: v for k, v in feeds.items() if k in names})
        times.append(time.perf_counter() - started)
    return 1000 * min(times)


def generator_ms(directory: Path, context: int, steps: int) -> tuple[float, float]:
    """The Generator's TTFT and decode ms/token after a ``context``-token prompt."""
    from kvexport import Generator

    generator = Generator(directory)
    ids = np.random.default_rng(1).integers(0, 1000, (1, context))
    generator.generate(ids, max_new_tokens=steps, eos_token_id=-1)
    stats = generator.last_stats
    assert stats is not None
    return 1000 * stats.ttft_s, 1000 * stats.decode_s / max(1, stats.new_tokens - 1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="gpt2")
    parser.add_argument("--work", type=Path, default=Path("/tmp/optimum-bench"))
    parser.add_argument("--venvs", type=Path, default=Path("/tmp/fx"), help="where build_foreign_fixtures keeps its venvs")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--dynamo", action="store_true", help="also time torch.onnx.export(dynamo=True) graphs (Llama-style)")
    parser.add_argument("--genai-python", type=Path, help="a python with onnxruntime_genai.models.builder (Llama-style models)")
    parser.add_argument("--context", type=int, default=128)
    parser.add_argument("--steps", type=int, default=24)
    parser.add_argument("--results", type=Path, default=ROOT / "benchmarks" / "results")
    args = parser.parse_args()
    import build_foreign_fixtures as fixtures

    work: Path = args.work
    work.mkdir(parents=True, exist_ok=True)
    optimum_python = fixtures.venv_python(args.venvs, "optimum")
    llama = args.model != "gpt2" and not args.model.startswith("gpt2")
    checkpoint, exported = work / "checkpoint", work / "optimum"
    if not (checkpoint / "config.json").exists():
        subprocess.run([str(optimum_python), "-c", LLAMA_CHECKPOINT if llama else CHECKPOINT, str(checkpoint), args.model], check=True)
    if not (exported / "model.onnx").exists():
        subprocess.run(
            [str(optimum_python.parent / "optimum-cli"), "export", "onnx", "--model", str(checkpoint),
             "--task", "text-generation-with-past", str(exported)],
            check=True, capture_output=True,
        )
    rewritten, imported, own = work / "rewrite.onnx", work / "imported", work / "kvexport"
    _kvexport("rewrite", str(exported / "model.onnx"), str(rewritten), "--attention", "ort", "--force")
    cache = [] if llama else ["--cache", "concat"]
    _kvexport("import", str(exported), "--out", str(imported), "--attention", "ort", *cache, "--model", str(checkpoint), "--force")
    directories = {"import": imported, "kvexport": own}
    if llama:
        directories["import-int8"] = work / "imported-int8"
        _kvexport("import", str(exported), "--out", str(directories["import-int8"]), "--attention", "ort", "--quantize", "int8",
                  "--model", str(checkpoint), "--force")
        _kvexport("export", "--model", str(checkpoint), "--out", str(own), "--target", "ort-cpu", "--force")
    else:
        _kvexport("gpt2", "--model", str(checkpoint), "--out", str(own), "--target", "ort-cpu", "--cache", "concat", "--force")
    config = json.loads((checkpoint / "config.json").read_text())
    HEAD_DIM.append(int(config.get("head_dim") or config.get("n_embd", 768) // config.get("n_head", 12)))
    extra: dict[str, Path] = {}
    if llama and args.genai_python is not None:
        built = work / "genai"
        if not (built / "model.onnx").exists():
            subprocess.run([str(args.genai_python), "-m", "onnxruntime_genai.models.builder", "-i", str(checkpoint), "-o", str(built),
                            "-p", "fp32", "-e", "cpu", "-c", str(work / "genai-cache")], check=True, capture_output=True)
        extra["genai"] = built / "model.onnx"
        directories["genai-import"] = work / "genai-imported"
        _kvexport("import", str(built), "--out", str(directories["genai-import"]), "--attention", "ort", "--model", str(checkpoint), "--force")
    prompt_graphs: dict[str, Path] = {}  # where the TTFT graph is not the decode graph
    if llama and args.dynamo:
        dynamo = work / "dynamo"
        if not (dynamo / "decode.onnx").exists():
            from kvexport.testing import export_foreign

            export_foreign(dynamo, checkpoint / "config.json", seed=0, style="optimum", exporter="dynamo")
        for graph in ("prefill", "decode"):
            _kvexport("rewrite", str(dynamo / f"{graph}.onnx"), str(work / f"dynamo-rewrite-{graph}.onnx"), "--attention", "ort", "--force")
        extra["dynamo"], extra["dynamo-rewrite"] = dynamo / "decode.onnx", work / "dynamo-rewrite-decode.onnx"
        prompt_graphs = {"dynamo": dynamo / "prefill.onnx", "dynamo-rewrite": work / "dynamo-rewrite-prefill.onnx"}
    graphs = {"optimum": exported / "model.onnx", "rewrite": rewritten, **extra, **{k: d / "decode.onnx" for k, d in directories.items()}}
    table: dict[str, dict[str, object]] = {name: {**graph_counts(path)} for name, path in graphs.items()}
    on_disk = {"optimum": [exported / "model.onnx"], "rewrite": [rewritten, Path(f"{rewritten}.data")],
               **{k: list(v.parent.iterdir()) for k, v in extra.items() if k == "genai"},
               **{k: list(d.iterdir()) for k, d in directories.items()}}
    for name, files in on_disk.items():
        table[name]["disk_mb"] = round(sum(f.stat().st_size for f in files if f.is_file()) / 1e6, 1)
    naive_graphs = {k: v for k, v in graphs.items() if not (llama and k in directories)}  # in-place graphs need the Generator
    naive: dict[str, list[float]] = {name: [] for name in naive_graphs}
    prefill: dict[str, list[float]] = {"optimum": [], "rewrite": [], **{k: [] for k in extra}}
    generator: dict[str, list[tuple[float, float]]] = {name: [] for name in directories}
    for round_ in range(args.rounds):
        for name, path in naive_graphs.items():
            naive[name].append(naive_decode_ms(path, args.context, args.steps))
        for name in prefill:
            prefill[name].append(naive_prefill_ms(prompt_graphs.get(name, graphs[name]), args.context))
        for name, directory in directories.items():
            generator[name].append(generator_ms(directory, args.context, args.steps))
        print(f"round {round_ + 1}: naive {({k: round(v[-1], 2) for k, v in naive.items()})}, "
              f"prefill {({k: round(v[-1], 1) for k, v in prefill.items()})}, "
              f"generator {({k: tuple(round(x, 2) for x in v[-1]) for k, v in generator.items()})}", flush=True)
    for name in naive:
        table[name]["naive_decode_ms"] = round(statistics.median(naive[name]), 2)
        # this host drifts within minutes: the ratio of each round, then their median
        ratios = [mine / base for mine, base in zip(naive[name], naive["optimum"], strict=True)]
        table[name]["naive_vs_optimum"] = round(statistics.median(ratios), 3)
    for name in prefill:
        table[name]["naive_ttft_ms"] = round(statistics.median(prefill[name]), 1)
        ratios = [mine / base for mine, base in zip(prefill[name], prefill["optimum"], strict=True)]
        table[name]["ttft_vs_optimum"] = round(statistics.median(ratios), 3)
    for name in generator:
        table[name]["generator_ttft_ms"] = round(statistics.median(t for t, _ in generator[name]), 1)
        table[name]["generator_decode_ms"] = round(statistics.median(d for _, d in generator[name]), 2)
        for column, index, base in (("decode", 1, naive["optimum"]), ("ttft", 0, prefill["optimum"])):
            ratios = [mine[index] / other for mine, other in zip(generator[name], base, strict=True)]
            table[name][f"generator_{column}_vs_optimum_naive"] = round(statistics.median(ratios), 3)
    ratios = [mine[1] / base[1] for mine, base in zip(generator["import"], generator["kvexport"], strict=True)]
    table["import"]["generator_vs_kvexport"] = round(statistics.median(ratios), 3)
    result = {"model": args.model, "context": args.context, "rounds": args.rounds, "table": table,
              "naive_rounds": naive, "prefill_rounds": prefill, "generator_rounds": generator}
    args.results.mkdir(parents=True, exist_ok=True)
    (args.results / f"optimum_rewrite-{args.model}.json").write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(table, indent=2))


if __name__ == "__main__":
    main()
