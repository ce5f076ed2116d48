"""GGUF files as a model source: ``kvexport export --model FILE.gguf``.

A GGUF file (llama.cpp's format, the one Ollama and LM Studio keep) holds the config, the
tokenizer, the chat template and the weights, most of them in quantized blocks. The ``gguf``
package (llama.cpp's own reader) reads the metadata here, before any weight is touched, so a
file kvexport cannot take is refused in one line: an architecture no family exports, or a
tensor type outside :data:`TAKEN_TYPES`. transformers' GGUF support (which reads through the
same package) then builds the config, the tokenizer and the weights, dequantized to fp32:
the numbers llama.cpp computes with, which verify's PyTorch reference uses too.

Nothing is written next to the file and nothing is cached: a source of kind ``gguf`` names
the file, and verify or bench rebuild the reference from it (about 2 s of dequantizing for
a 135M model).
"""

from __future__ import annotations

import copy
import functools
import hashlib
import importlib.util
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from kvexport.errors import KvexportError, first_line

if TYPE_CHECKING:
    import torch

    from kvexport.passes.quantize_weights import SourceBlocks

GGUF_EXTRA = "kvexport[gguf]"
# GGUF ``general.architecture`` -> the model_type of the family that exports it. llama.cpp's
# converter writes Mistral (7B v0.1-v0.3) and SmolLM2 as ``llama``: the same arithmetic.
GGUF_ARCHITECTURES: dict[str, str] = {
    "gpt2": "gpt2",
    "llama": "llama",
    "phi3": "phi3",
    "qwen2": "qwen2",
    "qwen3": "qwen3",
}
# The tensor types whose blocks the gguf package dequantizes exactly and transformers loads:
# floats, llama.cpp's legacy blocks and the K-quants. The i-quants (IQ*) and ternary types
# (TQ*) are left out: their grids are lookup tables that no ONNX Runtime format holds.
TAKEN_TYPES: tuple[str, ...] = (
    "F32", "F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K",
)

# a block type -> the kvexport scheme nearest it (see GgufSummary.scheme)
SCHEME_OF_TYPE: dict[str, str] = {
    **dict.fromkeys(("Q2_K", "Q3_K", "Q4_0", "Q4_1", "Q4_K"), "int4"),
    **dict.fromkeys(("Q5_0", "Q5_1", "Q5_K", "Q6_K", "Q8_0"), "int8"),
}


def is_gguf(model: str | Path) -> bool:
    """Whether ``--model`` names a GGUF file (by its suffix; read with :func:`read_gguf`)."""
    return Path(model).suffix.lower() == ".gguf"


@dataclass(frozen=True)
class GgufSummary:
    """What a GGUF file's metadata says, read without its weights.

    ``tensor_types`` maps each tensor's GGUF name to its type (``Q4_1``, ``F32``, ...).
    """

    path: Path
    architecture: str
    model_type: str
    tensor_types: dict[str, str]
    chat_template: str | None

    def scheme(self) -> str:
        """The ``--quantize`` scheme that holds most of the file's weights: its default export.

        ``int4`` where most block tensors are 4-bit or fewer (Q4_0, Q4_1, Q4_K keep their
        blocks; Q2_K, Q3_K are quantized anew in 4 bits), ``int8`` where most are 5 to 8 bits
        (Q8_0 keeps its blocks), ``none`` for a file of floats. A tensor of the other width is
        quantized anew by the file's scheme, except Q8_0, which keeps its 8-bit blocks.
        """
        widths = Counter(SCHEME_OF_TYPE[kind] for kind in self.tensor_types.values() if kind in SCHEME_OF_TYPE)
        return widths.most_common(1)[0][0] if widths else "none"

    def type_counts(self) -> dict[str, int]:
        """How many tensors of each type, most first."""
        return dict(Counter(self.tensor_types.values()).most_common())

    def to_dict(self, kept: dict[str, str] | None = None) -> dict[str, Any]:
        """The manifest's record of the file: its name, architecture, every tensor's type, and those whose blocks were kept.

        ``kept`` maps a tensor's name to its type where the export stores its blocks as the
        file does (:class:`GgufBlockIndex`); every other tensor was dequantized to fp32 (and
        quantized anew where the export's scheme quantizes it).
        """
        kept = kept or {}
        return {
            "file": self.path.name,
            "architecture": self.architecture,
            "type_counts": self.type_counts(),
            "tensor_types": self.tensor_types,
            "kept": dict(sorted(kept.items())),
            "weights": f"{len(kept)} of {len(self.tensor_types)} tensors' blocks kept as the file stores them; "
            "the rest dequantized to fp32 (transformers' GGUF loader), then quantized by the export's scheme if it has one",
        }


