"""Files on disk: atomic output directories, shared external weights, safe graph loading."""

from __future__ import annotations

import contextlib
import hashlib
import os
import shutil
import tempfile
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import onnx

from kvexport.errors import TERMINATING, KvexportError, ManifestError, Terminated, first_line

if TYPE_CHECKING:  # the runtime reads graphs with onnx alone; onnx_ir is the exporter's
    import onnx_ir as ir

WEIGHTS_FILE = "weights.onnx.data"
# Tensors smaller than this stay inside the graph (shape constants and the like).
EXTERNAL_THRESHOLD_BYTES = 1024
# Large tensors start on a page boundary so ONNX Runtime can map them directly.
ALIGNMENT = 4096


def check_output_dir(out: Path, force: bool) -> None:
    """Refuse an existing non-empty ``out`` unless ``force``; refuse a file in its place.

    Missing parent directories are fine (:func:`created_parents` makes them), but a parent
    that exists as a file is refused.
    """
    if out.exists() and not out.is_dir():
        raise KvexportError(f"--out {out}: exists and is not a directory; choose another path")
    if out.is_dir() and any(out.iterdir()) and not force:
        raise KvexportError(
            f"--out {out}: directory exists and is not empty; pass --force to replace it, "
            "or choose another path"
        )
    check_parent_path(out, "--out ")


def check_parent_path(path: Path, label: str = "") -> None:
    """Refuse ``path`` when one of its ancestors exists but is not a directory."""
    for parent in path.absolute().parents:
        if parent.exists():
            if not parent.is_dir():
                raise KvexportError(
                    f"{label}{path}: {parent} is not a directory; choose another path"
                )
            return


@contextlib.contextmanager
def created_parents(path: Path) -> Iterator[None]:
    """Create ``path``'s missing parent directories; remove them again if the block fails.

    Like ``mkdir -p`` for the parents, so ``--out new/dir/model`` works on a fresh clone;
    a failed or interrupted write leaves the file system as it found it.
    """
    missing = []
    for parent in path.absolute().parents:
        if parent.exists():
            break
        missing.append(parent)
    for parent in reversed(missing):
        parent.mkdir(exist_ok=True)
    try:
        yield
    except BaseException:
        for parent in missing:  # deepest first; stop at one someone else filled meanwhile
            try:
                parent.rmdir()
            except OSError:
                break
        raise


@contextlib.contextmanager
def atomic_output_dir(out: Path, force: bool) -> Iterator[Path]:
    """Yield a temporary sibling of ``out``; on success it replaces ``out`` in one rename.

    Missing parents of ``out`` are created. On any exception (Ctrl-C included) the
    temporary directory and any parents it created are removed, and ``out`` is left
    exactly as it was. An existing ``out`` is replaced only with ``force``.
    """
    out = out.absolute()
    check_output_dir(out, force)
    with created_parents(out), _atomic_rename_into(out, force) as tmp:
        yield tmp


@contextlib.contextmanager
def _atomic_rename_into(out: Path, force: bool) -> Iterator[Path]:
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    tmp.chmod(0o777 & ~_umask())  # mkdtemp makes it private; the result is an ordinary directory
    try:
        yield tmp
        if TERMINATING.is_set():  # a SIGTERM whose exception something swallowed
            raise Terminated
        check_output_dir(out, force)  # it may have appeared while we worked
        if out.exists():
            backup = Path(tempfile.mkdtemp(prefix=f".{out.name}.old-", dir=out.parent))
            os.rename(out, backup / out.name)
            try:
                os.rename(tmp, out)
            except BaseException:
                os.rename(backup / out.name, out)
                raise
            shutil.rmtree(backup, ignore_errors=True)
        else:
            os.rename(tmp, out)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


def _umask() -> int:
    current = os.umask(0)
    os.umask(current)
    return current


def file_mode() -> int:
    """Permission bits of an ordinary new file under the current umask."""
    return 0o666 & ~_umask()


@dataclass(frozen=True)
class WeightsInfo:
    """What :func:`save_with_shared_weights` wrote to the weights file."""

    file: str
    bytes: int
    tensors: int
    references: int


