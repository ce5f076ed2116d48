"""``kvexport inspect``: IO signature, op histogram and pass report of a graph or directory."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import onnx

from kvexport.bundle.manifest import GRAPH_NAMES, MANIFEST_FILE, read_manifest
from kvexport.bundle.storage import check_external_data, load_graph_structure
from kvexport.errors import KvexportError
from kvexport.passes.cache_names import canonical_slot


@dataclass(frozen=True)
class TensorInfo:
    """A graph input or output as found in the file (any name, not only canonical ones)."""

    name: str
    dtype: str
    shape: list[int | str]


@dataclass
class GraphInfo:
    """What one ``.onnx`` file holds."""

    file: str
    opset: int
    nodes: int
    inputs: list[TensorInfo]
    outputs: list[TensorInfo]
    ops: dict[str, int]
    initializer_bytes_external: int = 0
    # e.g. external data pointing outside the graph's directory (which kvexport refuses to load)
    warnings: list[str] = field(default_factory=list)


@dataclass
class InspectReport:
    """``inspect`` result: graphs, and for a directory the manifest's summary and passes."""

    path: str
    graphs: dict[str, GraphInfo]
    manifest: dict[str, Any] | None = None
    passes: list[dict[str, Any]] = field(default_factory=list)


def _tensor_info(value: onnx.ValueInfoProto) -> TensorInfo:
    tensor_type = value.type.tensor_type
    dtype = (
        onnx.helper.tensor_dtype_to_np_dtype(tensor_type.elem_type).name
        if tensor_type.elem_type
        else "?"
    )
    shape: list[int | str] = [
        d.dim_param if d.dim_param else d.dim_value for d in tensor_type.shape.dim
    ]
    return TensorInfo(value.name, dtype, shape)


def graph_info(path: Path) -> GraphInfo:
    """Describe one graph file without reading its weights."""
    proto = load_graph_structure(path)
    ops = Counter(
        f"{node.domain}.{node.op_type}" if node.domain not in ("", "ai.onnx") else node.op_type
        for node in proto.graph.node
    )
    opset = next((o.version for o in proto.opset_import if o.domain in ("", "ai.onnx")), 0)
    external = 0
    for tensor in proto.graph.initializer:
        if tensor.data_location == onnx.TensorProto.EXTERNAL:
            external += int(next((e.value for e in tensor.external_data if e.key == "length"), "0"))
    warnings = []
    try:
        check_external_data(path, proto)
    except KvexportError as exc:
        warnings.append(str(exc))
    return GraphInfo(
        file=path.name,
        opset=opset,
        nodes=len(proto.graph.node),
        inputs=[_tensor_info(v) for v in proto.graph.input],
        outputs=[_tensor_info(v) for v in proto.graph.output],
        ops=dict(ops.most_common()),
        initializer_bytes_external=external,
        warnings=warnings,
    )


def folded_tensors(tensors: list[TensorInfo]) -> list[tuple[str, str, list[int | str]]]:
    """``(name, dtype, shape)`` rows with the cache folded: one row per direction, dtype and shape.

    ``present.0.key`` ... ``present.11.value`` of one shape read as
    ``present.{0..11}.key|value``, in the place of the first; any other tensor is its own row.
    """
    groups: dict[tuple[str, str, tuple[int | str, ...]], list[tuple[int, str]]] = {}
    order: list[TensorInfo | tuple[str, str, tuple[int | str, ...]]] = []
    for tensor in tensors:
        slot = canonical_slot(tensor.name)
        if slot is None:
            order.append(tensor)
            continue
        key = (slot.direction, tensor.dtype, tuple(tensor.shape))
        if key not in groups:
            groups[key] = []
            order.append(key)
        groups[key].append((slot.layer, str(slot.kind)))
    rows: list[tuple[str, str, list[int | str]]] = []
    for item in order:
        if isinstance(item, TensorInfo):
            rows.append((item.name, item.dtype, item.shape))
            continue
        direction, dtype, shape = item
        layers = sorted({layer for layer, _ in groups[item]})
        kinds = "|".join(k for k in ("key", "value") if any(kind == k for _, kind in groups[item]))
        contiguous = len(layers) > 1 and layers == list(range(layers[0], layers[-1] + 1))
        span = f"{{{layers[0]}..{layers[-1]}}}" if contiguous else ",".join(map(str, layers))
        rows.append((f"{direction}.{span}.{kinds}", dtype, list(shape)))
    return rows


def inspect_path(path: str | Path) -> InspectReport:
    """Inspect an export directory (manifest + both graphs) or a single ``.onnx`` file."""
    target = Path(path)
    if target.is_dir():
        if not (target / MANIFEST_FILE).is_file():
            raise KvexportError(
                f"{target}: no {MANIFEST_FILE}; pass an export directory or an .onnx file"
            )
        manifest = read_manifest(target)
        graphs = {name: graph_info(target / manifest.graphs[name].file) for name in GRAPH_NAMES}
        data = manifest.to_dict()
        summary = {
            "source": data["model"]["source"],
            "family": data["model"]["family"],
            "dims": data["model"]["dims"],
            "dtype": data["dtype"],
            "opset": data["opset"],
            "target": data["target"],
            "attention": data["attention"],
            "cache_layout": manifest.cache_layout,
            "strategy": data["export"].get("strategy"),
            "weights": data["weights"],
            "tokenizer": data["tokenizer"],
            "quantization": data["quantization"],
            "verify": data["verify"],
        }
        return InspectReport(str(target), graphs, summary, manifest.passes)
    if not target.exists():
        raise KvexportError(f"{target}: no such file or directory")
    return InspectReport(str(target), {target.stem: graph_info(target)})
