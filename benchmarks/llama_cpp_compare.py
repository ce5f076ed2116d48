#!/usr/bin/env python
"""kvexport's quantized exports beside llama.cpp, same weights, same machine, one run.

Outside CI (it builds llama.cpp, minutes on 2 cores). Steps:

1. llama.cpp from the ``llama-cpp-python`` sdist's ``vendor/llama.cpp`` (PyPI is the only
   registry this machine reaches): ``pip download --no-binary :all:``, then cmake builds
   ``llama-bench``, ``llama-quantize`` and ``llama-perplexity``;
2. the same weights both ways: a Hugging Face directory (``save_pretrained``, plus the
   ``n_ctx`` that ``convert_hf_to_gguf.py`` reads and a ``vocab.json`` / ``merges.txt``
   made from the tokenizer) converted to GGUF F32, then ``llama-quantize`` to Q8_0 and
   Q4_0; and ``kvexport gpt2 --target ort-cpu`` at none / int8 / int4;
3. speed: ``llama-bench -p 128 -n 64 -t 2`` per GGUF, interleaved with kvexport's
   Generator at the same prompt length (best TTFT, median decode step, as ``kvexport
   bench`` times them);
4. quality (``--text``, on a trained model such as ``tests/data/tiny-trained``):
   ``llama-perplexity`` on the text for each GGUF, and ``kvexport verify --text`` for
   each export; each side's perplexity delta against its own full-precision run.

    .venv/bin/python benchmarks/llama_cpp_compare.py --model gpt2 --random-init --work /tmp/llama
    .venv/bin/python benchmarks/llama_cpp_compare.py --model tests/data/tiny-trained \\
        --text tests/data/tiny-trained/heldout.txt --work /tmp/llama

Prints one table (medians over the interleaved rounds) and writes ``compare.json`` under
``--work``. ``--int4-blocks 32,128`` adds int4 exports at other block sizes,
``--int8-per-channel`` an int8 export with ``--per-channel`` weights.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tarfile
import time
from pathlib import Path
from typing import Any

import numpy as np

LLAMA_CPP_PYTHON = "llama-cpp-python==0.3.36"
SCHEMES = (("none", "F32"), ("int8", "Q8_0"), ("int4", "Q4_0"))
# ggml's ISA switches by the /proc/cpuinfo flag that says the CPU has them. Named from the
# host rather than -march=native, which also turns on AMX, whose tile instructions die with
# SIGILL where the kernel grants no AMX state; and from the host rather than a fixed list,
# since this machine type is sometimes an AVX-512 Xeon and sometimes an AVX2-only EPYC.
_GGML_ISA = {
    "avx": "AVX",
    "avx2": "AVX2",
    "fma": "FMA",
    "f16c": "F16C",
    "avx512f": "AVX512",
    "avx512vbmi": "AVX512_VBMI",
    "avx512_vnni": "AVX512_VNNI",
    "avx512_bf16": "AVX512_BF16",
    "avx_vnni": "AVX_VNNI",
}


def isa_flags() -> list[str]:
    """``-DGGML_<ISA>=ON|OFF`` for each switch, by what this CPU reports."""
    try:
        line = next(line for line in open("/proc/cpuinfo") if line.startswith("flags"))
        have = set(line.split(":", 1)[1].split())
    except (OSError, StopIteration):  # not Linux: leave ggml's defaults
        return []
    return ["-DGGML_NATIVE=OFF", *(f"-DGGML_{isa}={'ON' if flag in have else 'OFF'}" for flag, isa in _GGML_ISA.items())]


def _run(command: list[str], **kwargs: Any) -> str:
    print("+", " ".join(command), file=sys.stderr, flush=True)
    done = subprocess.run(command, check=True, capture_output=True, text=True, **kwargs)
    return done.stdout + done.stderr


TOOLS = ("llama-bench", "llama-quantize", "llama-perplexity")


def build_llama_cpp(work: Path, targets: tuple[str, ...] = TOOLS) -> Path:
    """vendor/llama.cpp of the llama-cpp-python sdist, with ``targets`` built; returns its source dir.

    ``llama-server`` is built without its web UI, whose prebuilt assets would be downloaded.
    """
    source = next(work.glob("llama_cpp_python-*/vendor/llama.cpp"), None)
    if source is None:
        _run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--no-binary", ":all:", LLAMA_CPP_PYTHON, "-d", str(work)])
        with tarfile.open(next(work.glob("llama_cpp_python-*.tar.gz"))) as archive:
            archive.extractall(work, filter="data")
        source = next(work.glob("llama_cpp_python-*/vendor/llama.cpp"))
    build = source / "build"
    missing = [target for target in targets if not (build / "bin" / target).exists()]
    if missing:
        server = ["-DLLAMA_BUILD_SERVER=ON", "-DLLAMA_USE_PREBUILT_UI=OFF"] if "llama-server" in missing else []
        _run(["cmake", "-S", str(source), "-B", str(build), "-DCMAKE_BUILD_TYPE=Release", "-DLLAMA_CURL=OFF", *isa_flags(), "-DLLAMA_BUILD_TESTS=OFF", *server])
        _run(["cmake", "--build", str(build), "-j", str(os.cpu_count() or 2), "--target", *missing])
    return source


def hf_directory(model: str, random_init: bool, out: Path) -> Path:
    """The weights as a Hugging Face directory convert_hf_to_gguf.py reads."""
    from tokenizers import Tokenizer

    from kvexport.models.gpt2 import load_gpt2, resolve_source
    from kvexport.models.tokenizer import choose_tokenizer

    source = resolve_source(model, random_init=random_init, seed=0)
    torch_model = load_gpt2(source, "fp32")
    out.mkdir(parents=True, exist_ok=True)
    torch_model.save_pretrained(out, safe_serialization=True)
    config = json.loads((out / "config.json").read_text())
    config["n_ctx"] = config["n_positions"]
    (out / "config.json").write_text(json.dumps(config, indent=2))
    choice = choose_tokenizer(Path(model) if source.kind == "local" else None, torch_model.config.vocab_size)
    tokenizer: Tokenizer = choice.tokenizer  # type: ignore[assignment]
    data = json.loads(tokenizer.to_str())
    (out / "vocab.json").write_text(json.dumps(data["model"]["vocab"]))
    merges = [m if isinstance(m, str) else " ".join(m) for m in data["model"]["merges"]]
    (out / "merges.txt").write_text("#version: 0.2\n" + "\n".join(merges) + "\n")
    tokenizer.save(str(out / "tokenizer.json"))
    return out


_CONVERT = """
import sys
sys.path.insert(0, {source!r})
sys.path.insert(1, {gguf!r})
import conversion.base
# a BPE trained here has no entry in llama.cpp's table of known pre-tokenizers; GPT-2's
# byte-level pre-tokenizer is the one it uses
conversion.base.TextModel.get_vocab_base_pre = lambda self, tokenizer: "gpt-2"
sys.argv = ["convert_hf_to_gguf.py", *{args!r}]
import runpy
runpy.run_path({script!r}, run_name="__main__")
"""


def gguf_files(source: Path, hf_dir: Path, work: Path, kinds: tuple[str, ...] = ("Q8_0", "Q4_0")) -> dict[str, Path]:
    """F32 from the converter, each of ``kinds`` from llama-quantize."""
    f32 = work / "model-F32.gguf"
    code = _CONVERT.format(
        source=str(source),
        gguf=str(source / "gguf-py"),
        args=[str(hf_dir), "--outtype", "f32", "--outfile", str(f32)],
        script=str(source / "convert_hf_to_gguf.py"),
    )
    _run([sys.executable, "-c", code])
    files = {"F32": f32}
    for kind in kinds:
        files[kind] = work / f"model-{kind}.gguf"
        _run([str(source / "build/bin/llama-quantize"), str(f32), str(files[kind]), kind])
    return files


def llama_bench(source: Path, gguf: Path, prompt: int, threads: int) -> dict[str, float]:
    """prompt ms (pp) and decode ms/token (tg) from llama-bench's JSON."""
    text = _run([str(source / "build/bin/llama-bench"), "-m", str(gguf), "-p", str(prompt), "-n", "64", "-t", str(threads), "-r", "3", "-o", "json"])
    rows = json.loads(text[text.index("[") : text.rindex("]") + 1])
    result = {}
    for row in rows:  # avg_ts: tokens per second
        if row["n_prompt"]:
            result["prompt_ms"] = 1000 * row["n_prompt"] / row["avg_ts"]
        else:
            result["decode_ms_per_token"] = 1000 / row["avg_ts"]
    return result


