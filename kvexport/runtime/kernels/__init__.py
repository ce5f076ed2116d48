"""kvexport's own CPU kernels for ONNX Runtime: a custom-op library, built once per machine.

One op for now, ``kvexport.CacheAttention`` (``cache_attention.cc``): attention over the
in-place fp32 cache, for decode calls and prompts, in place of ONNX Runtime 1.31's CPU
``GroupQueryAttention`` (why: :mod:`kvexport.passes.cache_attention`). The runtime uses it
where the library is built (:func:`library_path`): CPU sessions then run those nodes
through it (:class:`kvexport.passes.CacheAttentionPass`). Exports do not change.

:func:`build` compiles it with the machine's C++ compiler against ONNX Runtime's C API
headers, which no PyPI wheel ships: they come from Debian's ``libonnxruntime-dev`` package
(1.21, MIT; the C API is versioned, and a library built against 1.21's headers asks 1.31's
runtime for API 21), downloaded once from the Debian archive and checked against its
SHA-256, or from ``--ort-include DIR``. ``kvexport build-kernels`` runs it;
``scripts/install.sh`` does so on set-up. ``KVEXPORT_KERNELS=off`` makes the runtime ignore
a built library, and ``KVEXPORT_KERNELS=PATH`` names one.
"""

from __future__ import annotations

import functools
import hashlib
import io
import os
import shutil
import subprocess
import tarfile
import tempfile
import urllib.request
from pathlib import Path

from kvexport.errors import KvexportError, first_line

SOURCE = Path(__file__).with_name("cache_attention.cc")
KERNELS_VARIABLE = "KVEXPORT_KERNELS"
# Debian's package of ONNX Runtime's headers (trixie, amd64; headers are the same on every architecture)
HEADERS_URL = "http://deb.debian.org/debian/pool/main/o/onnxruntime/libonnxruntime-dev_1.21.0+dfsg-1_amd64.deb"
HEADERS_SHA256 = "14f7d959d5deacbcf1504830d4189f91fc67382b399ed9ae9d3aa9c4050ced08"
_HEADER_DIR = "usr/include/onnxruntime"
# -ffast-math compiles only: linking with it would add crtfastmath, which sets flush-to-zero for the whole process.
# It lets the exponentials vectorize (glibc's libmvec) and the sums reassociate: 2x the decode path's speed.
_COMPILE_FLAGS = ("-O3", "-std=c++17", "-fPIC", "-fopenmp-simd", "-ffast-math", "-fvisibility=hidden")


class KernelBuildError(KvexportError):
    """The kernels could not be built: the compiler, the headers or the download failed."""


def cache_root() -> Path:
    """Where built libraries and the downloaded headers live: ``$XDG_CACHE_HOME/kvexport`` or ``~/.cache/kvexport``."""
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "kvexport"


@functools.cache
def _source_digest() -> str:
    digest = hashlib.sha256(SOURCE.read_bytes())
    digest.update(" ".join(_COMPILE_FLAGS).encode())
    return digest.hexdigest()[:16]


def default_library() -> Path:
    """Where :func:`build` puts the library for this source and these flags."""
    return cache_root() / "kernels" / f"libkvexport_kernels-{_source_digest()}.so"


def library_path() -> Path | None:
    """The custom-op library the runtime registers, or None (not built, or ``KVEXPORT_KERNELS=off``).

    Raises :class:`KvexportError` where ``KVEXPORT_KERNELS`` names a file that is not there.
    """
    choice = os.environ.get(KERNELS_VARIABLE, "").strip()
    if choice.lower() == "off":
        return None
    if choice and choice.lower() != "auto":
        path = Path(choice)
        if not path.is_file():
            raise KvexportError(f"{KERNELS_VARIABLE}={choice}: no such library; build one with kvexport build-kernels, or set it to off")
        return path
    path = default_library()
    return path if path.is_file() else None


