"""The model families kvexport exports, and the registry that picks one from a config.

:data:`FAMILIES` maps each Hugging Face ``model_type`` to the module that defines its
:class:`~kvexport.models.base.ModelFamily`; a family's module is imported only when it is
asked for, so reading the registry needs neither torch nor transformers.
"""

from __future__ import annotations

import importlib
from pathlib import Path

from kvexport.errors import KvexportError
from kvexport.models.base import ModelFamily, read_config
from kvexport.models.gguf import is_gguf, read_gguf

# model_type -> "module:attribute" of the ModelFamily that exports it
FAMILIES: dict[str, str] = {
    "gpt2": "kvexport.models.gpt2:FAMILY",
    "llama": "kvexport.models.llama:LLAMA",
    "mistral": "kvexport.models.llama:MISTRAL",
    "phi3": "kvexport.models.llama:PHI3",
    "qwen2": "kvexport.models.llama:QWEN2",
    "qwen3": "kvexport.models.llama:QWEN3",
}

__all__ = ["FAMILIES", "ModelFamily", "family_for", "family_of_model", "known_model_types"]


def known_model_types() -> list[str]:
    """The ``model_type`` values some family exports, sorted."""
    return sorted(FAMILIES)


def family_for(model_type: object, where: str = "config.json") -> ModelFamily:
    """The family that exports ``model_type``, or one line naming the known ones."""
    where_defined = FAMILIES.get(model_type) if isinstance(model_type, str) else None
    if where_defined is None:
        raise KvexportError(
            f"{where}: model_type {model_type!r} is not a family kvexport exports; "
            f"known: {', '.join(known_model_types())}"
        )
    module, _, attribute = where_defined.partition(":")
    family: ModelFamily = getattr(importlib.import_module(module), attribute)
    return family


def family_of_model(model: str, *, random_init: bool) -> ModelFamily:
    """The family of ``--model``: a preset name (with ``--random-init``), a config file, a model directory or a GGUF file."""
    if random_init:
        for model_type in known_model_types():
            family = family_for(model_type)
            if model in family.presets:
                return family
    path = Path(model)
    if is_gguf(path):
        return family_for(read_gguf(path).model_type, f"{model} (general.architecture)")
    if not path.exists():
        presets = [p for t in known_model_types() for p in family_for(t).presets]
        raise KvexportError(
            f"--model {model}: no such directory or config file"
            + (f", and not a preset ({', '.join(presets)})" if random_init else "")
            + "; pass a model directory with a config.json"
        )
    config_path = path / "config.json" if path.is_dir() else path
    return family_for(read_config(path).get("model_type"), str(config_path))
