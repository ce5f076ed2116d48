"""``kvexport rewrite``: the rewrite passes on any decoder graph (:func:`kvexport.tools.rewrite.rewrite_graph`)."""

from __future__ import annotations

import json
from pathlib import Path

import click

from kvexport.cli.base import json_option, main, run
from kvexport.cli.options import choice_option, knobs, quantization_options
from kvexport.cli.render import echo_pass_table
from kvexport.export.choices import QuantizationChoice


@main.command("rewrite")
@click.argument("source", type=click.Path(path_type=Path))
@click.argument("output", type=click.Path(path_type=Path))
@click.option(
    "--passes",
    "pass_list",
    default=None,
    help="Comma-separated passes [default: rename_cache,fold_shapes,cleanup]; "
    "choose from rename_cache, transposed_weight_gemm, fold_shapes, fuse_attention, fuse_ort_block, "
    "shared_buffer_cache (changes the cache IO; needs --attention ort), quantize_weights (with --quantize), cleanup.",
)
@choice_option("attention", default="unfused")
@quantization_options
@click.option(
    "--names",
    type=click.Choice(["canonical", "optimum"]),
    default="canonical",
    show_default=True,
    help="Cache names to write: past.<l>.key or Optimum's past_key_values.<l>.key.",
)
@click.option("--force", is_flag=True, help="Replace an existing OUTPUT.")
@click.option(
    "--explain", is_flag=True, help="Say why each fusion rule that matched 0 times did not match."
)
@json_option
def rewrite_command(
    source: Path,
    output: Path,
    pass_list: str | None,
    attention: str,
    quantization: QuantizationChoice,
    names: str,
    force: bool,
    explain: bool,
    as_json: bool,
) -> None:
    """Run the rewrite passes on any decoder graph SOURCE.onnx and write OUTPUT.onnx."""
    from kvexport.tools.rewrite import rewrite_graph

    chosen_knobs = knobs(quantization)
    chosen = [p.strip() for p in pass_list.split(",") if p.strip()] if pass_list else None
    result = run(
        lambda: rewrite_graph(
            source,
            output,
            passes=chosen,
            attention=attention,
            quantization=chosen_knobs,
            names=names,  # type: ignore[arg-type]
            force=force,
            explain=explain,
        )
    )
    entries = [r.to_json() for r in result.reports]
    if as_json:
        click.echo(json.dumps({"output": str(result.output), "passes": entries}, indent=2))
        return
    echo_pass_table(entries)
    for entry in entries:
        for rule, why in entry.get("explanations", {}).items():
            click.echo(f"{entry['name']}: {rule} matched 0 times: {why}")
    data = f" (weights in {result.data_file.name})" if result.data_file else ""
    click.echo(f"wrote {result.output}{data}")
