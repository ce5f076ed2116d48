"""CUDA-graph decode, checked without a GPU: what a capture cannot hold, the capacity buckets,
and the fixed-address decode step run uncaptured (``static_decode``) on CPU against the plain
path, token for token (Generator and engine). The capture itself needs a GPU
(``scripts/gpu_check.py``).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import pytest
from click.testing import CliRunner
from onnx import TensorProto, helper

from kvexport import (
    Engine,
    Generator,
    KvexportError,
    ProviderError,
    SamplingParams,
    export_gpt2,
    export_model,
)
from kvexport.cli import main
from kvexport.runtime.cuda_graph import (
    MIN_CAPACITY,
    NO_CAPTURE,
    CudaGraphError,
    GraphIds,
    check_fixed_decode,
    decode_capacity,
    graph_run_options,
    step_mask,
    uncapturable_nodes,
)
from kvexport.runtime.session import CUDA_GRAPH_OPTIONS, session_providers

from .conftest import TINY, TRAINED, write_config
from .test_families import FAMILY_CONFIGS

REFUSED_ON_CPU = (
    "--cuda-graph needs the CUDA provider (this runs on cpu); use --provider cuda on a machine with a GPU, "
    "or drop --cuda-graph"
)


@pytest.fixture(scope="module")
def exports(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The trained GPT-2 and a tiny Llama for ort-cpu (fp32, in place), and fp16 ort-cuda exports of each family."""
    root = tmp_path_factory.mktemp("cuda-graph")
    llama = write_config(root / "llama-config", FAMILY_CONFIGS["llama"])
    tiny = write_config(root / "gpt2-config", TINY)
    return {
        "gpt2": export_gpt2(root / "gpt2", str(TRAINED), target="ort-cpu").out_dir,
        "llama": export_model(root / "llama", str(llama), random_init=True, seed=3, target="ort-cpu").out_dir,
        "gpt2-cuda": export_gpt2(root / "gpt2-cuda", str(tiny), random_init=True, seed=1, target="ort-cuda").out_dir,
        "llama-cuda": export_model(root / "llama-cuda", str(llama), random_init=True, seed=3, target="ort-cuda").out_dir,
    }


def _model(nodes: list[onnx.NodeProto], inputs: list[onnx.ValueInfoProto], outputs: list[onnx.ValueInfoProto]) -> onnx.ModelProto:
    graph = helper.make_graph(nodes, "g", inputs, outputs)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)])


def test_control_flow_and_an_op_without_a_cuda_kernel_are_uncapturable() -> None:
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [4])
    flag = helper.make_tensor_value_info("flag", TensorProto.BOOL, [])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [4])
    u = helper.make_tensor_value_info("u", TensorProto.FLOAT, None)
    branch = helper.make_graph([helper.make_node("Identity", ["x"], ["r"])], "b", [], [helper.make_tensor_value_info("r", TensorProto.FLOAT, [4])])
    nodes = [
        helper.make_node("If", ["flag"], ["y"], name="choose", then_branch=branch, else_branch=branch),
        helper.make_node("Unique", ["x"], ["u"], name="distinct"),  # no CUDA kernel: runs on the CPU provider
        helper.make_node("Relu", ["x"], ["z"], name="fine"),
    ]
    found = uncapturable_nodes(_model(nodes, [x, flag], [y, u]))
    assert len(found) == 2
    assert found[0] == "choose (If: control flow)"
    assert found[1].startswith("distinct (Unique (ai.onnx opset 17) has no CUDA kernel at all")
    assert uncapturable_nodes(_model([nodes[2]], [x], [helper.make_tensor_value_info("z", TensorProto.FLOAT, [4])])) == []


