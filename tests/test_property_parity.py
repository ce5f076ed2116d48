"""Property-based parity: random small GPT-2 shapes export and match PyTorch (bounded for CI)."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import onnxruntime as ort
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvexport import export_gpt2
from kvexport.models.gpt2 import load_gpt2
from kvexport.passes.cache_names import cache_names

from .conftest import write_config

N_POSITIONS = 32


@st.composite
def shapes(draw: st.DrawFn) -> dict[str, Any]:
    n_head = draw(st.integers(1, 4))
    head_dim = draw(st.integers(8, 32))
    return {
        "n_layer": draw(st.integers(1, 3)),
        "n_head": n_head,
        "n_embd": n_head * head_dim,
        "vocab_size": draw(st.integers(50, 1000)) * 2 + 1,  # odd
        "prompt": draw(st.integers(1, N_POSITIONS - 8)),
        "pad": draw(st.integers(0, N_POSITIONS - 9)),
        "seed": draw(st.integers(0, 2**16)),
        "attention": draw(st.sampled_from(["unfused", "onnx", "ort"])),
    }


# 4 examples per CI run; KVEXPORT_FUZZ_EXAMPLES=50 for a longer local search.
@settings(
    max_examples=int(os.environ.get("KVEXPORT_FUZZ_EXAMPLES", "4")),
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
@given(shape=shapes())
def test_random_small_configs_match_pytorch(shape: dict[str, Any]) -> None:
    prompt, pad = shape["prompt"], min(shape["pad"], shape["prompt"] - 1)
    config = {k: shape[k] for k in ("n_layer", "n_head", "n_embd", "vocab_size")}
    with tempfile.TemporaryDirectory() as work:
        config_path = write_config(
            Path(work) / "config", {"model_type": "gpt2", "n_positions": N_POSITIONS, **config}
        )
        out = Path(work) / "out"
        # every attention variant, fused ones included, over the same random shapes; the
        # concat cache keeps the contract this test drives (the in-place one is verify's)
        manifest = export_gpt2(
            out,
            str(config_path),
            random_init=True,
            seed=shape["seed"],
            target="ort-cpu" if shape["attention"] == "ort" else "portable",
            attention=shape["attention"],
            cache="concat",
        ).manifest
        model = load_gpt2(manifest.source)
        rng = np.random.default_rng(shape["seed"])
        ids = rng.integers(0, shape["vocab_size"], (2, prompt), dtype=np.int64)
        mask = np.ones_like(ids)
        mask[1, :pad] = 0  # row 1 is left-padded
        ids[1, :pad] = 0
        positions = np.clip(mask.cumsum(-1) - 1, 0, None)
        prefill = ort.InferenceSession(
            str(out / "prefill.onnx"), providers=["CPUExecutionProvider"]
        )
        decode = ort.InferenceSession(str(out / "decode.onnx"), providers=["CPUExecutionProvider"])
        logits, *present = prefill.run(
            None, {"input_ids": ids, "attention_mask": mask, "position_ids": positions}
        )
        with torch.no_grad():
            reference = model(
                torch.from_numpy(ids),
                attention_mask=torch.from_numpy(mask),
                position_ids=torch.from_numpy(positions),
                use_cache=True,
            )
        np.testing.assert_allclose(logits, reference.logits[:, -1:].numpy(), atol=1e-4, rtol=1e-3)
        next_ids = logits[:, -1].argmax(-1).reshape(2, 1).astype(np.int64)
        grown = np.concatenate([mask, np.ones((2, 1), dtype=np.int64)], 1)
        feeds = {
            "input_ids": next_ids,
            "attention_mask": grown,
            "position_ids": mask.sum(-1, keepdims=True),
        }
        feeds.update(dict(zip(cache_names("past", shape["n_layer"]), present, strict=True)))
        step_logits, *_ = decode.run(None, feeds)
        with torch.no_grad():
            step_reference = model(
                torch.from_numpy(next_ids),
                reference.past_key_values,
                attention_mask=torch.from_numpy(grown),
                position_ids=torch.from_numpy(feeds["position_ids"]),
                use_cache=True,
            )
        np.testing.assert_allclose(step_logits, step_reference.logits.numpy(), atol=1e-4, rtol=1e-3)
