"""The GPT-2 family: its presets, config keys, loading, decoder body and tokenizer.

Everything GPT-2-specific lives here; the rest of kvexport reads the generic
:class:`~kvexport.bundle.model_info.ModelDims` this module maps GPT-2's config keys
(``n_layer``, ``n_head``, ``n_embd``, ``n_positions``) onto. Importing it needs neither
torch nor transformers; loading a model does.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kvexport.bundle.model_info import Dtype, ModelDims, ModelSource
from kvexport.errors import KvexportError, first_line
from kvexport.models.base import ModelFamily, read_config, source_of, weights_fingerprint
from kvexport.models.gguf import gguf_config, gguf_model
from kvexport.models.tokenizer import TokenizerChoice, choose_tokenizer

if TYPE_CHECKING:
    import torch
    from transformers import DynamicCache, GPT2LMHeadModel, PreTrainedModel

__all__ = [
    "FAMILY",
    "PRESETS",
    "Gpt2Family",
    "load_gpt2",
    "resolve_source",
    "weights_fingerprint",
]


# The GPT-2 family's architectures (the published checkpoints' config numbers).
PRESETS: dict[str, dict[str, int]] = {
    "gpt2": {"n_layer": 12, "n_head": 12, "n_embd": 768},
    "distilgpt2": {"n_layer": 6, "n_head": 12, "n_embd": 768},
    "gpt2-medium": {"n_layer": 24, "n_head": 16, "n_embd": 1024},
    "gpt2-large": {"n_layer": 36, "n_head": 20, "n_embd": 1280},
    "gpt2-xl": {"n_layer": 48, "n_head": 25, "n_embd": 1600},
}
_PRESET_COMMON = {"vocab_size": 50257, "n_positions": 1024}


def resolve_source(model: str, *, random_init: bool, seed: int = 0) -> ModelSource:
    """Turn the CLI's ``--model`` / ``--random-init`` / ``--seed`` into a :class:`ModelSource` (GPT-2 presets)."""
    return source_of(FAMILY, model, random_init=random_init, seed=seed)


def _transformer(
    model: GPT2LMHeadModel,
    input_ids: torch.Tensor,
    cache: DynamicCache,
    attention_mask: torch.Tensor,
    position_ids: torch.Tensor,
) -> torch.Tensor:
    """Final hidden states; ``cache`` is extended in place with this call's keys and values."""
    output = model.transformer(  # the cache goes positionally: its keyword was renamed in 5.x
        input_ids, cache, attention_mask=attention_mask, position_ids=position_ids, use_cache=True
    )
    hidden: torch.Tensor = output.last_hidden_state
    return hidden


class Gpt2Family(ModelFamily):
    """GPT-2 (and distilgpt2): learned positions, multi-head attention, a tied LM head."""

    name = "gpt2"
    model_types = ("gpt2",)
    presets = PRESETS
    genai_tried = True
    gated_mlp = False  # GELU(fc) then proj

    def random_init_config(self, model: str) -> dict[str, Any]:
        """A preset's config, or a GPT-2 config file's with GPT-2's defaults filled in."""
        from transformers import GPT2Config

        if model in PRESETS:
            numbers: dict[str, Any] = {**PRESETS[model], **_PRESET_COMMON}
            return GPT2Config(**numbers).to_dict()
        path = Path(model)
        if not (path / "config.json" if path.is_dir() else path).is_file():
            raise KvexportError(
                f"--random-init --model {model}: not a preset ({', '.join(PRESETS)}) "
                "and no config.json there; name a preset or a GPT-2 config file"
            )
        data = read_config(path)
        self.check_config(data, str(path))
        vocab_size = int(data.get("vocab_size", _PRESET_COMMON["vocab_size"]))
        for special in ("bos_token_id", "eos_token_id"):
            # GPT2Config defaults these to GPT-2's 50256, which a smaller vocabulary lacks.
            data.setdefault(special, None if vocab_size <= 50256 else 50256)
        return GPT2Config(**{k: v for k, v in data.items() if k != "model_type"}).to_dict()

    def check_config(self, config: Mapping[str, Any], where: str) -> None:
        """GPT-2's refusal names what kvexport gpt2 takes."""
        if config.get("model_type") != "gpt2":
            raise KvexportError(
                f"{where}: model_type is {config.get('model_type')!r}; kvexport exports GPT-2 models (model_type 'gpt2')"
            )

    def dims(self, config: Mapping[str, Any]) -> ModelDims:
        """GPT-2's ``n_layer``, ``n_head``, ``n_embd`` and ``n_positions`` as the generic dims."""
        heads, hidden = int(config["n_head"]), int(config["n_embd"])
        return ModelDims(
            num_layers=int(config["n_layer"]),
            num_heads=heads,
            num_kv_heads=heads,
            head_dim=hidden // heads,
            hidden_size=hidden,
            vocab_size=int(config["vocab_size"]),
            max_positions=int(config["n_positions"]),
        )

    def load(self, source: ModelSource, dtype: Dtype = "fp32", allow_pickle: bool = False) -> GPT2LMHeadModel:
        """Build or load the GPT-2 model a source names, in eval mode and the given dtype."""
        return load_gpt2(source, dtype, allow_pickle)

    def prefill_module(self, model: PreTrainedModel, all_logits: bool = False) -> torch.nn.Module:
        """The prompt graph's module over GPT-2's transformer."""
        from kvexport.models.wrappers import PrefillModule

        return PrefillModule(model, _transformer, all_logits=all_logits)

    def decode_module(self, model: PreTrainedModel) -> torch.nn.Module:
        """The one-step graph's module over GPT-2's transformer."""
        from kvexport.models.wrappers import DecodeModule

        return DecodeModule(model, _transformer)

    def tokenizer(self, model_dir: Path | None, vocab_size: int) -> TokenizerChoice:
        """The checkpoint's own tokenizer, else GPT-2's bundled BPE for GPT-2's vocabulary."""
        return choose_tokenizer(model_dir, vocab_size)

    def tokenizer_config(self, model_dir: Path | None) -> dict[str, Any] | None:
        """None: GPT-2 ships the ``tokenizer_config.json`` kvexport writes for onnxruntime-genai.

        GPT-2 checkpoints carry no chat template, and the file transformers 5 writes names a
        tokenizer class onnxruntime-genai rejects.
        """
        return None


