"""Turn-taking as a user meets it: premature turn ends, false interruptions, how fast a
real interruption is heard, and the wait from the end of speech to the answer's audio.

    .venv/bin/python bench/turns.py [--config PROFILE.yaml] [--sounds DIR] [--json]
        [--modes semantic_vad server_vad] [--kinds hesitations sentences nonspeech ...]

The gateway is started through its CLI with the real models. Each turn-detection mode
(`semantic_vad` eagerness auto, `server_vad` with its defaults) gets a session whose
client streams 40 ms frames in real time, silence between clips, as a microphone does:

- premature_end_rate: sentences with a 900 ms hesitation in mid-phrase (eSpeak NG, SSML
  <break>), answered before the speaker finished (a speech stop inside the pause).
- end_of_speech_to_first_audio_ms_p50: whole sentences, from the moment the client sent
  the last sample of the last word (not `speech_stopped`) to the first audio delta.
- false_interruption_rate_nonspeech / _backchannel: while an answer is being spoken, a
  non-speech sound (Debian's sound-theme-freedesktop, alsa-utils' Noise.wav) or a spoken
  backchannel ("mm hmm", "yeah", "okay"...); false if `speech_started` arrives or the
  answer is cancelled.
- interrupt_detect_ms_p95 (and _p50): real interrupting sentences over an answer, from
  the first sample of speech sent to `speech_started`; stale_audio_deltas counts audio of a
  cancelled answer arriving after its `response.done` (must be 0).

Hesitations and sentences share one session; each sound over an answer gets a session
of its own, so that every answer starts from a short conversation and is still being
spoken when the sound is played.

Debian's sound theme: `apt-get download sound-theme-freedesktop && dpkg-deb -x ...`
and pass `--sounds <dir>/usr/share/sounds/freedesktop/stereo` if it is not installed.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import numpy as np
import soundfile as sf
import soxr
from websockets.asyncio.client import ClientConnection, connect

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _gateway import RATE, ROOT, append_event, gateway_process  # noqa: E402

FRAME_MS = 40
FRAME_BYTES = RATE * 2 * FRAME_MS // 1000
SOUNDS = Path("/usr/share/sounds/freedesktop/stereo")
ALSA = Path("/usr/share/sounds/alsa")
VOICES = ("en-us", "en+m3")
HESITATIONS = (
    "I would like to book a table for <break time='900ms'/> two people at seven tonight.",
    "Could you tell me what the <break time='900ms'/> weather will be like tomorrow?",
    "Can you add eggs and <break time='900ms'/> milk to my shopping list?",
    "My favourite colour has always been <break time='900ms'/> a deep shade of blue.",
    "I need to send a message to <break time='900ms'/> my brother about the party.",
    "I think the best way to get there is <break time='900ms'/> probably by train.",
)
SENTENCES = (
    "What is the capital of France?",
    "Thanks, that is all I needed to know.",
    "Please tell me a fun fact about cats.",
    "How far away is the moon?",
    "Can you recommend a good book?",
)
BACKCHANNELS = ("mm hmm", "yeah", "okay", "uh huh", "right")
INTERRUPTIONS = (
    "Wait, stop, I have a different question.",
    "No no, that is not what I asked.",
    "Hold on, can you repeat that more slowly?",
    "Actually, tell me about the weather instead.",
    "Excuse me, I need to ask something else.",
)
# Speech recordings in the theme (channel names) are not non-speech.
NOT_NONSPEECH = ("audio-channel-", "audio-test-signal")
QUESTION = "Tell me a long story about a dragon who learns to fly over the sea."
KINDS = ["hesitations", "sentences", "nonspeech", "backchannels", "interruptions"]
MODES: dict[str, dict[str, Any]] = {
    "semantic_vad": {"type": "semantic_vad", "eagerness": "auto"},
    "server_vad": {"type": "server_vad"},
}


# --- clips (PCM16 24 kHz) -------------------------------------------------------------


def to_pcm(audio: np.ndarray, rate: int) -> bytes:
    if audio.ndim > 1:
        audio = audio.mean(axis=1)
    pcm = soxr.resample(audio.astype(np.float32), rate, RATE)
    return (np.clip(pcm, -1, 1) * 32767).astype("<i2").tobytes()


def speak(text: str, voice: str) -> bytes:
    with tempfile.NamedTemporaryFile(suffix=".wav") as wav:
        cmd = ["espeak-ng", "-m", "-v", voice, "-w", wav.name, text]
        subprocess.run(cmd, check=True)
        audio, rate = sf.read(wav.name, dtype="float32")
    return to_pcm(audio, rate)


def read_sound(path: Path) -> bytes:
    audio, rate = sf.read(str(path), dtype="float32")
    return to_pcm(audio, rate)


def loud_ms(pcm: bytes, level: float = 0.01) -> tuple[float, float, float | None]:
    """(first loud ms, last loud ms, end of the longest inner quiet run of >= 600 ms)."""
    x = np.abs(np.frombuffer(pcm, "<i2").astype(np.float32) / 32768) > level
    loud = np.nonzero(x)[0]
    first, last = loud[0] * 1000 / RATE, (loud[-1] + 1) * 1000 / RATE
    gaps = np.diff(loud)
    i = int(np.argmax(gaps))
    gap_end = loud[i + 1] * 1000 / RATE if gaps[i] >= 0.6 * RATE else None
    return first, last, gap_end


# --- the client: a microphone and an event log ----------------------------------------


class Microphone:
    """Sends one 40 ms frame every 40 ms on an absolute schedule; clips queued with
    `play`, silence otherwise. Session time is frames sent x 40 ms."""

    def __init__(self, ws: ClientConnection) -> None:
        self.ws = ws
        self.queue = bytearray()
        self.frames_sent = 0
        self.queued_end_ms = 0.0
        self.sent_at: dict[int, float] = {}  # frame index -> wall time it was sent
        self._sent = asyncio.Condition()

    def play(self, pcm: bytes) -> float:
        """Queue a clip; the session ms at which its first sample will be sent."""
        start_ms = max(self.queued_end_ms, self.frames_sent * FRAME_MS)
        if start_ms > self.queued_end_ms:  # nothing queued: it starts at the next frame
            self.queue.clear()
        self.queue += pcm
        self.queued_end_ms = start_ms + len(pcm) * 1000 / (RATE * 2)
        return start_ms

    async def sent(self, session_ms: float) -> float:
        """Wait until the frame holding `session_ms` was sent; its wall time."""
        frame = int(session_ms // FRAME_MS)
        async with self._sent:
            await self._sent.wait_for(lambda: frame in self.sent_at)
        return self.sent_at[frame]

    async def run(self) -> None:
        start = time.monotonic()
        while True:
            frame = bytes(self.queue[:FRAME_BYTES]).ljust(FRAME_BYTES, b"\0")
            del self.queue[:FRAME_BYTES]
            await self.ws.send(append_event(frame))
            async with self._sent:
                self.sent_at[self.frames_sent] = time.monotonic()
                self.frames_sent += 1
                self._sent.notify_all()
            wake = start + self.frames_sent * FRAME_MS / 1000
            await asyncio.sleep(max(0.0, wake - time.monotonic()))


class Events:
    def __init__(self, ws: ClientConnection) -> None:
        self.ws = ws
        self.log: list[tuple[float, dict[str, Any]]] = []
        self._new = asyncio.Condition()

    async def run(self) -> None:
        async for raw in self.ws:
            event = json.loads(raw)
            async with self._new:
                self.log.append((time.monotonic(), event))
                self._new.notify_all()

    async def next(
        self, since: int, match: Callable[[dict[str, Any]], bool], timeout: float = 60
    ) -> tuple[int, float, dict[str, Any]]:
        """The first event at index >= `since` that matches: (index, wall time, event)."""
        deadline = time.monotonic() + timeout
        async with self._new:
            while True:
                for i in range(since, len(self.log)):
                    if match(self.log[i][1]):
                        return i, *self.log[i]
                since = len(self.log)
                await asyncio.wait_for(self._new.wait(), deadline - time.monotonic())

    def since(self, index: int) -> list[dict[str, Any]]:
        return [e for _, e in self.log[index:]]


def of(kind: str) -> Callable[[dict[str, Any]], bool]:
    return lambda e: e["type"] == kind


def done_of(response_id: str) -> Callable[[dict[str, Any]], bool]:
    return lambda e: e["type"] == "response.done" and e["response"]["id"] == response_id


# --- scenarios --------------------------------------------------------------------------


class Session:
    def __init__(self, ws: ClientConnection, mic: Microphone, events: Events) -> None:
        self.ws = ws
        self.mic = mic
        self.events = events

    async def settle(self, ws: ClientConnection) -> None:
        """Stop the answer under way (its measurement is taken) and let a second of
        silence pass."""
        since = self.events.since(self._mark)
        created = {e["response"]["id"] for e in since if e["type"] == "response.created"}
        done = {e["response"]["id"] for e in since if e["type"] == "response.done"}
        for response_id in created - done:
            await ws.send(json.dumps({"type": "response.cancel", "response_id": response_id}))
            await self.events.next(self._mark, done_of(response_id))
        await self.mic.sent(self.mic.frames_sent * FRAME_MS + 1000)

    def mark(self) -> int:
        self._mark = len(self.events.log)
        return self._mark

    async def hesitation(self, pcm: bytes) -> bool:
        """True if the turn ended inside the hesitation (premature)."""
        mark = self.mark()
        _, last, gap_end = loud_ms(pcm)
        assert gap_end is not None, "no hesitation found in the clip"
        start = self.mic.play(pcm)
        await self.mic.sent(start + last + 6000)  # past the longest semantic wait
        stops = [e for e in self.events.since(mark) if e["type"].endswith("speech_stopped")]
        await self.settle(self.ws)
        return any(e["audio_end_ms"] < start + gap_end - 100 for e in stops)

    async def answer_wait(self, pcm: bytes) -> tuple[float, float]:
        """(ms from the end of the last word to the first audio delta, ms of that spent
        before `speech_stopped` arrived: deciding that the turn is over)."""
        mark = self.mark()
        _, last, _ = loud_ms(pcm)
        start = self.mic.play(pcm)
        spoken_end = await self.mic.sent(start + last)
        _, at, _ = await self.events.next(mark, of("response.output_audio.delta"), 120)
        stopped = [t for t, e in self.events.log[mark:] if e["type"].endswith("speech_stopped")]
        await self.settle(self.ws)
        decided = stopped[-1] if stopped else float("nan")
        return (at - spoken_end) * 1000, (decided - spoken_end) * 1000

    async def over_answer(self, ws: ClientConnection, pcm: bytes) -> tuple[bool, float, int]:
        """Play `pcm` once an answer is being spoken: (interrupted, ms from first sound
        to speech_started, stale deltas)."""
        mark = self.mark()
        await ask(ws)
        _, _, delta = await self.events.next(mark, of("response.output_audio.delta"), 180)
        response_id = delta["response_id"]
        first, last, _ = loud_ms(pcm)
        start = self.mic.play(pcm)
        sound_at = await self.mic.sent(start + first)
        await self.mic.sent(start + last + 1500)
        started = [
            at
            for at, e in self.events.log[mark:]
            if e["type"] == "input_audio_buffer.speech_started" and at >= sound_at
        ]
        await self.settle(ws)
        i, _, done = await self.events.next(mark, done_of(response_id))
        stale = sum(
            1
            for e in self.events.since(i + 1)
            if e.get("response_id") == response_id and e["type"].endswith("audio.delta")
        )
        details = done["response"].get("status_details") or {}
        cancelled = details.get("reason") == "turn_detected"
        detect_ms = (started[0] - sound_at) * 1000 if started else float("nan")
        return bool(started) or cancelled, detect_ms, stale


async def ask(ws: ClientConnection) -> None:
    item = {"type": "message", "role": "user"}
    item["content"] = [{"type": "input_text", "text": QUESTION}]  # type: ignore[assignment]
    await ws.send(json.dumps({"type": "conversation.item.create", "item": item}))
    await ws.send(json.dumps({"type": "response.create"}))


def _whole(ms: float) -> int | None:
    """Milliseconds for the trace; None where nothing was measured (NaN)."""
    return round(ms) if ms == ms else None


def rate(hits: list[bool]) -> float:
    return round(float(np.mean(hits)), 3) if hits else float("nan")


def percentile(values: list[float], q: float) -> float:
    finite = [v for v in values if v == v]
    return round(float(np.percentile(finite, q)), 1) if finite else float("nan")


@contextlib.asynccontextmanager
async def open_session(url: str, mode: str) -> AsyncIterator[Session]:
    """A new realtime session in `mode`, its microphone streaming silence."""
    # An OpenAI name: every profile serves it (its own name differs by profile).
    async with connect(f"{url}/realtime?model=gpt-realtime", max_size=None) as ws:
        mic, events = Microphone(ws), Events(ws)
        tasks = [asyncio.create_task(events.run()), asyncio.create_task(mic.run())]
        detection = MODES[mode]
        update = {"type": "realtime", "audio": {"input": {"turn_detection": detection}}}
        await ws.send(json.dumps({"type": "session.update", "session": update}))
        await events.next(0, of("session.updated"))
        session = Session(ws, mic, events)
        session.mark()
        try:
            yield session
        finally:
            for task in tasks:
                task.cancel()


async def over_fresh_answer(url: str, mode: str, pcm: bytes) -> tuple[bool, float, int]:
    """`Session.over_answer` in a session of its own: a conversation grown over many
    trials would leave the answer little room (its output tokens), and an answer that
    is over before the sound is played tests nothing."""
    async with open_session(url, mode) as session:
        return await session.over_answer(session.ws, pcm)


async def run_mode(url: str, mode: str, clips: dict[str, list[bytes]]) -> dict[str, Any]:
    async with open_session(url, mode) as session:
        premature = [await session.hesitation(pcm) for pcm in clips["hesitations"]]
        timings = [await session.answer_wait(pcm) for pcm in clips["sentences"]]
    waits = [wait for wait, _ in timings]
    deciding = [decide for _, decide in timings]
    nonspeech = [(await over_fresh_answer(url, mode, pcm))[0] for pcm in clips["nonspeech"]]
    backchannel = [(await over_fresh_answer(url, mode, pcm))[0] for pcm in clips["backchannels"]]
    interrupts = [await over_fresh_answer(url, mode, pcm) for pcm in clips["interruptions"]]
    trace = {"premature": premature, "waits_ms": [round(w) for w in waits]}
    trace["deciding_ms"] = [_whole(d) for d in deciding]
    trace |= {"nonspeech": nonspeech, "backchannel": backchannel}
    trace["interrupts"] = [(hit, _whole(ms), stale) for hit, ms, stale in interrupts]
    print(mode, json.dumps(trace), file=sys.stderr)
    return {
        "premature_end_rate": rate(premature),
        # An answer whose audio began before the sentence ended (the turn was cut inside
        # it) has no wait to measure; it is counted instead.
        "end_of_speech_to_first_audio_ms_p50": percentile([w for w in waits if w > 0], 50),
        # Of that wait, the part before `speech_stopped` (the turn's end decided); the
        # rest is the answer's first audio.
        "end_of_speech_to_speech_stopped_ms_p50": percentile(deciding, 50),
        "sentences_answered_before_their_end": sum(w <= 0 for w in waits),
        "false_interruption_rate_nonspeech": rate(nonspeech),
        "false_interruption_rate_backchannel": rate(backchannel),
        "interrupt_detect_ms_p95": percentile([d for _, d, _ in interrupts], 95),
        # Of ten trials the p95 is the slowest: the median says whether a change moved
        # them all.
        "interrupt_detect_ms_p50": percentile([d for _, d, _ in interrupts], 50),
        "interruptions_detected": sum(hit for hit, _, _ in interrupts),
        "stale_audio_deltas": sum(stale for _, _, stale in interrupts),
        "trials": {k: len(v) for k, v in clips.items()},
    }


def make_clips(sounds: Path) -> dict[str, list[bytes]]:
    theme = [p for p in sorted(sounds.glob("*.oga")) if not p.name.startswith(NOT_NONSPEECH)]
    nonspeech = [read_sound(p) for p in theme[:9]] + [read_sound(ALSA / "Noise.wav")]
    return {
        "hesitations": [speak(t, v) for t in HESITATIONS for v in VOICES],
        "sentences": [speak(t, v) for t in SENTENCES for v in VOICES],
        "nonspeech": nonspeech,
        "backchannels": [speak(t, v) for t in BACKCHANNELS for v in VOICES],
        "interruptions": [speak(t, v) for t in INTERRUPTIONS for v in VOICES],
    }


async def measure(
    url: str, clips: dict[str, list[bytes]], modes: tuple[str, ...]
) -> dict[str, Any]:
    return {mode: await run_mode(url, mode, clips) for mode in modes}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", type=Path, default=None, help="profile for the gateway")
    parser.add_argument("--url", default=None, help="a running gateway's ws://HOST:PORT/v1")
    parser.add_argument("--sounds", type=Path, default=SOUNDS, help="freedesktop sound theme")
    parser.add_argument("--per-kind", type=int, default=None, help="at most N clips per kind")
    parser.add_argument("--kinds", nargs="+", choices=KINDS, default=KINDS, help="clips to play")
    parser.add_argument("--modes", nargs="+", choices=list(MODES), default=list(MODES))
    parser.add_argument("--json", action="store_true", help="print JSON only")
    args = parser.parse_args()
    if not any(args.sounds.glob("*.oga")):
        parser.error(f"no sound theme at {args.sounds} (see the module docstring)")
    made = make_clips(args.sounds)
    clips = {k: v[: args.per_kind] if k in args.kinds else [] for k, v in made.items()}
    modes = tuple(args.modes)
    if args.url:
        results = asyncio.run(measure(args.url, clips, modes))
    else:
        extra = ["--config", str(args.config)] if args.config else []
        # The outer PYTHONPATH is kept: a model package may be reachable only through it.
        path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)
        with gateway_process(*extra, env={"PYTHONPATH": path}) as gw:
            results = asyncio.run(measure(gw.url, clips, modes))
    print(json.dumps(results, indent=None if args.json else 2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
