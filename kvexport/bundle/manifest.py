"""The manifest ``kvexport.json``: everything a consumer needs to drive the graphs.

The runner and ``verify`` read only this file and the graphs, never the exporting
Python objects. :func:`check_graph_io` proves that the graphs on disk still have the
signature the manifest describes.
"""

from __future__ import annotations

import json
import os
import tempfile
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal

import onnx

from kvexport.bundle.model_info import ModelDims, ModelSource
from kvexport.bundle.storage import file_mode
from kvexport.errors import ManifestError
from kvexport.passes.cache_names import cache_names, canonical_slot

MANIFEST_FILE = "kvexport.json"
FORMAT = "kvexport"
FORMAT_VERSION = 2
# versions read: 1 stored GPT-2's config keys as the dims (read as the generic ones)
READABLE_VERSIONS = (1, 2)
GRAPH_NAMES = ("prefill", "decode")

Role = Literal[
    "input_ids",
    "attention_mask",
    "position_ids",
    "logits",
    "past_key",
    "past_value",
    "present_key",
    "present_value",
]
_PLAIN_ROLES = ("input_ids", "attention_mask", "position_ids", "logits")

Dim = int | str


@dataclass(frozen=True)
class TensorSpec:
    """One graph input or output: name, role, dtype and symbolic shape."""

    name: str
    role: Role
    dtype: str
    shape: list[Dim]
    layer: int | None = None

    @classmethod
    def from_value_info(cls, value: onnx.ValueInfoProto) -> TensorSpec:
        """Describe an ONNX graph input/output, inferring its role from its name."""
        role, layer = role_of(value.name)
        tensor_type = value.type.tensor_type
        dtype = onnx.helper.tensor_dtype_to_np_dtype(tensor_type.elem_type).name
        shape: list[Dim] = [
            d.dim_param if d.dim_param else d.dim_value for d in tensor_type.shape.dim
        ]
        return cls(name=value.name, role=role, dtype=dtype, shape=shape, layer=layer)


def role_of(name: str) -> tuple[Role, int | None]:
    """Role and layer of a canonical IO name; a ManifestError for any other name."""
    if name in _PLAIN_ROLES:
        return name, None  # type: ignore[return-value]
    slot = canonical_slot(name)
    if slot is None:
        raise ManifestError(f"graph IO name {name!r} is not part of kvexport's contract")
    return f"{slot.direction}_{slot.kind}", slot.layer  # type: ignore[return-value]


@dataclass(frozen=True)
class GraphSpec:
    """One graph file and its full signature."""

    file: str
    inputs: list[TensorSpec]
    outputs: list[TensorSpec]
    nodes: int

    @classmethod
    def from_proto(cls, file: str, proto: onnx.ModelProto) -> GraphSpec:
        """Describe a graph from its proto (structure only)."""
        return cls(
            file=file,
            inputs=[TensorSpec.from_value_info(v) for v in proto.graph.input],
            outputs=[TensorSpec.from_value_info(v) for v in proto.graph.output],
            nodes=len(proto.graph.node),
        )

    @classmethod
    def from_model(cls, file: str, model: Any) -> GraphSpec:
        """Describe an in-memory ``onnx_ir.Model`` as :meth:`from_proto` describes its saved proto."""
        import onnx_ir as ir

        return cls(
            file=file,
            inputs=[TensorSpec.from_value_info(ir.serde.serialize_value(v)) for v in model.graph.inputs],
            outputs=[TensorSpec.from_value_info(ir.serde.serialize_value(v)) for v in model.graph.outputs],
            nodes=len(model.graph),
        )

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> GraphSpec:
        """Inverse of ``asdict``."""
        return cls(
            file=data["file"],
            inputs=[TensorSpec(**t) for t in data["inputs"]],
            outputs=[TensorSpec(**t) for t in data["outputs"]],
            nodes=int(data["nodes"]),
        )


