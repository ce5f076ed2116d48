"""``kvexport export`` and ``kvexport gpt2``: a model to ONNX graphs with a KV cache (:func:`kvexport.export.exporter.export_model`)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import click

from kvexport.cli.base import main, progress, run
from kvexport.cli.options import export_choices, export_options
from kvexport.cli.render import cache_line, quantization_line
from kvexport.export.choices import QuantizationChoice
from kvexport.extras import require_export_extra


@main.command("gpt2")
@click.option(
    "--model",
    default="gpt2",
    show_default=True,
    help="Model directory or hub id; with --random-init a preset (gpt2, distilgpt2, gpt2-medium, "
    "gpt2-large, gpt2-xl) or a config.json.",
)
@export_options
def gpt2_command(model: str, **options: Any) -> None:
    """Export GPT-2 to OUT/ (prefill.onnx, decode.onnx, weights, kvexport.json, tokenizer.json)."""
    _export("kvexport gpt2", model, "gpt2", **options)


@main.command("export")
@click.option(
    "--model",
    required=True,
    help="A model directory (config.json + safetensors + tokenizer files), or with --random-init "
    "a preset or a config.json; the family comes from its model_type.",
)
@export_options
def export_command(model: str, **options: Any) -> None:
    """Export a model of any known family to OUT/ (the family from its config's model_type)."""
    _export("kvexport export", model, None, **options)


def _export(
    command: str, model: str, family: str | None, out: Path, quantization: QuantizationChoice, as_json: bool, **given: Any
) -> None:
    """Run one export command and render its result; ``given`` holds the other export choices."""
    run(lambda: require_export_extra(command))
    from kvexport.export.exporter import export_model

    choices = export_choices(quantization, given)
    result = run(lambda: export_model(out, model, choices, family=family, progress=progress))
    manifest = result.manifest
    if as_json:
        click.echo(json.dumps(manifest.to_dict(), indent=2))
        return
    dims = manifest.dims
    click.echo(f"exported {manifest.source.describe()} to {result.out_dir}")
    click.echo(
        f"  layers {dims.num_layers}, heads {dims.num_heads} (cache {dims.num_kv_heads}) x {dims.head_dim}, vocab {dims.vocab_size}, "
        f"positions {dims.max_positions}, {manifest.dtype}, opset {manifest.opset}"
    )
    click.echo(f"  target {manifest.target}, attention {manifest.attention}, cache {cache_line(manifest)}")
    if manifest.quantization:
        click.echo(f"  {quantization_line(manifest.quantization)}")
    click.echo(
        f"  strategy {result.strategy}; nodes: prefill {result.node_counts['prefill']}, decode {result.node_counts['decode']}"
    )
    click.echo(
        f"  weights {manifest.weights['bytes'] / 1e6:.1f} MB in {manifest.weights['file']} (shared)"
    )
    click.echo(f"  tokenizer: {manifest.tokenizer['source']}")
    click.echo(f"  took {result.seconds:.1f} s; next: kvexport verify {result.out_dir}")
