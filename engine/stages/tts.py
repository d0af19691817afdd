"""Text to speech, streamed clause by clause.

A voice (`engine.stages.voices`: Piper's `Voice`, or Kokoro's) turns clauses into float
audio at the voice rate, many clauses in one batched pass. Every chunk leaves the engine
as that audio, float32 mono at the voice's own rate: converting it to what a client
wants is the gateway's job, done once there. `Synthesizer` is the plain API: text in,
one chunk per clause out. `TtsStage` is the engine stage: requests are opened with
`add`, text arrives with `feed` as the LLM produces it, and each `step` speaks the next
chunk of the most urgent requests in one batch.

The stage renders a request's first audio in a short chunk where the voice renders
windows of a clause (Piper), or as the clause's short first piece where it renders
whole pieces (Kokoro). Each later chunk of a request is at most twice the audio already
rendered for it, so the next chunk is ready well before playback reaches it, and at
most MAX_CHUNK_FRAMES, so that no single chunk holds a step for long.

Scheduling is earliest deadline first. A request's deadline is the moment its listener
runs out of audio: the wall time of its first chunk plus the audio emitted since. A
request not yet heard is already late (its deadline is when it arrived). Each step takes
the requests with the soonest deadlines whose next chunk is at most twice as wide as the
most urgent one's (a wider one would hold it up; cutting it narrower would cost more
context per second of audio), and stops adding requests when the padded batch would exceed
STEP_WINDOW_FRAMES, so that the most urgent chunk never waits behind a big batch. A
request with more than AHEAD_S of audio in hand is not rendered while another has less,
whether that other has text to speak now or is waiting for it (its text comes a clause at
a time from the LLM, and its next chunk must not wait behind a step spent on audio not
needed for seconds); the held request is rendered once its own runway falls to AHEAD_S,
when the stage wakes the engine (`wake_in`) if nothing else has.
"""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import mlx.core as mx
import numpy as np

from engine.runtime.stage import StageOutput
from engine.stages.tts_text import first_piece, speakable_clauses, spoken_text
from engine.stages.voices import (
    DEFAULT_VOICE,
    Scales,
    TtsRequest,
    Voice,
    VoiceModel,
    load_voice,
    open_voice,
)

__all__ = [
    "AHEAD_S",
    "AudioChunk",
    "DEFAULT_VOICE",
    "FIRST_CHUNK_FRAMES",
    "MAX_CHUNK_FRAMES",
    "MIN_REST_FRAMES",
    "STEP_WINDOW_FRAMES",
    "Scales",
    "Synthesizer",
    "TtsRequest",
    "TtsStage",
    "Voice",
    "VoiceModel",
    "load_voice",
    "open_voice",
]

# A request's first chunk: 32 latent frames, about 0.37 s of speech at Piper's hop.
FIRST_CHUNK_FRAMES = 32
# A remainder shorter than this joins the chunk before it: rendering it apart would
# cost more in window context than it saves.
MIN_REST_FRAMES = 16
# The widest chunk (about 3 s of speech). Each chunk also computes 2 x 44 frames of
# context, so narrower chunks cost more per second of audio; wider ones hold every other
# request's chunk for their whole step.
MAX_CHUNK_FRAMES = 256
# The most latent frames one step renders, counted as the padded batch computes them
# (rows x (widest chunk + context)): six first chunks, or two of the widest.
STEP_WINDOW_FRAMES = 720
# A request with this much audio in hand (seconds) waits while another has less.
AHEAD_S = 5.0


@dataclass(frozen=True, eq=False)
class AudioChunk:
    """Float32 mono `samples` at the voice's `sample_rate`, speaking `text` (empty for a
    final tail)."""

    samples: np.ndarray
    sample_rate: int
    text: str
    duration_ms: float

    @classmethod
    def of(cls, samples: np.ndarray, sample_rate: int, text: str) -> AudioChunk:
        samples = np.asarray(samples, dtype=np.float32)
        return cls(samples, sample_rate, text, 1000 * len(samples) / sample_rate)


class Synthesizer:
    """Text in, one `AudioChunk` per clause out, at the voice rate."""

    def __init__(self, voice: VoiceModel) -> None:
        self.voice = voice

    def stream(self, text: str, request: TtsRequest | None = None) -> Iterator[AudioChunk]:
        scales = self.voice.scales(request or TtsRequest())
        for clause in speakable_clauses(text):
            (audio,) = self.voice.synthesize([clause], [scales])
            yield AudioChunk.of(audio, self.voice.sample_rate, clause)

    def synthesize(self, text: str, request: TtsRequest | None = None) -> AudioChunk:
        """The whole text as one chunk."""
        chunks = list(self.stream(text, request))
        samples = np.concatenate([c.samples for c in chunks] or [np.zeros(0, np.float32)])
        return AudioChunk.of(samples, self.voice.sample_rate, " ".join(c.text for c in chunks))


