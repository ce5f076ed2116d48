"""``kvexport check``: an export directory checked without torch, then run for a few steps.

The manifest, each file's size and hash, each graph's external data and IO against the
manifest (:func:`kvexport.bundle.integrity.preflight`), for an ``ort-cuda`` export what the
CUDA provider would make of its graphs (:mod:`kvexport.runtime.cuda_support`, no GPU
needed), then a few greedy steps through the Generator. Every finding is a :class:`Check`; the report's ``ok`` is the verdict.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from kvexport.bundle.integrity import preflight
from kvexport.bundle.manifest import GRAPH_NAMES, Manifest, read_manifest
from kvexport.errors import KvexportError
from kvexport.progress import Progress, silent
from kvexport.runtime.cuda_support import cuda_findings
from kvexport.runtime.generator import Generator


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
    progress: Progress | None = None,
) -> CheckReport:
    """Check an export directory without torch (see the module docstring).

    Raises :class:`~kvexport.KvexportError` only when there is nothing to check (no
    directory, no readable manifest); every other finding is a failed :class:`Check`.
    """
    started = time.perf_counter()
    path = Path(directory)
    progress = progress or silent
    if steps < 1:
        raise KvexportError(f"--steps {steps}: must be at least 1")
    manifest = read_manifest(path)
    progress(f"hashing {len(manifest.files or {})} files")
    found = preflight(path, manifest=manifest)
    report = CheckReport(directory=str(path))
    report.checks.append(Check("manifest", True, f"{manifest.source.describe()}, {manifest.dtype}"))
    problems = found.file_problems
    report.checks.append(
        Check("files", not problems, "; ".join(problems) or f"{len(manifest.files or {})} files, sizes and sha256 as recorded")
    )
    for graph in GRAPH_NAMES:
        if graph in found.external_data:
            report.checks.append(Check(f"{graph} external data", False, found.external_data[graph]))
            continue
        report.checks.append(Check(f"{graph} external data", True, "every location inside the directory"))
        io = found.io_problems[graph]
        report.checks.append(Check(f"{graph} IO", not io, "; ".join(io) or "as in the manifest"))
    if manifest.target == "ort-cuda":
        report.checks.append(_cuda_support(path))
    if problems or found.graph_problems():
        report.seconds = time.perf_counter() - started
        return report
    progress(f"running {steps} greedy steps")
    report.checks.append(_greedy_steps(path, manifest, steps, provider))
    report.seconds = time.perf_counter() - started
    return report


def _cuda_support(path: Path) -> Check:
    """What the CUDA provider would make of the graphs, read without a GPU (:mod:`kvexport.runtime.cuda_support`)."""
    findings = cuda_findings(path)
    errors = [str(f) for f in findings if f.level == "error"]
    on_cpu = sorted({f"{f.message.split(' ', 1)[0]}" for f in findings if f.level == "note"})
    detail = "; ".join(errors[:3]) if errors else "every ONNX Runtime op has a CUDA kernel for its types, no CUDA optimizer breaks a node"
    if on_cpu:
        detail += f" (on the CPU provider under CUDA: {', '.join(on_cpu)})"
    return Check("CUDA kernels", not errors, detail)


def _greedy_steps(path: Path, manifest: Manifest, steps: int, provider: str) -> Check:
    """Prefill and ``steps`` decode steps run, and every token is a vocabulary id."""
    name = f"greedy steps ({provider})"
    try:
        generator = Generator(path, provider=provider)
        prompt = [int(t) for t in np.random.default_rng(0).integers(0, manifest.dims.vocab_size, 8)]
        tokens = generator.generate([prompt], steps, eos_token_id=-1)[0, len(prompt) :]
    except Exception as exc:  # any runtime failure is the finding
        return Check(name, False, f"{type(exc).__name__}: {str(exc).splitlines()[0][:300]}")
    ok = len(tokens) == steps and bool(((tokens >= 0) & (tokens < manifest.dims.vocab_size)).all())
    return Check(name, ok, f"prefill + {steps} decode steps gave tokens {tokens.tolist()}")
