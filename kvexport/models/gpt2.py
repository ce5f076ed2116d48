"""GPT-2 loading and the two exportable wrappers (prefill and decode).

Transformers 5 passes the KV cache as a ``DynamicCache`` object, which neither torch
exporter can take as a graph input or output. The wrappers here take and return the
cache as flat tensors (``past.<l>.key``, ``past.<l>.value``, ...), build the cache object
inside ``forward`` and flatten it again on the way out, so the exported graphs have
plain tensor IO.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import torch
from transformers import DynamicCache, GPT2Config, GPT2LMHeadModel

from kvexport.errors import KvexportError, first_line
from kvexport.model_info import Dtype, ModelDims, ModelSource

__all__ = [
    "PRESETS",
    "DecodeModule",
    "Dtype",
    "ModelDims",
    "ModelSource",
    "PrefillModule",
    "load_gpt2",
    "resolve_source",
    "weights_fingerprint",
]


TORCH_DTYPES: dict[str, torch.dtype] = {"fp32": torch.float32, "fp16": torch.float16}

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
    """Turn the CLI's ``--model`` / ``--random-init`` / ``--seed`` into a :class:`ModelSource`."""
    if random_init:
        config = _random_init_config(model)
        return ModelSource(kind="random-init", name=model, seed=seed, config=config)
    path = Path(model)
    if path.exists():
        if not path.is_dir():
            raise KvexportError(
                f"--model {model}: is a file; pass a Hugging Face model directory "
                "(config.json + model.safetensors), or a config with --random-init"
            )
        return ModelSource(kind="local", name=str(path.resolve()))
    if model.startswith((".", "/", "~")) or model.count("/") > 1:
        raise KvexportError(
            f"--model {model}: no such directory; pass an existing model directory, a hub id, "
            "or --random-init"
        )
    return ModelSource(kind="hub", name=model)


def _random_init_config(model: str) -> dict[str, Any]:
    if model in PRESETS:
        numbers: dict[str, Any] = {**PRESETS[model], **_PRESET_COMMON}
        return GPT2Config(**numbers).to_dict()
    path = Path(model)
    if path.is_dir():
        path = path / "config.json"
    if not path.is_file():
        raise KvexportError(
            f"--random-init --model {model}: not a preset ({', '.join(PRESETS)}) "
            "and no config.json there; name a preset or a GPT-2 config file"
        )
    try:
        data = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise KvexportError(
            f"{path}: not a readable JSON config ({exc}); fix or replace it"
        ) from exc
    _check_gpt2(data.get("model_type"), str(path))
    vocab_size = int(data.get("vocab_size", _PRESET_COMMON["vocab_size"]))
    for special in ("bos_token_id", "eos_token_id"):
        # GPT2Config defaults these to GPT-2's 50256, which a smaller vocabulary lacks.
        data.setdefault(special, None if vocab_size <= 50256 else 50256)
    return GPT2Config(**{k: v for k, v in data.items() if k != "model_type"}).to_dict()


def _check_gpt2(model_type: object, where: str) -> None:
    if model_type != "gpt2":
        raise KvexportError(
            f"{where}: model_type is {model_type!r}; kvexport exports GPT-2 models (model_type 'gpt2')"
        )


def load_gpt2(
    source: ModelSource, dtype: Dtype = "fp32", allow_pickle: bool = False
) -> GPT2LMHeadModel:
    """Build or load the GPT-2 model a source names, in eval mode and the given dtype."""
    if source.kind == "random-init":
        assert source.config is not None, "random-init source carries its config"
        config = GPT2Config(**{k: v for k, v in source.config.items() if k != "model_type"})
        torch.manual_seed(source.seed or 0)
        model = GPT2LMHeadModel(config)
    elif source.kind == "local":
        model = _load_local(Path(source.name), allow_pickle)
    else:
        model = _load_hub(source.name)
    model.eval()
    converted: GPT2LMHeadModel = model.to(dtype=TORCH_DTYPES[dtype])  # type: ignore[call-arg]
    return converted


def _load_local(path: Path, allow_pickle: bool) -> GPT2LMHeadModel:
    config_path = path / "config.json"
    if not config_path.is_file():
        raise KvexportError(f"{path}: no config.json; pass a Hugging Face model directory")
    try:
        model_type = json.loads(config_path.read_text()).get("model_type")
    except json.JSONDecodeError as exc:
        raise KvexportError(f"{config_path}: not valid JSON ({exc}); fix or replace it") from exc
    _check_gpt2(model_type, str(config_path))
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
    try:
        config = GPT2Config.from_pretrained(model_id)
        _check_gpt2(config.model_type, model_id)
        return GPT2LMHeadModel.from_pretrained(model_id, use_safetensors=True)
    except OSError as exc:
        raise KvexportError(
            f"--model {model_id}: not a local directory and the hub could not serve it "
            "(offline?); pass a local model directory, or --random-init for seeded random weights"
        ) from exc