def llama_perplexity(source: Path, gguf: Path, text: Path, context: int, threads: int, cache_type: str | None = None) -> float:
    """llama-perplexity's final estimate; ``cache_type`` (q8_0, q4_0) quantizes its K and V cache (with flash attention, which a quantized V needs)."""
    # to a file, not a pipe: through a pipe its log thread lost the last lines at exit
    log = gguf.with_suffix(f".perplexity{'-' + cache_type if cache_type else ''}.log")
    command = [str(source / "build/bin/llama-perplexity"), "-m", str(gguf), "-f", str(text), "-c", str(context), "-t", str(threads), "-b", str(context)]
    if cache_type is not None:
        command += ["-ctk", cache_type, "-ctv", cache_type, "-fa", "on"]
    print("+", " ".join(command), file=sys.stderr, flush=True)
    with open(log, "w") as handle:
        subprocess.run(command, check=True, stdout=handle, stderr=subprocess.STDOUT)
    output = log.read_text()
    found = re.findall(r"Final estimate: PPL = ([0-9.]+)", output)
    if not found:
        raise RuntimeError(f"llama-perplexity printed no estimate: {output[-500:]}")
    return float(found[-1])


def kvexport_exports(
    model: str, random_init: bool, work: Path, int4_blocks: list[int], int8_per_channel: bool = False
) -> dict[str, Path]:
    """ort-cpu exports by row label: none, int8 (the blocks, asked for by name: GPT-2's default int8
    on ort-cpu is per channel), int4, int4 at other block sizes, and ``int8 pc`` (``--per-channel``) when asked."""
    import dataclasses

    from kvexport import export_gpt2
    from kvexport.export.quantization import QUANTIZATION_SCHEMES

    wanted: dict[str, tuple[str, Any]] = {scheme: (scheme, QUANTIZATION_SCHEMES.get(scheme)) for scheme, _ in SCHEMES}
    for block in int4_blocks:
        if block != QUANTIZATION_SCHEMES["int4"].block_size:
            wanted[f"int4 b{block}"] = ("int4", dataclasses.replace(QUANTIZATION_SCHEMES["int4"], block_size=block))
    if int8_per_channel:
        wanted["int8 pc"] = ("int8", dataclasses.replace(QUANTIZATION_SCHEMES["int8"], per_channel=True))
    exports = {}
    for label, (scheme, knobs) in wanted.items():
        out = work / f"kvexport-{label.replace(' ', '-')}"
        if _stale(out, knobs):
            export_gpt2(out, model, random_init=random_init, seed=0, target="ort-cpu", quantize=scheme, quantization=knobs, force=True)
        exports[label] = out
    return exports


