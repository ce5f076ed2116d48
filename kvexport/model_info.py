"""What describes a GPT-2 export without torch: its dims and where its weights came from.

The manifest, the runner and ``kvexport check`` read these; loading the model itself
(torch, transformers) lives in :mod:`kvexport.models.gpt2`.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any, Literal

from kvexport.errors import KvexportError

SourceKind = Literal["random-init", "local", "hub", "graph"]
Dtype = Literal["fp32", "fp16"]


@dataclass(frozen=True)
class ModelDims:
    """The numbers of a GPT-2 architecture that the graphs and the runner depend on."""

    n_layer: int
    n_head: int
    head_dim: int
    n_embd: int
    vocab_size: int
    n_positions: int

    @classmethod
    def from_config(cls, config: Any) -> ModelDims:
        """Read the dims from a Hugging Face ``GPT2Config``."""
        return cls(
            n_layer=config.n_layer,
            n_head=config.n_head,
            head_dim=config.n_embd // config.n_head,
            n_embd=config.n_embd,
            vocab_size=config.vocab_size,
            n_positions=config.n_positions,
        )

    def to_dict(self) -> dict[str, int]:
        """Plain-dict form for the manifest."""
        return asdict(self)


@dataclass(frozen=True)
class ModelSource:
    """Where the weights come from; recorded in the manifest so verify can rebuild them.

    ``kind`` is ``random-init`` (``name`` is a preset or a config path, weights are
    seeded random), ``local`` (``name`` is a Hugging Face model directory) or ``hub``
    (``name`` is a hub id) or ``graph`` (``kvexport import`` of a graph without its
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
        if kind not in ("random-init", "local", "hub", "graph"):
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
        return f"{self.name} ({self.kind})"
