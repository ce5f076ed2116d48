"""``kvexport import``: another exporter's one-graph decoder as a kvexport directory (:func:`kvexport.export.importer.import_decoder`)."""

from __future__ import annotations

import json
from pathlib import Path

import click

from kvexport.cli.base import json_option, main, progress, run
from kvexport.cli.options import choice_option, knobs, quantization_options
from kvexport.cli.render import echo_pass_table
from kvexport.export.choices import QuantizationChoice, QuantizeKind


@main.command("import")
@click.argument("source", type=click.Path(path_type=Path))
@click.option("--out", type=click.Path(path_type=Path), required=True, help="The kvexport directory to write.")
@click.option(
    "--model",
    "checkpoint",
    type=click.Path(path_type=Path),
    default=None,
    help="The checkpoint directory the graph was exported from; recorded so verify can compare with PyTorch.",
)
@choice_option("attention", default="unfused")
@choice_option("cache", shown="shared-buffer with --attention ort (also loads in onnxruntime-genai), else concat")
@quantization_options
@choice_option("kv_cache")
@click.option("--force", is_flag=True, help="Replace a non-empty --out.")
@json_option
def import_command(
    source: Path,
    out: Path,
    checkpoint: Path | None,
    attention: str,
    cache: str | None,
    quantization: QuantizationChoice,
    kv_cache: str | None,
    force: bool,
    as_json: bool,
) -> None:
    """Turn a one-graph decoder SOURCE (an Optimum export directory or its .onnx) into a kvexport directory."""
    from kvexport.export.importer import import_decoder

    chosen_knobs = knobs(quantization, defaulted=True)
    manifest = run(
        lambda: import_decoder(
            source,
            out,
            model=checkpoint,
            attention=attention,
            cache=cache,
            quantize=(quantization.scheme or QuantizeKind.NONE).value,
            quantization=chosen_knobs,
            kv_cache=kv_cache,
            force=force,
            progress=None if as_json else progress,
        )
    )
    if as_json:
        click.echo(json.dumps(manifest.to_dict(), indent=2))
        return
    echo_pass_table(manifest.passes)
    nodes = ", ".join(f"{name} {spec.nodes} nodes" for name, spec in manifest.graphs.items())
    click.echo(f"imported {source} to {out}: {nodes}, weights {manifest.weights['bytes'] / 1e6:.1f} MB once")
    if manifest.source.kind == "graph":
        click.echo("  no checkpoint given: verify needs --model; kvexport check and generate work as they are")