def _reader(path: Path) -> Any:
    missing = [name for name in ("gguf", "accelerate") if importlib.util.find_spec(name) is None]
    if missing:  # transformers' GGUF loader refuses to load weights without accelerate
        raise KvexportError(
            f"--model {path}: reading a GGUF file needs {' and '.join(missing)}; pip install '{GGUF_EXTRA}'"
        )
    import gguf

    if not path.is_file():
        raise KvexportError(f"--model {path}: no such file; pass an existing .gguf file")
    try:
        return gguf.GGUFReader(path)
    except Exception as exc:  # the reader raises ValueError / struct errors on a file of another kind
        raise KvexportError(f"--model {path}: not a GGUF file kvexport can read ({first_line(exc)[:200]})") from exc


def _field(reader: Any, key: str) -> Any:
    field = reader.fields.get(key)
    return None if field is None else field.contents()


def read_gguf(path: Path) -> GgufSummary:
    """Read a GGUF file's metadata, refusing what kvexport does not take (one line each).

    Read once per file and version (its size and modification time): the reader parses the
    tokenizer's arrays in Python, seconds for a 49k vocabulary, and an export asks several times.

    Raises :class:`~kvexport.errors.KvexportError` for a missing ``gguf`` package, a file that
    is not GGUF, an architecture outside :data:`GGUF_ARCHITECTURES`, or tensors of a type
    outside :data:`TAKEN_TYPES` (named with one tensor of each and their count).
    """
    return _read_gguf(path.resolve(), _version(path))


def _version(path: Path) -> tuple[int, int] | None:
    """A file's size and modification time: the key its cached readings are kept under."""
    stat = path.stat() if path.is_file() else None
    return None if stat is None else (stat.st_size, stat.st_mtime_ns)


@functools.lru_cache(maxsize=8)
def _read_gguf(path: Path, version: tuple[int, int] | None) -> GgufSummary:
    reader = _reader(path)
    architecture = str(_field(reader, "general.architecture") or "")
    if architecture not in GGUF_ARCHITECTURES:
        raise KvexportError(
            f"--model {path}: GGUF architecture {architecture or '(none)'!r} is not one kvexport exports; "
            f"it takes {', '.join(sorted(GGUF_ARCHITECTURES))}"
        )
    types = {tensor.name: tensor.tensor_type.name for tensor in reader.tensors}
    refused: dict[str, list[str]] = {}
    for name, kind in types.items():
        if kind not in TAKEN_TYPES:
            refused.setdefault(kind, []).append(name)
    if refused:
        listed = "; ".join(
            f"{kind} ({names[0]}" + (f" and {len(names) - 1} more)" if len(names) > 1 else ")")
            for kind, names in sorted(refused.items())
        )
        raise KvexportError(
            f"--model {path}: tensor type {listed} is not one kvexport takes; it takes {', '.join(TAKEN_TYPES)} "
            "(requantize the file with llama-quantize to one of them)"
        )
    template = _field(reader, "tokenizer.chat_template")
    return GgufSummary(
        path=path,
        architecture=architecture,
        model_type=GGUF_ARCHITECTURES[architecture],
        tensor_types=types,
        chat_template=str(template) if template is not None else None,
    )


def gguf_config(path: Path) -> dict[str, Any]:
    """The Hugging Face config transformers builds from the file's metadata (no weights read).

    Built once per file and version, as :func:`read_gguf` reads it (an export asks before
    loading and again to load); each caller gets its own copy.
    """
    return copy.deepcopy(_gguf_config(path.resolve(), _version(path)))


@functools.lru_cache(maxsize=8)
def _gguf_config(path: Path, version: tuple[int, int] | None) -> dict[str, Any]:
    from transformers import AutoConfig

    try:
        config = AutoConfig.from_pretrained(path.parent, gguf_file=path.name)
    except Exception as exc:  # transformers raises ValueError / KeyError / RuntimeError on metadata it lacks
        raise KvexportError(f"--model {path}: transformers cannot read its config ({first_line(exc)[:200]})") from exc
    data: dict[str, Any] = config.to_dict()
    data.pop("quantization_config", None)  # GgufConfig: it says where the weights came from, not how to run them
    return data