@dataclass
class _Segment:
    """One phoneme piece of a clause, between steps: its latents and how far it is rendered."""

    text: str  # the whole clause
    z_p: mx.array  # [1, frames, C]
    offset: int  # frames of the clause's earlier pieces
    clause_frames: int
    rendered: int = 0

    @property
    def frames(self) -> int:
        return self.z_p.shape[1]


@dataclass
class _Stream:
    scales: Scales
    arrived: float  # stage clock when the request was added
    pending: deque[str] = field(default_factory=deque)
    segments: deque[_Segment] = field(default_factory=deque)
    final: bool = False
    started: bool = False
    frames_out: int = 0  # latent frames rendered so far
    first_at: float | None = None  # stage clock when its first chunk left
    audio_s: float = 0.0  # seconds of audio emitted so far

    def busy(self) -> bool:
        return bool(self.pending or self.segments or self.final)

    def speakable(self) -> bool:
        return bool(self.pending or self.segments)

    def spoken(self) -> bool:
        """Its final text is all rendered: only its finished output is owed."""
        return self.final and not self.speakable()

    def deadline(self) -> float:
        """When its listener runs out of audio; a request not yet heard is already late."""
        if self.first_at is None:
            return self.arrived
        return self.first_at + self.audio_s

    def chunk_frames(self) -> int:
        # Each chunk at most doubles the audio rendered before it, so it is ready before
        # the audio ahead of it has played.
        return min(MAX_CHUNK_FRAMES, max(FIRST_CHUNK_FRAMES, 2 * self.frames_out))

    def next_span(self, width: int, whole: bool) -> tuple[_Segment, int, int]:
        """The segment to render from and the frames [start, stop) of this step's chunk,
        at most `width` frames (plus a remainder too short to render apart); all of it
        for a voice that renders `whole` segments."""
        seg = self.segments[0]
        start = seg.rendered
        if whole:
            return seg, start, seg.frames
        stop = min(seg.frames, start + min(width, self.chunk_frames()))
        if seg.frames - stop < MIN_REST_FRAMES:
            stop = seg.frames
        return seg, start, stop


