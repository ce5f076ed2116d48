"""What ONNX Runtime's CUDA provider takes, checked without a GPU.

A graph that loads and runs on the CPU provider can still fail on CUDA: in December 2026
every Llama-family ``ort-cuda`` export failed to load on an H200 because an extended-level
graph transformer of the CUDA provider (``GroupQueryAttentionFusion``) rewrote its
attention. Two things can be read off a graph here, with no GPU and no CUDA libraries:

- the shapes that CUDA's own graph transformers rewrite wrongly (:func:`fusion_findings`):
  a ``GroupQueryAttention`` without ``do_rotary`` whose query and key come from
  ``RotaryEmbedding`` ops reading ``MatMul`` / ``MatMulNBits`` directly and whose value
  comes from one, the pattern ``GroupQueryAttentionFusion`` matches; it rewires the node's
  first nine inputs and leaves any further input counted, so the session fails to load;
- which nodes have a CUDA kernel for their input types (:func:`kernel_findings`), from
  :data:`KERNELS_FILE`: the CUDA provider's kernels as ONNX Runtime's generated
  ``docs/OperatorKernels.md`` lists them (the source and commit are in the file). A node
  with none runs on the CPU provider, behind copies between the devices; an ONNX Runtime
  op (``com.microsoft``) with none is an error here, a standard op a note.

Of ONNX Runtime's graph transformers, ``GroupQueryAttentionFusion`` is the one registered
for the CUDA provider alone (``cuda_eps`` in ``graph_transformer_utils.cc``); every other
fusion is registered for the CPU provider too, so the CPU sessions the tests open run it on
every export. ``GpuOpsPrepack`` (CUDA only) re-lays fp16 4-bit ``MatMulNBits`` weights for
the SM80 kernels when a session asks for it. What still needs a GPU to see: that one, the
kernels' own runtime checks (shapes, head sizes, attributes a kernel refuses when it
runs), numbers and speed. ``kvexport export --target ort-cuda`` refuses a graph with an
error-level finding; ``kvexport check`` lists them for an ``ort-cuda`` export.
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import onnx

from kvexport.passes.vocabulary import GROUP_QUERY_ATTENTION, MS_DOMAIN, ROTARY_EMBEDDING

KERNELS_FILE = Path(__file__).with_name("cuda_kernels.json")
_PROJECTIONS = frozenset({"MatMul", "MatMulNBits"})
_ONNX_DOMAINS = ("", "ai.onnx")


@dataclass(frozen=True)
class CudaFinding:
    """One thing CUDA would do with a graph that the CPU provider does not: ``error`` or ``note``."""

    graph: str
    node: str
    level: str
    message: str

    def __str__(self) -> str:
        return f"{self.graph}: {self.node}: {self.message}"


@functools.cache
def cuda_kernels() -> dict[str, Any]:
    """The CUDA provider's kernel table (:data:`KERNELS_FILE`): ``{"source": ..., "kernels": {domain: {op: [...]}}}``."""
    loaded: dict[str, Any] = json.loads(KERNELS_FILE.read_text())
    return loaded


def fusion_findings(graph: onnx.GraphProto, name: str) -> list[CudaFinding]:
    """Each ``GroupQueryAttention`` that CUDA's ``GroupQueryAttentionFusion`` would rewrite (see the module docstring)."""
    producers = {output: node for node in graph.node for output in node.output}
    findings = []
    for node in graph.node:
        if node.op_type != GROUP_QUERY_ATTENTION or node.domain != MS_DOMAIN or len(node.input) < 3:
            continue
        attributes = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
        if attributes.get("do_rotary") == 1:
            continue
        query, key, value = (producers.get(i) for i in node.input[:3])
        rotated = [
            n for n in (query, key)
            if n is not None and n.op_type == ROTARY_EMBEDDING
            and (p := producers.get(n.input[0])) is not None and p.op_type in _PROJECTIONS
        ]
        if len(rotated) == 2 and value is not None and value.op_type in _PROJECTIONS:
            findings.append(CudaFinding(
                name, node.name or node.op_type, "error",
                f"ONNX Runtime's CUDA optimizer GroupQueryAttentionFusion rewrites this attention (query and key rotated "
                f"straight from their MatMuls, {len(node.input)} inputs) and the session fails to load; "
                "pack the projections (kvexport.passes.PackProjectionsPass)",
            ))
    return findings


def _types(graph: onnx.GraphProto) -> dict[str, str]:
    """Each value's element type as the kernel table spells it (``float16``, ``int64``...), where the graph records it."""
    known: dict[str, str] = {}
    for info in [*graph.input, *graph.output, *graph.value_info]:
        if info.type.HasField("tensor_type") and info.type.tensor_type.elem_type:
            known[info.name] = onnx.helper.tensor_dtype_to_string(info.type.tensor_type.elem_type)
    for tensor in graph.initializer:
        known[tensor.name] = onnx.helper.tensor_dtype_to_string(tensor.data_type)
    return {name: spelled.removeprefix("TensorProto.").lower() for name, spelled in known.items()}


def _admits(entry: dict[str, Any], types: list[str | None]) -> bool:
    """Whether one kernel of the table takes inputs of these types (None: not recorded, not checked)."""
    formals: list[str] = entry.get("inputs") or []
    for position, actual in enumerate(types):
        if actual is None or not formals:
            continue
        formal = formals[min(position, len(formals) - 1)]  # a variadic input repeats the last
        if formal.startswith("="):
            if formal[1:] != actual:
                return False
        elif formal in entry.get("types", {}) and actual not in entry["types"][formal]:
            return False
    return True


def kernel_findings(model: onnx.ModelProto, name: str) -> list[CudaFinding]:
    """Each node with no CUDA kernel for its opset and input types (see the module docstring)."""
    table: dict[str, dict[str, list[dict[str, Any]]]] = cuda_kernels()["kernels"]
    opsets = {(o.domain or "ai.onnx"): o.version for o in model.opset_import}
    types = _types(model.graph)
    findings = []
    for node in model.graph.node:
        domain = node.domain or "ai.onnx"
        version = opsets.get(domain, 1)
        entries = [
            e for e in table.get(domain, {}).get(node.op_type, [])
            if e["since"] <= version and (e.get("until") is None or version <= e["until"])
        ]
        actual = [types.get(i) if i else None for i in node.input]
        if entries and any(_admits(e, actual) for e in entries):
            continue
        level = "error" if domain == MS_DOMAIN else "note"
        if not table.get(domain, {}).get(node.op_type):
            what = "no CUDA kernel at all"
        elif not entries:
            what = f"no CUDA kernel for opset {version}"
        else:
            what = "no CUDA kernel for inputs (" + ", ".join(t or "?" for t in actual) + ")"
        findings.append(CudaFinding(
            name, node.name or node.op_type, level,
            f"{node.op_type} ({domain} opset {version}) has {what}; it runs on the CPU provider",
        ))
    return findings


def cuda_findings(directory: Path, graphs: tuple[str, ...] = ("prefill", "decode")) -> list[CudaFinding]:
    """Every finding for an export directory's graphs, read without their weights."""
    findings: list[CudaFinding] = []
    for graph in graphs:
        path = directory / f"{graph}.onnx"
        if not path.exists():
            continue
        model = onnx.load(str(path), load_external_data=False)
        findings += fusion_findings(model.graph, graph) + kernel_findings(model, graph)
    return findings
