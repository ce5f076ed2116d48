"""The ``kvexport`` command: a thin click layer over the library (parse, call, render), one module per command.

:mod:`kvexport.cli.base` holds the group and what every command shares; each command's
module registers it on :func:`main` when imported here.
"""

from __future__ import annotations

from kvexport.cli import (  # noqa: F401  # each registers its command on main
    bench,
    check,
    export,
    generate,
    import_graph,
    inspect,
    kernels,
    rewrite,
    serve,
    verify,
)
from kvexport.cli.base import main

__all__ = ["main"]
