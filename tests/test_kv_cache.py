"""A quantized KV cache (``--kv-cache int8|int4``): the graphs, the manifest, quality against PyTorch, the runners."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import onnx
import onnx_ir as ir
import pytest
from click.testing import CliRunner

from kvexport import verify
from kvexport.bundle.manifest import read_manifest
from kvexport.cli import main
from kvexport.export.quantization import CACHE_TOLERANCES
from kvexport.passes.quantize_cache import CacheQuantization, QuantizeCacheError, QuantizeCachePass
from kvexport.runtime import Generator
from kvexport.runtime.cache import SlotCache
from tests.conftest import TRAINED, heldout_report

HELDOUT = TRAINED / "heldout.txt"


@pytest.mark.parametrize(("kind", "element", "width"), [("int8", onnx.TensorProto.INT8, 64), ("int4", onnx.TensorProto.UINT8, 32)])
def test_the_cache_is_quantized_in_every_attention_op_and_recorded(
    trained_exports: dict[str, Path], kind: str, element: int, width: int
) -> None:
    export = trained_exports[f"kv-{kind}"]
    for graph in ("prefill", "decode"):
        proto = onnx.load(str(export / f"{graph}.onnx"), load_external_data=False)
        caches = [v for v in [*proto.graph.input, *proto.graph.output] if v.name.startswith(("past.", "present."))]
        assert len(caches) == 4 * 4  # 4 layers, key and value, past and present
        for value in caches:
            assert value.type.tensor_type.elem_type == element
            assert value.type.tensor_type.shape.dim[3].dim_value == width  # head size 64, two 4-bit values a byte
        attention = [n for n in proto.graph.node if n.op_type == "GroupQueryAttention"]
        assert len(attention) == 4
        for node in attention:
            attrs = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
            assert attrs["k_quant_type"] == attrs["v_quant_type"] == b"PER_CHANNEL"
            assert attrs["kv_cache_bit_width"] == int(kind[3:])
            scales = {i.name: onnx.numpy_helper.to_array(i) for i in proto.graph.initializer if i.name in node.input[12:14]}
            for name in node.input[12:14]:
                assert scales[name].shape == (1, 2, 1, 64) and (scales[name] > 0).all()
    manifest = json.loads((export / "kvexport.json").read_text())
    assert manifest["cache"]["dtype"] == kind
    assert manifest["cache"]["quantization"]["type"] == "PER_CHANNEL"
    assert "calibrated" in manifest["cache"]["quantization"]["scales"]
    assert manifest["genai"]["written"] is False and not (export / "genai_config.json").exists()
    check = CliRunner().invoke(main, ["check", str(export)])
    assert check.exit_code == 0, check.output


@pytest.mark.parametrize("kind", ["int8", "int4"])
def test_a_quantized_cache_stays_within_its_tolerances_against_pytorch_fp32(trained_exports: dict[str, Path], kind: str) -> None:
    report = verify(trained_exports[f"kv-{kind}"], steps=4, text=HELDOUT, text_tokens=100_000, record=False)
    assert report.ok, report.failures()
    assert report.tolerances == CACHE_TOLERANCES[kind]  # the cache's own, not the weights' of the same width
    assert report.text is not None
    # quantized, so not fp32-equal: some error, and int4's more than int8's
    assert report.text.mean_kl > 1e-7
    float_cache = heldout_report(trained_exports["none"], 1)  # once for both caches
    assert float_cache.text is not None and float_cache.text.mean_kl < report.text.mean_kl


def test_each_cache_dtype_loads_in_a_cpu_session_and_generates(trained_exports: dict[str, Path]) -> None:
    prompt = list(range(5, 25))
    tokens = {}
    for name, dtype, width in (("none", np.float32, 64), ("kv-int8", np.int8, 64), ("kv-int4", np.uint8, 32)):
        export = trained_exports[name]
        generator = Generator(export)
        assert generator.cache_dtype is dtype
        tokens[name] = generator.generate([prompt], 12, eos_token_id=-1)[0, len(prompt):].tolist()
        slots = SlotCache(read_manifest(export), "cpu", 2, 40)
        assert slots.cache_dtype is dtype and slots.row_shape == (2, 40, width)
    # greedy over a short prompt: the int8 cache keeps fp32's tokens
    assert tokens["kv-int8"] == tokens["none"]
    assert len(tokens["kv-int4"]) == 12


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--kv-cache", "int8"], "Error: --kv-cache int8 needs the in-place cache (GroupQueryAttention), not --cache concat; use ort attention (kvexport export --target ort-cpu, kvexport import --attention ort)"),
        (["--target", "ort-cpu", "--kv-cache", "fp16"], "Error: --kv-cache fp16 with fp32 graphs: a float cache has the graph's dtype; use --dtype fp16, or --kv-cache int8 / int4"),
        (["--target", "ort-cpu", "--dtype", "fp16", "--kv-cache", "int4"], "Error: --kv-cache int4 needs fp32 graphs (its scales are calibrated on CPU), not fp16; drop --dtype fp16"),
    ],
)
def test_a_cache_that_cannot_be_quantized_is_one_line(tmp_path: Path, args: list[str], message: str) -> None:
    result = CliRunner().invoke(main, ["gpt2", "--out", str(tmp_path / "o"), "--model", str(TRAINED), *args])
    assert result.exit_code == 2
    assert result.stderr.strip() == message
    assert not (tmp_path / "o").exists()


def test_the_pass_refuses_a_graph_without_group_query_attention(trained_exports: dict[str, Path]) -> None:
    graph = onnx.helper.make_graph(
        [onnx.helper.make_node("Identity", ["x"], ["y"])],
        "plain",
        [onnx.helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [1])],
        [onnx.helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [1])],
    )
    model = ir.from_proto(onnx.helper.make_model(graph))
    with pytest.raises(QuantizeCacheError, match="needs GroupQueryAttention"):
        QuantizeCachePass(CacheQuantization(bits=8), {})(model)
    # an already quantized graph is refused too
    quantized = ir.from_proto(onnx.load(str(trained_exports["kv-int8"] / "prefill.onnx"), load_external_data=False))
    with pytest.raises(QuantizeCacheError, match="the cache is INT8 already"):
        QuantizeCachePass(CacheQuantization(bits=8), {f"past.{layer}.{k}": np.ones(1, np.float32) for layer in range(4) for k in ("key", "value")})(quantized)


def test_kv_memory_sizes_the_slots_from_the_cache_dtype(trained_exports: dict[str, Path]) -> None:
    from kvexport.serving import Engine
    from kvexport.serving.engine import slot_bytes

    per_slot = {name: slot_bytes(read_manifest(trained_exports[name]), 64) for name in ("none", "kv-int8", "kv-int4")}
    # 4 layers x K and V x 2 heads x 64 positions x 64 channels: 4 bytes, 1 byte, half a byte each
    assert per_slot == {"none": 2 * 4 * 2 * 64 * 64 * 4, "kv-int8": 2 * 4 * 2 * 64 * 64, "kv-int4": 2 * 4 * 2 * 64 * 32}
    budget = 10 * per_slot["none"] + 1
    for name, slots in (("none", 10), ("kv-int8", 40), ("kv-int4", 80)):  # an 8-bit cache keeps the slot layout
        with Engine(trained_exports[name], kv_memory=budget, max_context=64, warm_up=0, kv_layout="slots") as engine:
            assert engine.slots == slots
            cache = engine.runner.cache
            buffers = sum(cache.banks.host_view(0, i, (cache.slots, *cache.row_shape)).nbytes for i in range(len(cache.past)))
            assert buffers == slots * per_slot[name] <= budget
    # paged (an fp32 cache's default): the same budget is a pool of 16-token blocks, whatever the slots
    with Engine(trained_exports["none"], kv_memory=budget, max_context=64, slots=3, warm_up=0) as engine:
        cache = engine.runner.cache
        assert engine.kv_layout == "paged" and engine.slots == 3 and cache.blocks == budget // (per_slot["none"] // 4)
        buffers = sum(cache.banks.host_view(0, i, cache.pool_shape).nbytes for i in range(len(cache.past)))
        assert buffers == cache.pool_bytes == 40 * per_slot["none"] // 4 <= budget


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (
            ["--slots", "4", "--kv-memory", "1GiB", "--kv-layout", "slots"],
            "Error: --slots and --kv-memory both size the slot layout's cache; give one",
        ),
        (["--kv-memory", "lots"], "Error: 'lots': not a size; write bytes, or a number with B, KB, MB, GB, KiB, MiB or GiB"),
        (
            ["--kv-memory", "1KiB", "--max-context", "64"],
            "Error: kv_memory 1024 bytes holds no slot: one slot of 64 tokens takes 65536 bytes of int8 cache; "
            "give more, or a smaller max_context",
        ),
    ],
)
def test_bad_kv_memory_is_one_line(trained_exports: dict[str, Path], args: list[str], message: str) -> None:
    result = CliRunner().invoke(main, ["serve", str(trained_exports["kv-int8"]), "--port", "0", *args])
    assert result.exit_code == 2
    assert result.stderr.strip() == message
