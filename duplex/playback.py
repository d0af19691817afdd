"""What the client actually heard of a response, from the audio chunks sent to it.

The ledger lays the turn's audio chunks end to end on a millisecond timeline, each with
the text it speaks, so `heard_text(audio_end_ms)` can cut the assistant transcript to
what was played when the client truncates the item. `words_before` is the one rule for
how much of a text a fraction of its audio speaks; the TTS stage labels its chunks by it.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["PlaybackLedger", "words_before"]


@dataclass(frozen=True, slots=True)
class _Segment:
    start_ms: float
    end_ms: float
    text: str


class PlaybackLedger:
    """Audio chunks of one response, in play order."""

    def __init__(self) -> None:
        self._segments: list[_Segment] = []

    @property
    def duration_ms(self) -> float:
        return self._segments[-1].end_ms if self._segments else 0.0

    @property
    def text(self) -> str:
        return "".join(s.text for s in self._segments)

    def add(self, duration_ms: float, text: str) -> None:
        if duration_ms < 0:
            raise ValueError(f"audio duration must be >= 0 ms, got {duration_ms}")
        start = self.duration_ms
        self._segments.append(_Segment(start, start + duration_ms, text))

    def heard_text(self, audio_end_ms: float) -> str:
        """The text spoken by the first `audio_end_ms` milliseconds of audio.

        A chunk played only in part contributes the same fraction of its text, cut back
        to a word boundary so no half word is kept.
        """
        if audio_end_ms < 0:
            raise ValueError(f"audio_end_ms must be >= 0, got {audio_end_ms}")
        heard: list[str] = []
        for seg in self._segments:
            if audio_end_ms >= seg.end_ms:
                heard.append(seg.text)
                continue
            if audio_end_ms > seg.start_ms:
                fraction = (audio_end_ms - seg.start_ms) / (seg.end_ms - seg.start_ms)
                heard.append(words_before(seg.text, fraction))
            break
        return "".join(heard)


def words_before(text: str, fraction: float) -> str:
    """The prefix of `text` spoken by `fraction` (0 to 1) of its audio.

    Speech is taken to run at an even pace over the characters; a word cut by that point
    is dropped whole, so the prefix never ends inside a word.
    """
    n = int(len(text) * min(max(fraction, 0.0), 1.0))
    head = text[:n]
    # Keep whole words only: the character cut lands mid-word more often than not.
    if n < len(text) and not text[n].isspace():
        head = head[: len(head) - len(head.split(" ")[-1])]
    return head