def _attention(total_from_input: bool) -> onnx.ModelProto:
    """A GroupQueryAttention (fp16) whose total_sequence_length comes from the mask's shape, or from a graph input's values."""
    half = [helper.make_tensor_value_info(n, TensorProto.FLOAT16, shape) for n, shape in (
        ("q", [1, 1, 32]), ("k", [1, 1, 32]), ("v", [1, 1, 32]), ("past_k", [1, 2, 8, 16]), ("past_v", [1, 2, 8, 16]))]
    mask = helper.make_tensor_value_info("attention_mask", TensorProto.INT64, [1, 8])
    seqlens = helper.make_tensor_value_info("seqlens_k", TensorProto.INT32, [1])
    nodes = [helper.make_node("Shape", ["attention_mask"], ["shape"], start=1, end=2),
             helper.make_node("Cast", ["shape"], ["total"], to=TensorProto.INT32)]
    inputs = [*half, mask, seqlens]
    if total_from_input:
        inputs.append(helper.make_tensor_value_info("total_sequence_length", TensorProto.INT32, [1]))
        nodes = []
    total = "total_sequence_length" if total_from_input else "total"
    nodes.append(helper.make_node(
        "GroupQueryAttention", ["q", "k", "v", "past_k", "past_v", "seqlens_k", total], ["out", "present_k", "present_v"],
        domain="com.microsoft", name="attention", num_heads=2, kv_num_heads=2,
    ))
    outputs = [helper.make_tensor_value_info(n, TensorProto.FLOAT16, None) for n in ("out", "present_k", "present_v")]
    return _model(nodes, inputs, outputs)


def test_a_total_sequence_length_read_from_values_is_uncapturable_and_one_from_shapes_is_not() -> None:
    assert uncapturable_nodes(_attention(total_from_input=False)) == []
    found = uncapturable_nodes(_attention(total_from_input=True))
    assert found == [
        "attention (GroupQueryAttention's total_sequence_length, read on the host, comes from the values of "
        "total_sequence_length)"
    ]


@pytest.mark.parametrize("name", ["gpt2-cuda", "llama-cuda"])
def test_ort_cuda_exports_hold_nothing_a_capture_cannot(exports: dict[str, Path], name: str) -> None:
    for graph in ("decode", "prefill"):
        assert uncapturable_nodes(exports[name] / f"{graph}.onnx") == []
    check_fixed_decode(exports[name] / "decode.onnx")  # no error


def test_an_fp32_ort_cpu_export_is_refused_naming_its_attention(exports: dict[str, Path]) -> None:
    with pytest.raises(CudaGraphError) as refused:
        check_fixed_decode(exports["gpt2"] / "decode.onnx")
    message = str(refused.value)
    assert "\n" not in message
    assert message.startswith("--cuda-graph: decode.onnx has nodes a CUDA graph cannot capture: ")
    assert "GroupQueryAttention (com.microsoft opset 1) has no CUDA kernel for inputs (float" in message
    assert message.endswith("export with --target ort-cuda, or drop --cuda-graph")


@pytest.mark.parametrize(
    ("tokens", "positions", "capacity"),
    [(1, 1024, 256), (256, 1024, 256), (257, 1024, 512), (700, 40960, 1024), (40000, 40960, 40960), (60, 64, 64), (64, 64, 64)],
)
def test_capacity_is_the_next_power_of_two_from_256_within_the_positions(tokens: int, positions: int, capacity: int) -> None:
    assert decode_capacity(tokens, positions) == capacity
    assert MIN_CAPACITY == 256


def test_capacity_refuses_more_tokens_than_positions() -> None:
    with pytest.raises(KvexportError, match=r"65 tokens: a fixed decode holds 1\.\.64"):
        decode_capacity(65, 64)


def test_graph_ids_and_run_options() -> None:
    ids = GraphIds()
    assert [ids(1, 256), ids(2, 256), ids(1, 512), ids(1, 256)] == [1, 2, 3, 1]  # 0 is ONNX Runtime's own
    assert graph_run_options(3).get_run_config_entry("gpu_graph_id") == "3"
    assert graph_run_options(NO_CAPTURE).get_run_config_entry("gpu_graph_id") == "-1"
    with pytest.raises(ValueError, match="gpu_graph_id 0"):
        graph_run_options(0)