def weights_fingerprint(model: torch.nn.Module) -> str:
    """SHA-256 over every parameter (name, dtype, shape, bytes), in name order.

    Verify compares this with the manifest so that a reference rebuilt from a different
    checkpoint (or a different torch RNG) is reported as such, not as a numeric mismatch.
    """
    digest = hashlib.sha256()
    for name, tensor in sorted(model.state_dict().items()):
        array = tensor.detach().cpu().contiguous()
        digest.update(f"{name}:{array.dtype}:{tuple(array.shape)};".encode())
        digest.update(array.view(torch.uint8).numpy().data if array.numel() else b"")
    return digest.hexdigest()


def cache_layers(cache: DynamicCache) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(key, value) per layer of a filled cache, each ``[batch, H, total_sequence, D]``."""
    pairs = []
    for layer in cache.layers:
        keys, values = getattr(layer, "keys", None), getattr(layer, "values", None)
        assert isinstance(keys, torch.Tensor) and isinstance(values, torch.Tensor), (
            "cache layer is filled"
        )
        pairs.append((keys, values))
    return pairs


def _flatten_cache(cache: DynamicCache) -> list[torch.Tensor]:
    return [tensor for pair in cache_layers(cache) for tensor in pair]


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


def _lm_head(model: GPT2LMHeadModel, hidden: torch.Tensor) -> torch.Tensor:
    """Logits from [batch, rows, n_embd] hidden states, through a 2-D product.

    The dynamo exporter turns the 2-D form into ``Gemm(W, transB=1)``, which reads the tied
    weight where it is stored; a 3-D product exports as ``MatMul(X, Transpose(W))``, which
    ONNX Runtime folds into a private transposed copy per session. (Where an exporter
    emits ``MatMul(X2d, Transpose(W))``, the ``transposed_weight_gemm`` pass rewrites it.)
    """
    batch, rows, n_embd = hidden.shape
    logits = model.lm_head(hidden.reshape(batch * rows, n_embd))  # [batch * rows, V]
    return logits.reshape(batch, rows, model.config.vocab_size)  # [batch, rows, V]


class PrefillModule(torch.nn.Module):
    """Prompt graph: ``(input_ids, attention_mask, position_ids) -> (logits, *present)``.

    With ``all_logits=False`` the LM head runs on one position per row, giving logits
    ``[batch, 1, V]``: the row's last real token, the last 1 of its mask. Left padding puts
    it in the last column; right-padded prompts (onnxruntime-genai's convention) end
    earlier. The mask may be wider than the tokens fed (a chunk after a past, or one token
    over a mask as wide as an in-place buffer): the tokens end where the row's mask ends,
    so the index is the tokens' length less one less the columns after the row's last 1,
    and at least 0.
    """

    def __init__(self, model: GPT2LMHeadModel, all_logits: bool = False) -> None:
        super().__init__()
        self.model = model
        self.all_logits = all_logits

    def forward(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor, position_ids: torch.Tensor
    ) -> tuple[torch.Tensor, ...]:
        """Run the prompt; return last-position (or all) logits and the presents."""
        cache = DynamicCache(config=self.model.config)
        hidden = _transformer(
            self.model, input_ids, cache, attention_mask, position_ids
        )  # [batch, sequence, n_embd]
        if not self.all_logits:
            # The mask's width and the tokens' length share one dim name in this graph, so any
            # length read off a shape is the mask's: count the columns after each row's last 1
            # from the mask's values, and the tokens fed from their values (ids are >= 0).
            ones_from_here = attention_mask.sum(-1, keepdim=True) - attention_mask.cumsum(-1) + attention_mask
            trailing = (ones_from_here == 0).sum(-1)  # [batch]
            fed = (input_ids != -1).sum(-1)  # [batch]
            index = (fed - 1 - trailing).clamp(min=0)
            hidden = hidden.gather(1, index.view(-1, 1, 1).expand(-1, 1, hidden.shape[-1]))  # [batch, 1, n_embd]
        return (_lm_head(self.model, hidden), *_flatten_cache(cache))


class DecodeModule(torch.nn.Module):
    """One-step graph: ``(input_ids, attention_mask, position_ids, *past) -> (logits, *present)``.

    ``past`` is flat: ``past.0.key, past.0.value, past.1.key, ...``, each
    ``[batch, H, past_sequence, D]``; presents come back ``[batch, H, past_sequence + 1, D]``.
    """

    def __init__(self, model: GPT2LMHeadModel) -> None:
        super().__init__()
        self.model = model

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        position_ids: torch.Tensor,
        *past: torch.Tensor,
    ) -> tuple[torch.Tensor, ...]:
        """Run one token against the past; return its logits and the grown presents."""
        pairs = [(past[2 * layer], past[2 * layer + 1]) for layer in range(len(past) // 2)]
        cache = DynamicCache(pairs, config=self.model.config)
        hidden = _transformer(
            self.model, input_ids, cache, attention_mask, position_ids
        )  # [batch, 1, n_embd]
        return (_lm_head(self.model, hidden), *_flatten_cache(cache))
