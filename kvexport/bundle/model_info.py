"""What describes an export's model without torch: its dims and where its weights came from.

The manifest, the runner and ``kvexport check`` read these; loading the model itself
(torch, transformers) lives in the family's module under :mod:`kvexport.models`.
The dims are generic: every family maps its own config keys onto them in its module, so
nothing above the export reads a family's config keys.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any, Literal

from kvexport.errors import KvexportError

SourceKind = Literal["random-init", "local", "hub", "graph", "gguf"]
Dtype = Literal["fp32", "fp16"]

# manifest format 1 stored GPT-2's config keys; format 2 stores the generic names
_FORMAT_1_KEYS = {"n_layer": "num_layers", "n_embd": "hidden_size", "n_positions": "max_positions"}


@dataclass(frozen=True)
class ModelDims:
    """The numbers of a decoder that the graphs, the cache and the runner depend on.

    ``num_kv_heads`` is the heads the cache stores (``past.<l>.key`` is
    ``[batch, num_kv_heads, past_sequence, head_dim]``): equal to ``num_heads`` for
    multi-head attention, fewer under grouped-query attention.
    """

    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    hidden_size: int
    vocab_size: int
    max_positions: int

    def to_dict(self) -> dict[str, int]:
        """Plain-dict form for the manifest."""
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ModelDims:
        """Inverse of :meth:`to_dict`; also reads format 1's GPT-2 keys (``n_layer``, ``n_head``, ...)."""
        if "n_head" in data:  # format 1: GPT-2's own keys, multi-head attention
            data = {_FORMAT_1_KEYS.get(key, key): value for key, value in data.items()}
            heads = data.pop("n_head")
            data = {**data, "num_heads": heads, "num_kv_heads": heads}
        return cls(**{name: int(data[name]) for name in cls.__dataclass_fields__})


@dataclass(frozen=True)
class ModelSource:
    """Where the weights come from; recorded in the manifest so verify can rebuild them.

    ``kind`` is ``random-init`` (``name`` is a preset or a config path, weights are
    seeded random), ``local`` (``name`` is a Hugging Face model directory) or ``hub``
    (``name`` is a hub id), ``gguf`` (``name`` is a GGUF file, :mod:`kvexport.models.gguf`) or ``graph`` (``kvexport import`` of a graph without its
    checkpoint: ``name`` is the graph; there is nothing to rebuild). For random init, ``config`` holds the full config so the
    reference can be rebuilt without the original file.
    """

    kind: SourceKind
    name: str
    seed: int | None = None
    config: dict[str, Any] | None = field(default=None, compare=False)

    def to_dict(self) -> dict[str, Any]:
        """Plain-dict form for the manifest."""
        return {"kind": self.kind, "name": self.name, "seed": self.seed, "config": self.config}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ModelSource:
        """Inverse of :meth:`to_dict`."""
        kind = data.get("kind")
        if kind not in ("random-init", "local", "hub", "graph", "gguf"):
            raise KvexportError(f"manifest model source has unknown kind {kind!r}")
        return cls(
            kind=kind, name=str(data["name"]), seed=data.get("seed"), config=data.get("config")
        )

    def describe(self) -> str:
        """One-line human description."""
        if self.kind == "random-init":
            return f"{self.name} (random init, seed {self.seed})"
        if self.kind == "graph":
            return f"{self.name} (imported graph, no checkpoint)"
        if self.kind == "gguf":
            return f"{self.name} (GGUF)"
        return f"{self.name} ({self.kind})"
