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

from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kvexport.errors import KvexportError, first_line

if TYPE_CHECKING:
    import torch

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

    def type_counts(self) -> dict[str, int]:
        """How many tensors of each type, most first."""
        return dict(Counter(self.tensor_types.values()).most_common())

    def to_dict(self) -> dict[str, Any]:
        """The manifest's record of the file: its name, architecture and every tensor's type."""
        return {
            "file": self.path.name,
            "architecture": self.architecture,
            "type_counts": self.type_counts(),
            "tensor_types": self.tensor_types,
            "weights": "dequantized to fp32 (transformers' GGUF loader)",
        }


def _reader(path: Path) -> Any:
    try:
        import gguf
    except ImportError as exc:
        raise KvexportError(
            f"--model {path}: reading a GGUF file needs the gguf package; pip install '{GGUF_EXTRA}'"
        ) from exc
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

    Raises :class:`~kvexport.errors.KvexportError` for a missing ``gguf`` package, a file that
    is not GGUF, an architecture outside :data:`GGUF_ARCHITECTURES`, or tensors of a type
    outside :data:`TAKEN_TYPES` (named with one tensor of each and their count).
    """
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
        path=path.resolve(),
        architecture=architecture,
        model_type=GGUF_ARCHITECTURES[architecture],
        tensor_types=types,
        chat_template=str(template) if template is not None else None,
    )


def gguf_config(path: Path) -> dict[str, Any]:
    """The Hugging Face config transformers builds from the file's metadata (no weights read)."""
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
