"""``EngineConfig``: every setting of the serving engine, in one frozen object.

The CLI, :func:`kvexport.serving.server.serve` and the Ray Serve deployment each build it
once and hand it on; ``serve run kvexport.serving.ray:app key=value`` parses every field
from it (:meth:`EngineConfig.from_strings`), so no setting can be forgotten on one path.
"""

from __future__ import annotations

import dataclasses
import re
import types
import typing
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kvexport.drafting import DEFAULT_DRAFT_TOKENS
from kvexport.errors import KvexportError

if TYPE_CHECKING:
    from kvexport.runtime.speculative import Drafter

DEFAULT_CHUNK = 256


@dataclass(frozen=True)
class EngineConfig:
    """The engine's settings (see :class:`~kvexport.serving.engine.Engine`).

    Attributes:
        slots: rows of the cache: requests generating at once.
        max_context: tokens per slot (prompt + completion); default the model's positions.
        kv_memory: size the slots from this many bytes of cache instead (as many slots of
            ``max_context`` tokens as fit, in the export's cache dtype: an int8 cache holds
            4x the fp32 cache's slots); it overrides ``slots`` (the CLI refuses both).
        max_queue: requests that may wait for a slot; more are refused.
        chunk: prompt tokens prefilled per engine step.
        provider: ``cpu``, ``cuda`` or ``auto``.
        intra_op_threads: ONNX Runtime threads (default: ONNX Runtime's choice).
        spinning: let the session's threads spin between runs (faster decode steps on CPU).
        check: compare every file's size and sha256 with the manifest before loading (on by
            default: a damaged or different copy is refused with the file named).
        prefix_cache: reuse the cached rows of a prompt's prefix.
        prompt_lookup: speculative decoding with prompt-lookup drafts while one request
            runs alone (the export needs ``--all-logits``).
        draft: speculative decoding with drafts from this smaller in-place export.
        draft_tokens: drafts per speculative step.
        warm_up: requests run through the engine before it takes any (0: none), so the
            first real requests do not pay for ONNX Runtime's first runs; what they leave
            (counters, cached rows) is cleared.

    """

    slots: int = 8
    max_context: int | None = None
    kv_memory: int | None = None
    max_queue: int = 64
    chunk: int = DEFAULT_CHUNK
    provider: str = "cpu"
    intra_op_threads: int | None = None
    spinning: bool = True
    check: bool = True
    prefix_cache: bool = True
    prompt_lookup: bool = False
    draft: str | None = None
    draft_tokens: int = DEFAULT_DRAFT_TOKENS
    warm_up: int = 2

    def __post_init__(self) -> None:
        for name, low in (("slots", 1), ("max_queue", 0), ("chunk", 1), ("draft_tokens", 1), ("warm_up", 0)):
            value = getattr(self, name)
            if value < low:
                raise KvexportError(f"{name} {value}: must be at least {low}")
        if self.prompt_lookup and self.draft is not None:
            raise KvexportError("--prompt-lookup and --draft: pick one drafter")
        if self.kv_memory is not None and self.kv_memory < 1:
            raise KvexportError(f"kv_memory {self.kv_memory}: must be a positive number of bytes")

    def drafter(self) -> Drafter | None:
        """The drafter these settings ask for (None: no speculative decoding)."""
        from kvexport.runtime.speculative import DraftModel, PromptLookup

        if self.draft is not None:
            return DraftModel(Path(self.draft), self.provider)
        return PromptLookup() if self.prompt_lookup else None

    @classmethod
    def from_strings(cls, values: dict[str, Any]) -> EngineConfig:
        """A config from ``key=value`` strings (Serve's CLI arguments), each parsed by its field's type.

        Values that are not strings (a YAML config's numbers and booleans) are taken as
        they are. Unknown keys are refused in one line naming them and the known ones.
        """
        hints = typing.get_type_hints(cls)
        return cls().updated(**{name: _parse(name, text, hints[name]) if name in hints else text for name, text in values.items()})

    def updated(self, **settings: Any) -> EngineConfig:
        """A copy of the config with ``settings`` changed; an unknown name is refused in one line naming the known ones."""
        known = [f.name for f in dataclasses.fields(self)]
        unknown = sorted(set(settings) - set(known))
        if unknown:
            raise KvexportError(f"unknown engine setting {unknown[0]!r}; the settings are {', '.join(known)}")
        return dataclasses.replace(self, **settings)


_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "kib": 2**10, "mib": 2**20, "gib": 2**30}


def parse_bytes(text: str) -> int:
    """``"2GiB"``, ``"512MB"``, ``"1e9"`` or ``"1073741824"`` as bytes; one line naming the units otherwise."""
    match = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]*)?(?:e[0-9]+)?)\s*([a-z]*)\s*", text.lower())
    if match is None or match.group(2) not in _UNITS:
        raise KvexportError(f"{text!r}: not a size; write bytes, or a number with B, KB, MB, GB, KiB, MiB or GiB")
    return int(float(match.group(1)) * _UNITS[match.group(2)])


def _parse(name: str, text: Any, hint: Any) -> Any:
    """``text`` as a value of the annotated type ``hint`` (int, bool, str, or one of them or None)."""
    if not isinstance(text, str):
        return text
    choices = typing.get_args(hint) if isinstance(hint, types.UnionType) else (hint,)
    if type(None) in choices and text.lower() in ("", "none", "null"):
        return None
    kind = next(choice for choice in choices if choice is not type(None))
    if kind is bool:
        lowered = text.lower()
        if lowered not in ("true", "false", "1", "0", "yes", "no"):
            raise KvexportError(f"{name}={text}: expected true or false")
        return lowered in ("true", "1", "yes")
    if kind is int and name == "kv_memory":
        return parse_bytes(text)
    if kind is int:
        try:
            return int(text)
        except ValueError:
            raise KvexportError(f"{name}={text}: expected an integer") from None
    return text
