"""``kvexport build-kernels``: kvexport's CPU kernels for ONNX Runtime (:func:`kvexport.runtime.kernels.build`)."""

from __future__ import annotations

from pathlib import Path

import click

from kvexport.cli.base import main, run


@main.command("build-kernels")
@click.option(
    "--ort-include",
    type=click.Path(path_type=Path, file_okay=False),
    default=None,
    help="A folder with ONNX Runtime's onnxruntime_cxx_api.h [default: ONNX Runtime 1.21's, which kvexport carries].",
)
@click.option("--out", type=click.Path(path_type=Path, dir_okay=False), default=None, help="Where to write the library [default: the cache the runtime looks in].")
def build_kernels_command(ort_include: Path | None, out: Path | None) -> None:
    """Build kvexport's CPU kernels (attention over the in-place fp32 cache, bf16 prompt products on AMX) for ONNX Runtime; CPU sessions use them once built."""
    from kvexport.runtime.kernels import KERNELS_VARIABLE, build, default_library

    library = run(lambda: build(ort_include, out))
    click.echo(f"built {library}")
    if library != default_library():
        click.echo(f"  the runtime uses it with {KERNELS_VARIABLE}={library}")