def _stale(out: Path, knobs: Any) -> bool:
    """Whether ``out`` must be exported (again): missing, or written with other knobs (or by an older kvexport)."""
    manifest = out / "kvexport.json"
    if not manifest.exists():
        return True
    if knobs is None:
        return False
    recorded = json.loads(manifest.read_text()).get("quantization") or {}
    return any(recorded.get(key) != value for key, value in knobs.to_json().items())


def kvexport_speed(export: Path, prompt: int, repeats: int = 3) -> dict[str, float]:
    from kvexport.runtime import Generator
    from kvexport.tools.bench import time_generator, warm_up

    generator = Generator(export)
    warm_up(generator)
    measured = time_generator(generator, 1, prompt, 64, repeats)
    return {"prompt_ms": measured.ttft_ms or 0.0, "decode_ms_per_token": measured.decode_ms_per_token or 0.0}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="gpt2")
    parser.add_argument("--random-init", action="store_true")
    parser.add_argument("--text", type=Path, default=None, help="Held-out text for perplexity.")
    parser.add_argument("--work", type=Path, default=Path("/tmp/llama"))
    parser.add_argument("--prompt", type=int, default=128)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=2, help="Interleaved timing rounds.")
    parser.add_argument("--int4-blocks", default="32", help="int4 block sizes to time (comma-separated).")
    parser.add_argument("--int8-per-channel", action="store_true", help="Add an int8 --per-channel export.")
    parser.add_argument("--cache-types", default="", help="With --text: llama.cpp's perplexity again with -ctk/-ctv of each (e.g. q8_0,q4_0) on F32 and Q8_0.")
    args = parser.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    args.work.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    source = build_llama_cpp(args.work)
    name = Path(args.model).name
    hf_dir = hf_directory(args.model, args.random_init, args.work / f"hf-{name}")
    ggufs = gguf_files(source, hf_dir, args.work / f"hf-{name}")
    blocks = [int(b) for b in args.int4_blocks.split(",")]
    exports = kvexport_exports(args.model, args.random_init, args.work / f"hf-{name}", blocks, args.int8_per_channel)
    rows: dict[str, dict[str, Any]] = {}
    timings: dict[str, list[dict[str, float]]] = {}
    for _ in range(args.rounds):  # interleaved: a drifting host treats both sides alike
        for scheme, kind in SCHEMES:
            for label in [label for label in exports if label.split()[0] == scheme]:
                timings.setdefault(f"kvexport {label}", []).append(kvexport_speed(exports[label], args.prompt))
            timings.setdefault(f"llama.cpp {kind}", []).append(llama_bench(source, ggufs[kind], args.prompt, args.threads))
    for system, samples in timings.items():
        rows[system] = {key: float(np.median([s[key] for s in samples])) for key in samples[0]}
    for label, export in exports.items():
        rows[f"kvexport {label}"]["disk_mb"] = sum(f.stat().st_size for f in export.iterdir() if f.is_file()) / 1e6
    for _, kind in SCHEMES:
        rows[f"llama.cpp {kind}"]["disk_mb"] = ggufs[kind].stat().st_size / 1e6
    if args.text is not None:
        from kvexport import verify

        for label, export in exports.items():
            report = verify(export, steps=2, text=args.text, text_tokens=100_000, record=False)
            assert report.text is not None
            rows[f"kvexport {label}"].update(
                perplexity=report.text.perplexity_onnx,
                perplexity_delta_pct=report.text.perplexity_delta_pct,
                top1_agreement=report.text.top1_agreement,
                reference="PyTorch fp32",
            )
        for _, kind in SCHEMES:
            rows[f"llama.cpp {kind}"]["perplexity"] = llama_perplexity(source, ggufs[kind], args.text, 256, args.threads)
        base = rows["llama.cpp F32"]["perplexity"]
        for _, kind in SCHEMES:
            rows[f"llama.cpp {kind}"]["perplexity_delta_pct"] = 100 * (rows[f"llama.cpp {kind}"]["perplexity"] / base - 1)
            rows[f"llama.cpp {kind}"]["reference"] = "llama.cpp F32"
        for cache_type in [c for c in args.cache_types.split(",") if c]:
            for kind in ("F32", "Q8_0"):
                ppl = llama_perplexity(source, ggufs[kind], args.text, 256, args.threads, cache_type)
                rows[f"llama.cpp {kind} cache {cache_type}"] = {
                    **{key: rows[f"llama.cpp {kind}"][key] for key in ("prompt_ms", "decode_ms_per_token", "disk_mb")},
                    "perplexity": ppl,
                    "perplexity_delta_pct": 100 * (ppl / base - 1),
                    "perplexity_delta_pct_vs_f16_cache": 100 * (ppl / rows[f"llama.cpp {kind}"]["perplexity"] - 1),
                    "reference": "llama.cpp F32",
                }
    print(f"{'system':<18} {'prompt ms':>10} {'decode ms/tok':>14} {'disk MB':>9} {'ppl':>9} {'ppl delta %':>12}")
    for system, row in rows.items():
        ppl = f"{row['perplexity']:.3f}" if "perplexity" in row else "-"
        delta = f"{row['perplexity_delta_pct']:+.2f}" if "perplexity_delta_pct" in row else "-"
        print(f"{system:<18} {row['prompt_ms']:>10.1f} {row['decode_ms_per_token']:>14.2f} {row['disk_mb']:>9.1f} {ppl:>9} {delta:>12}")
    result = {"model": args.model, "prompt": args.prompt, "threads": args.threads, "rows": rows, "seconds": round(time.perf_counter() - started, 1)}
    (args.work / "compare.json").write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
