"""Incremental detokenization for streamed generation (the engine, the Generators, the CLI)."""

from __future__ import annotations

from collections.abc import Collection, Iterable, Iterator, Sequence
from pathlib import Path

from tokenizers import Tokenizer

from kvexport.bundle.manifest import Manifest
from kvexport.errors import KvexportError


class ExportTokenizer:
    """An export directory's bundled tokenizer, if it has one (the Generators and the engine)."""

    def __init__(self, directory: Path, manifest: Manifest) -> None:
        self.directory = directory
        self.source = manifest.tokenizer.get("source")
        file = manifest.tokenizer.get("file")
        self.tokenizer: Tokenizer | None = Tokenizer.from_file(str(directory / file)) if file else None

    def require(self) -> Tokenizer:
        """The tokenizer, or one line saying there is none."""
        if self.tokenizer is None:
            raise KvexportError(f"{self.directory} has no tokenizer ({self.source}); pass token ids instead")
        return self.tokenizer

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text``."""
        return list(self.require().encode(text).ids)


class TextStream:
    """Token ids to text pieces, holding back an incomplete character or a possible stop string.

    Feed it each generated token with :meth:`add`, which returns the text now safe to show
    and whether a stop string ended the text; :meth:`flush` at the end releases the rest.

    Decodes incrementally (vLLM's prefix and read offsets): each token decodes a short
    window of the ids, not the whole text, so a long generation costs no more per token
    than a short one.
    """

    def __init__(self, tokenizer: Tokenizer | None, stop: Sequence[str], *, include_stop: bool = False) -> None:
        self.tokenizer = tokenizer
        self.stop = list(stop)
        self.include_stop = include_stop  # release the stop string itself too (vLLM's include_stop_str_in_output)
        self.matched: str | None = None  # the stop string that ended the text
        self.ids: list[int] = []
        self.prefix_offset = 0  # ids before it are decoded for good
        self.read_offset = 0  # ids before it are in ``text``
        self.text = ""  # everything decoded so far
        self.emitted = 0  # characters of ``text`` already released

    def _decode_new(self) -> None:
        """Append the text the ids past ``read_offset`` complete, if they end a whole character."""
        assert self.tokenizer is not None
        prefix = self.tokenizer.decode(self.ids[self.prefix_offset : self.read_offset])
        window = self.tokenizer.decode(self.ids[self.prefix_offset :])
        if len(window) > len(prefix) and not window.endswith("\ufffd"):
            self.text += window[len(prefix) :]
            self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)

    def add(self, token: int | None, *, check_stop: bool = True) -> tuple[str, bool]:
        """The text this token releases, and whether a stop string ended the text.

        ``check_stop`` False looks for no stop string yet (``min_tokens`` not reached).
        """
        if self.tokenizer is None:
            return "", False
        if token is not None:
            self.ids.append(token)
        self._decode_new()
        text = self.text
        stops = self.stop if check_stop else []
        for stop in stops:
            found = text.find(stop, max(0, self.emitted - len(stop) + 1))
            if found != -1:
                self.matched = stop
                end = found + len(stop) if self.include_stop else found
                return self._release(text[:end], end), True
        hold = max((k for s in stops for k in range(1, len(s)) if text.endswith(s[:k])), default=0)
        return self._release(text, len(text) - hold), False

    def flush(self) -> str:
        """What is still held back, at the end of the stream (an incomplete character as decoded)."""
        if self.tokenizer is None:
            return ""
        tail = self.tokenizer.decode(self.ids[self.read_offset :]) if self.read_offset < len(self.ids) else ""
        text = self.text + tail
        return self._release(text, len(text))

    def _release(self, text: str, upto: int) -> str:
        piece = text[self.emitted : upto] if upto > self.emitted else ""
        self.emitted = max(self.emitted, upto)
        return piece


def text_pieces(tokenizer: Tokenizer, tokens: Iterable[int], eos_token_id: int | Collection[int] | None) -> Iterator[str]:
    """The text of ``tokens`` as it becomes whole characters, up to (not including) EOS (any of several)."""
    stops = {eos_token_id} if isinstance(eos_token_id, int) else set(eos_token_id or ())
    stream = TextStream(tokenizer, ())
    for token in tokens:
        if token in stops:
            break
        piece, _ = stream.add(token)
        if piece:
            yield piece
    tail = stream.flush()
    if tail:
        yield tail