FAMILY = Gpt2Family()


def load_gpt2(source: ModelSource, dtype: Dtype = "fp32", allow_pickle: bool = False) -> GPT2LMHeadModel:
    """Build or load the GPT-2 model a source names, in eval mode and the given dtype."""
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    if source.kind == "random-init":
        assert source.config is not None, "random-init source carries its config"
        config = GPT2Config(**{k: v for k, v in source.config.items() if k != "model_type"})
        torch.manual_seed(source.seed or 0)
        model = GPT2LMHeadModel(config)
    elif source.kind == "local":
        model = _load_local(Path(source.name), allow_pickle)
    elif source.kind == "gguf":
        read = gguf_config(Path(source.name))
        FAMILY.check_config(read, source.name)
        model = gguf_model(Path(source.name), GPT2Config(**{k: v for k, v in read.items() if k != "model_type"}))
    else:
        model = _load_hub(source.name)
    model.eval()
    dtypes = {"fp32": torch.float32, "fp16": torch.float16}
    converted: GPT2LMHeadModel = model.to(dtype=dtypes[dtype])  # type: ignore[call-arg]
    return converted


def _load_local(path: Path, allow_pickle: bool) -> GPT2LMHeadModel:
    from transformers import GPT2LMHeadModel

    config_path = path / "config.json"
    if not config_path.is_file():
        raise KvexportError(f"{path}: no config.json; pass a Hugging Face model directory")
    FAMILY.check_config(read_config(config_path), str(config_path))
    has_safetensors = any(path.glob("*.safetensors"))
    if not has_safetensors and not allow_pickle:
        if any(path.glob("*.bin")) or any(path.glob("*.pt")):
            raise KvexportError(
                f"{path}: weights are only in a pickle checkpoint (.bin), which can run code "
                "when loaded; convert to safetensors, or pass --allow-pickle if you trust it"
            )
        raise KvexportError(
            f"{path}: no model.safetensors found; add the weights or use --random-init"
        )
    try:
        model = GPT2LMHeadModel.from_pretrained(path, use_safetensors=has_safetensors)
    except (OSError, ValueError, RuntimeError) as exc:
        first = first_line(exc)
        raise KvexportError(f"{path}: could not load the model ({first})") from exc
    return model


def _load_hub(model_id: str) -> GPT2LMHeadModel:
    from transformers import GPT2Config, GPT2LMHeadModel

    try:
        config = GPT2Config.from_pretrained(model_id)
        FAMILY.check_config({"model_type": config.model_type}, model_id)
        return GPT2LMHeadModel.from_pretrained(model_id, use_safetensors=True)
    except OSError as exc:
        raise KvexportError(
            f"--model {model_id}: not a local directory and the hub could not serve it "
            "(offline?); pass a local model directory, or --random-init for seeded random weights"
        ) from exc