def save_with_shared_weights(graphs: Mapping[str, ir.Model], out_dir: Path) -> WeightsInfo:
    """Save each graph as ``<name>.onnx`` with all large initializers in one shared file.

    Initializers are deduplicated by their bytes, so a weight used by both graphs, or twice
    in one graph, is stored once; so are the same bytes under two shapes (a quantized LM
    head and the tied embedding that reads it as a table). The graphs refer to it by
    offset, each with its own dtype and shape.
    Works for models past protobuf's 2 GB limit, since no tensor bytes enter a proto.
    """
    import onnx_ir as ir

    weights_path = out_dir / WEIGHTS_FILE
    stored: dict[str, tuple[int, int]] = {}
    references = 0
    with open(weights_path, "wb") as weights:
        for model in graphs.values():
            for value in model.graph.initializers.values():
                tensor = value.const_value
                if tensor is None:
                    continue
                if tensor.nbytes < EXTERNAL_THRESHOLD_BYTES:
                    if isinstance(tensor, ir.ExternalTensor):  # small, but in the source's file: into the graph
                        value.const_value = ir.Tensor(tensor.numpy(), name=value.name or "")
                    continue
                data = tensor.tobytes()
                key = hashlib.sha256(data).hexdigest()
                if key not in stored:
                    offset = -(-weights.tell() // ALIGNMENT) * ALIGNMENT
                    weights.write(b"\0" * (offset - weights.tell()))
                    weights.write(data)
                    stored[key] = (offset, len(data))
                offset, length = stored[key]
                value.const_value = ir.ExternalTensor(
                    WEIGHTS_FILE,
                    offset,
                    length,
                    tensor.dtype,
                    shape=ir.Shape(tensor.shape.numpy()),
                    name=value.name or "",
                    base_dir=out_dir,
                )
                references += 1
                del data
        total = weights.tell()
    for name, model in graphs.items():
        ir.save(model, out_dir / f"{name}.onnx")
    return WeightsInfo(file=WEIGHTS_FILE, bytes=total, tensors=len(stored), references=references)


def check_external_data(graph_path: Path, proto: onnx.ModelProto | None = None) -> onnx.ModelProto:
    """Load a graph's structure (no weights) and refuse external data outside its directory.

    Every external location must be a relative path that stays inside the graph's
    directory after resolving links, and must exist. This runs before ONNX Runtime reads
    a byte, so a crafted graph cannot make it read ``/etc/shadow`` or ``../../secret``.
    """
    if proto is None:
        proto = load_graph_structure(graph_path)
    base = graph_path.parent.resolve()
    for tensor in _external_tensors(proto):
        location = next((e.value for e in tensor.external_data if e.key == "location"), "")
        target = (base / location).resolve()
        if os.path.isabs(location) or not target.is_relative_to(base):
            raise ManifestError(
                f"{graph_path}: initializer {tensor.name!r} points outside the model directory "
                f"({location!r}); refusing to load it"
            )
        if not target.is_file():
            raise ManifestError(
                f"{graph_path}: external weights file {location!r} is missing; re-export the model"
            )
    return proto


def load_graph_structure(graph_path: Path) -> onnx.ModelProto:
    """Parse an ONNX file without reading its external data; one clear error if it is not ONNX."""
    if not graph_path.is_file():
        raise ManifestError(f"{graph_path}: graph file is missing; re-export the model")
    try:
        return onnx.load(str(graph_path), load_external_data=False)
    except Exception as exc:  # protobuf raises DecodeError and others
        raise ManifestError(
            f"{graph_path}: not a readable ONNX graph ({type(exc).__name__}); re-export the model"
        ) from exc


def _external_tensors(proto: onnx.ModelProto) -> Iterator[onnx.TensorProto]:
    for tensor in proto.graph.initializer:
        if tensor.data_location == onnx.TensorProto.EXTERNAL:
            yield tensor
    for node in proto.graph.node:
        for attribute in node.attribute:
            if attribute.HasField("t") and attribute.t.data_location == onnx.TensorProto.EXTERNAL:
                yield attribute.t


def load_graph(source: Path) -> ir.Model:
    """Load an ``.onnx`` graph after checking its external data stays in its directory; one clear error otherwise."""
    if not source.exists():
        raise KvexportError(f"{source}: no such file; pass an .onnx graph")
    if source.is_dir():
        raise KvexportError(f"{source}: is a directory; pass an .onnx graph file")
    import onnx_ir as ir

    check_external_data(source)
    try:
        return ir.load(source)
    except Exception as exc:  # onnx / protobuf raise many kinds
        raise KvexportError(f"{source}: not a readable ONNX graph ({first_line(exc)})") from exc