class TtsStage:
    """Engine stage: streaming requests, the most urgent first, batched (module docstring).

    A step picks the requests to speak (`_pick`), starts the next clause of each picked
    request that has none in progress, then renders one chunk of each. `feed` for an id
    the stage does not hold (e.g. aborted a moment ago) is ignored and returns False, so
    late LLM text after a barge-in is harmless. `clock` is the wall clock deadlines are
    read on (seconds).
    """

    name = "tts"

    def __init__(
        self, voice: VoiceModel, max_batch: int = 8, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.voice = voice
        self.max_batch = max_batch
        self._clock = clock
        self._context = voice.context_frames()
        self._streams: dict[str, _Stream] = {}

    def give_way_with(self, pause: Callable[[], None] | None) -> None:
        """The voice's renders take hundreds of ms (Piper) to seconds (Kokoro) on a
        CPU: `pause` is called between their pieces (`engine.runtime.urgency`)."""
        self.voice.give_way_with(pause)

    def add(self, request_id: str, inputs: TtsRequest) -> None:
        if not isinstance(inputs, TtsRequest):
            raise ValueError(f"TTS inputs must be a TtsRequest, not {type(inputs).__name__}")
        if request_id in self._streams:
            raise ValueError(f"TTS request {request_id!r} already exists")
        self._streams[request_id] = _Stream(self.voice.scales(inputs), self._clock())

    def runway(self, request_id: str) -> float | None:
        """Seconds of audio its listener has in hand now (negative: already dry); None
        for a request not held or not yet heard."""
        stream = self._streams.get(request_id)
        if stream is None or stream.first_at is None:
            return None
        return stream.deadline() - self._clock()

    def feed(self, request_id: str, text: str, final: bool = False) -> bool:
        stream = self._streams.get(request_id)
        if stream is None:
            return False
        if stream.final:
            raise ValueError(f"TTS request {request_id!r} already received its final text")
        clauses = speakable_clauses(text)
        if clauses and not stream.started and not stream.pending:
            head, rest = first_piece(clauses[0])
            clauses[:1] = [head, rest] if rest else [head]
        stream.pending.extend(clauses)
        stream.final = final
        return True

    def abort(self, request_id: str) -> None:
        self._streams.pop(request_id, None)

    def has_work(self) -> bool:
        return any(s.spoken() for s in self._streams.values()) or bool(self._pick()[0])

    def wake_in(self) -> float | None:
        """Seconds until a request held back by the AHEAD_S rule may be rendered, though
        nothing new arrives; None when none is held."""
        now = self._clock()
        if self._least_runway(now) > AHEAD_S:
            return None
        held = [
            runway - AHEAD_S
            for s in self._streams.values()
            if s.speakable() and (runway := s.deadline() - now) > AHEAD_S
        ]
        return min(held, default=None)

    def step(self) -> list[StageOutput]:
        # Requests with their final text all spoken only need their finished output.
        ended = [(rid, s) for rid, s in self._streams.items() if s.spoken()]
        speak, width = self._pick()
        outputs = self._speak(speak, width) if speak else []
        for rid, s in ended:
            outputs.append(self._emit(rid, s, np.zeros(0, np.float32), "", {}))
        return outputs

    def _pick(self) -> tuple[list[tuple[str, _Stream]], int]:
        """This step's requests, earliest deadline first, and the widest chunk they may
        render: twice the most urgent one's, so it is never held up much longer."""
        now = self._clock()
        ready = sorted(
            ((rid, s) for rid, s in self._streams.items() if s.speakable()),
            key=lambda item: item[1].deadline(),
        )
        if not ready:
            return [], 0
        limit = 2 * ready[0][1].chunk_frames()
        short = self._least_runway(now) <= AHEAD_S
        picked: list[tuple[str, _Stream]] = []
        widest = 0
        for rid, s in ready:
            if len(picked) == self.max_batch:
                break
            if short and s.deadline() - now > AHEAD_S:
                break  # far enough ahead: it waits while others run short
            width = s.chunk_frames()
            if width > limit:
                continue  # its wide chunk would hold the urgent one up: a later step
            rows, widest = len(picked) + 1, max(widest, width)
            if picked and rows * (widest + 2 * self._context) > STEP_WINDOW_FRAMES:
                break
            picked.append((rid, s))
        return picked, limit

    def _least_runway(self, now: float) -> float:
        """The least audio in hand (seconds) among the requests with more to speak:
        text to render now, or more text to come."""
        return min(
            (s.deadline() - now for s in self._streams.values() if s.speakable() or not s.final),
            default=math.inf,
        )

    def _speak(self, speak: list[tuple[str, _Stream]], width: int) -> list[StageOutput]:
        start = time.perf_counter()
        try:
            self._start_clauses([s for _, s in speak if not s.segments])
            spans = [s.next_span(width, self.voice.whole_segments) for _, s in speak]
            audio = self.voice.render([(seg.z_p, a, b) for seg, a, b in spans])
        except Exception as exc:  # a model failure fails these requests, not the engine
            for rid, _ in speak:
                self._streams.pop(rid, None)
            return [
                StageOutput(rid, None, finished=True, error=f"tts failed: {exc}")
                for rid, _ in speak
            ]
        synth_ms = 1000 * (time.perf_counter() - start)
        metrics = {"synth_ms": synth_ms, "batch": float(len(speak))}
        now = self._clock()
        outputs = []
        for (rid, s), (seg, a, b), chunk in zip(speak, spans, audio, strict=True):
            seg.rendered = b
            s.frames_out += b - a
            if s.first_at is None:
                s.first_at = now
            s.audio_s += len(chunk) / self.voice.sample_rate
            if seg.rendered == seg.frames:
                s.segments.popleft()
            total = seg.clause_frames
            text = spoken_text(seg.text, (seg.offset + a) / total, (seg.offset + b) / total)
            outputs.append(self._emit(rid, s, chunk, text, metrics))
        return outputs

    def _start_clauses(self, streams: list[_Stream]) -> None:
        # One batched latents pass over every phoneme piece of each stream's next clause.
        texts = [s.pending.popleft() for s in streams]
        pieces = [self.voice.id_pieces(t) for t in texts]
        flat = [ids for ps in pieces for ids in ps]
        if not flat:
            return
        scales = [s.scales for s, ps in zip(streams, pieces, strict=True) for _ in ps]
        latents = iter(self.voice.latents(flat, scales))
        for s, text, ps in zip(streams, texts, pieces, strict=True):
            s.started = True
            z_ps = [next(latents) for _ in ps]
            total, offset = sum(z.shape[1] for z in z_ps), 0
            for z_p in z_ps:
                s.segments.append(_Segment(text, z_p, offset, total))
                offset += z_p.shape[1]

    def _emit(
        self, rid: str, s: _Stream, audio: np.ndarray, text: str, metrics: dict
    ) -> StageOutput:
        finished = s.final and not s.pending and not s.segments
        chunk = AudioChunk.of(audio, self.voice.sample_rate, text)
        if finished:
            self._streams.pop(rid, None)
        return StageOutput(rid, chunk, finished=finished, metrics=dict(metrics))
