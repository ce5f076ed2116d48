"""Pre-packed weights that prefill and decode share, for ONNX Runtime on CPU.

ONNX Runtime's CPU GEMM kernels re-lay each weight matrix into a packed form when a
session loads ("pre-packing"); that is what makes them fast. Each session packs its own
copy, so prefill and decode together hold about 2.3x the weight bytes, and the Python
API offers no way to share one packed copy between sessions.

ONNX Runtime can, however, write the packed blobs into an optimized model's external
data file and later load them from it by memory mapping. This module builds such a
cache for an export directory, once per machine:

1. each graph is optimized and saved by ONNX Runtime with its pre-packed weights;
2. the two data files are merged into one, every region deduplicated by content (the
   weights and their packed forms are identical in both graphs) and 4 KiB-aligned;
3. both graphs are rewritten to point into that one file.

Both sessions then map the same file: the physical memory is one copy of the packed
weights plus the unpacked tensors they still read (embeddings, norms), about 1.3-1.4x
the weight bytes for GPT-2 124M. The pages are clean and file-backed, so the kernel can
drop and re-read them under memory pressure. Note that RSS counts a page once per
mapping, and each session maps the file itself, so RSS shows about twice what is
resident; PSS (``/proc/<pid>/smaps_rollup``) shows the real figure.

The packed layout depends on the CPU's instruction set and ONNX Runtime's version, so
the cache is keyed by both (and by the graphs' bytes) and lives under
``<export>/.ort-prepacked/<key>/`` unless another root is given. It is built in a child
process, so the transient memory of building never stays in the caller's.
"""

from __future__ import annotations

import functools
import hashlib
import os
import platform
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort

from kvexport.bundle.manifest import GRAPH_NAMES, Manifest, read_manifest
from kvexport.errors import KvexportError, first_line
from kvexport.runtime.kernels import library_path
from kvexport.runtime.session import (
    CPU_REWRITES_VERSION,
    cpu_flags_line,
    cpu_graph,
    disabled_optimizers,
    prompt_attention_products,
    session_options,
    signed_int8_weights,
)

CACHE_DIR = ".ort-prepacked"
DATA_FILE = "weights.prepacked.data"
_ALIGN = 4096  # mmap granularity; MLAS also reads packed blobs with aligned loads


def _cpu_signature() -> str:
    """What the packed layout depends on besides ONNX Runtime: machine and ISA flags."""
    flags = cpu_flags_line()
    return f"{platform.machine()} {platform.processor().strip() if flags is None else flags}"


def cache_key(directory: Path, manifest: Manifest) -> str:
    """A key that changes with ONNX Runtime's version, the CPU, the graphs and the weights."""
    digest = hashlib.sha256()
    kernel = "u8s8" if signed_int8_weights() else "u8u8"  # how 8-bit per-channel weights are packed
    attention = "products" if prompt_attention_products() else "gqa"  # how a prompt's attention runs
    rewrites = f"rewrites {CPU_REWRITES_VERSION}"
    library = library_path()  # kvexport's decode kernel, where it is built, and which build
    kernels = "no kernels" if library is None else hashlib.sha256(library.read_bytes()).hexdigest()
    digest.update(f"ort {ort.__version__}\n{_cpu_signature()}\n{kernel}\n{attention}\n{rewrites}\n{kernels}\n{manifest.weights_sha256}\n".encode())
    for graph in GRAPH_NAMES:
        digest.update((directory / manifest.graphs[graph].file).read_bytes())
    return f"ort{ort.__version__}-{digest.hexdigest()[:16]}"


def prepacked_graphs(directory: str | Path, cache_root: str | Path | None = None) -> dict[str, Path]:
    """The pre-packed prefill/decode graphs for ``directory``, built (in a child process) if missing.

    Raises :class:`KvexportError` with one line when the cache can't be written or built.
    """
    directory = Path(directory)
    manifest = read_manifest(directory)
    root = Path(cache_root) if cache_root is not None else directory / CACHE_DIR
    target = root / cache_key(directory, manifest)
    paths = {graph: target / f"{graph}.onnx" for graph in GRAPH_NAMES}
    if all(p.is_file() for p in paths.values()) and (target / DATA_FILE).is_file():
        return paths
    try:
        root.mkdir(parents=True, exist_ok=True)
        probe = tempfile.NamedTemporaryFile(dir=root, prefix=".probe-")
        probe.close()
    except OSError as exc:
        raise KvexportError(
            f"{root}: can't write the pre-packed weights cache there ({exc.strerror or exc}); "
            "pass another cache directory"
        ) from exc
    child = subprocess.run(
        [sys.executable, "-m", "kvexport.runtime.prepacked", str(directory), str(target)],
        capture_output=True,
        text=True,
        check=False,
    )
    if child.returncode != 0 or not all(p.is_file() for p in paths.values()):
        lines = [line for line in child.stderr.splitlines() if line.strip()]
        raise KvexportError(
            f"{directory}: building the pre-packed weights failed ({lines[-1] if lines else child.returncode})"
        )
    return paths


