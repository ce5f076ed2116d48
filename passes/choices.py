"""How attention is expressed: the one definition the passes and kvexport's options share.

Standard library only, so command-line parsing can list the choices without loading
onnx_ir or onnxscript.
"""

from __future__ import annotations

from enum import Enum


class Attention(str, Enum):
    """``unfused`` (decomposed MatMul/Softmax), ``onnx`` (opset-23 ``Attention``), ``ort`` (``com.microsoft``)."""

    UNFUSED = "unfused"
    ONNX = "onnx"
    ORT = "ort"
