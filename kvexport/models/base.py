"""The model-family seam: everything kvexport needs to know of one family of decoders.

One module per family (``gpt2.py``; ``llama.py`` for the five Llama-style ones) defines a :class:`ModelFamily`
subclass that overrides only what its family does differently, in the way
onnxruntime-genai's builder keeps a base decoder and one subclass per family, and
transformers keeps each family's quirks in its own ``modeling_<family>.py``. The
registry in :mod:`kvexport.models` maps a config's ``model_type`` to its family.

What a family provides:

- recognise a config (:attr:`model_types`) and its published architectures (:attr:`presets`);
- the generic dims the manifest stores (:meth:`dims`), so that the runtime, the server,
  verify and check never read a family's own config keys;
- a seeded random-init model from a preset or a config file, or a checkpoint (:meth:`load`);
- the exportable prefill / decode modules (:meth:`prefill_module`, :meth:`decode_module`);
- the tokenizer and chat template to ship (:meth:`tokenizer`, :meth:`tokenizer_config`);
- which attention fusions apply to its graphs (:attr:`attention_kinds`).

Nothing here imports torch at module level: the importer and ``kvexport check`` read
configs and dims on the base install. Only :meth:`load` and the modules need torch.
"""

from __future__ import annotations

import hashlib
import json
from abc import ABC, abstractmethod
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

from kvexport.bundle.model_info import Dtype, ModelDims, ModelSource
from kvexport.errors import KvexportError
from kvexport.models.gguf import is_gguf, read_gguf
from kvexport.models.tokenizer import GPT2_GENAI_TOKENIZER, TokenizerChoice

if TYPE_CHECKING:
    import torch
    from transformers import PreTrainedModel


class ModelFamily(ABC):
    """One family of decoders (GPT-2, ...): the only place its config keys and quirks are known."""

    #: the family's name, as the manifest records it (``model.family``)
    name: ClassVar[str]
    #: the ``model_type`` values of Hugging Face configs this family exports
    model_types: ClassVar[tuple[str, ...]]
    #: preset name -> the published architecture's config numbers (for ``--random-init``)
    presets: ClassVar[Mapping[str, Mapping[str, Any]]]
    #: the ``--attention`` kinds whose fusion rules match this family's graphs
    attention_kinds: ClassVar[frozenset[str]] = frozenset({"unfused", "onnx", "ort"})
    #: onnxruntime-genai has loaded this family's in-place exports (tests/test_examples.py): write its files
    genai_tried: ClassVar[bool] = False
    #: ``ort`` attention comes from the export itself (:meth:`in_place_module`), not the fusion passes
    in_place_attention: ClassVar[bool] = False
    #: the MLP is gated (``down(silu(gate) * up)``): per-channel int8 then keeps 8-bit weights and
    #: rotates the down projection's input (:func:`kvexport.export.quantization.scheme_knobs`)
    gated_mlp: ClassVar[bool] = True
    #: onnxruntime-genai's ``tokenizer_config.json`` fields (the tokenizer class and special tokens),
    #: written where the checkpoint ships none; the export adds ``model_max_length``. Default: GPT-2's
    #: BPE, the tokenizer every family falls back to (:meth:`tokenizer`)
    genai_tokenizer: ClassVar[Mapping[str, Any]] = GPT2_GENAI_TOKENIZER

    @abstractmethod
    def random_init_config(self, model: str) -> dict[str, Any]:
        """The full config (a plain dict) of a preset name or a config file, for ``--random-init``."""

    @abstractmethod
    def dims(self, config: Mapping[str, Any]) -> ModelDims:
        """The generic dims of a config (a plain dict, as ``config.json`` holds it)."""

    @abstractmethod
    def load(self, source: ModelSource, dtype: Dtype = "fp32", allow_pickle: bool = False) -> PreTrainedModel:
        """Build or load the model a source names, in eval mode and the given dtype (needs torch)."""

    @abstractmethod
    def prefill_module(self, model: PreTrainedModel, all_logits: bool = False) -> torch.nn.Module:
        """The prompt graph's module: ``(input_ids, attention_mask, position_ids) -> (logits, *present)``."""

    @abstractmethod
    def decode_module(self, model: PreTrainedModel) -> torch.nn.Module:
        """The one-step graph's module: ``(input_ids, attention_mask, position_ids, *past) -> (logits, *present)``."""

    def layer_windows(self, config: Mapping[str, Any]) -> list[int]:
        """Each layer's sliding attention window in positions, -1 where it sees the whole past (all, here)."""
        return [-1] * self.dims(config).num_layers

    def in_place_module(self, model: PreTrainedModel, last_only: bool = True) -> torch.nn.Module:
        """Either graph over the in-place cache with GroupQueryAttention (families with :attr:`in_place_attention`)."""
        raise NotImplementedError(f"{self.name}: ort attention comes from the fusion passes, not the export")

    @abstractmethod
    def tokenizer(self, model_dir: Path | None, vocab_size: int) -> TokenizerChoice:
        """The tokenizer an export ships (the checkpoint's own first), or why none."""

    def tokenizer_config(self, model_dir: Path | None) -> dict[str, Any] | None:
        """The checkpoint's ``tokenizer_config.json``, with its chat template, to ship beside ``tokenizer.json``.

        Newer checkpoints keep the template in ``chat_template.jinja``; it is folded into the
        config's ``chat_template``, where ``kvexport serve`` (and transformers) read it.
        """
        if model_dir is None:
            return None
        config_path, template_path = model_dir / "tokenizer_config.json", model_dir / "chat_template.jinja"
        config: dict[str, Any] = {}
        if config_path.is_file():
            try:
                loaded = json.loads(config_path.read_text())
            except (OSError, json.JSONDecodeError) as exc:
                raise KvexportError(f"{config_path}: not readable JSON ({exc}); fix or remove it") from exc
            config = loaded if isinstance(loaded, dict) else {}
        if template_path.is_file():
            config["chat_template"] = template_path.read_text()
        return config or None

    def check_export(self, config: Mapping[str, Any], attention: str, where: str) -> None:  # noqa: B027 - an optional hook
        """Refuse, in one line, a config that the chosen ``--attention`` can't export correctly (default: none)."""

    def check_config(self, config: Mapping[str, Any], where: str) -> None:
        """Refuse, in one line, a config this family does not export."""
        model_type = config.get("model_type")
        if model_type not in self.model_types:
            raise KvexportError(
                f"{where}: model_type is {model_type!r}; the {self.name} family exports "
                f"{', '.join(repr(t) for t in self.model_types)}"
            )

    def describe_presets(self) -> str:
        """The preset names, comma-separated, for help and errors."""
        return ", ".join(self.presets)


