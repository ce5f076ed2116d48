"""The Llama-style families: Llama (3.x, SmolLM2), Qwen2/2.5, Qwen3, Mistral and Phi-3.

They share one decoder (RMSNorm, rotary positions, grouped-query attention, a gated MLP)
and one set of config keys, so one base class (:class:`LlamaStyleFamily`) serves them and
each family overrides only its presets and what its own ``modeling_<family>.py`` adds:
QKV bias (Qwen2), Q/K RMSNorm and a head dim of its own (Qwen3), a sliding window
(Mistral), fused QKV and gate/up projections with ``longrope`` scaling (Phi-3). The
Hugging Face classes run every quirk; kvexport reads the generic dims and refuses, by
name, the config options it has not verified.

Importing this module needs neither torch nor transformers; loading a model does.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

from kvexport.bundle.model_info import Dtype, ModelDims, ModelSource
from kvexport.errors import KvexportError, first_line
from kvexport.models.base import ModelFamily, read_config
from kvexport.models.gguf import gguf_config, gguf_model
from kvexport.models.tokenizer import TokenizerChoice, checkpoint_tokenizer

if TYPE_CHECKING:
    import torch
    from transformers import PreTrainedModel

__all__ = ["FAMILY", "LLAMA", "MISTRAL", "PHI3", "QWEN2", "QWEN3", "LlamaStyleFamily"]

# The published architectures' config numbers (from each checkpoint's config.json), for
# timing with random weights where no hub is reachable.
_SMOLLM2 = {"vocab_size": 49152, "max_position_embeddings": 8192, "rope_theta": 100000.0, "rms_norm_eps": 1e-5,
            "tie_word_embeddings": True, "bos_token_id": 0, "eos_token_id": 0}
_LLAMA_3 = {"vocab_size": 128256, "max_position_embeddings": 131072, "rms_norm_eps": 1e-5, "tie_word_embeddings": True,
            "bos_token_id": 128000, "eos_token_id": 128001, "head_dim": 64,
            "rope_scaling": {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                             "original_max_position_embeddings": 8192},
            "rope_theta": 500000.0}
_QWEN = {"vocab_size": 151936, "rms_norm_eps": 1e-6, "rope_theta": 1000000.0, "tie_word_embeddings": True,
         "bos_token_id": 151643, "eos_token_id": 151643}


def _renamed_rope(config: dict[str, Any]) -> dict[str, Any]:
    """``config`` with Phi-3's early name for longrope, ``su``, given its later name.

    The same scaling (short and long factors, switched by length); Phi-3 checkpoints saved
    before the rename say ``"type": "su"``, which transformers 5 maps to ``longrope`` but then
    fails to load (it looks for ``original_max_position_embeddings`` inside the scaling).
    """
    rope = config.get("rope_scaling")
    if isinstance(rope, Mapping) and "su" in (rope.get("type"), rope.get("rope_type")):
        renamed = {key: value for key, value in rope.items() if key not in ("type", "rope_type")}
        return {**config, "rope_scaling": {**renamed, "type": "longrope"}}
    return config


def _config_keys(config: Mapping[str, Any]) -> tuple[int, int, int]:
    heads = int(config["num_attention_heads"])
    kv_heads = int(config.get("num_key_value_heads") or heads)
    head_dim = int(config.get("head_dim") or int(config["hidden_size"]) // heads)
    return heads, kv_heads, head_dim


class LlamaStyleFamily(ModelFamily):
    """A Llama-style decoder family: one model_type, its presets, and the options it has verified."""

    name: ClassVar[str]
    model_types: ClassVar[tuple[str, ...]]
    presets: ClassVar[Mapping[str, Mapping[str, Any]]] = {}
    # ``--attention``: the standard ops, or ONNX Runtime's GroupQueryAttention from the export itself
    attention_kinds = frozenset({"unfused", "ort"})
    in_place_attention = True
    # onnxruntime-genai 0.18 runs these in-place exports as the Generator does (tests/test_examples.py)
    genai_tried = True
    # config options that change the graph and that this family's tests cover, by value
    _rope_types: ClassVar[frozenset[str]] = frozenset({"default"})

    def layer_windows(self, config: Mapping[str, Any]) -> list[int]:
        """The window transformers applies per layer: ``sliding_window`` where ``layer_types`` says sliding.

        Read through transformers' config class, which drops Qwen2's window unless
        ``use_sliding_window`` is set; a config without ``layer_types`` (Mistral, Phi-3)
        windows every layer.
        """
        from transformers import AutoConfig

        settings = {k: v for k, v in config.items() if k not in ("model_type", "transformers_version", "architectures")}
        loaded = AutoConfig.for_model(str(config["model_type"]), **settings)
        window = getattr(loaded, "sliding_window", None)
        kinds = getattr(loaded, "layer_types", None) or ["sliding_attention"] * int(loaded.num_hidden_layers)
        return [int(window) if window and kind == "sliding_attention" else -1 for kind in kinds]

    def random_init_config(self, model: str) -> dict[str, Any]:
        """A preset's config, or a config file's, with transformers' defaults filled in."""
        from transformers import AutoConfig

        if model in self.presets:
            data: dict[str, Any] = {"model_type": self.model_types[0], **self.presets[model]}
        else:
            path = Path(model)
            if not (path / "config.json" if path.is_dir() else path).is_file():
                raise KvexportError(
                    f"--random-init --model {model}: not a preset ({self.describe_presets()}) "
                    f"and no config.json there; name a preset or a {self.name} config file"
                )
            data = _renamed_rope(read_config(path))
            self.check_config(data, str(path))
        config = AutoConfig.for_model(**data)
        full: dict[str, Any] = config.to_dict()
        self.check_supported(full, model)
        return full

    def check_supported(self, config: Mapping[str, Any], where: str) -> None:
        """Refuse, by name, a config option this family's export has not been verified with."""
        rope = config.get("rope_parameters") or config.get("rope_scaling") or {}
        rope_type = rope.get("rope_type", rope.get("type", "default")) if isinstance(rope, Mapping) else "default"
        if rope_type not in self._rope_types:
            raise KvexportError(
                f"{where}: rope type {rope_type!r} is not one kvexport has verified for {self.name} "
                f"({', '.join(sorted(self._rope_types))})"
            )

    def check_export(self, config: Mapping[str, Any], attention: str, where: str) -> None:
        """A sliding window needs ort attention: GroupQueryAttention's ``local_window_size`` applies it."""
        window = config.get("sliding_window")
        if window is None or not config.get("use_sliding_window", True):
            return
        if int(window) < int(config["max_position_embeddings"]) and attention != "ort":
            # the standard-ops graph's decode step differs from PyTorch past the window
            raise KvexportError(
                f"{where}: sliding_window {window} is exported with ort attention only "
                "(GroupQueryAttention's local window); use --target ort-cpu or ort-cuda"
            )

    def dims(self, config: Mapping[str, Any]) -> ModelDims:
        """The generic dims from the keys every Llama-style config shares."""
        heads, kv_heads, head_dim = _config_keys(config)
        return ModelDims(
            num_layers=int(config["num_hidden_layers"]),
            num_heads=heads,
            num_kv_heads=kv_heads,
            head_dim=head_dim,
            hidden_size=int(config["hidden_size"]),
            vocab_size=int(config["vocab_size"]),
            max_positions=int(config["max_position_embeddings"]),
        )

    def load(self, source: ModelSource, dtype: Dtype = "fp32", allow_pickle: bool = False) -> PreTrainedModel:
        """Build (seeded) or load the model a source names, in eval mode and the given dtype."""
        import torch
        from transformers import AutoConfig, AutoModelForCausalLM

        dtypes = {"fp32": torch.float32, "fp16": torch.float16}
        if source.kind == "random-init":
            assert source.config is not None, "random-init source carries its config"
            config = AutoConfig.for_model(**source.config)
            config._attn_implementation = "eager"  # the reference verify compares against
            torch.manual_seed(source.seed or 0)
            model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        elif source.kind == "local":
            model = self._load_local(Path(source.name), allow_pickle)
        elif source.kind == "gguf":
            model = self._load_gguf(Path(source.name))
        else:
            raise KvexportError(
                f"--model {source.name}: no such directory; pass a local model directory "
                "(config.json + safetensors + tokenizer files), or --random-init with a preset"
            )
        model.eval()
        converted: PreTrainedModel = model.to(dtype=dtypes[dtype])
        # The rotary frequencies stay fp32 whatever the dtype, as transformers computes the angles:
        # Phi-3's longrope picks between its fp32 long factors and these in the graph, and an fp16
        # buffer there stops torch.export ("Tensor dtype mismatch! Expected: torch.float16").
        for module in converted.modules():
            for name in ("inv_freq", "original_inv_freq"):
                value = getattr(module, name, None)
                if isinstance(value, torch.Tensor) and value.dtype != torch.float32:
                    setattr(module, name, value.float())
        # One eager call builds what rope updates build lazily on their first call (Phi-3's long
        # factors): built during an export's trace instead, it would stay a fake tensor on the
        # module and break the next graph's export.
        with torch.no_grad():
            converted(torch.zeros((1, 1), dtype=torch.int64))
        return converted

    def _load_local(self, path: Path, allow_pickle: bool) -> PreTrainedModel:
        from transformers import AutoConfig, AutoModelForCausalLM

        config = _renamed_rope(read_config(path))
        self.check_config(config, str(path / "config.json"))
        self.check_supported(config, str(path / "config.json"))
        has_safetensors = any(path.glob("*.safetensors"))
        if not has_safetensors and not allow_pickle:
            raise KvexportError(
                f"{path}: no .safetensors weights (a pickle checkpoint can run code when loaded); "
                "convert to safetensors, or pass --allow-pickle if you trust it"
            )
        try:
            model = AutoModelForCausalLM.from_pretrained(
                path, config=AutoConfig.for_model(**config), use_safetensors=has_safetensors, attn_implementation="eager"
            )
        except (OSError, ValueError, RuntimeError) as exc:
            raise KvexportError(f"{path}: could not load the model ({first_line(exc)})") from exc
        result: PreTrainedModel = model
        return result

    def _load_gguf(self, path: Path) -> PreTrainedModel:
        from transformers import AutoConfig

        config = _renamed_rope(gguf_config(path))
        self.check_config(config, str(path))
        self.check_supported(config, str(path))
        built = AutoConfig.for_model(**config)
        built._attn_implementation = "eager"  # the reference verify compares against
        result: PreTrainedModel = gguf_model(path, built)
        return result

    def prefill_module(self, model: PreTrainedModel, all_logits: bool = False) -> torch.nn.Module:
        """The prompt graph's module over the decoder (``model.model``)."""
        from kvexport.models.wrappers import PrefillModule, decoder_body

        return PrefillModule(model, decoder_body, all_logits=all_logits)

    def decode_module(self, model: PreTrainedModel) -> torch.nn.Module:
        """The one-step graph's module over the decoder."""
        from kvexport.models.wrappers import DecodeModule, decoder_body

        return DecodeModule(model, decoder_body)

    def in_place_module(self, model: PreTrainedModel, last_only: bool = True) -> torch.nn.Module:
        """Either graph over the in-place cache, attention as GroupQueryAttention."""
        from kvexport.models.wrappers import InPlaceModule

        return InPlaceModule(model, last_only=last_only)

    def tokenizer(self, model_dir: Path | None, vocab_size: int) -> TokenizerChoice:
        """The checkpoint's own ``tokenizer.json`` and its EOS tokens; none for a random-init model."""
        return checkpoint_tokenizer(model_dir, vocab_size)