def fetch_headers(root: Path | None = None) -> Path:
    """ONNX Runtime's C API headers from Debian's ``libonnxruntime-dev``, downloaded once; the include folder."""
    target = (root or cache_root()) / "ort-headers" / HEADERS_SHA256[:16]
    include = target / _HEADER_DIR
    if (include / "onnxruntime_cxx_api.h").is_file():
        return include
    try:
        with urllib.request.urlopen(HEADERS_URL, timeout=120) as response:
            package = response.read()
    except OSError as exc:
        raise KernelBuildError(
            f"can't download ONNX Runtime's headers ({HEADERS_URL}: {first_line(exc)}); "
            "pass --ort-include DIR with onnxruntime_cxx_api.h"
        ) from exc
    if hashlib.sha256(package).hexdigest() != HEADERS_SHA256:
        raise KernelBuildError(f"{HEADERS_URL}: the download's SHA-256 is not the pinned one; not used")
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        work = Path(tempfile.mkdtemp(dir=target.parent, prefix=".extracting-"))
    except OSError as exc:
        raise KernelBuildError(f"can't write ONNX Runtime's headers under {target.parent}: {first_line(exc)}") from exc
    try:
        with tarfile.open(fileobj=io.BytesIO(_deb_member(package, b"data.tar"))) as data:
            members = [m for m in data.getmembers() if m.isfile() and m.name.lstrip("./").startswith(_HEADER_DIR + "/")]
            data.extractall(work, members=members, filter="data")
        if not (work / _HEADER_DIR / "onnxruntime_cxx_api.h").is_file():
            raise KernelBuildError(f"{HEADERS_URL}: no {_HEADER_DIR}/onnxruntime_cxx_api.h in the package")
        if not (include / "onnxruntime_cxx_api.h").is_file():  # another build may have put them there meanwhile
            shutil.rmtree(target, ignore_errors=True)  # a broken earlier extraction
            try:
                os.replace(work, target)
            except OSError:
                if not (include / "onnxruntime_cxx_api.h").is_file():
                    raise
    except (ValueError, TypeError, tarfile.TarError, OSError) as exc:  # a damaged archive, a Python without lzma or tar filters, the disk
        raise KernelBuildError(f"can't unpack ONNX Runtime's headers from {HEADERS_URL}: {first_line(exc)}") from exc
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return include


def _deb_member(package: bytes, prefix: bytes) -> bytes:
    """The first member of a Debian package (an ``ar`` archive) whose name starts with ``prefix``."""
    if not package.startswith(b"!<arch>\n"):
        raise KernelBuildError(f"{HEADERS_URL}: not a Debian package")
    at = 8
    while at + 60 <= len(package):
        header = package[at : at + 60]
        size = int(header[48:58].decode().strip())
        if header[:16].strip().startswith(prefix):
            return package[at + 60 : at + 60 + size]
        at += 60 + size + (size % 2)
    raise KernelBuildError(f"{HEADERS_URL}: no {prefix.decode()}* member in the package")


def build(include: Path | None = None, output: Path | None = None, *, compiler: str | None = None) -> Path:
    """Compile the kernels into ``output`` (default :func:`default_library`); the library's path.

    ``include`` is a folder with ``onnxruntime_cxx_api.h`` (default: :func:`fetch_headers`).
    ``compiler`` defaults to ``$CXX`` or ``g++``. Raises :class:`KernelBuildError` with one line.
    """
    compiler = compiler or os.environ.get("CXX") or "g++"
    if shutil.which(compiler) is None:
        raise KernelBuildError(f"no C++ compiler {compiler!r} here; install g++ (or set CXX) and build again")
    if include is None:
        include = fetch_headers()
    elif not (include / "onnxruntime_cxx_api.h").is_file():
        raise KernelBuildError(f"--ort-include {include}: no onnxruntime_cxx_api.h there")
    output = output or default_library()
    try:
        output.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise KernelBuildError(f"can't write {output}: {first_line(exc)}") from exc
    with tempfile.TemporaryDirectory(dir=output.parent, prefix=".building-") as work:
        objects = Path(work) / "kernels.o"
        library = Path(work) / output.name
        for command in (
            [compiler, *_COMPILE_FLAGS, f"-I{include}", "-c", str(SOURCE), "-o", str(objects)],
            [compiler, "-shared", str(objects), "-o", str(library)],
        ):
            done = subprocess.run(command, capture_output=True, text=True, check=False)
            if done.returncode != 0:
                lines = [line for line in done.stderr.splitlines() if "error" in line] or done.stderr.splitlines() or [""]
                raise KernelBuildError(f"building the kernels failed: {lines[0].strip()[:300]}")
        try:
            os.replace(library, output)
        except OSError as exc:
            raise KernelBuildError(f"can't write {output}: {first_line(exc)}") from exc
    return output
