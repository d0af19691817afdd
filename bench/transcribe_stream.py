"""Live transcription: GA transcription sessions (`?intent=transcription`) on
`duplex-gateway` started through its CLI with the real embedded models, fed real speech
at a microphone's pace (40 ms `input_audio_buffer.append` frames in real time, silence
between the clips), server VAD committing each utterance.

    python bench/transcribe_stream.py [--json] [--max-streams 16] [--config PROFILE.yaml]

Clips: the alsa-utils recordings (a voice saying "Front center", "Rear left", ...) and
eSpeak NG sentences, each with its reference text.

One stream (every clip, in order; after one such stream that is not counted, so that
the gateway is warm):
- `first_delta_ms_p50`: from the start of speech in the clip (its first sample above
  -34 dBFS, as the client sent it) to the first `...input_audio_transcription.delta` of
  its item. Without live deltas the first delta comes with the final transcript.
- `completed_after_stop_ms_p50`: from `input_audio_buffer.speech_stopped` arriving to
  the item's `...input_audio_transcription.completed` arriving.
- `final_wer`: word error rate of the `.completed` transcripts against the references
  (lower case, punctuation dropped; the transcripts of a clip VAD cut in two are joined).
- `whole_wer`: the same clips as whole utterances, in the same run and the same gateway:
  each appended at once to a manual-commit transcription session and committed, so the
  speech-to-text sees the whole clip in one go. `wer_increase` = final - whole.

`live_streams_realtime`: the number of concurrent streams is stepped 1, 2, 4, 6, 8, 10,
12, 16, each stream speaking `LOAD_CLIPS` clips (starting at a different clip, after a
different lead-in silence, as independent speakers would). A step is sustained at real
time when every utterance of every stream is transcribed and, over all of them, each lag
stays bounded: its median within `BOUNDS_MS`, its p90 within twice that (this machine
may be shared: a tail may be another program's):
  - `completed_after_stop_ms` <= 1000: the transcript keeps up with the end of speech;
  - `stop_lag_ms` <= 1500: from the moment the client sent the audio at the utterance's
    `audio_end_ms` to `speech_stopped` arriving, the 500 ms of silence server VAD waits
    for included: the VAD keeps up with the audio;
  - `delta_lag_ms` <= 2000: from that same moment to the utterance's first delta, or 0
    when a delta came before that audio was sent (live deltas keeping up with speech).
A stream that falls behind real time shows as lags growing without bound over its
utterances. The result is the largest step sustained, every smaller one sustained too.

The machine running this may be shared: the figures are those of one run.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import re
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import soundfile as sf
import soxr
from websockets.asyncio.client import ClientConnection, connect

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _gateway import RATE, append_event, gateway_process  # noqa: E402

FRAME_MS = 40
FRAME_BYTES = RATE * 2 * FRAME_MS // 1000
LEAD_MS = 600  # silence before the first clip
GAP_MS = 1600  # silence after each clip: above server VAD's 500 ms, as a pause is
ONSET_LEVEL = 0.02  # -34 dBFS: where speech starts in a clip
STEPS = (1, 2, 4, 6, 8, 10, 12, 16)
STAGGER_MS = 680  # between the streams' starts
LOAD_CLIPS = 4
BOUNDS_MS = {"completed_after_stop_ms": 1000.0, "stop_lag_ms": 1500.0, "delta_lag_ms": 2000.0}
TAIL_TIMEOUT_S = 60.0  # for the last transcripts once a stream has sent everything
ALSA = Path("/usr/share/sounds/alsa")
ALSA_CLIPS = (
    "Front_Center",
    "Front_Left",
    "Front_Right",
    "Rear_Center",
    "Rear_Left",
    "Rear_Right",
    "Side_Left",
    "Side_Right",
)
# The first six in one voice, the rest in four: words enough (over 200 with the
# recordings) that one misheard word moves the word error rate by under 0.005.
SENTENCES = (
    ("Could you tell me what the weather will be like tomorrow in Paris?", "en-us"),
    ("I would like to book a table for two people at seven tonight.", "en-us"),
    ("Thanks, that is all I needed to know.", "en-us"),
    ("Please remind me to call my sister when I get home.", "en-us"),
    ("The children played in the park until the sun went down.", "en-us"),
    ("The meeting has been moved to Monday afternoon.", "en-us"),
    ("What is the capital of France?", "en-gb"),
    ("Set a timer for ten minutes.", "en-us+f3"),
    ("How far is the nearest train station?", "en-gb-x-rp"),
    ("My flight leaves at six in the morning.", "en-us"),
    ("Can you read me the latest news?", "en-gb"),
    ("Turn off the lights in the kitchen please.", "en-us+f3"),
    ("Where did I leave my keys yesterday?", "en-gb-x-rp"),
    ("Send a message to my brother saying I am late.", "en-us"),
    ("Please add milk and bread to my shopping list.", "en-gb"),
    ("What time does the museum open on Sunday?", "en-us+f3"),
    ("I need a taxi to the airport at noon.", "en-gb-x-rp"),
    ("Tell me a joke about cats.", "en-us"),
    ("How many people live in Tokyo?", "en-gb"),
    ("Remind me to water the plants every morning.", "en-us+f3"),
    ("Is it going to rain this weekend?", "en-gb-x-rp"),
    ("Play the next episode of my podcast.", "en-us"),
    ("Which restaurant did we visit last Friday?", "en-gb"),
    ("Book me a haircut for Thursday afternoon.", "en-us+f3"),
)
SESSION = {
    "type": "transcription",
    "audio": {
        "input": {
            "transcription": {"model": "whisper-1", "language": "en"},
            "turn_detection": {"type": "server_vad", "silence_duration_ms": 500},
        }
    },
}
DELTA = "conversation.item.input_audio_transcription.delta"
COMPLETED = "conversation.item.input_audio_transcription.completed"


@dataclass(frozen=True)
class Clip:
    name: str
    reference: str
    pcm: bytes  # PCM16 24 kHz mono
    onset_ms: float  # where its speech starts

    @property
    def duration_ms(self) -> float:
        return len(self.pcm) / 2 / RATE * 1000


def _pcm16(audio: np.ndarray, rate: int) -> bytes:
    if audio.ndim > 1:
        audio = audio.mean(axis=1)
    resampled = soxr.resample(audio.astype(np.float32), rate, RATE)
    return (np.clip(resampled, -1, 1) * 32767).astype("<i2").tobytes()


def _clip(name: str, reference: str, pcm: bytes) -> Clip:
    samples = np.abs(np.frombuffer(pcm, "<i2") / 32768)
    loud = np.flatnonzero(samples > ONSET_LEVEL)
    onset = loud[0] / RATE * 1000 if loud.size else 0.0
    return Clip(name, reference, pcm, float(onset))


def clips() -> list[Clip]:
    """The alsa-utils recordings and the eSpeak NG sentences."""
    out = []
    for stem in ALSA_CLIPS:
        audio, rate = sf.read(ALSA / f"{stem}.wav", dtype="float32")
        out.append(_clip(stem, stem.replace("_", " "), _pcm16(audio, rate)))
    for i, (sentence, voice) in enumerate(SENTENCES):
        with tempfile.NamedTemporaryFile(suffix=".wav") as wav:
            subprocess.run(["espeak-ng", "-v", voice, "-w", wav.name, sentence], check=True)
            audio, rate = sf.read(wav.name, dtype="float32")
        out.append(_clip(f"sentence{i}", sentence, _pcm16(audio, rate)))
    return out


# -- word error rate ----------------------------------------------------------------------


def normalise(text: str) -> list[str]:
    return re.findall(r"[a-z0-9']+", text.lower())


def word_errors(reference: list[str], hypothesis: list[str]) -> int:
    """Substitutions, insertions and deletions (Levenshtein distance over words)."""
    row = list(range(len(hypothesis) + 1))
    for i, ref in enumerate(reference, 1):
        previous, row[0] = row[0], i
        for j, hyp in enumerate(hypothesis, 1):
            previous, row[j] = row[j], min(row[j] + 1, row[j - 1] + 1, previous + (ref != hyp))
    return row[-1]


def wer(pairs: list[tuple[str, str]]) -> float:
    """Corpus WER of (reference, hypothesis) pairs."""
    errors = sum(word_errors(normalise(r), normalise(h)) for r, h in pairs)
    return round(errors / max(1, sum(len(normalise(r)) for r, _ in pairs)), 4)


# -- one stream -------------------------------------------------------------------------


@dataclass
class Utterance:
    """One item server VAD committed, and what arrived for it."""

    start_ms: float
    end_ms: float | None = None
    stopped_at: float | None = None
    first_delta_at: float | None = None
    completed_at: float | None = None
    transcript: str = ""


@dataclass
class Stream:
    """A transcription session speaking `clips` in order, a frame every 40 ms."""

    clips: list[Clip]
    lead_ms: float = LEAD_MS
    spans: list[tuple[float, float]] = field(default_factory=list)  # each clip's ms
    sent_at: list[float] = field(default_factory=list)  # wall time of each frame sent
    utterances: dict[str, Utterance] = field(default_factory=dict)
    errors: list[str] = field(default_factory=list)

    def timeline(self) -> bytes:
        pcm = bytearray(_silence(self.lead_ms))
        for clip in self.clips:
            start = len(pcm) / 2 / RATE * 1000
            self.spans.append((start, start + clip.duration_ms))
            pcm += clip.pcm + _silence(GAP_MS)
        pcm += bytes(-len(pcm) % FRAME_BYTES)
        return bytes(pcm)

    def sent_time(self, ms: float) -> float:
        """When the client sent the frame holding session time `ms`."""
        return self.sent_at[min(int(ms // FRAME_MS), len(self.sent_at) - 1)]

    def clip_of(self, utterance: Utterance) -> int:
        """The clip an utterance belongs to: the one whose span (and gap) holds its start."""
        for i, (start, end) in enumerate(self.spans):
            if utterance.start_ms < end + GAP_MS / 2:
                return i if utterance.start_ms >= start - GAP_MS / 2 else -1
        return -1

    def pending(self) -> int:
        """Utterances heard but not yet transcribed."""
        return sum(u.completed_at is None for u in self.utterances.values())


def _silence(ms: float) -> bytes:
    return bytes(int(RATE * ms / 1000) * 2)


async def _send(ws: ClientConnection, stream: Stream, pcm: bytes) -> None:
    start = time.monotonic()
    for n, i in enumerate(range(0, len(pcm), FRAME_BYTES)):
        await ws.send(append_event(pcm[i : i + FRAME_BYTES]))
        stream.sent_at.append(time.monotonic())
        await asyncio.sleep(max(0.0, start + (n + 1) * FRAME_MS / 1000 - time.monotonic()))


async def _read(ws: ClientConnection, stream: Stream, drained: asyncio.Event) -> None:
    async for message in ws:
        event, now = json.loads(message), time.monotonic()
        kind = event["type"]
        if kind == "error":
            stream.errors.append(event["error"]["message"])
        elif kind == "input_audio_buffer.speech_started":
            stream.utterances[event["item_id"]] = Utterance(event["audio_start_ms"])
        elif kind == "input_audio_buffer.speech_stopped":
            utterance = stream.utterances[event["item_id"]]
            utterance.end_ms, utterance.stopped_at = event["audio_end_ms"], now
        elif kind == DELTA:
            utterance = stream.utterances[event["item_id"]]
            utterance.first_delta_at = utterance.first_delta_at or now
        elif kind == COMPLETED:
            utterance = stream.utterances[event["item_id"]]
            utterance.completed_at, utterance.transcript = now, event["transcript"]
        if drained.is_set() and not stream.pending():
            return


async def open_session(url: str) -> ClientConnection:
    ws = await connect(f"{url}?intent=transcription", max_size=None, open_timeout=60)
    created = json.loads(await ws.recv())
    assert created["type"] == "session.created", created
    await ws.send(json.dumps({"type": "session.update", "session": SESSION}))
    updated = json.loads(await ws.recv())
    assert updated["type"] == "session.updated", updated
    return ws


async def run_stream(url: str, stream: Stream) -> Stream:
    ws = await open_session(url)
    try:
        drained = asyncio.Event()
        reader = asyncio.create_task(_read(ws, stream, drained))
        await _send(ws, stream, stream.timeline())
        drained.set()
        if not stream.pending():
            reader.cancel()
        with contextlib.suppress(asyncio.CancelledError, asyncio.TimeoutError):
            await asyncio.wait_for(reader, TAIL_TIMEOUT_S)
    finally:
        await ws.close()
    return stream


# -- measures -------------------------------------------------------------------------


@dataclass
class Measures:
    first_delta_ms: list[float] = field(default_factory=list)
    completed_after_stop_ms: list[float] = field(default_factory=list)
    delta_lag_ms: list[float] = field(default_factory=list)
    stop_lag_ms: list[float] = field(default_factory=list)
    transcripts: list[tuple[str, str]] = field(default_factory=list)  # (reference, final)
    clip_first_delta_ms: list[float | None] = field(default_factory=list)  # per clip
    utterances: int = 0
    untranscribed: int = 0
    errors: list[str] = field(default_factory=list)

    def add(self, stream: Stream) -> None:
        self.errors += stream.errors
        heard: dict[int, list[Utterance]] = {}
        for utterance in stream.utterances.values():
            heard.setdefault(stream.clip_of(utterance), []).append(utterance)
        for i, clip in enumerate(stream.clips):
            said = sorted(heard.get(i, []), key=lambda u: u.start_ms)
            self.transcripts.append((clip.reference, " ".join(u.transcript for u in said)))
            firsts = [u.first_delta_at for u in said if u.first_delta_at is not None]
            first = None
            if firsts:
                onset = stream.sent_time(stream.spans[i][0] + clip.onset_ms)
                first = round((min(firsts) - onset) * 1000, 1)
                self.first_delta_ms.append(first)
            self.clip_first_delta_ms.append(first)
        for utterance in stream.utterances.values():
            self._add_utterance(stream, utterance)

    def _add_utterance(self, stream: Stream, u: Utterance) -> None:
        self.utterances += 1
        if u.end_ms is None or u.stopped_at is None:
            self.untranscribed += 1  # every clip ends in a pause: its stop never came
            return
        if u.completed_at is None or u.first_delta_at is None:
            self.untranscribed += 1
            return
        end_sent = stream.sent_time(u.end_ms)
        self.completed_after_stop_ms.append((u.completed_at - u.stopped_at) * 1000)
        self.delta_lag_ms.append(max(0.0, (u.first_delta_at - end_sent) * 1000))
        self.stop_lag_ms.append((u.stopped_at - end_sent) * 1000)

    def summary(self) -> dict[str, Any]:
        return {
            "utterances": self.utterances,
            "untranscribed": self.untranscribed,
            "first_delta_ms_p50": pct(self.first_delta_ms, 50),
            **{f"{name}_p{q}": pct(getattr(self, name), q) for name in BOUNDS_MS for q in (50, 90)},
            "error_events": len(self.errors),
        }


def _known(values: list[float | None]) -> list[float]:
    return [v for v in values if v is not None]


def pct(values: list[float], q: float) -> float | None:
    return round(float(np.percentile(values, q)), 1) if values else None


def sustained(step: dict[str, Any]) -> bool:
    if step["untranscribed"] or not step["utterances"] or step["error_events"]:
        return False
    for name, bound in BOUNDS_MS.items():
        median, tail = step[f"{name}_p50"], step[f"{name}_p90"]
        if median is None or median > bound or tail > 2 * bound:
            return False
    return True


# -- whole utterances ---------------------------------------------------------------------


async def whole_transcripts(url: str, all_clips: list[Clip]) -> list[tuple[str, str]]:
    """Each clip appended at once to a manual-commit transcription session, committed."""
    ws = await open_session(url)
    manual = {"type": "transcription", "audio": {"input": {"turn_detection": None}}}
    await ws.send(json.dumps({"type": "session.update", "session": manual}))
    await _until(ws, "session.updated")
    pairs = []
    try:
        for clip in all_clips:
            await ws.send(append_event(_silence(200) + clip.pcm + _silence(200)))
            await ws.send(json.dumps({"type": "input_audio_buffer.commit"}))
            completed = await _until(ws, COMPLETED)
            pairs.append((clip.reference, completed["transcript"]))
    finally:
        await ws.close()
    return pairs


async def _until(ws: ClientConnection, kind: str) -> dict[str, Any]:
    return await asyncio.wait_for(_next(ws, kind), 120)


async def _next(ws: ClientConnection, kind: str) -> dict[str, Any]:
    while True:
        event: dict[str, Any] = json.loads(await ws.recv())
        if event["type"] == "error":
            raise RuntimeError(event["error"]["message"])
        if event["type"] == kind:
            return event


# -- the run --------------------------------------------------------------------------------


async def load_step(url: str, all_clips: list[Clip], n: int) -> dict[str, Any]:
    streams = [
        Stream(
            [all_clips[(k * LOAD_CLIPS + j) % len(all_clips)] for j in range(LOAD_CLIPS)],
            lead_ms=LEAD_MS + (k * STAGGER_MS) % (2 * GAP_MS),
        )
        for k in range(n)
    ]
    measures = Measures()
    for stream in await asyncio.gather(*(run_stream(url, s) for s in streams)):
        measures.add(stream)
    return {"streams": n, **measures.summary()}


async def run(max_streams: int, config: Path | None) -> dict[str, Any]:
    all_clips = clips()
    extra = ["--max-sessions", str(max_streams + 4)]
    extra += ["--config", str(config)] if config is not None else []
    with gateway_process(*extra) as gateway:
        url = gateway.realtime_url
        whole = await whole_transcripts(url, all_clips)
        # Live partials ask for window and prefix sizes the whole transcripts did not:
        # one stream first, not counted, so the figures are not those of a cold start.
        await run_stream(url, Stream(list(all_clips)))
        single = Measures()
        single.add(await run_stream(url, Stream(list(all_clips))))
        steps = []
        for n in (s for s in STEPS if s <= max_streams):
            steps.append(await load_step(url, all_clips, n))
            steps[-1]["sustained"] = sustained(steps[-1])
            if not steps[-1]["sustained"]:
                break
    passing = 0
    for step in steps:
        if not step["sustained"]:
            break
        passing = step["streams"]
    final, whole_wer = wer(single.transcripts), wer(whole)
    n_rec = len(ALSA_CLIPS)
    summary = single.summary()
    return {
        "clips": len(all_clips),
        "first_delta_ms_p50": summary["first_delta_ms_p50"],
        # The recordings are two words, about a second: their first delta may be the last.
        "first_delta_ms_p50_recordings": pct(_known(single.clip_first_delta_ms[:n_rec]), 50),
        "first_delta_ms_p50_sentences": pct(_known(single.clip_first_delta_ms[n_rec:]), 50),
        "completed_after_stop_ms_p50": summary["completed_after_stop_ms_p50"],
        "final_wer": final,
        "whole_wer": whole_wer,
        "wer_increase": round(final - whole_wer, 4),
        "live_streams_realtime": passing,
        "single_stream": summary,
        "transcripts": [
            {"reference": r, "final": f, "whole": w, "first_delta_ms": first}
            for (r, f), (_, w), first in zip(
                single.transcripts, whole, single.clip_first_delta_ms, strict=True
            )
        ],
        "steps": steps,
        "bounds_ms": BOUNDS_MS,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--max-streams", type=int, default=16)
    parser.add_argument("--config", type=Path, help="profile YAML (default: the default one)")
    args = parser.parse_args()
    result = asyncio.run(run(args.max_streams, args.config))
    if args.json:
        print(json.dumps(result))
        return
    for key, value in result.items():
        if key not in ("transcripts", "steps", "single_stream"):
            print(f"{key}: {value}")
    for step in result["steps"]:
        print(step)


if __name__ == "__main__":
    main()
