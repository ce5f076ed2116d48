"""Build the third-party decoder fixtures under tests/data/foreign/ (run by hand, not in CI).

Each tool runs in a venv of its own, because each pins an older transformers than
kvexport's: what the tests then rewrite is what a user of that tool really has.

- ``optimum-l2``, ``optimum-l3``: ``optimum-cli export onnx --task
  text-generation-with-past`` (optimum-onnx 0.1.0, transformers 4.57.6, torch 2.13): one
  graph for both phases, eager attention; the two depths show whether the rewrite's
  result grows with depth.
- ``genai-llama``, ``genai-qwen3``: onnxruntime-genai's model builder (``python -m
  onnxruntime_genai.models.builder -p fp32 -e cpu``, onnxruntime-genai 0.18.0) of
  ``checkpoint-llama`` / ``checkpoint-qwen3``: GQA-fused already, rotary inside the op
  (``do_rotary``), no ``position_ids``, every key before every value. (Its Phi-3 path fails
  on a config without longrope: ``KeyError: 'multi_cache'``.)
- ``ortopt-l3``: ONNX Runtime's transformers optimizer (``onnxruntime.transformers
  .optimizer``, ``--model_type gpt2``) applied to ``optimum-l3``.
- ``torchscript-decode-l3``: ``torch.onnx.export(dynamo=False)`` of ``GPT2LMHeadModel``
  under transformers 4.57.6 with eager attention, past as legacy tuples. The trace bakes
  the query length into transformers' mask code (a graph traced with 3 new tokens fails
  on 5), so it is traced with one: a decode graph, for any past length.

- ``optimum-llama``, ``optimum-qwen3``, ``optimum-phi3``: the same Optimum export of tiny
  Llama-style checkpoints (6 query heads over 2 cache heads, head size 8; Qwen3 4 over 2
  with head size 16 and its Q/K norms; Llama 3's rope scaling and tied embeddings; Phi-3's
  fused QKV and gate/up projections), each from ``checkpoint-<family>``. Optimum loads them
  with transformers' SDPA attention: the past is concatenated and ``repeat_kv`` widens it
  before the product, rotary is decomposed.

The checkpoint the graphs come from (3 heads of 8, vocabulary of 2048, seeded random
weights, the tiny-trained model's tokenizer) is kept beside them in ``checkpoint-l2`` /
``checkpoint-l3`` (and ``checkpoint-<family>``), so verify can compare against PyTorch.
``FIXTURES.json`` records the tool versions that made each graph.

Usage: python scripts/build_foreign_fixtures.py [--work /tmp/fx] [--keep-venvs]
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "tests" / "data" / "foreign"
TOKENIZER = ROOT / "tests" / "data" / "tiny-trained" / "tokenizer.json"

VENVS = {
    # name: pip requirements, in install order (torch first: its CPU build is on disk)
    "optimum": [["torch==2.13.0"], ["transformers==4.57.6", "optimum-onnx==0.1.0", "onnxruntime==1.32.0"]],
    "torchscript": [["torch==2.13.0"], ["transformers==4.57.6", "onnx==1.23.2"]],
    "ortopt": [["torch==2.13.0"], ["onnxruntime==1.32.0", "onnx==1.23.2"]],
    "genai": [["torch==2.13.0"], ["transformers==5.24.0", "onnxruntime-genai==0.18.0", "onnxruntime==1.32.0", "onnx==1.23.2"]],
}
GENAI_FAMILIES = ("llama", "qwen3")

CHECKPOINT = """
import sys, json, torch
from transformers import GPT2Config, GPT2LMHeadModel
out, layers = sys.argv[1], int(sys.argv[2])
torch.manual_seed(7 + layers)
config = GPT2Config(n_layer=layers, n_head=3, n_embd=24, n_positions=64, vocab_size=2048,
                    bos_token_id=0, eos_token_id=0)
model = GPT2LMHeadModel(config).eval()
model.save_pretrained(out)
"""

FAMILIES = ("llama", "qwen3", "phi3")
FAMILY_CHECKPOINT = """
import sys, json, torch
from transformers import AutoConfig, AutoModelForCausalLM
out, family = sys.argv[1], sys.argv[2]
common = dict(hidden_size=48, intermediate_size=96, num_hidden_layers=2, num_attention_heads=6,
              num_key_value_heads=2, vocab_size=2048, max_position_embeddings=64, bos_token_id=0, eos_token_id=0)
