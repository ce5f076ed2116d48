"""Integrity of an export directory without torch: file hashes, graph IO, external data, a few steps.

The manifest records the size and sha256 of every file the export wrote (``files``), so a
copy on a deployment machine can be checked with onnxruntime alone. :func:`check` is
``kvexport check``: the manifest, each file's size and hash, each graph's IO against the
manifest, every external-data path, then a few greedy steps through the Generator.
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from kvexport.errors import KvexportError
from kvexport.manifest import GRAPH_NAMES, MANIFEST_FILE, Manifest, check_graph_io, read_manifest
from kvexport.storage import check_external_data

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


@dataclass(frozen=True)
class Check:
    """One check of :func:`check`."""

    name: str
    ok: bool
    detail: str


@dataclass
class CheckReport:
    """What :func:`check` found; ``ok`` only when every check holds."""

    directory: str
    checks: list[Check] = field(default_factory=list)
    seconds: float = 0.0

    @property
    def ok(self) -> bool:
        """True when every check holds."""
        return bool(self.checks) and all(c.ok for c in self.checks)

    def failures(self) -> list[str]:
        """One line per failed check."""
        return [f"{c.name}: {c.detail}" for c in self.checks if not c.ok]

    def to_dict(self) -> dict[str, Any]:
        """JSON form (``kvexport check --json``)."""
        return {**asdict(self), "ok": self.ok, "failures": self.failures()}


def check(
    directory: str | Path,
    *,
    steps: int = 4,
    provider: str = "cpu",
    progress: Callable[[str], None] | None = None,
) -> CheckReport:
    """Check an export directory without torch (see the module docstring).

    Raises :class:`~kvexport.KvexportError` only when there is nothing to check (no
    directory, no readable manifest); every other finding is a failed :class:`Check`.
    """
    started = time.perf_counter()
    path = Path(directory)
    say = progress or (lambda message: None)
    if steps < 1:
        raise KvexportError(f"--steps {steps}: must be at least 1")
    manifest = read_manifest(path)
    report = CheckReport(directory=str(path))
    report.checks.append(Check("manifest", True, f"{manifest.source.describe()}, {manifest.dtype}"))
    say(f"hashing {len(manifest.files or {})} files")
    problems = file_problems(path, manifest)
    report.checks.append(
        Check("files", not problems, "; ".join(problems) or f"{len(manifest.files or {})} files, sizes and sha256 as recorded")
    )
    graphs_ok = True
    for graph in GRAPH_NAMES:
        try:
            proto = check_external_data(path / manifest.graphs[graph].file)
        except KvexportError as exc:
            report.checks.append(Check(f"{graph} external data", False, str(exc)))
            graphs_ok = False
            continue
        report.checks.append(Check(f"{graph} external data", True, "every location inside the directory"))
        io = check_graph_io(manifest, graph, proto)
        report.checks.append(Check(f"{graph} IO", not io, "; ".join(io) or "as in the manifest"))
        graphs_ok &= not io
    if problems or not graphs_ok:
        report.seconds = time.perf_counter() - started
        return report
    say(f"running {steps} greedy steps")
    report.checks.append(_greedy_steps(path, manifest, steps, provider))
    report.seconds = time.perf_counter() - started
    return report


def _greedy_steps(path: Path, manifest: Manifest, steps: int, provider: str) -> Check:
    """Prefill and ``steps`` decode steps run, and every token is a vocabulary id."""
    import numpy as np

    from kvexport.runtime.generator import Generator

    name = f"greedy steps ({provider})"
    try:
        generator = Generator(path, provider=provider)
        prompt = [int(t) for t in np.random.default_rng(0).integers(0, manifest.dims.vocab_size, 8)]
        tokens = generator.generate([prompt], steps, eos_token_id=-1)[0, len(prompt) :]
    except Exception as exc:  # any runtime failure is the finding
        return Check(name, False, f"{type(exc).__name__}: {str(exc).splitlines()[0][:300]}")
    ok = len(tokens) == steps and bool(((tokens >= 0) & (tokens < manifest.dims.vocab_size)).all())
    return Check(name, ok, f"prefill + {steps} decode steps gave tokens {tokens.tolist()}")
