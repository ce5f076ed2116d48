"""One way to open an export and one prompt check, for every runner of an export.

:func:`open_export` runs the pre-flight (manifest, graphs, optionally the file hashes),
resolves the provider and loads the bundled tokenizer and EOS id: what the
``Generator``, the ``SpeculativeGenerator``, a draft model and the serving engine all
need before they open a session. :func:`check_prompt` refuses, in one line each, an
empty prompt, an id outside the vocabulary and a prompt with no room for its new tokens.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import numpy as np
import onnx

from kvexport.bundle.integrity import preflight
from kvexport.bundle.manifest import Manifest
from kvexport.errors import KvexportError
from kvexport.runtime.session import resolve_provider
from kvexport.runtime.text import ExportTokenizer


@dataclass
class OpenedExport:
    """An export directory that passed its pre-flight, with its provider, tokenizer and EOS."""

    directory: Path
    manifest: Manifest
    provider: Literal["cpu", "cuda"]
    tokenizer: ExportTokenizer
    eos_token_id: int | None
    # every token that ends a generation (the manifest's eos_token_ids; Llama 3 has several)
    eos_token_ids: tuple[int, ...] = ()
    protos: dict[str, onnx.ModelProto] = field(default_factory=dict)

    def require_in_place(self, why: str) -> None:
        """Refuse, in one line, an export without the in-place cache; ``why`` says who needs it."""
        if self.manifest.cache_layout != "shared-buffer":
            raise KvexportError(
                f"{self.directory}: has the {self.manifest.cache_layout} cache layout; {why}: export with "
                "--target ort-cpu or ort-cuda (or --cache shared-buffer)"
            )


def open_export(
    directory: str | Path, provider: str = "cpu", *, check: bool = False, manifest: Manifest | None = None
) -> OpenedExport:
    """Pre-flight ``directory`` (hashes too when ``check``) and resolve ``provider``; one line on failure."""
    path = Path(directory)
    found = preflight(path, hash_files=check, manifest=manifest)
    found.raise_first()
    resolved = resolve_provider(provider)
    return OpenedExport(
        directory=path,
        manifest=found.manifest,
        provider=resolved,
        tokenizer=ExportTokenizer(path, found.manifest),
        eos_token_id=found.manifest.tokenizer.get("eos_token_id"),
        eos_token_ids=_eos_token_ids(found.manifest),
        protos=found.protos,
    )


def check_prompt(
    ids: Sequence[int] | np.ndarray, vocab_size: int, new_tokens: int, limit: int, *, hint: str = ""
) -> None:
    """Refuse an empty prompt, an id outside the vocabulary, or more than ``limit`` tokens in all (one row)."""
    check_token_ids(ids, vocab_size)
    check_room(len(ids), new_tokens, limit, hint=hint)


def check_token_ids(ids: Sequence[int] | np.ndarray, vocab_size: int) -> None:
    """Refuse an empty prompt or an id outside the vocabulary; ``ids`` are the real tokens of any rows."""
    tokens = np.asarray(ids, dtype=np.int64).reshape(-1)
    if tokens.size == 0:
        raise KvexportError("the prompt is empty; pass at least one token")
    outside = tokens[(tokens < 0) | (tokens >= vocab_size)]
    if outside.size:
        raise KvexportError(out_of_vocabulary(outside.tolist(), vocab_size))


def out_of_vocabulary(ids: Sequence[int], vocab_size: int) -> str:
    """The one-line error for token ids outside the vocabulary, naming each (once, in order) and its size, as vLLM words it."""
    named = list(dict.fromkeys(int(t) for t in ids))
    which = f"token id {named[0]} is" if len(named) == 1 else f"token ids {', '.join(map(str, named))} are"
    return f"{which} out of vocabulary (its {vocab_size} tokens are 0..{vocab_size - 1})"


def check_room(prompt: int, new_tokens: int, limit: int, *, hint: str = "") -> None:
    """Refuse a prompt of ``prompt`` tokens that leaves no room for ``new_tokens`` within ``limit``.

    ``hint`` adds a way out to the message (``--truncate``, say).
    """
    if prompt + new_tokens > limit:
        raise KvexportError(
            f"this model's maximum context length is {limit} tokens, but {prompt + new_tokens} were requested "
            f"({prompt} in the prompt, {new_tokens} for the completion); shorten the prompt or ask for fewer "
            f"tokens{hint}"
        )


def _eos_token_ids(manifest: Manifest) -> tuple[int, ...]:
    """The manifest's ``eos_token_ids``, else its one ``eos_token_id`` (exports before the list)."""
    listed = manifest.tokenizer.get("eos_token_ids")
    if isinstance(listed, list) and listed:
        return tuple(int(token) for token in listed)
    single = manifest.tokenizer.get("eos_token_id")
    return () if single is None else (int(single),)
