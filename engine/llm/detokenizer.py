"""Streaming detokenization with stop strings.

Deltas are produced by decoding a short window of tokens with and without the newest
ones (the "prefix offset / read offset" scheme), so byte-level and SentencePiece
tokenizers both join words correctly and a character split across tokens is held back
until it is complete. Text that could still turn out to be the start of a stop string
is held back too, so no delta ever carries text at or past a stop string.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

__all__ = ["StreamingDetokenizer"]

Decode = Callable[[list[int]], str]

_REPLACEMENT = "\ufffd"


class StreamingDetokenizer:
    """Turns a request's output tokens into safe text deltas.

    `push(token_ids)` returns the text that may be shown now; `finish()` returns what
    was held back once generation ends for a reason other than a stop string. After a
    stop string is found, `stopped` is true and `text` ends just before it.
    """

    def __init__(self, decode: Decode, stop: Sequence[str] = ()) -> None:
        self._decode = decode
        self._stop = [s for s in stop if s]
        self._holdback = max((len(s) for s in self._stop), default=1) - 1
        self._ids: list[int] = []
        self._prefix_offset = 0
        self._read_offset = 0
        self._decoded = ""  # every complete character decoded so far
        self._emitted = 0  # how much of `_decoded` has been handed out
        self.stopped = False

    @property
    def text(self) -> str:
        return self._decoded[: self._emitted]

    def push(self, token_ids: Sequence[int]) -> str:
        if self.stopped:
            return ""
        self._ids.extend(token_ids)
        searched_from = max(0, len(self._decoded) - self._holdback)
        self._decoded += self._decode_new()
        if self._find_stop(searched_from):
            return self._emit(len(self._decoded))
        return self._emit(len(self._decoded) - self._holdback)

    def finish(self) -> str:
        if self.stopped:
            return ""
        return self._emit(len(self._decoded))

    def _decode_new(self) -> str:
        prefix = self._decode(self._ids[self._prefix_offset : self._read_offset])
        full = self._decode(self._ids[self._prefix_offset :])
        if len(full) <= len(prefix) or full.endswith(_REPLACEMENT):
            return ""  # an incomplete UTF-8 sequence: wait for the next token
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._ids)
        return full[len(prefix) :]

    def _find_stop(self, start: int) -> bool:
        hits = [i for i in (self._decoded.find(s, start) for s in self._stop) if i >= 0]
        if not hits:
            return False
        self._decoded = self._decoded[: min(hits)]
        self.stopped = True
        return True

    def _emit(self, upto: int) -> str:
        if upto <= self._emitted:
            return ""
        delta = self._decoded[self._emitted : upto]
        self._emitted = upto
        return delta
