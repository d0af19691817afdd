"""Clause splitting of streamed LLM text, so speech can start before the reply is done.

A clause ends at sentence punctuation followed by a space (so "3.14", "1,000" and "e.g."
inside a word never end one), at a newline, or, once it is long enough, at a comma,
semicolon, colon or dash. Titles ("Dr.", "Mr.") never end a clause; other abbreviations
("etc.", "U.S.") and ellipses end one only when the next word starts with a capital.
A clause that grows past `max_chars` without a boundary is cut at its last comma or space;
the first clause already past `first_max_chars`, so speech can start a few words in.

The streaming splitter decides a boundary only once enough text has arrived to be sure,
so pushing a text in any pieces gives the same clauses as splitting it whole.
"""

from __future__ import annotations

__all__ = ["ClauseSplitter", "split_clauses"]

_ENDERS = ".!?…"
_SOFT = ",;:—"
_CLOSERS = "\"')]}»”’"
# Words that are never the last word of a sentence.
_TITLES = frozenset(
    [
        "mr",
        "mrs",
        "ms",
        "dr",
        "prof",
        "st",
        "sr",
        "jr",
        "vs",
        "mt",
        "ft",
        "no",
        "nos",
        "fig",
        "figs",
        "approx",
        "dept",
        "est",
        "gen",
        "gov",
        "sen",
        "rep",
        "e.g",
        "i.e",
        "cf",
        "viz",
    ]
)
# Abbreviations that end a sentence only when a capitalised word follows.
_ABBREVIATIONS = frozenset(
    [
        "etc",
        "inc",
        "ltd",
        "co",
        "corp",
        "jan",
        "feb",
        "mar",
        "apr",
        "jun",
        "jul",
        "aug",
        "sep",
        "sept",
        "oct",
        "nov",
        "dec",
        "a.m",
        "p.m",
        "u.s",
        "u.k",
        "u.n",
        "e.u",
        "ph.d",
        "b.c",
        "a.d",
    ]
)

_YES, _NO, _WAIT = "yes", "no", "wait"


class ClauseSplitter:
    """Turns a stream of text deltas into complete clauses.

    `first_min_chars` is the length a first clause needs before a comma may end it (short,
    so the first audio starts early); `min_chars` the same for later clauses.
    `first_max_chars` (default `max_chars`) and `max_chars` cap the first and later clauses.
    """

    def __init__(
        self,
        *,
        first_min_chars: int = 16,
        first_max_chars: int | None = None,
        min_chars: int = 48,
        max_chars: int = 160,
    ) -> None:
        first_max_chars = max_chars if first_max_chars is None else first_max_chars
        if not 0 < first_min_chars <= first_max_chars or not 0 < min_chars <= max_chars:
            raise ValueError("clause lengths must satisfy 0 < min_chars <= max_chars")
        self.first_min_chars = first_min_chars
        self.first_max_chars = first_max_chars
        self.min_chars = min_chars
        self.max_chars = max_chars
        self._buffer = ""
        self._emitted = 0

    def push(self, delta: str) -> list[str]:
        """Add text; return the clauses it completed."""
        self._buffer += delta
        return self._drain(final=False)

    def flush(self) -> list[str]:
        """End of text: return what is left as clauses."""
        clauses = self._drain(final=True)
        rest = self._buffer.strip()
        self._buffer = ""
        if rest:
            clauses.append(rest)
            self._emitted += 1
        return clauses

    def _drain(self, *, final: bool) -> list[str]:
        clauses: list[str] = []
        while True:
            self._buffer = self._buffer.lstrip()
            cut = self._next_cut(final)
            if cut is None:
                return clauses
            clause, self._buffer = self._buffer[:cut].strip(), self._buffer[cut:]
            if clause:
                clauses.append(clause)
                self._emitted += 1

    def _next_cut(self, final: bool) -> int | None:
        """Index just past the first decided clause end in the buffer, or None to wait."""
        text = self._buffer
        first = self._emitted == 0
        soft_min = self.first_min_chars if first else self.min_chars
        cap = self.first_max_chars if first else self.max_chars
        i = 0
        while i < len(text):
            if i >= cap:
                return _cap_cut(text, cap)
            ch = text[i]
            if ch == "\n":
                return i + 1
            if ch in _ENDERS:
                end = _run_end(text, i)
                verdict = _sentence_end(text, i, end, final)
            elif ch in _SOFT:
                end = i + 1
                verdict = _soft_end(text, end, final) if end >= soft_min else _NO
            else:
                i += 1
                continue
            if verdict == _YES:
                return end
            if verdict == _WAIT:
                return None
            i = end
        if len(text) > cap:
            return _cap_cut(text, cap)
        return None


def split_clauses(text: str, **limits: int) -> list[str]:
    """Split a whole text into the clauses the streaming splitter would give."""
    splitter = ClauseSplitter(**limits)
    return splitter.push(text) + splitter.flush()


def _run_end(text: str, i: int) -> int:
    """End of the punctuation run starting at i, including closing quotes/brackets."""
    j = i
    while j < len(text) and text[j] in _ENDERS:
        j += 1
    while j < len(text) and text[j] in _CLOSERS:
        j += 1
    return j


def _sentence_end(text: str, start: int, end: int, final: bool) -> str:
    if end == len(text):
        return _YES if final else _WAIT
    if not text[end].isspace():
        return _NO  # "3.14", "e.g.x", "U.S.A" and the like
    run = text[start:end].rstrip(_CLOSERS)
    if "!" in run or "?" in run:
        return _YES
    if run in ("...", "…", "..") or len(run) > 1:
        return _capital_follows(text, end, final)
    word = _word_before(text, start)
    if word.lower() in _TITLES or _is_initial(word):
        return _NO
    if word.lower() in _ABBREVIATIONS:
        return _capital_follows(text, end, final)
    return _YES


def _soft_end(text: str, end: int, final: bool) -> str:
    if end == len(text):
        return _YES if final else _WAIT
    return _YES if text[end].isspace() else _NO


def _capital_follows(text: str, end: int, final: bool) -> str:
    k = end
    while k < len(text) and text[k].isspace():
        k += 1
    if k == len(text):
        return _YES if final else _WAIT
    return _YES if text[k].isupper() else _NO


def _word_before(text: str, i: int) -> str:
    j = i
    while j > 0 and (text[j - 1].isalnum() or text[j - 1] == "."):
        j -= 1
    return text[j:i]


def _is_initial(word: str) -> bool:
    # "J. K. Rowling"; "I." is a pronoun and may end a sentence.
    return len(word) == 1 and word.isupper() and word != "I"


def _cap_cut(text: str, cap: int) -> int:
    """Cut a boundary-less run of text at its last comma, else last space, before cap."""
    head = text[:cap]
    for mark in (", ", " "):
        at = head.rfind(mark)
        if at > 0:
            return at + len(mark)
    return cap
