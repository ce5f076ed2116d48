"""``kvexport bench``: TTFT and decode speed beside the baselines, in one run (:func:`kvexport.tools.bench.run_bench`)."""

from __future__ import annotations

import json
from pathlib import Path

import click

from kvexport.cli.base import cuda_graph_option, json_option, main, progress, provider_option, run
from kvexport.extras import require_export_extra, require_extra


def _int_list(ctx: click.Context, param: click.Parameter, value: str) -> list[int]:
    try:
        return [int(v) for v in value.split(",") if v.strip()]
    except ValueError:
        raise click.BadParameter(
            f"{value!r}: pass comma-separated integers, e.g. 128,512,1000"
        ) from None


@main.command("bench")
@click.argument("directory", type=click.Path(path_type=Path))
@click.option(
    "--contexts",
    default="128,512,1000",
    show_default=True,
    callback=_int_list,
    help="Prompt lengths.",
)
@click.option(
    "--batches", default="1,4", show_default=True, callback=_int_list, help="Batch sizes."
)
@click.option(
    "--new-tokens", default=16, show_default=True, type=int, help="Decode steps per measurement."
)
@click.option("--repeats", default=2, show_default=True, type=int)
@click.option("--no-baselines", is_flag=True, help="Skip the PyTorch and no-cache baselines.")
@click.option(
    "--no-memory-variants",
    "--no-shared",
    "no_memory_variants",
    is_flag=True,
    help="Skip the memory-saving Generator variants (pre-packed, shared weights); --no-shared is the old spelling.",
)
@click.option(
    "--compare",
    "compare",
    multiple=True,
    type=click.Path(path_type=Path),
    help="Another export of the same weights (e.g. --target ort-cpu) to time in the same run; repeatable.",
)
@click.option(
    "--prefix",
    default=512,
    show_default=True,
    type=click.IntRange(0),
    help="In-place exports: the serving engine's TTFT with a cached prefix of this many tokens against cold (0 skips).",
)
@click.option(
    "--draft",
    "drafts",
    multiple=True,
    type=click.Path(path_type=Path),
    help="An --all-logits export also gets speculative rows; this export drafts in one more (repeatable).",
)
@click.option(
    "--text",
    type=click.Path(path_type=Path, exists=True, dir_okay=False),
    default=None,
    help="Passages for the speculative rows (default: random token ids).",
)
@click.option(
    "--results",
    default=Path("bench-results"),
    show_default=True,
    type=click.Path(path_type=Path),
    help="Directory for bench.json and bench.png.",
)
@provider_option
@cuda_graph_option
@json_option
def bench_command(
    directory: Path,
    contexts: list[int],
    batches: list[int],
    new_tokens: int,
    repeats: int,
    no_baselines: bool,
    no_memory_variants: bool,
    compare: tuple[Path, ...],
    prefix: int,
    drafts: tuple[Path, ...],
    text: Path | None,
    results: Path,
    provider: str,
    cuda_graph: bool,
    as_json: bool,
) -> None:
    """Time TTFT and decode ms/token against PyTorch, no-cache and the bandwidth floor, in one run."""
    run(lambda: require_export_extra("kvexport bench (the PyTorch baselines)"))
    run(lambda: require_extra("bench", "kvexport bench (its plot)"))
    from kvexport.tools.bench import run_bench, write_json, write_plot

    report = run(
        lambda: run_bench(
            directory,
            provider=provider,
            contexts=contexts,
            batches=batches,
            new_tokens=new_tokens,
            repeats=repeats,
            baselines=not no_baselines,
            memory_variants=not no_memory_variants,
            compare=compare,
            prefix=prefix,
            drafts=drafts,
            text=text,
            progress=progress,
            cuda_graph=cuda_graph,
        )
    )
    results.mkdir(parents=True, exist_ok=True)
    write_json(report, results / "bench.json")
    write_plot(report, results / "bench.png")
    if as_json:
        click.echo(json.dumps(report.to_dict(), indent=2))
        return
    click.echo(f"{'system':<32} {'batch':>5} {'context':>7} {'TTFT ms':>9} {'decode ms/token':>16}")
    for m in sorted(report.measurements, key=lambda m: (m.batch, m.context, m.system)):
        ttft = f"{m.ttft_ms:.1f}" if m.ttft_ms is not None else "-"
        decode = f"{m.decode_ms_per_token:.2f}" if m.decode_ms_per_token is not None else "-"
        click.echo(f"{m.system:<32} {m.batch:>5} {m.context:>7} {ttft:>9} {decode:>16}")
    memory = [f"kvexport RSS {report.generator_rss_mb:.0f} / PSS {report.generator_pss_mb:.0f} MiB"]
    memory += [
        f"{system} RSS {m['rss_mb']:.0f} / PSS {m['pss_mb']:.0f} MiB"
        for system, m in report.variant_memory.items()
    ]
    click.echo(
        f"bandwidth {report.bandwidth_gb_s} GB/s; weights {report.weight_bytes / 1e6:.1f} MB; "
        + "; ".join(memory)
        + f" (process {report.rss_after_load_mb:.0f} MiB)"
    )
    for system, figures in report.speculation.items():
        click.echo(f"{system}: drafts accepted {100 * figures['acceptance_rate']:.0f}%, {figures['tokens_per_call']} tokens per call")
    click.echo("ratios: " + ", ".join(f"{k} {v}" for k, v in report.ratios().items()))
    click.echo(f"wrote {results / 'bench.json'} and {results / 'bench.png'}")
