"""The bundled GPT-2 tokenizer and the choice of which tokenizer an export ships."""

from __future__ import annotations

from pathlib import Path

import pytest
from tokenizers import Tokenizer

from kvexport.models.tokenizer import GPT2_EOS_TOKEN_ID, choose_tokenizer, gpt2_tokenizer


def test_bundled_tokenizer_is_real_gpt2_bpe() -> None:
    tokenizer = gpt2_tokenizer()
    assert tokenizer.get_vocab_size() == 50257
    assert tokenizer.encode("The sky is").ids == [464, 6766, 318]
    assert tokenizer.token_to_id("<|endoftext|>") == GPT2_EOS_TOKEN_ID
    text = "Hello world<|endoftext|> naïve 東京 "
    assert tokenizer.decode(tokenizer.encode(text).ids, skip_special_tokens=False) == text


@pytest.mark.parametrize(
    "text",
    ["The sky is", "  two leading spaces,\ttabs\nand newlines\n", "naïve café — 東京 🙂", "<|endoftext|>"],
)
def test_exported_tokenizer_round_trips(tiny_export: Path, text: str) -> None:
    tokenizer = Tokenizer.from_file(str(tiny_export / "tokenizer.json"))
    ids = tokenizer.encode(text).ids
    assert tokenizer.decode(ids, skip_special_tokens=False) == text


def test_exported_tokenizer_has_gpt2_ids(tiny_export: Path) -> None:
    tokenizer = Tokenizer.from_file(str(tiny_export / "tokenizer.json"))
    assert tokenizer.encode("The sky is").ids == [464, 6766, 318]
    assert tokenizer.encode("<|endoftext|>").ids == [50256]


def test_model_directory_tokenizer_wins(tmp_path: Path) -> None:
    own = gpt2_tokenizer()
    own.add_special_tokens(["<|mine|>"])
    own.save(str(tmp_path / "tokenizer.json"))
    choice = choose_tokenizer(tmp_path, 50258)
    assert choice.tokenizer is not None and choice.tokenizer.token_to_id("<|mine|>") == 50257
    assert str(tmp_path / "tokenizer.json") == choice.source


def test_other_vocabularies_get_no_tokenizer() -> None:
    choice = choose_tokenizer(None, 1001)
    assert choice.tokenizer is None and choice.eos_token_id is None
    assert "1001" in choice.source