def gguf_weights(path: Path) -> dict[str, torch.Tensor]:
    """The file's weights, dequantized to fp32 and named as transformers names them.

    transformers' loader also undoes llama.cpp's row permutation of the query and key
    projections. (A model it builds carries a ``GgufConfig`` that its ``save_pretrained``
    refuses; the families build their own from :func:`gguf_config` and load these.)
    """
    import torch
    from transformers import AutoModelForCausalLM

    try:
        loaded = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32)
    except Exception as exc:  # as in gguf_config
        raise KvexportError(f"--model {path}: transformers cannot load its weights ({first_line(exc)[:200]})") from exc
    return dict(loaded.state_dict())


def save_gguf_tokenizer(path: Path, directory: Path) -> Path:
    """Write the file's tokenizer (``tokenizer.json``, its config with the chat template) and generation config into ``directory``."""
    from transformers import AutoTokenizer, GenerationConfig

    try:
        tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    except Exception as exc:  # as in gguf_config
        raise KvexportError(f"--model {path}: transformers cannot build its tokenizer ({first_line(exc)[:200]})") from exc
    directory.mkdir(parents=True, exist_ok=True)
    tokenizer.save_pretrained(directory)
    GenerationConfig(
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id
    ).save_pretrained(directory)
    return directory


def gguf_model(path: Path, config: Any) -> Any:
    """A model of ``config`` (a transformers ``PretrainedConfig``) holding the file's dequantized weights.

    Every weight must find its place: a transformers release that names the file's tensors
    otherwise is one line, not a half-random model. A tied head is tied again.
    """
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    loaded = model.load_state_dict(gguf_weights(path), strict=False)
    missing = [name for name in loaded.missing_keys if name != "lm_head.weight" or not config.tie_word_embeddings]
    if missing or loaded.unexpected_keys:
        raise KvexportError(
            f"--model {path}: its dequantized weights do not fill a {config.model_type} model "
            f"(missing {missing[:3]}, unexpected {loaded.unexpected_keys[:3]})"
        )
    model.tie_weights()
    return model.eval()


# GGUF block types whose codes and scales ONNX Runtime's block formats hold as they are -> bits
# (passes.quantize_weights keeps them: Q8_0 as 8-bit symmetric blocks; the 4-bit ones as 4-bit
# blocks with each block's offset, Q4_K's 32-weight sub-blocks with their 6-bit scales applied)
KEPT_KINDS: dict[str, int] = {"Q8_0": 8, "Q4_0": 4, "Q4_1": 4, "Q4_K": 4}
_BLOCK = 32


def _half(raw: np.ndarray) -> np.ndarray:
    """fp16 values stored as two bytes each in the last axis, as fp32."""
    return np.ascontiguousarray(raw).view(np.float16)[..., 0].astype(np.float32)


