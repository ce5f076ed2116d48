"""onnxruntime-genai files for an export, so ``og.Model(dir)`` runs it from C, C#, Java or Python.

onnxruntime-genai drives one ``"type": "decoder"`` graph for both phases and keeps the cache
in buffers that past and present share (``past_present_share_buffer``). kvexport's in-place
layout (``--cache shared-buffer``) is exactly that: its prefill graph takes a past of any
length (GroupQueryAttention handles the prompt and each new token), so ``genai_config.json``
names ``prefill.onnx`` as the decoder. The concat layout (a new, longer present each step)
is not what onnxruntime-genai expects of a shared buffer, so no config is written for it.

``tokenizer_config.json`` is what onnxruntime-genai's tokenizer loader needs beside
``tokenizer.json`` (the tokenizer class and the special tokens).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from kvexport.bundle.model_info import ModelDims

GENAI_CONFIG = "genai_config.json"
TOKENIZER_CONFIG = "tokenizer_config.json"


def genai_unsupported_reason(cache_layout: str, tokenizer_file: str | None) -> str | None:
    """Why an export gets no onnxruntime-genai files, or None when it does."""
    if cache_layout != "shared-buffer":
        return (
            "the concat cache layout grows present by one row per step; onnxruntime-genai needs the "
            "in-place layout (--target ort-cpu / ort-cuda, or --cache shared-buffer)"
        )
    if not tokenizer_file:
        return "the export has no tokenizer.json for onnxruntime-genai's tokenizer"
    return None


def genai_config(
    dims: ModelDims, target: str, eos_token_id: int | Sequence[int] | None, graph_file: str = "prefill.onnx"
) -> dict[str, Any]:
    """The ``genai_config.json`` object for an in-place-cache export.

    ``eos_token_id``: one id, or every id that ends a generation (Llama 3 lists several;
    onnxruntime-genai takes the list and stops at any); the first is also BOS and padding.
    """
    listed = [eos_token_id] if isinstance(eos_token_id, int) else list(eos_token_id or [0])
    first = listed[0]
    eos: int | list[int] = listed if len(listed) > 1 else first
    provider_options: list[dict[str, Any]] = [{"cuda": {}}] if target == "ort-cuda" else []
    return {
        "model": {
            "type": "decoder",
            "bos_token_id": first,
            "eos_token_id": eos,
            "pad_token_id": first,
            "context_length": dims.max_positions,
            "vocab_size": dims.vocab_size,
            "decoder": {
                "filename": graph_file,
                # 0: ONNX Runtime's own default, a thread per physical core. Left out, onnxruntime-genai
                # 0.18 ran this export's decode at 35 ms/token on 2 cores instead of 18-19 ms.
                "session_options": {
                    "log_id": "onnxruntime-genai",
                    "intra_op_num_threads": 0,
                    "provider_options": provider_options,
                },
                "head_size": dims.head_dim,
                "hidden_size": dims.hidden_size,
                "num_attention_heads": dims.num_heads,
                "num_key_value_heads": dims.num_kv_heads,
                "num_hidden_layers": dims.num_layers,
                "inputs": {
                    "input_ids": "input_ids",
                    "attention_mask": "attention_mask",
                    "position_ids": "position_ids",
                    "past_key_names": "past.%d.key",
                    "past_value_names": "past.%d.value",
                },
                "outputs": {
                    "logits": "logits",
                    "present_key_names": "present.%d.key",
                    "present_value_names": "present.%d.value",
                },
            },
        },
        "search": {
            "do_sample": False,
            "early_stopping": True,
            "length_penalty": 1.0,
            "max_length": dims.max_positions,
            "min_length": 0,
            "no_repeat_ngram_size": 0,
            "num_beams": 1,
            "num_return_sequences": 1,
            "past_present_share_buffer": True,
            "repetition_penalty": 1.0,
            "temperature": 1.0,
            "top_k": 1,
            "top_p": 1.0,
            "diversity_penalty": 0.0,
        },
    }


def tokenizer_config(dims: ModelDims, fields: Mapping[str, Any]) -> dict[str, Any]:
    """The ``tokenizer_config.json`` onnxruntime-genai's loader reads beside ``tokenizer.json``.

    ``fields``: the family's (:attr:`~kvexport.models.base.ModelFamily.genai_tokenizer`).
    """
    return {**fields, "model_max_length": dims.max_positions}


def write_genai_files(
    directory: Path,
    dims: ModelDims,
    target: str,
    cache_layout: str,
    tokenizer: dict[str, Any],
    tokenizer_fields: Mapping[str, Any],
) -> dict[str, Any]:
    """Write the onnxruntime-genai files if the layout allows; what the manifest records of it.

    ``tokenizer_fields``: the family's ``tokenizer_config.json`` fields for onnxruntime-genai,
    written where the checkpoint shipped none.
    """
    reason = genai_unsupported_reason(cache_layout, tokenizer.get("file"))
    if reason is not None:
        return {"written": False, "why": reason}
    config = genai_config(dims, target, tokenizer.get("eos_token_ids") or tokenizer.get("eos_token_id"))
    (directory / GENAI_CONFIG).write_text(json.dumps(config, indent=2) + "\n")
    if not (directory / TOKENIZER_CONFIG).exists():  # the checkpoint's own, if shipped, serves genai too
        (directory / TOKENIZER_CONFIG).write_text(json.dumps(tokenizer_config(dims, tokenizer_fields), indent=2) + "\n")
    return {"written": True, "files": [GENAI_CONFIG, TOKENIZER_CONFIG], "decoder": "prefill.onnx"}