quirks = {
    "llama": dict(tie_word_embeddings=True, rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                                           "high_freq_factor": 4.0, "original_max_position_embeddings": 16}),
    "qwen3": dict(num_attention_heads=4, head_dim=16),
    "phi3": dict(pad_token_id=0),
}
torch.manual_seed(5)
AutoModelForCausalLM.from_config(AutoConfig.for_model(family, **common, **quirks[family])).save_pretrained(out)
# a fast tokenizer as it is: without this class Optimum re-saves it with Llama's <s> prepended
json.dump({"tokenizer_class": "PreTrainedTokenizerFast"}, open(f"{out}/tokenizer_config.json", "w"))
"""

TORCHSCRIPT = """
import sys, torch
import transformers.masking_utils as masking
from transformers import GPT2LMHeadModel
# The TorchScript tracer can't follow the vmap that builds masks on torch >= 2.6; Optimum
# patches the same function for the same reason.
masking.sdpa_mask = masking.sdpa_mask_older_torch
source, target = sys.argv[1], sys.argv[2]
model = GPT2LMHeadModel.from_pretrained(source, attn_implementation="eager").eval()
model.config.use_cache = True
layers, heads = model.config.n_layer, model.config.n_head
head_dim = model.config.n_embd // heads


class Decoder(torch.nn.Module):
    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, input_ids, attention_mask, position_ids, *past):
        pairs = tuple((past[2 * i], past[2 * i + 1]) for i in range(layers))
        from transformers.cache_utils import DynamicCache
        cache = DynamicCache.from_legacy_cache(pairs)
        out = self.model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                         past_key_values=cache, use_cache=True, return_dict=True)
        flat = []
        for key, value in out.past_key_values.to_legacy_cache():
            flat += [key, value]
        return (out.logits, *flat)


# Traced with one new token: the trace bakes the query length into the mask code, so
# the graph is a decode graph (any past length, one token), as such exports were used.
batch, seq, past_len = 2, 1, 4
ids = torch.randint(0, 2048, (batch, seq))
mask = torch.ones(batch, past_len + seq, dtype=torch.int64)
positions = torch.arange(past_len, past_len + seq).expand(batch, seq)
past = [torch.randn(batch, heads, past_len, head_dim) for _ in range(2 * layers)]
past_names = [f"past_key_values.{i}.{kind}" for i in range(layers) for kind in ("key", "value")]
present_names = [f"present.{i}.{kind}" for i in range(layers) for kind in ("key", "value")]
axes = {"input_ids": {0: "batch_size", 1: "sequence_length"},
        "attention_mask": {0: "batch_size", 1: "total_sequence_length"},
        "position_ids": {0: "batch_size", 1: "sequence_length"},
        "logits": {0: "batch_size", 1: "sequence_length"}}
axes.update({n: {0: "batch_size", 2: "past_sequence_length"} for n in past_names})
axes.update({n: {0: "batch_size", 2: "total_sequence_length"} for n in present_names})
with torch.no_grad():
    torch.onnx.export(Decoder(model), (ids, mask, positions, *past), target, dynamo=False, opset_version=17,
                      input_names=["input_ids", "attention_mask", "position_ids", *past_names],
                      output_names=["logits", *present_names], dynamic_axes=axes)