class _Llama(LlamaStyleFamily):
    """Llama 2/3.x and SmolLM2 (tied embeddings; Llama 3's ``llama3`` rope scaling)."""

    name = "llama"
    model_types = ("llama",)
    presets: ClassVar[Mapping[str, Mapping[str, Any]]] = {
        "smollm2-135m": {**_SMOLLM2, "hidden_size": 576, "intermediate_size": 1536, "num_hidden_layers": 30,
                         "num_attention_heads": 9, "num_key_value_heads": 3},
        "smollm2-360m": {**_SMOLLM2, "hidden_size": 960, "intermediate_size": 2560, "num_hidden_layers": 32,
                         "num_attention_heads": 15, "num_key_value_heads": 5},
        "llama-3.2-1b": {**_LLAMA_3, "hidden_size": 2048, "intermediate_size": 8192, "num_hidden_layers": 16,
                         "num_attention_heads": 32, "num_key_value_heads": 8},
    }
    _rope_types = frozenset({"default", "llama3"})


class _Qwen2(LlamaStyleFamily):
    """Qwen2 and Qwen2.5 (bias on the Q, K and V projections)."""

    name = "qwen2"
    model_types = ("qwen2",)
    presets: ClassVar[Mapping[str, Mapping[str, Any]]] = {
        "qwen2.5-0.5b": {**_QWEN, "hidden_size": 896, "intermediate_size": 4864, "num_hidden_layers": 24,
                         "num_attention_heads": 14, "num_key_value_heads": 2, "max_position_embeddings": 32768},
    }


