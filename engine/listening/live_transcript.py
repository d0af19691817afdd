"""The transcript of one utterance while it is spoken: which ASR request to make next,
and which words are settled enough to show (sans-I/O: no model, no threads, no asyncio).

Policy, LocalAgreement-2 as in whisper_streaming: every partial request re-transcribes the
utterance's audio with the committed tokens forced as the transcript's start; the words on
which the last two hypotheses agree are committed, up to a token that starts a new word
(so a word still being spoken, or a character split across byte-level tokens, is never
committed), or to the end when the two hypotheses are the same although the audio grew.
An agreed token to which the latest guess gives a log-probability under `min_logprob`
ends what may be committed: Whisper is unsure of it, as it usually is of a mishearing
two guesses share. A guess over less than `min_agree_s` of an utterance's first audio
counts for nothing. Committed text is only ever appended to. At the end of the turn a
final request decodes only the tail after the committed tokens.

Bounded cost: a partial never re-transcribes much more than `window_s` of audio. When the
current window grows past it, the next request is a seal: the window up to a quiet point
(a pause between words) in its second half, short of the words still being spoken, with
the committed tokens forced as usual. The seal is kept when its cut lies after every
committed word (each was first heard in audio shorter than the cut, or the seal heard
words after them) and it holds as many words as the last partial had heard before the
cut. Then all its text is committed and becomes Whisper's previous text (after the
caller's prompt), and the window starts again at the quiet point; otherwise the seal is
tried again on more audio. Past `hard_window_s` the cut goes after the audio in which
every committed word lies and the seal is kept whatever it hears, so that the window
stays under Whisper's 30 s.

How the live path uses it, one request in flight at a time, results in order:

    live = await clients.asr(engine).run(lambda asr: asr.new_live_transcript(prompt))
    while speaking:  request(audio, final=False) -> partial; agree(result) -> delta or None
    at the turn's end: request(audio, final=True) -> final; finish(result) -> last delta

After a final request is made the transcript is frozen: `agree` commits nothing (a partial
result still arriving is dropped) until `thaw()`. `finish` does not change the transcript:
if the prepared turn is discarded because the speech goes on, do not emit its delta, call
`thaw()` and go on with partials. Once the turn stands, the transcript is `text` plus the
delta `finish` returned, and that equals the concatenation of every delta emitted.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from engine.stages.asr_request import SENTENCE_ENDS, SURE_LOGPROB, AsrRequest, Transcription

__all__ = ["LiveDelta", "LiveTranscript"]

SAMPLE_RATE = 16000
WINDOW_S = 8.0  # the most audio a partial re-transcribes before part of it is sealed
HARD_WINDOW_S = 20.0  # past this a seal cuts where it can (Whisper's window is 30 s)
MAX_WINDOW_S = 28.0  # Whisper hears 30 s at most: room for the pad
SEAL_GUARD_S = 0.5  # a seal cuts this far from the end of the audio (words being spoken)
MIN_SEAL_SPAN_S = 0.3  # the least audio to look for a quiet point in
RETRY_SEAL_S = 1.0  # more audio before another try after a seal that failed
PROMPT_CHARS = 600  # previous text given to Whisper (it keeps at most 223 tokens anyway)
QUIET_FRAME = SAMPLE_RATE // 50  # 20 ms
# Whisper guesses wildly on the first fraction of a second of speech: an utterance's
# guesses count only from this much audio on (the gateway's 300 ms of padding included).
MIN_AGREE_S = 0.7
# Two guesses can still agree on a mishearing ("for meeting" for "The meeting", "leave"
# for "leaves"), but Whisper is unsure of it: an agreed token below this log-probability
# and the words after it wait for the next guess, or for the final request.
MIN_LOGPROB = SURE_LOGPROB


@dataclass(frozen=True)
class LiveDelta:
    """Text newly committed to the transcript; with each token's text and log-probability
    when they were asked for."""

    text: str
    tokens: tuple[tuple[str, float], ...] = ()


@dataclass(frozen=True)
class _Asked:
    """The partial request in flight: where its window starts, and where a seal cuts it."""

    window_start: int
    length: int  # samples of the window transcribed
    seal_end: int | None = None  # samples into the window; None for a plain partial
    hard: bool = False  # a seal past `hard_window_s`: cut where it could


class LiveTranscript:
    """One utterance's live transcript; see the module docstring for the rules."""

    def __init__(
        self,
        decode: Callable[[Sequence[int]], str],
        *,
        prompt: str = "",
        logprobs: bool = False,
        window_s: float = WINDOW_S,
        hard_window_s: float = HARD_WINDOW_S,
        min_agree_s: float = MIN_AGREE_S,
        min_logprob: float = MIN_LOGPROB,
    ) -> None:
        if not 2.0 <= window_s <= hard_window_s <= MAX_WINDOW_S:
            raise ValueError(f"need 2 <= window_s <= hard_window_s <= {MAX_WINDOW_S}")
        self._decode = decode
        self._prompt = prompt
        self._logprobs = logprobs
        self._window = int(window_s * SAMPLE_RATE)
        self._hard_window = int(hard_window_s * SAMPLE_RATE)
        self._min_agree = int(min_agree_s * SAMPLE_RATE)
        self._min_logprob = min_logprob
        self._sealed = ""  # text of the windows before the current one
        self._window_start = 0  # sample where the current window starts
        self._committed: list[int] = []  # committed tokens of the current window
        self._hypothesis: list[int] | None = None  # the last guess after the committed
        # For each token of the guess: the window length (samples) of the first request
        # whose guess held it, as far as the guesses agree. Its word was spoken before.
        self._first_heard: list[int] = []
        self._text = ""  # everything committed: sealed and current window
        self._asked: _Asked | None = None
        self._next_seal = self._window  # window length at which to try sealing
        self._agreed_end = 0  # window samples within which every committed word lies
        self._failed_cut = 0  # a seal cut here heard nothing new: look after it next time
        self._frozen = False

    # --- state ---

    @property
    def text(self) -> str:
        """Everything committed so far: the concatenation of every delta returned."""
        return self._text

    @property
    def counts_from_s(self) -> float:
        """The utterance's length from which a partial's guess counts (see `agree`)."""
        return 0.0 if self._sealed else self._min_agree / SAMPLE_RATE

    @property
    def frozen(self) -> bool:
        return self._frozen

    @property
    def window_start_s(self) -> float:
        """Where the audio the next request transcribes starts, in the utterance."""
        return self._window_start / SAMPLE_RATE

    @property
    def sealing(self) -> bool:
        """Whether the partial request in flight transcribes a part of the window to seal."""
        return self._asked is not None and self._asked.seal_end is not None

    def thaw(self) -> None:
        """Go on with partials after a final request whose turn was discarded."""
        self._frozen = False

    # --- requests ---

    def request(self, audio: np.ndarray, *, final: bool) -> AsrRequest:
        """The next request for `audio`, the utterance from its start to now."""
        if final:
            self._frozen = True
            self._asked = None
            return self._ask(audio[self._window_start :], partial=False)
        if self._frozen:
            raise RuntimeError("a final request was made: thaw() before more partials")
        window = audio[self._window_start :]
        hard = len(window) >= self._hard_window
        end = self._seal_point(window, hard) if len(window) >= self._next_seal else None
        self._asked = _Asked(self._window_start, len(window), end, hard)
        return self._ask(window if end is None else window[:end], partial=True)

    def _seal_point(self, window: np.ndarray, hard: bool) -> int | None:
        """Where to cut the window for a seal (samples), or None to wait for more audio."""
        lo = max(len(window) // 2, self._failed_cut + int(MIN_SEAL_SPAN_S * SAMPLE_RATE))
        hi = len(window) - int(SEAL_GUARD_S * SAMPLE_RATE)
        if hard:  # after every committed word, as close to the end as need be
            lo, hi = self._agreed_end, len(window)
        if hi - lo < int(MIN_SEAL_SPAN_S * SAMPLE_RATE):
            return None
        return _quiet_point(window, lo, hi)

    def _ask(self, window: np.ndarray, *, partial: bool) -> AsrRequest:
        # A partial always asks for log-probabilities: unsure words are not committed.
        logprobs = self._logprobs or partial
        return AsrRequest(
            window, tuple(self._committed), self._context(), logprobs, partial=partial
        )

    def _context(self) -> str:
        return f"{self._prompt} {self._sealed}".strip()[-PROMPT_CHARS:]

    # --- results ---

    def agree(self, result: Transcription) -> LiveDelta | None:
        """After a partial: commit what this hypothesis and the last one agree on."""
        asked, self._asked = self._asked, None
        if self._frozen or asked is None or asked.window_start != self._window_start:
            return None
        if asked.seal_end is not None:
            return self._seal(result, asked.seal_end, asked.hard)
        if asked.length < self._min_agree and not self._sealed:
            return None
        tail = self._after_committed(result)
        if tail is None:
            return None
        tokens, scores = tail
        previous, self._hypothesis = self._hypothesis, tokens
        agreed = _common_prefix(tokens, previous or [])
        heard = self._first_heard[:agreed] + [asked.length] * (len(tokens) - agreed)
        self._first_heard = heard
        if previous is None:
            return None
        # Two whole hypotheses alike, although the audio grew between them: the last
        # word is over too, unless they end a sentence there, as Whisper ends every
        # guess ("Please remind me." before "to call"). Otherwise commit only up to
        # where a new word starts.
        same = agreed == len(tokens) == len(previous)
        same = same and not self._decode(tokens[-1:]).endswith(SENTENCE_ENDS)
        cut = self._word_cut(tokens, _sure(scores, agreed, self._min_logprob), to_end=same)
        if cut == 0:
            return None
        self._agreed_end = max(heard[:cut])
        return self._commit(tokens[:cut], scores[:cut], keep=tokens[cut:])

    def finish(self, result: Transcription) -> LiveDelta:
        """After the final request: the rest of the transcript (maybe ""). Changes
        nothing: the delta counts only once the turn stands."""
        tail = self._after_committed(result)
        tokens, scores = tail if tail is not None else ([], [])
        full = self._full_text(self._committed + tokens).strip()
        if not full.startswith(self._text):  # cannot happen with the prefix forced
            full = self._text
        return LiveDelta(full[len(self._text) :], self._token_pairs(tokens, scores))

    def _after_committed(self, result: Transcription) -> tuple[list[int], list[float]] | None:
        n = len(self._committed)
        if list(result.tokens[:n]) != self._committed:
            return None  # not a transcript of this state (cannot happen in order)
        return list(result.tokens[n:]), list(result.logprobs[n:])

    def _word_cut(self, tokens: list[int], agreed: int, *, to_end: bool) -> int:
        """The longest agreed part that ends where a new word starts (or at the end, if
        `to_end`) and whose text is whole (no split character, no trailing space), as a
        token count; 0 if none."""
        for cut in range(agreed, 0, -1):
            ends_word = cut == len(tokens) if to_end else False
            if cut < len(tokens):
                ends_word = self._decode([tokens[cut]]).startswith(" ")
            if not ends_word:
                continue
            text = self._full_text(self._committed + tokens[:cut])
            if text.startswith(self._text) and _whole(text):
                return cut
        return 0

    def _commit(
        self, tokens: list[int], scores: list[float], *, keep: list[int]
    ) -> LiveDelta | None:
        text = self._full_text(self._committed + tokens)
        delta = LiveDelta(text[len(self._text) :], self._token_pairs(tokens, scores))
        self._committed += tokens
        self._hypothesis = keep
        self._first_heard = self._first_heard[len(tokens) :]
        self._text = text
        return delta if delta.text else None

    def _seal(self, result: Transcription, end: int, hard: bool) -> LiveDelta | None:
        """After a request for the window up to a quiet point: seal that part if the cut
        lies after every committed word (known from when they were first heard, or from
        words heard after them before the cut; else the last committed words would be
        heard again in the next window), and the seal holds as many tokens after them as
        the last guess had heard before the cut (else it stopped early: words would be
        lost)."""
        tail = self._after_committed(result)
        # Words of the last guess first heard before the cut: the seal must hold as many.
        expected = sum(1 for heard in self._first_heard if heard <= end)
        after_committed = self._agreed_end <= end or bool(tail and tail[0])
        if tail is None or not (hard or after_committed and len(tail[0]) >= expected):
            self._seal_failed(end)
            return None
        tokens, scores = tail
        text = self._full_text(self._committed + tokens)
        if not (text.startswith(self._text) and _whole(text)):
            self._seal_failed(end)
            return None
        delta = LiveDelta(text[len(self._text) :], self._token_pairs(tokens, scores))
        self._start_window(end, text)
        self._text = text
        return delta if delta.text else None

    def _seal_failed(self, end: int) -> None:
        self._next_seal += int(RETRY_SEAL_S * SAMPLE_RATE)
        self._failed_cut = end

    def _start_window(self, end: int, sealed: str) -> None:
        self._window_start += end
        self._sealed = sealed
        self._committed = []
        self._hypothesis, self._first_heard = None, []
        self._next_seal = self._window
        self._agreed_end = self._failed_cut = 0

    # --- text ---

    def _full_text(self, window_tokens: list[int]) -> str:
        """The whole transcript with these tokens in the current window, without the
        leading space Whisper's first token carries."""
        return (self._sealed + self._decode(window_tokens)).lstrip()

    def _token_pairs(self, tokens: list[int], scores: list[float]) -> tuple[tuple[str, float], ...]:
        if not self._logprobs:
            return ()
        return tuple((self._decode([t]), float(s)) for t, s in zip(tokens, scores, strict=True))


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def _sure(scores: list[float], agreed: int, min_logprob: float) -> int:
    """How many of the first `agreed` tokens come before the first unsure one."""
    for i, score in enumerate(scores[:agreed]):
        if score < min_logprob:
            return i
    return agreed


def _whole(text: str) -> bool:
    # U+FFFD: a character whose bytes are split across tokens; a trailing space would be
    # stripped from the final transcript, so a delta must not end with one.
    return "\ufffd" not in text and text == text.rstrip()


def _quiet_point(window: np.ndarray, lo: int, hi: int) -> int:
    """The middle of the quietest 100 ms of `window[lo:hi]` (the latest of equals), in
    samples; `hi` when that span is shorter."""
    frames = window[lo:hi][: (hi - lo) // QUIET_FRAME * QUIET_FRAME].reshape(-1, QUIET_FRAME)
    if len(frames) < 5:
        return hi
    energy = np.convolve((frames.astype(np.float64) ** 2).mean(axis=1), np.ones(5), "same")
    latest = len(energy) - 1 - int(np.argmin(energy[::-1]))
    return lo + latest * QUIET_FRAME + QUIET_FRAME // 2
