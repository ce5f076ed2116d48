"""ort-cuda exports as ONNX Runtime's CUDA provider takes them, checked without a GPU.

On an H200 every Llama-family ``ort-cuda`` export failed to load: the CUDA provider's
``GroupQueryAttentionFusion`` rewrote attentions whose query and key were rotated straight
from their MatMuls. These tests hold the exports to the form that provider loads (packed
projections, kernels for every ONNX Runtime op's types, from ONNX Runtime's own kernel
table), show that the check finds the broken form, and that the packed graphs still match
PyTorch on the CPU provider.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import onnx_ir as ir
import onnxruntime as ort
import pytest
from click.testing import CliRunner
from onnx import TensorProto, helper

from kvexport import KvexportError, export_model, verify
from kvexport.cli import main
from kvexport.export.exporter import refuse_what_cuda_cannot_load
from kvexport.passes import PackProjectionsPass
from kvexport.progress import silent
from kvexport.runtime.cuda_support import (
    cuda_findings,
    cuda_kernels,
    fusion_findings,
    kernel_findings,
)

from .conftest import write_config
from .test_families import FAMILY_CONFIGS

# the break (llama: rotary straight from the MatMuls), Qwen3's per-head norms between them, Phi-3's
# packed qkv_proj and longrope (whose fp16 export failed in torch.export before its frequencies stayed fp32)
FAMILIES = ("llama", "qwen3", "phi3")


def _export(root: Path, family: str, **choices: object) -> Path:
    config = write_config(root / f"config-{family}", FAMILY_CONFIGS[family])
    out = root / f"{family}-{'-'.join(f'{k}={v}' for k, v in choices.items()) or 'fp16'}"
    export_model(out, str(config), random_init=True, seed=3, **choices)  # type: ignore[arg-type]
    return out


@pytest.fixture(scope="module")
def cuda_exports(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("cuda-exports")
    exports = {family: _export(root, family, target="ort-cuda") for family in FAMILIES}
    # int4 weights and the int8 cache CUDA's GroupQueryAttention takes with fp16 graphs
    exports["llama-int4-kv8"] = _export(root, "llama", target="ort-cuda", quantize="int4", kv_cache="int8")
    return exports


def _rotary_sources(path: Path) -> list[str]:
    """The op each GroupQueryAttention's query and key derive from (through rotary, norms, reshapes, bias)."""
    graph = onnx.load(str(path), load_external_data=False).graph
    producers = {o: n for n in graph.node for o in n.output}
    sources = []
    for node in graph.node:
        if node.op_type != "GroupQueryAttention":
            continue
        for value in node.input[:2]:
            while (producer := producers.get(value)) is not None and producer.op_type not in ("Split", "Slice", "MatMul", "MatMulNBits"):
                value = producer.input[0]
            sources.append(producer.op_type if producer is not None else "input")
    return sources


@pytest.mark.parametrize("name", [*FAMILIES, "llama-int4-kv8"])
def test_ort_cuda_exports_have_no_cuda_break_and_match_pytorch(cuda_exports: dict[str, Path], name: str) -> None:
    export = cuda_exports[name]
    assert [str(f) for f in cuda_findings(export) if f.level == "error"] == []
    for graph in ("prefill", "decode"):
        sources = _rotary_sources(export / f"{graph}.onnx")
        assert sources and all(s in ("Split", "Slice") for s in sources), sources  # one projection MatMul, split
    report = verify(export, steps=4, provider="cpu", record=False)
    assert report.ok, report.failures()


