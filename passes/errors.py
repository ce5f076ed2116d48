"""The one base of every "this graph can't take this pass" error.

A pass checks what it needs of a graph in ``requires()`` (``onnx_ir``'s precondition hook,
run before the pass changes anything) and raises a :class:`PassInputError` naming what is
missing; ``kvexport rewrite`` and ``kvexport import`` turn it into one line and exit 2 with
nothing written. It is a ``PreconditionError`` (``onnx_ir`` passes it on as it is) and a
``ValueError`` (what callers caught before it existed).
"""

from __future__ import annotations

from onnx_ir.passes import PreconditionError


class PassInputError(PreconditionError, ValueError):
    """A graph a pass can't take, in one line that says what it lacks and what to do."""
