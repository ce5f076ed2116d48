"""``kvexport check``: an export checked without torch (:func:`kvexport.tools.check.check`)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import click

from kvexport.cli.base import EXIT_FAILED_CHECKS, json_option, main, progress, provider_option, run


@main.command("check")
@click.argument("directory", type=click.Path(path_type=Path))
@click.option("--steps", default=4, show_default=True, type=int, help="Greedy decode steps to run.")
@provider_option
@json_option
def check_command(directory: Path, steps: int, provider: str, as_json: bool) -> None:
    """Check DIRECTORY without torch: manifest, file hashes, graph IO, external data, a few steps.

    Exit 0 when every check holds, 1 when one fails, 2 when there is nothing to check.
    """
    from kvexport.tools.check import check

    report = run(lambda: check(directory, steps=steps, provider=provider, progress=progress))
    if as_json:
        click.echo(json.dumps(report.to_dict(), indent=2))
    else:
        for item in report.checks:
            click.echo(f"{'ok  ' if item.ok else 'FAIL'} {item.name:<22} {item.detail}")
        click.echo(f"{'PASS' if report.ok else 'FAIL'}: {report.directory}, {report.seconds:.1f} s")
    if not report.ok:
        sys.exit(EXIT_FAILED_CHECKS)