class _Qwen3(LlamaStyleFamily):
    """Qwen3 (RMSNorm on Q and K per head; a head dim of its own, not hidden / heads)."""

    name = "qwen3"
    model_types = ("qwen3",)
    presets: ClassVar[Mapping[str, Mapping[str, Any]]] = {
        "qwen3-0.6b": {**_QWEN, "hidden_size": 1024, "intermediate_size": 3072, "num_hidden_layers": 28,
                       "num_attention_heads": 16, "num_key_value_heads": 8, "head_dim": 128,
                       "max_position_embeddings": 40960},
    }


class _Mistral(LlamaStyleFamily):
    """Mistral (a sliding attention window)."""

    name = "mistral"
    model_types = ("mistral",)


class _Phi3(LlamaStyleFamily):
    """Phi-3 (fused QKV and gate/up projections; ``longrope`` scaling with short and long factors)."""

    name = "phi3"
    model_types = ("phi3",)
    _rope_types = frozenset({"default", "longrope"})


LLAMA, QWEN2, QWEN3, MISTRAL, PHI3 = _Llama(), _Qwen2(), _Qwen3(), _Mistral(), _Phi3()
FAMILY = LLAMA
BY_MODEL_TYPE: dict[str, LlamaStyleFamily] = {f.model_types[0]: f for f in (LLAMA, QWEN2, QWEN3, MISTRAL, PHI3)}
