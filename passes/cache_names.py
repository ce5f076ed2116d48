"""The canonical KV-cache names: ``past.<layer>.<key|value>`` in, ``present.<layer>.<key|value>`` out.

The one parser of the canonical scheme, for the passes, the manifest and ``inspect``
alike. It needs the standard library only, so the torch-free runtime imports it
without onnx_ir. Other exporters' names are parsed by
:func:`passes.rename_cache.parse_cache_name`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Literal

Direction = Literal["past", "present"]
Kind = Literal["key", "value"]
Style = Literal["canonical", "optimum"]

_CANONICAL = re.compile(r"^(past|present)\.(\d+)\.(key|value)$")


@dataclass(frozen=True)
class CacheSlot:
    """Where one cache tensor belongs: past (input) or present (output), layer, kind."""

    direction: Direction
    layer: int
    kind: Kind | None  # None: a stacked tensor holding key and value

    def name(self, style: Style = "canonical") -> str:
        """The slot's name in ``style`` (Optimum names its inputs ``past_key_values.<l>.<kind>``)."""
        assert self.kind is not None
        if style == "optimum" and self.direction == "past":
            return f"past_key_values.{self.layer}.{self.kind}"
        return f"{self.direction}.{self.layer}.{self.kind}"


def canonical_slot(name: str) -> CacheSlot | None:
    """The slot a canonical name stands for (``present.3.value``), None for any other name."""
    match = _CANONICAL.match(name)
    if match is None:
        return None
    direction, layer, kind = match.groups()
    return CacheSlot(direction, int(layer), kind)  # type: ignore[arg-type]


def cache_name(direction: Direction, layer: int, kind: Kind) -> str:
    """Canonical cache tensor name, e.g. ``past.3.key``."""
    return CacheSlot(direction, layer, kind).name()


def cache_names(direction: Direction, n_layer: int) -> list[str]:
    """All canonical cache names for ``n_layer`` layers, key before value, layer order."""
    return [cache_name(direction, layer, kind) for layer in range(n_layer) for kind in ("key", "value")]