def read_config(path: Path) -> dict[str, Any]:
    """A ``config.json`` (or a directory holding one) as a dict, or one clear error."""
    if path.is_dir():
        path = path / "config.json"
    if not path.is_file():
        raise KvexportError(f"{path}: no such config file; pass a model directory with a config.json")
    try:
        data = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise KvexportError(f"{path}: not a readable JSON config ({exc}); fix or replace it") from exc
    if not isinstance(data, dict):
        raise KvexportError(f"{path}: not a JSON object; fix or replace it")
    return data


def source_of(family: ModelFamily, model: str, *, random_init: bool, seed: int = 0) -> ModelSource:
    """``--model`` / ``--random-init`` / ``--seed`` as a :class:`ModelSource` of ``family``."""
    if random_init:
        config = family.random_init_config(model)
        return ModelSource(kind="random-init", name=model, seed=seed, config=config)
    path = Path(model)
    if is_gguf(path):
        return ModelSource(kind="gguf", name=str(read_gguf(path).path))
    if path.exists():
        if not path.is_dir():
            raise KvexportError(
                f"--model {model}: is a file; pass a Hugging Face model directory "
                "(config.json + model.safetensors), a .gguf file, or a config with --random-init"
            )
        return ModelSource(kind="local", name=str(path.resolve()))
    if model.startswith((".", "/", "~")) or model.count("/") > 1:
        raise KvexportError(
            f"--model {model}: no such directory; pass an existing model directory, a hub id, "
            "or --random-init"
        )
    return ModelSource(kind="hub", name=model)


def weights_fingerprint(model: torch.nn.Module) -> str:
    """SHA-256 over every parameter (name, dtype, shape, bytes), in name order.

    Verify compares this with the manifest so that a reference rebuilt from a different
    checkpoint (or a different torch RNG) is reported as such, not as a numeric mismatch.
    """
    import torch

    digest = hashlib.sha256()
    for name, tensor in sorted(model.state_dict().items()):
        array = tensor.detach().cpu().contiguous()
        digest.update(f"{name}:{array.dtype}:{tuple(array.shape)};".encode())
        digest.update(array.view(torch.uint8).numpy().data if array.numel() else b"")
    return digest.hexdigest()
