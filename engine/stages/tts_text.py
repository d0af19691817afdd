"""The text the TTS stage speaks, cut to size: clauses of bounded length, a request's
short first piece, phoneme pieces one forward pass can take, and the words each chunk
of audio spoke."""

from __future__ import annotations

from duplex.playback import words_before
from engine.stages.clauses import split_clauses

__all__ = [
    "MAX_PIECE_PHONEMES",
    "speakable_clauses",
    "first_piece",
    "split_phonemes",
    "spoken_text",
]

# Clauses longer than this are cut further, so one clause never stalls a step for long.
MAX_CLAUSE_CHARS = 300
# A request's first clause is split at its first comma when that leaves a piece at least
# this long on each side: a shorter first piece is ready sooner, so playback starts sooner.
FIRST_PIECE_MIN_CHARS = 4
_SOFT_BREAKS = (", ", "; ", ": ")
# Phonemes per forward pass (about ten seconds of speech). Longer clauses, which only
# degenerate text produces (e.g. "x1x1x1..." read out symbol by symbol), are cut at word
# boundaries so that one step stays bounded.
MAX_PIECE_PHONEMES = 400


def speakable_clauses(text: str) -> list[str]:
    """The clauses of `text` that hold something to say, each at most MAX_CLAUSE_CHARS."""
    return [c for c in split_clauses(text, max_chars=MAX_CLAUSE_CHARS) if c.strip()]


def first_piece(clause: str) -> tuple[str, str]:
    """Split a clause at its first soft break into (head, rest); rest may be empty."""
    cuts = [i for b in _SOFT_BREAKS if (i := clause.find(b)) >= 0]
    if cuts:
        cut = min(cuts) + 1
        head, rest = clause[:cut].strip(), clause[cut:].strip()
        if len(head) >= FIRST_PIECE_MIN_CHARS and len(rest) >= FIRST_PIECE_MIN_CHARS:
            return head, rest
    return clause, ""


def split_phonemes(ipa: str, limit: int) -> list[str]:
    """Cut IPA into pieces of at most `limit` characters, at spaces where possible."""
    pieces: list[str] = []
    rest = ipa.strip()
    while len(rest) > limit:
        cut = rest.rfind(" ", 0, limit + 1)
        cut = cut if cut > 0 else limit
        pieces.append(rest[:cut].strip())
        rest = rest[cut:].strip()
    return pieces + [rest]


def spoken_text(text: str, start: float, stop: float) -> str:
    """The words of `text` spoken from fraction `start` to `stop` of its audio, at an even
    pace; a word belongs to the chunk its end falls in, so chunks join to the whole."""
    return words_before(text, stop)[len(words_before(text, start)) :].strip()
