"""``kvexport inspect``: an export's or a graph's IO, ops and pass report (:func:`kvexport.tools.inspect.inspect_path`)."""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path

import click

from kvexport.cli.base import json_option, main, run
from kvexport.cli.render import echo_pass_table, quantization_line, verify_sentence


@main.command("inspect")
@click.argument("path", type=click.Path(path_type=Path))
@json_option
def inspect_command(path: Path, as_json: bool) -> None:
    """Show the IO signature, op histogram and pass report of an export directory or .onnx file."""
    from kvexport.tools.inspect import folded_tensors, inspect_path

    report = run(lambda: inspect_path(path))
    if as_json:
        click.echo(json.dumps(asdict(report), indent=2))
        return
    if report.manifest:
        m = report.manifest
        click.echo(
            f"{report.path}: {m['source']['name']} ({m['source']['kind']}), {m['dtype']}, opset {m['opset']}, target {m['target']}, attention {m['attention']}, cache {m.get('cache_layout', 'concat')}, exported by {m['strategy']}"
        )
        click.echo(f"  {m['family']} dims {m['dims']}")
        click.echo(
            f"  weights {m['weights']['bytes'] / 1e6:.1f} MB in {m['weights']['file']}; tokenizer: {m['tokenizer']['file'] or 'none'}"
        )
        if m.get("quantization"):
            click.echo(f"  {quantization_line(m['quantization'])}")
        if m["verify"]:
            click.echo(f"  last verify: {verify_sentence(m['verify'])}")
    for name, graph in report.graphs.items():
        click.echo(f"\n[{name}] {graph.file}: {graph.nodes} nodes, opset {graph.opset}")
        for warning in graph.warnings:
            click.echo(f"  warning: {warning}")
        for direction, tensors in (("in ", graph.inputs), ("out", graph.outputs)):
            for tensor_name, dtype, shape in folded_tensors(tensors):
                click.echo(f"  {direction} {tensor_name:<28} {dtype:<8} [{', '.join(map(str, shape))}]")
        click.echo("  ops: " + ", ".join(f"{op} {count}" for op, count in graph.ops.items()))
    if report.passes:
        click.echo("")
        echo_pass_table(report.passes)