def build(directory: Path, target: Path) -> None:
    """Optimize both graphs with their packed weights, then merge the data into one file."""
    manifest = read_manifest(directory)
    target.parent.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(dir=target.parent, prefix=".building-"))
    try:
        for graph in GRAPH_NAMES:
            options = session_options()
            options.optimized_model_filepath = str(work / f"{graph}.opt.onnx")
            options.add_session_config_entry(
                "session.optimized_model_external_initializers_file_name", f"{graph}.opt.data"
            )
            options.add_session_config_entry(
                "session.optimized_model_external_initializers_min_size_in_bytes", "1024"
            )
            options.add_session_config_entry("session.save_external_prepacked_constant_initializers", "1")
            options.log_severity_level = 3  # the "hardware specific" warning is why the cache is keyed
            path = directory / manifest.graphs[graph].file
            ort.InferenceSession(
                cpu_graph(path, options), options, providers=["CPUExecutionProvider"], disabled_optimizers=disabled_optimizers("cpu")
            )
        final = work / "final"
        final.mkdir()
        _merge(work, final)
        try:
            os.replace(final, target)
        except OSError:
            if not target.is_dir():  # another process may have finished the same cache first
                raise
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _merge(work: Path, final: Path) -> None:
    """Write ``final/DATA_FILE`` (every region once, aligned) and graphs that point into it."""
    models = {g: onnx.load(str(work / f"{g}.opt.onnx"), load_external_data=False) for g in GRAPH_NAMES}
    sources: dict[str, np.memmap] = {}
    placed: dict[tuple[str, int], int] = {}  # (sha256, length) -> offset in the merged file
    regions: list[tuple[int, np.ndarray]] = []
    size = 0

    def place(location: str, offset: int, length: int) -> int:
        nonlocal size
        if location not in sources:
            sources[location] = np.memmap(work / location, dtype=np.uint8, mode="r")
        data = sources[location][offset : offset + length]
        if data.size != length:
            raise KvexportError(f"{location}: region {offset}+{length} runs past the file's end")
        key = (hashlib.sha256(data.data).hexdigest(), length)
        if key not in placed:
            size += -size % _ALIGN
            placed[key] = size
            regions.append((size, data))
            size += length
        return placed[key]

    for model in models.values():
        for tensor in model.graph.initializer:
            entries = {e.key: e.value for e in tensor.external_data}
            if "location" not in entries:
                continue
            location = entries["location"]
            rewritten = dict(entries, location=DATA_FILE)
            rewritten["offset"] = str(place(location, int(entries.get("offset", 0)), int(entries["length"])))
            for key, value in entries.items():
                if key.startswith("prepacked_"):
                    rewritten[key] = _relocate(value, functools.partial(place, location))
            del tensor.external_data[:]
            for key, value in rewritten.items():
                entry = tensor.external_data.add()
                entry.key, entry.value = key, value
    with open(final / DATA_FILE, "wb") as out:
        for offset, data in regions:
            out.seek(offset)
            out.write(data.tobytes())
    for graph, model in models.items():
        (final / f"{graph}.onnx").write_bytes(model.SerializeToString())


def _relocate(value: str, place: Callable[[int, int], int]) -> str:
    """Rewrite ``"<kernel key>|offset;length;checksum|..."`` (ONNX Runtime's form) to new offsets."""
    kernel, *blobs = value.split("|")
    moved = []
    for blob in blobs:
        fields = blob.split(";")
        if not kernel or len(fields) != 3 or not fields[0].isdigit() or not fields[1].isdigit():
            raise KvexportError(
                f"ONNX Runtime {ort.__version__} saved pre-packed weights as {value[:80]!r}, a form "
                "kvexport does not know; use share_weights instead"
            )
        offset = place(int(fields[0]), int(fields[1]))
        moved.append(f"{offset};{fields[1]};{fields[2]}")
    return "|".join([kernel, *moved])


def _main(argv: list[str]) -> int:
    try:
        build(Path(argv[0]), Path(argv[1]))
    except Exception as exc:  # one line for the parent, which raises it as a KvexportError
        print(f"{type(exc).__name__}: {first_line(exc)}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(_main(sys.argv[1:]))