def test_cuda_graph_is_a_cuda_provider_option_and_refused_on_cpu() -> None:
    cuda, cpu = session_providers("cuda", cuda_graph=True)
    assert cuda == ("CUDAExecutionProvider", {"use_tf32": "0", **CUDA_GRAPH_OPTIONS}) and cpu == "CPUExecutionProvider"
    assert CUDA_GRAPH_OPTIONS == {"enable_cuda_graph": "1"}
    assert session_providers("cuda")[0] == ("CUDAExecutionProvider", {"use_tf32": "0"})
    with pytest.raises(ProviderError) as refused:
        session_providers("cpu", cuda_graph=True)
    assert str(refused.value) == REFUSED_ON_CPU


def test_step_mask_keeps_the_prompts_padding() -> None:
    prompt = np.array([[0, 0, 1], [1, 1, 1]])
    assert step_mask([4, 4], 6, prompt).tolist() == [[0, 0, 1, 1, 0, 0], [1, 1, 1, 1, 0, 0]]


@pytest.mark.parametrize("name", ["gpt2", "llama"])
def test_static_decode_gives_the_plain_paths_tokens(exports: dict[str, Path], name: str) -> None:
    plain, static = Generator(exports[name]), Generator(exports[name], static_decode=True, trace_cache=True)
    one = [5, 17, 42, 7, 99, 3, 12]
    ragged = [[5, 17, 42, 7, 99, 3, 12], [8, 1, 30]]  # left-padded
    for prompt in (one, ragged, one):
        want = plain.generate(prompt, 24, eos_token_id=-1)
        got = static.generate(prompt, 24, eos_token_id=-1)
        np.testing.assert_array_equal(got, want)
    # one fixed step per (rows, capacity), kept: a second generation of one row reuses its cache's addresses
    capacity = min(256, plain.max_positions)
    assert sorted(static._fixed) == [(1, capacity), (2, capacity)]
    static.generate(one, 4, eos_token_id=-1)
    first = static.last_stats.cache_pointers
    assert len(first) == 2 and first[0] and first[0] == dict(zip(first[0], first[1].values(), strict=True))  # past is present
    static.generate([9, 9, 9], 4, eos_token_id=-1)
    assert static.last_stats.cache_pointers == first


def test_static_decode_through_the_engine_gives_each_prompts_own_tokens(exports: dict[str, Path]) -> None:
    export = exports["gpt2"]
    prompts = [[5, 17, 42, 7, 99, 3, 12], [8, 1, 30], list(range(40, 80)), [77]]
    alone = Generator(export)
    want = [alone.generate([p], 16, eos_token_id=-1)[0, len(p) :].tolist() for p in prompts]
    greedy = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    with Engine(export, slots=4, max_context=128, chunk=16, static_decode=True, warm_up=0) as engine:
        got = [h.result()[0] for h in engine.submit_all([(p, greedy) for p in prompts])]
        rows = sorted(engine.runner._fixed)
    assert got == want
    assert rows and all(1 <= r <= 4 for r in rows)


def test_cuda_graph_on_cpu_is_refused_by_the_generator_and_the_engine(exports: dict[str, Path]) -> None:
    with pytest.raises(ProviderError) as refused:
        Generator(exports["gpt2-cuda"], cuda_graph=True)
    assert str(refused.value) == REFUSED_ON_CPU
    with pytest.raises(ProviderError) as refused:
        Engine(exports["gpt2"], slots=2, cuda_graph=True, warm_up=0)
    assert str(refused.value) == REFUSED_ON_CPU


@pytest.mark.parametrize("command", ["generate", "bench", "serve"])
def test_the_cuda_graph_flag_is_refused_on_cpu_in_one_line(exports: dict[str, Path], command: str) -> None:
    args = [command, str(exports["gpt2"]), "--cuda-graph"] + (["--prompt", "Hello"] if command == "generate" else [])
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 2, result.output
    assert result.output.strip().splitlines()[-1] == f"Error: {REFUSED_ON_CPU}"
    assert "Traceback" not in result.output


def test_a_cache_that_grows_by_concatenation_has_no_fixed_step(tiny_export: Path) -> None:
    with pytest.raises(KvexportError) as refused:
        Generator(tiny_export, static_decode=True)
    assert str(refused.value) == (
        f"{tiny_export}: has the concat cache layout; --cuda-graph and static_decode need a decode step of one shape: "
        "export with --target ort-cpu or ort-cuda (or --cache shared-buffer)"
    )