@dataclass
class Manifest:
    """The parsed ``kvexport.json``."""

    source: ModelSource
    dims: ModelDims
    dtype: str
    opset: int
    target: str
    attention: str
    all_logits: bool
    graphs: dict[str, GraphSpec]
    weights: dict[str, Any]
    export: dict[str, Any]
    weights_sha256: str
    tokenizer: dict[str, Any]
    passes: list[dict[str, Any]] = field(default_factory=list)
    versions: dict[str, str] = field(default_factory=dict)
    verify: dict[str, Any] | None = None
    # "concat": present = past + the new rows, a new tensor each step (the portable contract);
    # "shared-buffer": past and present are one [batch, H, capacity, D] buffer the caller
    # binds to both, updated in place; prefill takes the (empty) buffers as past inputs too.
    cache: dict[str, Any] = field(default_factory=lambda: {"layout": "concat"})
    # None for float weights; else {"scheme": "int8"|"int4", the QuantizationConfig knobs,
    # "tolerances": what verify holds the export to against PyTorch fp32}.
    quantization: dict[str, Any] | None = None
    # file name -> {"bytes", "sha256"} of every file the export wrote but this one
    files: dict[str, dict[str, Any]] | None = None
    # onnxruntime-genai: {"written": True, "files": [...]} or {"written": False, "why": ...}
    genai: dict[str, Any] | None = None
    # the model family (a key of kvexport.models.FAMILIES) whose module rebuilds the reference
    family: str = "gpt2"

    @property
    def cache_layout(self) -> str:
        """``concat`` or ``shared-buffer`` (see ``cache``)."""
        return str(self.cache.get("layout", "concat"))

    @property
    def cache_dtype(self) -> str:
        """The cache tensors' kind: the graph's ``dtype`` (fp32, fp16) unless ``cache`` says int8 or int4."""
        return str(self.cache.get("dtype", self.dtype))

    def to_dict(self) -> dict[str, Any]:
        """The JSON object written to ``kvexport.json``."""
        return {
            "format": FORMAT,
            "format_version": FORMAT_VERSION,
            "model": {
                "family": self.family,
                "source": self.source.to_dict(),
                "dims": self.dims.to_dict(),
                "weights_sha256": self.weights_sha256,
            },
            "dtype": self.dtype,
            "opset": self.opset,
            "target": self.target,
            "attention": self.attention,
            "all_logits": self.all_logits,
            "graphs": {name: asdict(spec) for name, spec in self.graphs.items()},
            "weights": self.weights,
            "tokenizer": self.tokenizer,
            "export": self.export,
            "cache": self.cache,
            "quantization": self.quantization,
            "files": self.files,
            "genai": self.genai,
            "passes": self.passes,
            "versions": self.versions,
            "verify": self.verify,
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Manifest:
        """Parse and validate; raises ManifestError naming the first problem."""
        if data.get("format") != FORMAT:
            raise ManifestError(
                'not a kvexport manifest (no "format": "kvexport"); re-export the model'
            )
        if data.get("format_version") not in READABLE_VERSIONS:
            raise ManifestError(
                f"manifest format_version {data.get('format_version')!r} is not supported by this "
                f"kvexport (reads {FORMAT_VERSION}); re-export with this version"
            )
        try:
            model = data["model"]
            graphs = {name: GraphSpec.from_dict(data["graphs"][name]) for name in GRAPH_NAMES}
            return cls(
                source=ModelSource.from_dict(model["source"]),
                dims=ModelDims.from_dict(model.get("dims") or model["config"]),
                family=str(model.get("family", "gpt2")),
                dtype=data["dtype"],
                opset=int(data["opset"]),
                target=data["target"],
                attention=data["attention"],
                all_logits=bool(data["all_logits"]),
                graphs=graphs,
                weights=data["weights"],
                export=data["export"],
                weights_sha256=model["weights_sha256"],
                tokenizer=data["tokenizer"],
                passes=data.get("passes", []),
                versions=data.get("versions", {}),
                verify=data.get("verify"),
                cache=data.get("cache", {"layout": "concat"}),
                quantization=data.get("quantization"),
                files=data.get("files"),
                genai=data.get("genai"),
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise ManifestError(
                f"manifest is incomplete or malformed (problem at {exc}); re-export the model"
            ) from exc

    def write(self, directory: Path) -> None:
        """Write ``kvexport.json`` atomically (temporary file, then rename)."""
        text = json.dumps(self.to_dict(), indent=2) + "\n"
        fd, tmp = tempfile.mkstemp(prefix=".kvexport.json.", dir=directory)
        try:
            with os.fdopen(fd, "w") as handle:
                handle.write(text)
            os.chmod(tmp, file_mode())
            os.replace(tmp, directory / MANIFEST_FILE)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise


def read_manifest(directory: Path) -> Manifest:
    """Read ``DIR/kvexport.json``; one clear ManifestError for each way it can be wrong."""
    if not directory.is_dir():
        raise ManifestError(
            f"{directory}: no such directory; pass a directory made by `kvexport export` or `kvexport import`"
        )
    path = directory / MANIFEST_FILE
    if not path.is_file():
        raise ManifestError(
            f"{directory}: no {MANIFEST_FILE}; pass a directory made by `kvexport export` or `kvexport import`"
        )
    try:
        data = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ManifestError(f"{path}: not valid JSON ({exc}); re-export the model") from exc
    if not isinstance(data, dict):
        raise ManifestError(f"{path}: not a JSON object; re-export the model")
    return Manifest.from_dict(data)


def check_graph_io(manifest: Manifest, graph: str, proto: onnx.ModelProto) -> list[str]:
    """Differences between a graph's real signature and the manifest's (empty when they agree).

    Also checks the contract itself: the cache entries match the manifest's layer count.
    """
    spec = manifest.graphs[graph]
    actual = GraphSpec.from_proto(spec.file, proto)
    problems: list[str] = []
    for kind, expected, found in (
        ("input", spec.inputs, actual.inputs),
        ("output", spec.outputs, actual.outputs),
    ):
        expected_by_name = {t.name: t for t in expected}
        found_by_name = {t.name: t for t in found}
        for name in expected_by_name.keys() - found_by_name.keys():
            problems.append(f"{graph}: {kind} {name} is in the manifest but not in the graph")
        for name in found_by_name.keys() - expected_by_name.keys():
            problems.append(f"{graph}: {kind} {name} is in the graph but not in the manifest")
        for name in expected_by_name.keys() & found_by_name.keys():
            want, got = expected_by_name[name], found_by_name[name]
            if (want.dtype, list(want.shape)) != (got.dtype, list(got.shape)):
                problems.append(
                    f"{graph}: {kind} {name} is {got.dtype}{got.shape} in the graph, "
                    f"{want.dtype}{want.shape} in the manifest"
                )
    n_layer = manifest.dims.num_layers
    expected_present = cache_names("present", n_layer)
    if [t.name for t in actual.outputs if t.layer is not None] != expected_present:
        problems.append(f"{graph}: present outputs do not match the manifest's {n_layer} layers")
    past_inputs = [t.name for t in actual.inputs if t.layer is not None]
    takes_past = graph == "decode" or manifest.cache_layout == "shared-buffer"
    if takes_past and past_inputs != cache_names("past", n_layer):
        problems.append(f"{graph}: past inputs do not match the manifest's {n_layer} layers")
    if not takes_past and past_inputs:
        problems.append("prefill: takes past inputs; prefill and decode graphs may be swapped")
    return problems
