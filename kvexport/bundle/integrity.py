"""Integrity of an export directory without torch: file hashes, external data, graph IO.

The manifest records the size and sha256 of every file the export wrote (``files``), so a
copy on a deployment machine can be checked with onnxruntime alone. :func:`preflight` is
the one place that loads a directory's manifest and checks it before anything runs: the
Generator, ``kvexport check`` (:mod:`kvexport.tools.check`) and ``verify`` all call it, and
each decides what a problem means for it (refuse, report, or fail the verdict).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import onnx

from kvexport.bundle.manifest import (
    GRAPH_NAMES,
    MANIFEST_FILE,
    Manifest,
    check_graph_io,
    read_manifest,
)
from kvexport.bundle.storage import check_external_data
from kvexport.errors import KvexportError, ManifestError

_CHUNK = 1 << 22


def file_digest(path: Path) -> dict[str, Any]:
    """``{"bytes": size, "sha256": hex}`` of one file, read in chunks."""
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while chunk := handle.read(_CHUNK):
            digest.update(chunk)
    return {"bytes": path.stat().st_size, "sha256": digest.hexdigest()}


def record_files(directory: Path) -> dict[str, dict[str, Any]]:
    """Size and sha256 of every regular file in ``directory`` but the manifest and hidden ones."""
    return {
        path.name: file_digest(path)
        for path in sorted(directory.iterdir())
        if path.is_file() and path.name != MANIFEST_FILE and not path.name.startswith(".")
    }


def file_problems(directory: Path, manifest: Manifest) -> list[str]:
    """One line per file that is missing, of another size, or with other bytes than recorded."""
    if not manifest.files:
        return [
            f"{directory}: the manifest records no file hashes (an export older than this kvexport); "
            "re-export the model to check it"
        ]
    problems = []
    for name, want in manifest.files.items():
        path = directory / name
        if not path.is_file():
            problems.append(f"{name}: missing; copy the whole export directory again")
            continue
        size = path.stat().st_size
        if size != want["bytes"]:
            problems.append(
                f"{name}: {size} bytes where the export wrote {want['bytes']} (truncated or replaced); "
                "copy it again"
            )
        elif file_digest(path)["sha256"] != want["sha256"]:
            problems.append(f"{name}: its sha256 differs from the one recorded (corrupted); copy it again")
    return problems


@dataclass
class Preflight:
    """What :func:`preflight` found in an export directory, before anything runs."""

    directory: Path
    manifest: Manifest
    # files whose size or sha256 differ from the manifest's record (empty when not hashed)
    file_problems: list[str] = field(default_factory=list)
    # graph -> its structure (no weights), for every graph whose external data checked out
    protos: dict[str, onnx.ModelProto] = field(default_factory=dict)
    # graph -> why its external data can't be loaded (missing, outside the directory, not ONNX)
    external_data: dict[str, str] = field(default_factory=dict)
    # graph -> how its inputs and outputs differ from the manifest's
    io_problems: dict[str, list[str]] = field(default_factory=dict)

    def graph_problems(self) -> list[str]:
        """Every external-data and IO problem, graph by graph."""
        lines: list[str] = []
        for graph in GRAPH_NAMES:
            if graph in self.external_data:
                lines.append(self.external_data[graph])
            lines += self.io_problems.get(graph, [])
        return lines

    def raise_first(self) -> None:
        """Raise :class:`ManifestError` for the first problem found, if any (for callers that refuse)."""
        if self.file_problems:
            raise ManifestError(f"{self.directory}: {self.file_problems[0]}")
        for graph in GRAPH_NAMES:
            if graph in self.external_data:
                raise ManifestError(self.external_data[graph])
            if self.io_problems.get(graph):
                raise ManifestError(f"{self.directory}: {self.io_problems[graph][0]}; re-export the model")


def preflight(directory: str | Path, *, hash_files: bool = True, manifest: Manifest | None = None) -> Preflight:
    """Load ``directory``'s manifest and check the export before it runs.

    Each file's size and sha256 against the manifest's record (with ``hash_files``),
    each graph's external-data paths (inside the directory, present), and each graph's
    inputs and outputs against the manifest. Every finding is recorded, none raised: only
    a directory with no readable manifest raises (:class:`ManifestError`). ``manifest``:
    one the caller has already read from ``directory``.
    """
    path = Path(directory)
    found = Preflight(path, manifest or read_manifest(path))
    if hash_files:
        found.file_problems = file_problems(path, found.manifest)
    for graph in GRAPH_NAMES:
        try:
            proto = check_external_data(path / found.manifest.graphs[graph].file)
        except KvexportError as exc:
            found.external_data[graph] = str(exc)
            continue
        found.protos[graph] = proto
        found.io_problems[graph] = check_graph_io(found.manifest, graph, proto)
    return found
