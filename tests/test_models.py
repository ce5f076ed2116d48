"""Model sources: local directories, presets, configs, and the refusals."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from kvexport import KvexportError, export_gpt2, verify
from kvexport.models.gpt2 import PRESETS, load_gpt2, resolve_source, weights_fingerprint

from .conftest import TINY_ODD, write_config


@pytest.fixture(scope="module")
def local_model_dir(tmp_path_factory: pytest.TempPathFactory, tiny_odd_config: Path) -> Path:
    model = load_gpt2(resolve_source(str(tiny_odd_config), random_init=True, seed=11))
    directory = tmp_path_factory.mktemp("hf") / "local-gpt2"
    model.save_pretrained(directory, safe_serialization=True)
    return directory


def test_local_directory_exports_and_verifies(local_model_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    result = export_gpt2(out, str(local_model_dir))
    assert result.manifest.source.kind == "local"
    assert result.manifest.source.name == str(local_model_dir.resolve())
    expected = weights_fingerprint(
        load_gpt2(resolve_source(str(local_model_dir), random_init=False))
    )
    assert result.manifest.weights_sha256 == expected
    report = verify(out, steps=3)
    assert report.ok, report.failures()


def test_pickle_only_directory_needs_opt_in(local_model_dir: Path, tmp_path: Path) -> None:
    pickled = tmp_path / "pickled"
    pickled.mkdir()
    (pickled / "config.json").write_text((local_model_dir / "config.json").read_text())
    model = load_gpt2(resolve_source(str(local_model_dir), random_init=False))
    torch.save(model.state_dict(), pickled / "pytorch_model.bin")
    with pytest.raises(KvexportError, match="pickle checkpoint .* --allow-pickle"):
        export_gpt2(tmp_path / "out", str(pickled))
    assert not (tmp_path / "out").exists()


def test_refusals_are_one_clear_line(tmp_path: Path) -> None:
    with pytest.raises(KvexportError, match="no such directory"):
        resolve_source("./does/not/exist", random_init=False)
    not_gpt2 = write_config(tmp_path / "llama", {**TINY_ODD, "model_type": "llama"})
    with pytest.raises(KvexportError, match="model_type is 'llama'; kvexport exports GPT-2"):
        resolve_source(str(not_gpt2), random_init=True)
    with pytest.raises(KvexportError, match="not a preset"):
        resolve_source("gpt5", random_init=True)
    (tmp_path / "bad.json").write_text("{not json")
    with pytest.raises(KvexportError, match="not a readable JSON config"):
        resolve_source(str(tmp_path / "bad.json"), random_init=True)


def test_hub_id_without_a_hub_says_what_to_do(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    source = resolve_source("openai-community/gpt2-not-cached", random_init=False)
    assert source.kind == "hub"
    with pytest.raises(KvexportError, match="--random-init"):
        load_gpt2(source)


# The published checkpoints' config.json numbers (openai-community/gpt2, gpt2-medium,
# gpt2-large, gpt2-xl; distilbert/distilgpt2): layers, heads, width.
PUBLISHED = {
    "gpt2": (12, 12, 768),
    "distilgpt2": (6, 12, 768),
    "gpt2-medium": (24, 16, 1024),
    "gpt2-large": (36, 20, 1280),
    "gpt2-xl": (48, 25, 1600),
}


def test_every_preset_is_a_published_architecture() -> None:
    assert set(PRESETS) == set(PUBLISHED)


@pytest.mark.parametrize("preset", sorted(PUBLISHED))
def test_presets_have_the_published_architecture(preset: str) -> None:
    config = resolve_source(preset, random_init=True).config
    assert config is not None
    assert (config["n_layer"], config["n_head"], config["n_embd"]) == PUBLISHED[preset]
    assert config["vocab_size"] == 50257 and config["n_positions"] == 1024


def test_small_vocab_config_does_not_keep_gpt2_special_ids(tmp_path: Path) -> None:
    config = resolve_source(str(write_config(tmp_path, TINY_ODD)), random_init=True).config
    assert config is not None and config["eos_token_id"] is None
    assert json.loads(json.dumps(config))["vocab_size"] == 1001


def test_the_registry_picks_the_family_from_model_type(local_model_dir: Path) -> None:
    from kvexport.models import FAMILIES, family_for, family_of_model

    assert family_of_model(str(local_model_dir), random_init=False).name == "gpt2"
    assert family_of_model("distilgpt2", random_init=True).name == "gpt2"
    assert sorted(FAMILIES) == ["gpt2", "llama", "mistral", "phi3", "qwen2", "qwen3"]
    assert {t: family_for(t).name for t in FAMILIES} == {t: t for t in FAMILIES}
    with pytest.raises(
        KvexportError,
        match=r"^x/config.json: model_type 'gemma' is not a family kvexport exports; known: gpt2, llama, mistral, phi3, qwen2, qwen3$",
    ):
        family_for("gemma", "x/config.json")


def test_gpt2_family_maps_its_config_keys_onto_the_generic_dims(local_model_dir: Path) -> None:
    from transformers import GPT2Config

    from kvexport.bundle.model_info import ModelDims
    from kvexport.models.gpt2 import FAMILY

    config = GPT2Config.from_pretrained(local_model_dir)  # transformers' own reading of the keys
    dims = FAMILY.dims(json.loads((local_model_dir / "config.json").read_text()))
    assert (dims.num_layers, dims.num_heads, dims.num_kv_heads) == (config.num_hidden_layers, config.num_attention_heads, config.num_attention_heads)
    assert (dims.hidden_size, dims.head_dim) == (config.hidden_size, config.hidden_size // config.num_attention_heads)
    assert (dims.vocab_size, dims.max_positions) == (config.vocab_size, config.max_position_embeddings)
    # a manifest of format 1 stored GPT-2's keys: it still reads, as the same dims
    legacy = {"n_layer": dims.num_layers, "n_head": dims.num_heads, "head_dim": dims.head_dim,
              "n_embd": dims.hidden_size, "vocab_size": dims.vocab_size, "n_positions": dims.max_positions}
    assert ModelDims.from_dict(legacy) == dims


def test_export_command_picks_the_family_and_refuses_unknown_ones(local_model_dir: Path, tmp_path: Path) -> None:
    from click.testing import CliRunner

    from kvexport.bundle.manifest import read_manifest
    from kvexport.cli import main

    out = tmp_path / "out"
    result = CliRunner().invoke(main, ["export", "--model", str(local_model_dir), "--out", str(out)])
    assert result.exit_code == 0, result.output
    manifest = read_manifest(out)
    assert manifest.family == "gpt2" and manifest.source.kind == "local"
    assert verify(out, steps=2).ok

    gemma = write_config(tmp_path / "gemma", {**TINY_ODD, "model_type": "gemma"})
    refused = CliRunner().invoke(main, ["export", "--model", str(gemma.parent), "--out", str(tmp_path / "no")])
    assert refused.exit_code == 2
    assert refused.output == (
        f"Error: {gemma.parent / 'config.json'}: model_type 'gemma' is not a family kvexport exports; "
        "known: gpt2, llama, mistral, phi3, qwen2, qwen3\n"
    )
    assert not (tmp_path / "no").exists()
    missing = CliRunner().invoke(main, ["export", "--out", str(tmp_path / "no")])
    assert missing.exit_code == 2 and "Missing option '--model'" in missing.output