"""

OPTIMIZER = """
import sys
from onnxruntime.transformers import optimizer
source, target = sys.argv[1], sys.argv[2]
model = optimizer.optimize_model(source, model_type="gpt2", num_heads=3, hidden_size=24)
model.save_model_to_file(target)
"""


def _run(command: list[str], **kwargs: object) -> str:
    print("+", " ".join(command)[:200], flush=True)
    done = subprocess.run(command, capture_output=True, text=True, **kwargs)  # type: ignore[call-overload]
    if done.returncode:
        sys.exit(f"failed ({done.returncode}): {done.stderr[-2000:]}")
    return str(done.stdout)


def venv_python(work: Path, name: str) -> Path:
    """The python of the fixture tool venv ``name`` under ``work``, built with its pinned packages when missing."""
    python = work / name / "bin" / "python"
    if not python.exists():
        _run([sys.executable, "-m", "venv", str(work / name)])
        for group in VENVS[name]:
            _run([str(python), "-m", "pip", "install", "-q", "--disable-pip-version-check", *group])
    return python


def _versions(python: Path, packages: list[str]) -> dict[str, str]:
    code = textwrap.dedent(
        f"""
        import importlib.metadata as m, json
        print(json.dumps({{p: m.version(p) for p in {packages!r}}}))
        """
    )
    return dict(json.loads(_run([str(python), "-c", code])))


def _single_file(directory: Path, target: Path) -> None:
    """Copy ``directory/model.onnx`` (weights inside it) to ``target``."""
    import onnx

    model = onnx.load(str(directory / "model.onnx"), load_external_data=True)
    onnx.save(model, str(target), save_as_external_data=False)


def _optimum_fixture(optimum: Path, work: Path, name: str, script: str, argument: str) -> dict[str, object]:
    """``checkpoint-<name>`` made by ``script`` (given ``argument``), exported by Optimum to ``optimum-<name>.onnx``; its record."""
    checkpoint = OUT / f"checkpoint-{name}"
    _run([str(optimum), "-c", script, str(checkpoint), argument])
    shutil.copy(TOKENIZER, checkpoint / "tokenizer.json")
    exported = work / f"optimum-{name}"
    shutil.rmtree(exported, ignore_errors=True)
    _run(
        [str(optimum.parent / "optimum-cli"), "export", "onnx", "--model", str(checkpoint),
         "--task", "text-generation-with-past", str(exported)],
        cwd=work,
    )
    _single_file(exported, OUT / f"optimum-{name}.onnx")
    return {
        "tool": "optimum-cli export onnx --task text-generation-with-past",
        "source": checkpoint.name,
        "versions": _versions(optimum, ["optimum-onnx", "optimum", "transformers", "torch", "onnx"]),
    }


def main() -> None:
    """Build every fixture and write FIXTURES.json."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--work", type=Path, default=Path("/tmp/fx"))
    parser.add_argument("--keep-venvs", action="store_true")
    args = parser.parse_args()
    work: Path = args.work
    work.mkdir(parents=True, exist_ok=True)
    optimum, torchscript, ortopt, genai = (venv_python(work, name) for name in ("optimum", "torchscript", "ortopt", "genai"))
    if OUT.exists():
        shutil.rmtree(OUT)
    OUT.mkdir(parents=True)
    record: dict[str, object] = {}
    for name, script, argument in [*((f"l{n}", CHECKPOINT, str(n)) for n in (2, 3)),
                                   *((family, FAMILY_CHECKPOINT, family) for family in FAMILIES)]:  # fmt: skip
        record[f"optimum-{name}.onnx"] = _optimum_fixture(optimum, work, name, script, argument)
    for family in GENAI_FAMILIES:
        built = work / f"genai-{family}"
        shutil.rmtree(built, ignore_errors=True)
        _run([str(genai), "-m", "onnxruntime_genai.models.builder", "-i", str(OUT / f"checkpoint-{family}"), "-o", str(built),
              "-p", "fp32", "-e", "cpu", "-c", str(work / "genai-cache")])
        _single_file(built, OUT / f"genai-{family}.onnx")
        record[f"genai-{family}.onnx"] = {
            "tool": "python -m onnxruntime_genai.models.builder -p fp32 -e cpu",
            "source": f"checkpoint-{family}",
            "versions": _versions(genai, ["onnxruntime-genai", "onnxruntime", "transformers", "torch", "onnx"]),
        }
    checkpoint = OUT / "checkpoint-l3"
    _run([str(ortopt), "-c", OPTIMIZER, str(OUT / "optimum-l3.onnx"), str(OUT / "ortopt-l3.onnx")])
    record["ortopt-l3.onnx"] = {
        "tool": "onnxruntime.transformers.optimizer.optimize_model(model_type='gpt2', num_heads=3, hidden_size=24) of optimum-l3.onnx",
        "source": checkpoint.name,
        "versions": _versions(ortopt, ["onnxruntime", "onnx"]),
    }
    _run([str(torchscript), "-c", TORCHSCRIPT, str(checkpoint), str(OUT / "torchscript-decode-l3.onnx")])
    record["torchscript-decode-l3.onnx"] = {
        "tool": "torch.onnx.export(dynamo=False), eager attention, legacy-tuple past, traced with 1 new token",
        "source": checkpoint.name,
        "versions": _versions(torchscript, ["transformers", "torch"]),
    }
    (OUT / "FIXTURES.json").write_text(json.dumps(record, indent=2) + "\n")
    if not args.keep_venvs:
        for name in VENVS:
            shutil.rmtree(work / name, ignore_errors=True)
    print(json.dumps(record, indent=2))


if __name__ == "__main__":
    main()
