"""kvexport's own CPU kernels for ONNX Runtime: a custom-op library, built once per machine.

Two ops: ``kvexport.CacheAttention`` (``cache_attention.cc``): attention over the
in-place fp32 cache, for decode calls and prompts, in place of ONNX Runtime 1.31's CPU
``GroupQueryAttention`` (why: :mod:`kvexport.passes.cache_attention`); and
``kvexport.PromptMatMul`` (``prompt_matmul.cc``): a prompt's products in bf16 on AMX tiles or
AVX512-BF16 (why: :mod:`kvexport.passes.prompt_products`; :func:`prompt_gemm_path`). The
runtime uses them where the library is built (:func:`library_path`): CPU sessions then run
those nodes through it (:class:`kvexport.passes.CacheAttentionPass`), and a second session
runs prompts (:func:`kvexport.runtime.session.prompt_session_for`). Exports do not change.

:func:`build` compiles it with the machine's C++ compiler against ONNX Runtime's C API
headers, which no PyPI wheel ships (nor npm's ``onnxruntime-node``), and Debian has them
(``libonnxruntime-dev``) from trixie on only: kvexport carries ONNX Runtime 1.21's four
headers, MIT, unchanged (``include/``, with their licence; the C API is versioned, and a
library built against 1.21's headers asks 1.31's runtime for API 21), or takes
``--ort-include DIR`` (e.g. ``/usr/include/onnxruntime`` from ``apt-get install
libonnxruntime-dev``). Nothing is downloaded. ``kvexport build-kernels`` runs it;
``scripts/install.sh`` does so on set-up. ``KVEXPORT_KERNELS=off`` makes the runtime ignore
a built library, and ``KVEXPORT_KERNELS=PATH`` names one.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

from kvexport.errors import KvexportError, first_line

SOURCES = (Path(__file__).with_name("cache_attention.cc"), Path(__file__).with_name("prompt_matmul.cc"))
KERNELS_VARIABLE = "KVEXPORT_KERNELS"
# ONNX Runtime 1.21's C/C++ API headers, carried with the source (MIT; include/LICENSE)
BUNDLED_HEADERS = Path(__file__).with_name("include")
# -ffast-math compiles only: linking with it would add crtfastmath, which sets flush-to-zero for the whole process.
# It lets the exponentials vectorize (glibc's libmvec) and the sums reassociate: 2x the decode path's speed.
_COMPILE_FLAGS = ("-O3", "-std=c++17", "-fPIC", "-fopenmp-simd", "-ffast-math", "-fvisibility=hidden")


class KernelBuildError(KvexportError):
    """The kernels could not be built: the compiler or the headers are missing, or the build failed."""


def cache_root() -> Path:
    """Where built libraries live: ``$XDG_CACHE_HOME/kvexport`` or ``~/.cache/kvexport``."""
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "kvexport"


@functools.cache
def _source_digest() -> str:
    digest = hashlib.sha256()
    for source in SOURCES:
        digest.update(source.read_bytes())
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


PROMPT_GEMM_VARIABLE = "KVEXPORT_PROMPT_GEMM"  # amx | avx512bf16 | generic | auto: the prompt product's path (prompt_matmul.cc)
FAST_PROMPT_GEMMS = ("amx", "avx512bf16")  # the paths the runtime opens a prompt session for (avx512bf16: by name only)


def prompt_gemm_path() -> str | None:
    """The path kvexport's prompt product (``kvexport.PromptMatMul``) takes on this CPU, or None (no library built).

    ``amx`` (AMX tiles, where the CPU has them and the OS grants them) or ``generic`` (a portable
    loop), chosen when a kernel is made; ``KVEXPORT_PROMPT_GEMM`` forces one, or ``avx512bf16``
    (AVX512-BF16 dot products: slower than ONNX Runtime's int8 blocks on a Sapphire Rapids, so
    never chosen by itself; asked for by name, the runtime opens its prompt session with it), or
    says ``unavailable`` where the CPU lacks the one asked for.
    """
    path = library_path()
    if path is None:
        return None
    library = ctypes.CDLL(str(path))
    library.KvexportPromptGemmPath.restype = ctypes.c_char_p
    return str(library.KvexportPromptGemmPath().decode())


def build(include: Path | None = None, output: Path | None = None, *, compiler: str | None = None) -> Path:
    """Compile the kernels into ``output`` (default :func:`default_library`); the library's path.

    ``include`` is a folder with ``onnxruntime_cxx_api.h`` (default: :data:`BUNDLED_HEADERS`).
    ``compiler`` defaults to ``$CXX`` or ``g++``. Raises :class:`KernelBuildError` with one line.
    """
    compiler = compiler or os.environ.get("CXX") or "g++"
    if shutil.which(compiler) is None:
        raise KernelBuildError(f"no C++ compiler {compiler!r} here; install g++ (or set CXX) and build again")
    if include is None:
        include = BUNDLED_HEADERS
        if not (include / "onnxruntime_cxx_api.h").is_file():
            raise KernelBuildError(
                f"ONNX Runtime's headers that kvexport carries are not in {include} (an incomplete install?); "
                "reinstall kvexport, or pass --ort-include DIR with onnxruntime_cxx_api.h"
            )
    elif not (include / "onnxruntime_cxx_api.h").is_file():
        raise KernelBuildError(f"--ort-include {include}: no onnxruntime_cxx_api.h there")
    output = output or default_library()
    try:
        output.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise KernelBuildError(f"can't write {output}: {first_line(exc)}") from exc
    with tempfile.TemporaryDirectory(dir=output.parent, prefix=".building-") as work:
        objects = [Path(work) / f"{source.stem}.o" for source in SOURCES]
        library = Path(work) / output.name
        compiles = [
            [compiler, *_COMPILE_FLAGS, f"-I{include}", "-c", str(source), "-o", str(obj)]
            for source, obj in zip(SOURCES, objects, strict=True)
        ]
        for command in (*compiles, [compiler, "-shared", *map(str, objects), "-o", str(library)]):
            done = subprocess.run(command, capture_output=True, text=True, check=False)
            if done.returncode != 0:
                lines = [line for line in done.stderr.splitlines() if "error" in line] or done.stderr.splitlines() or [""]
                raise KernelBuildError(f"building the kernels failed: {lines[0].strip()[:300]}")
        try:
            os.replace(library, output)
        except OSError as exc:
            raise KernelBuildError(f"can't write {output}: {first_line(exc)}") from exc
    return output