def test_the_check_finds_what_failed_on_the_h200(tmp_path: Path) -> None:
    # the same graphs without the packing: ort-cpu in fp16 is the ort-cuda export less pack_projections
    export = _export(tmp_path, "llama", target="ort-cpu", dtype="fp16")
    findings = cuda_findings(export)
    fused = [f for f in findings if "GroupQueryAttentionFusion" in f.message]
    assert len(fused) == 4 and all(f.level == "error" for f in fused)  # 2 layers x 2 graphs
    with pytest.raises(KvexportError, match=r"^--target ort-cuda: prefill: .*GroupQueryAttentionFusion.* \(and 3 more\); nothing written$"):
        refuse_what_cuda_cannot_load(export, silent)

    # the pass alone repairs the graph: the finding goes, the numbers stay
    path = export / "decode.onnx"
    model = ir.load(path)
    assert PackProjectionsPass()(model).modified
    repaired = ir.to_proto(model)
    assert fusion_findings(repaired.graph, "decode") == []
    feeds = _decode_feeds(path)
    before = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"]).run(None, feeds)
    options = ort.SessionOptions()  # the repaired graph's weights are still the export's data file
    options.add_session_config_entry("session.model_external_initializers_file_folder_path", str(export))
    after = ort.InferenceSession(repaired.SerializeToString(), options, providers=["CPUExecutionProvider"]).run(None, feeds)
    for old, new in zip(before, after, strict=True):
        np.testing.assert_allclose(new.astype(np.float32), old.astype(np.float32), rtol=1e-3, atol=1e-3)


def _decode_feeds(path: Path) -> dict[str, np.ndarray]:
    """One decode step's inputs: a token after 3 cached positions, random cache contents."""
    rng = np.random.default_rng(0)
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    feeds: dict[str, np.ndarray] = {}
    for value in session.get_inputs():
        if value.name == "input_ids":
            feeds[value.name] = np.array([[5]], np.int64)
        elif value.name == "attention_mask":
            feeds[value.name] = np.array([[1, 1, 1, 1, 0, 0, 0, 0]], np.int64)
        elif value.name == "position_ids":
            feeds[value.name] = np.array([[3]], np.int64)
        else:  # past.<l>.key|value [1, kv heads, capacity, head dim]
            shape = [1, value.shape[1], 8, value.shape[3]]
            feeds[value.name] = rng.standard_normal(shape).astype(np.float16)
    return feeds


def _single_node_model(op: str, domain: str, dtype: int, inputs: int, **attributes: object) -> onnx.ModelProto:
    names = [f"x{i}" for i in range(inputs)]
    node = helper.make_node(op, names, ["y"], domain=domain, **attributes)
    graph = helper.make_graph(
        [node], "one", [helper.make_tensor_value_info(n, dtype, None) for n in names], [helper.make_tensor_value_info("y", dtype, None)]
    )
    opsets = [helper.make_opsetid("", 18)] + ([helper.make_opsetid(domain, 1)] if domain else [])
    return helper.make_model(graph, opset_imports=opsets)


def test_kernel_findings_follow_onnx_runtimes_cuda_kernel_table() -> None:
    table = cuda_kernels()
    assert table["source"].startswith("microsoft/onnxruntime docs/OperatorKernels.md")
    gqa = table["kernels"]["com.microsoft"]["GroupQueryAttention"][0]["types"]["T"]
    assert "float" not in gqa and "float16" in gqa  # CUDA's GroupQueryAttention is fp16 / bf16 only

    fp32 = _single_node_model("GroupQueryAttention", "com.microsoft", TensorProto.FLOAT, 7, num_heads=2, kv_num_heads=1)
    (finding,) = kernel_findings(fp32, "decode")
    assert finding.level == "error"
    assert "GroupQueryAttention (com.microsoft opset 1) has no CUDA kernel for inputs (float, float, float" in finding.message
    fp16 = _single_node_model("GroupQueryAttention", "com.microsoft", TensorProto.FLOAT16, 3, num_heads=2, kv_num_heads=1)
    assert kernel_findings(fp16, "decode") == []
    # a standard op without a CUDA kernel runs on the CPU provider: a note, not a refusal
    (note,) = kernel_findings(_single_node_model("Unique", "", TensorProto.FLOAT, 1), "prefill")
    assert note.level == "note" and "no CUDA kernel at all" in note.message


def test_kvexport_check_reports_cuda_support_for_an_ort_cuda_export(cuda_exports: dict[str, Path]) -> None:
    result = CliRunner().invoke(main, ["check", str(cuda_exports["llama"]), "--steps", "2"])
    assert result.exit_code == 0, result.output
    line = next(line for line in result.output.splitlines() if "CUDA kernels" in line)
    assert line.startswith("ok ") and "every ONNX Runtime op has a CUDA kernel" in line
