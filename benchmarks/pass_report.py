"""Per-pass report for GPT-2 124M-shaped models at several depths, both torch exporters.

For each depth, exports the graphs the way other tools leave them (Optimum cache names, no
passes), runs kvexport's full pipeline for each attention target, prints per graph and
pass: nodes, Shape nodes, fused attention ops and Softmax nodes before/after, and checks
parity with PyTorch by running ``kvexport.tools.verify`` on the result.

    python benchmarks/pass_report.py --layers 6,12 --work /tmp/pass-report [--json report.json]
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import onnx_ir as ir

os.environ.setdefault("HF_HUB_OFFLINE", "1")


def main() -> None:
    """Parse arguments, run every combination, print markdown tables."""
    from transformers import GPT2Config

    from kvexport import export_gpt2, verify
    from kvexport.passes import build_pipeline, run_pipeline
    from kvexport.testing import export_foreign, kvexport_dir_with_graphs

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", default="6,12")
    parser.add_argument("--targets", default="ort,onnx")
    parser.add_argument("--exporters", default="dynamo,torchscript")
    parser.add_argument("--work", type=Path, required=True)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    rows: list[dict[str, object]] = []
    for layers in [int(x) for x in args.layers.split(",")]:
        work = args.work / f"L{layers}"
        work.mkdir(parents=True, exist_ok=True)
        config = work / "config.json"
        config.write_text(json.dumps({**GPT2Config().to_dict(), "n_layer": layers}))
        reference = work / "kvexport"
        if not (reference / "kvexport.json").exists():
            export_gpt2(reference, str(config), random_init=True, seed=0, force=True)
        for exporter in args.exporters.split(","):
            raw = work / f"raw-{exporter}"
            if not (raw / "decode.onnx").exists():
                export_foreign(raw, config, seed=0, style="optimum", exporter=exporter)
            for attention in args.targets.split(","):
                out = work / f"{exporter}-{attention}"
                out.mkdir(exist_ok=True)
                graphs = {}
                for name in ("prefill", "decode"):
                    model = ir.load(raw / f"{name}.onnx")
                    started = time.perf_counter()
                    reports = run_pipeline(model, build_pipeline(attention))  # type: ignore[arg-type]
                    seconds = time.perf_counter() - started
                    graphs[name] = out / f"{name}.onnx"
                    ir.save(model, graphs[name], external_data=f"{name}.onnx.data")
                    for r in reports:
                        rows.append({"layers": layers, "exporter": exporter, "attention": attention, "graph": name, "pass_seconds_total": round(seconds, 1), **r.to_json()})
                check = verify(kvexport_dir_with_graphs(reference, graphs, work / f"dir-{exporter}-{attention}"), steps=4, record=False)
                worst = check.worst()
                rows.append({
                    "layers": layers, "exporter": exporter, "attention": attention, "graph": "parity",
                    "ok": check.ok, "logits_max_abs": worst["logits"].max_abs_diff, "cache_max_abs": worst["cache"].max_abs_diff,
                    "tokens_agree": all(t.ok for t in check.tokens),
                })
                print(f"L{layers} {exporter} {attention}: verify {'PASS' if check.ok else 'FAIL'} logits {worst['logits'].max_abs_diff:.2e} cache {worst['cache'].max_abs_diff:.2e}", flush=True)
    print("| L | exporter | attention | graph | pass | nodes | Shape | fused | Softmax |")
    print("|---|---|---|---|---|---|---|---|---|")
    for row in rows:
        if row["graph"] == "parity":
            continue
        print(
            f"| {row['layers']} | {row['exporter']} | {row['attention']} | {row['graph']} | {row['name']} | "
            f"{row['nodes_before']} -> {row['nodes_after']} | {row['shape_nodes_before']} -> {row['shape_nodes_after']} | "
            f"{row['fused_attention_after']} | {row['softmax_after']} |"
        )
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2, default=str))


if __name__ == "__main__":
    main()