def unpack_blocks(kind: str, data: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """A GGUF tensor's raw rows (``uint8 [N, bytes]``) as codes ``[N, K/32, 32]``, scales and offsets ``[N, K/32]``.

    The layouts are llama.cpp's (``ggml-quants.c``; the ``gguf`` package's ``quants.py``
    dequantizes them the same way): Q8_0 ``d, q[32]`` (``w = q d``; codes ``q + 128``),
    Q4_0 ``d, q[16 bytes]`` (``w = (q - 8) d``), Q4_1 ``d, m, q`` (``w = q d + m``), the
    nibbles low first for a block's first 16 weights, then high; Q4_K 256-weight super-blocks
    of ``d, dmin``, twelve bytes of 6-bit sub-scales and sub-mins, then four 32-byte groups
    whose low and high nibbles are two 32-weight sub-blocks (``w = q (d sc) - dmin m``).
    """
    rows = data.shape[0]
    if kind == "Q8_0":
        blocks = data.reshape(rows, -1, 2 + _BLOCK)
        codes = (np.ascontiguousarray(blocks[..., 2:]).view(np.int8).astype(np.int16) + 128).astype(np.uint8)
        return codes, _half(blocks[..., :2]), None
    if kind in ("Q4_0", "Q4_1"):
        head = 2 if kind == "Q4_0" else 4
        blocks = data.reshape(rows, -1, head + _BLOCK // 2)
        scales = _half(blocks[..., :2])
        offsets = -8 * scales if kind == "Q4_0" else _half(blocks[..., 2:4])
        nibbles = blocks[..., head:]
        return np.concatenate([nibbles & 0x0F, nibbles >> 4], axis=-1), scales, offsets
    if kind == "Q4_K":
        from gguf.quants import Q4_K

        blocks = data.reshape(rows, -1, 144)
        supers = blocks.shape[1]
        d, dmin = _half(blocks[..., 0:2]), _half(blocks[..., 2:4])
        sub_scales, sub_mins = Q4_K.get_scale_min(np.ascontiguousarray(blocks[..., 4:16]).reshape(-1, 12))
        groups = blocks[..., 16:].reshape(rows, supers, 4, 1, 32)
        codes = np.concatenate([groups & 0x0F, groups >> 4], axis=3).reshape(rows, supers * 8, _BLOCK)
        scales = (d[..., None] * sub_scales.reshape(rows, supers, 8).astype(np.float32)).reshape(rows, -1)
        offsets = -(dmin[..., None] * sub_mins.reshape(rows, supers, 8).astype(np.float32)).reshape(rows, -1)
        return codes, scales, offsets
    raise ValueError(f"{kind}: not a block type kvexport keeps ({', '.join(KEPT_KINDS)})")


def _digest(row: np.ndarray) -> bytes:
    return hashlib.blake2b(row.tobytes(), digest_size=16).digest()


class GgufBlockIndex:
    """A GGUF file's kept block types (:data:`KEPT_KINDS`), found by a weight's values.

    The :class:`~kvexport.passes.quantize_weights.BlockSource` an export from a GGUF file hands
    the weight quantization. Every row of every such tensor is indexed by a digest of its
    dequantized fp32 values (the ``gguf`` package's, which transformers loads): a graph weight
    whose every output column is such a row holds exactly the file's numbers, wherever the
    passes moved it (transposed, llama.cpp's query/key row order undone, Q/K/V packed into
    one product). :attr:`kept` records which file tensors were kept, for the manifest.
    """

    def __init__(self, path: Path) -> None:
        from gguf.quants import dequantize

        self._tensors = {
            tensor.name: tensor for tensor in _reader(path).tensors
            if tensor.tensor_type.name in KEPT_KINDS and len(tensor.shape) == 2
        }
        self._rows: dict[bytes, tuple[str, int]] = {}
        for name, tensor in self._tensors.items():
            for index, row in enumerate(dequantize(tensor.data, tensor.tensor_type)):
                self._rows.setdefault(_digest(row), (name, index))
        self._unpacked: dict[str, tuple[np.ndarray, np.ndarray, np.ndarray | None]] = {}
        self.kept: dict[str, str] = {}

    def _unpack(self, name: str) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
        if name not in self._unpacked:
            tensor = self._tensors[name]
            self._unpacked[name] = unpack_blocks(tensor.tensor_type.name, np.asarray(tensor.data))
        return self._unpacked[name]

    def find(self, k_by_n: np.ndarray) -> SourceBlocks | None:
        """The file's blocks of a weight (``[K, N]``) whose values are exactly the file's, or None."""
        from kvexport.passes.quantize_weights import SourceBlocks

        if k_by_n.dtype != np.float32 or k_by_n.ndim != 2 or k_by_n.shape[0] % _BLOCK:
            return None
        hits = [self._rows.get(_digest(row)) for row in np.ascontiguousarray(k_by_n.T)]
        if any(hit is None for hit in hits):
            return None
        names = np.array([hit[0] for hit in hits if hit is not None])
        indices = np.array([hit[1] for hit in hits if hit is not None])
        kinds = {self._tensors[name].tensor_type.name for name in set(names.tolist())}
        if len(kinds) != 1:
            return None
        kind = kinds.pop()
        n, blocks = k_by_n.shape[1], k_by_n.shape[0] // _BLOCK
        codes = np.empty((n, blocks, _BLOCK), dtype=np.uint8)
        scales = np.empty((n, blocks), dtype=np.float32)
        offsets = None if KEPT_KINDS[kind] == 8 else np.empty((n, blocks), dtype=np.float32)
        for name in set(names.tolist()):
            rows = names == name
            their_codes, their_scales, their_offsets = self._unpack(name)
            codes[rows], scales[rows] = their_codes[indices[rows]], their_scales[indices[rows]]
            if offsets is not None and their_offsets is not None:
                offsets[rows] = their_offsets[indices[rows]]
            self.kept[name] = kind
        return SourceBlocks(kind, codes, scales, offsets, bits=KEPT_KINDS[kind], block_size=_BLOCK)
