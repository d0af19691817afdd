"""Speakerphone clients against the gateway: echo cancellation on against off, in one run.

    .venv/bin/python bench/echo.py [--url ws://HOST:PORT/v1 | --config PROFILE.yaml]
                                   [--rooms 8] [--clean 8] [--json]
    .venv/bin/python bench/echo.py --offline [--rooms 8] [--json]

Without `--url` the gateway is started through its CLI (real models). Each client runs
in real time: it streams its microphone in 40 ms appends, plays every answer on its
loudspeaker, and its microphone picks the playback up through a simulated room
(`bench/_rooms.py`: echo 4 to 20 dB below the voice, 20 to 300 ms of delay,
reverberation, a playback clock that drifts and jitters). When the gateway says speech
started, it stops playback and truncates the item, as the realtime guide asks. Speech
is eSpeak NG's and ALSA's recordings.

Per room, one session with cancellation on and one with it off (the session field
`echo_cancellation`): the user asks aloud, then stays silent while the whole answer
plays; then asks in text, and a person talks over the second answer 1.5 s into it. Any
`speech_started` from the first answer on, before the person spoke, is a
self-interruption; the person is detected when `speech_started` arrives after they
began (`detect_ms`: from their first sample to the event, on the client's clock).
Then on echo-free speech (headphones: no echo, the answer still playing), each clip is
committed by server VAD and transcribed: `clean_wer_delta` is on minus off, and the
speech timing (start, end) is compared clip by clip.

Offline, on the microphone signals the echo trials recorded, the gateway's input
processing and speexdsp (the other candidate) are replayed: `erle_db` (echo return loss
enhancement where only echo plays), the person's level kept while they talk over it,
and CPU ms per second of audio per stream. Timing and CPU figures are noisy on a shared
machine.

`--offline` runs no gateway: the same rooms, with eSpeak NG as the far end, through the
gateway's input processing, through speexdsp and through nothing, and the output heard
by the gateway's VAD (Silero): how long the echo reads as speech, ERLE, how soon a person
over the echo is heard and how much of their level is kept, and speech over an answer on
a headset.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
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
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from _gateway import gateway_process  # noqa: E402
from _rooms import RATE, ROOMS, Room, Speakerphone  # noqa: E402
from _speex import SpeexCanceller  # noqa: E402

from gateway.audio import ENGINE_RATE  # noqa: E402
from gateway.far_end import FarEnd  # noqa: E402
from gateway.input_processing import InputProcessing  # noqa: E402

FRAME = RATE * 40 // 1000  # one 40 ms append
VOICE_DBFS = -24.0  # the user's (and the person's) active speech level at the microphone
NOISE_DBFS = -65.0  # the microphone's noise floor
PERSON_AFTER_S = 1.5  # the person talks over the answer this far into its playback
TAIL_S = 1.5  # after playback ends, how long the echo trial still listens
INSTRUCTIONS = "You are a storyteller. Answer every request with a story of four or five sentences."
QUESTIONS = (
    "Tell me a story about a brave little dog.",
    "Tell me a story about the sea.",
    "Tell me a story about a tall mountain.",
    "Tell me a story about a lost key.",
    "Tell me a story about a robot who cooks.",
    "Tell me a story about a rainy day.",
    "Tell me a story about a old train.",
    "Tell me a story about a garden.",
)
SECOND_QUESTION = "Tell me another story, about a fisherman."
PERSON = (
    "Hold on, can we talk about the weather tomorrow instead?",
    "Wait, please stop, I have another question.",
)
CLEAN = (
    "The library opens at nine in the morning.",
    "Please send the report to my office before Friday.",
    "My brother bought a new bicycle last summer.",
    "The train to Boston leaves from platform four.",
    "We planted tomatoes and beans in the garden.",
    "Turn left at the bridge and park near the bakery.",
    "She plays the violin in the city orchestra.",
    "The meeting moved to Thursday afternoon.",
    "Our flight was delayed by two hours.",
    "He painted the kitchen a pale shade of green.",
)
ALSA = Path("/usr/share/sounds/alsa")


# ---- speech clips -----------------------------------------------------------------------


def espeak(text: str, voice: str = "en-us") -> np.ndarray:
    with tempfile.NamedTemporaryFile(suffix=".wav") as wav:
        subprocess.run(["espeak-ng", "-v", voice, "-w", wav.name, text], check=True)
        audio, rate = sf.read(wav.name, dtype="float32")
    return level(soxr.resample(audio, rate, RATE).astype(np.float32))


def recording(name: str) -> np.ndarray:
    audio, rate = sf.read(ALSA / name, dtype="float32")
    return level(soxr.resample(audio, rate, RATE).astype(np.float32))


def active_rms(audio: np.ndarray) -> float:
    frames = audio[: len(audio) // 480 * 480].reshape(-1, 480)
    power = np.mean(frames.astype(np.float64) ** 2, axis=1)
    active = power[power > power.max() * 1e-3]
    return float(np.sqrt(np.mean(active))) if active.size else 0.0


def level(audio: np.ndarray, dbfs: float = VOICE_DBFS) -> np.ndarray:
    return (audio * (10 ** (dbfs / 20) / max(active_rms(audio), 1e-9))).astype(np.float32)


def words(text: str) -> list[str]:
    return re.sub(r"[^a-z0-9' ]+", " ", text.lower()).split()


def word_errors(ref: list[str], hyp: list[str]) -> int:
    row = list(range(len(hyp) + 1))
    for i, r in enumerate(ref, 1):
        prev, row[0] = row[:], i
        for j, h in enumerate(hyp, 1):
            row[j] = min(prev[j] + 1, row[j - 1] + 1, prev[j - 1] + (r != h))
    return row[-1]


def wer(refs: list[str], hyps: list[str]) -> float:
    errors = sum(word_errors(words(r), words(h)) for r, h in zip(refs, hyps, strict=True))
    return errors / sum(len(words(r)) for r in refs)


def log(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def pct(values: list[float], q: float) -> float | None:
    return round(float(np.percentile(values, q)), 1) if values else None


# ---- a real-time speakerphone client ------------------------------------------------------


@dataclass
class Recording:
    """What a client's microphone sent, with its parts, and what it played when."""

    mic: list[np.ndarray] = field(default_factory=list)
    echo: list[np.ndarray] = field(default_factory=list)
    near: list[np.ndarray] = field(default_factory=list)
    played: list[tuple[int, str, np.ndarray]] = field(default_factory=list)  # (mic sample, ...)
    truncated: list[tuple[int, str, float]] = field(default_factory=list)


class Client:
    """One session: a microphone streamed in real time, a loudspeaker in `room`."""

    def __init__(self, ws: ClientConnection, phone: Speakerphone, stop_on_speech: bool) -> None:
        self.ws = ws
        self.phone = phone
        self.stop_on_speech = stop_on_speech
        self.sent = 0  # microphone samples sent: the client's clock
        self.events: list[tuple[float, dict[str, Any]]] = []  # (client ms, event)
        self.record = Recording()
        self._near: list[tuple[int, np.ndarray]] = []  # scheduled speech (start sample, clip)
        self._playing: str | None = None  # the item whose audio plays
        self._noise = np.random.default_rng(7)
        self._changed = asyncio.Event()
        self._closed = False

    @property
    def now_ms(self) -> float:
        return self.sent * 1000 / RATE

    def say(self, clip: np.ndarray, at_ms: float | None = None) -> int:
        start = int((at_ms if at_ms is not None else self.now_ms) * RATE / 1000)
        self._near.append((max(start, self.sent), clip))
        return max(start, self.sent)

    async def send(self, **event: Any) -> None:
        await self.ws.send(json.dumps(event))

    async def microphone(self) -> None:
        start = time.monotonic()
        n = 0
        while not self._closed:
            near = np.zeros(FRAME, np.float32)
            for at, clip in self._near:
                lo, hi = max(at, self.sent), min(at + len(clip), self.sent + FRAME)
                if hi > lo:
                    near[lo - self.sent : hi - self.sent] += clip[lo - at : hi - at]
            echo = self.phone.microphone(FRAME)
            noise = self._noise.standard_normal(FRAME).astype(np.float32)
            mic = near + echo + noise * 10 ** (NOISE_DBFS / 20)
            self.record.mic.append(mic)
            self.record.echo.append(echo)
            self.record.near.append(near)
            pcm = (np.clip(mic, -1, 1) * 32767).astype("<i2").tobytes()
            await self.send(type="input_audio_buffer.append", audio=base64.b64encode(pcm).decode())
            self.sent += FRAME
            n += 1
            await asyncio.sleep(max(0.0, start + n * 0.04 - time.monotonic()))

    async def speaker(self) -> None:
        async for message in self.ws:
            event = json.loads(message)
            kind = event["type"]
            self.events.append((self.now_ms, event))
            if kind == "response.output_audio.delta":
                pcm = np.frombuffer(base64.b64decode(event["delta"]), "<i2")
                audio = (pcm / np.float32(32767)).astype(np.float32)
                self.phone.play(event["item_id"], audio)
                self.record.played.append((self.sent, event["item_id"], audio))
                self._playing = event["item_id"]
            elif kind == "input_audio_buffer.speech_started" and self.stop_on_speech:
                await self.stop_playback()
            self._changed.set()

    async def stop_playback(self) -> None:
        """Stop the loudspeaker and tell the gateway how much of the item played."""
        if self._playing is None:
            return
        played_ms = self.phone.stop(self._playing)
        self.record.truncated.append((self.sent, self._playing, played_ms))
        await self.send(
            type="conversation.item.truncate",
            item_id=self._playing,
            content_index=0,
            audio_end_ms=int(played_ms),
        )
        self._playing = None

    async def wait(self, condition: Any, timeout: float = 300.0) -> None:
        deadline = time.monotonic() + timeout
        while not condition():
            self._changed.clear()
            await asyncio.wait_for(self._changed.wait(), max(deadline - time.monotonic(), 0))

    async def sleep_until(self, ms: float) -> None:
        while self.now_ms < ms:
            await asyncio.sleep(0.02)

    def seen(self, kind: str, after_ms: float = 0.0) -> list[tuple[float, dict[str, Any]]]:
        return [(t, e) for t, e in self.events if e["type"] == kind and t >= after_ms]

    def first_audio_ms(self) -> float | None:
        audio = self.seen("response.output_audio.delta")
        return audio[0][0] if audio else None

    def close(self) -> None:
        self._closed = True


async def session(
    url: str, phone: Speakerphone, settings: dict[str, Any], stop_on_speech: bool = True
) -> tuple[Client, Any]:
    ws = await connect(f"{url}/realtime?model=duplex-smollm2", max_size=None)
    await ws.recv()  # session.created
    await ws.send(
        json.dumps({"type": "session.update", "session": {"type": "realtime", **settings}})
    )
    client = Client(ws, phone, stop_on_speech)
    tasks = (asyncio.create_task(client.microphone()), asyncio.create_task(client.speaker()))
    await client.wait(lambda: bool(client.seen("session.updated")) or bool(client.seen("error")))
    if client.seen("error"):
        raise RuntimeError(f"session.update refused: {client.seen('error')}")
    return client, tasks


async def close(client: Client, tasks: Any) -> None:
    client.close()
    await client.ws.close()
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)


def has(client: Client, kind: str, after_ms: float = 0.0) -> Any:
    """A condition for `Client.wait`: an event of `kind` arrived after `after_ms`."""
    return lambda: bool(client.seen(kind, after_ms))


def speaking_settings(cancel: bool) -> dict[str, Any]:
    return {
        "instructions": INSTRUCTIONS,
        "output_modalities": ["audio"],
        "max_output_tokens": 50,
        "audio": {"input": {"echo_cancellation": cancel}},
    }


@dataclass
class Trial:
    room: str
    cancel: bool
    self_interruptions: int = 0
    answer_s: float = 0.0
    detect_ms: float | None = None
    cut_before_person: bool = False
    record: Recording | None = None
    person_at: int = 0
    failed: str | None = None  # the trial did not run its course (why)


async def room_trial(
    url: str, room: Room, gain: float, question: np.ndarray, cancel: bool, person: np.ndarray
) -> Trial:
    """One session in `room`: the user asks aloud and stays silent while the whole answer
    plays; then asks in text, and a person talks over the second answer's echo."""
    trial = Trial(room.name, cancel)
    client, tasks = await session(url, Speakerphone(room, gain), speaking_settings(cancel))
    try:
        client.say(question, at_ms=client.now_ms + 300)
        await client.wait(has(client, "response.created"))
        answer_from = client.seen("response.created")[0][0]
        await client.wait(has(client, "response.done"))
        first_item = next((item for _, item, _ in client.record.played), None)
        played = sum(len(a) for _, item, a in client.record.played if item == first_item)
        trial.answer_s = round(played / RATE, 2)
        # Listen on while the answer plays out and its echo dies away.
        await client.sleep_until(client.phone.playing_until_s() * 1000 + TAIL_S * 1000)
        await client.send(type="conversation.item.create", item=text_item(SECOND_QUESTION))
        asked = client.now_ms
        await client.send(type="response.create")
        await client.wait(has(client, "response.output_audio.delta", asked))
        first_ms = client.seen("response.output_audio.delta", asked)[0][0]
        at_ms = first_ms + PERSON_AFTER_S * 1000 + 40  # + the playout latency
        trial.person_at = client.say(person, at_ms=at_ms)
        onset_ms = trial.person_at * 1000 / RATE
        await client.sleep_until(onset_ms + len(person) * 1000 / RATE + 1500)
        started = client.seen("input_audio_buffer.speech_started", after_ms=answer_from)
        before = [t for t, _ in started if t < onset_ms]
        after = [t for t, _ in started if t >= onset_ms]
        trial.self_interruptions = len(before)
        trial.cut_before_person = bool(before)
        if after and not before:
            trial.detect_ms = after[0] - onset_ms
        trial.record = client.record
    except TimeoutError:
        trial.failed = "timed out: " + ", ".join(e["type"] for _, e in client.events[-5:])
    finally:
        await close(client, tasks)
    return trial


async def clean_clip(client: Client, clip: np.ndarray, question: str) -> dict[str, Any]:
    """One clip spoken while an answer plays; its transcript and speech timing."""
    await client.send(type="conversation.item.create", item=text_item(question))
    asked = client.now_ms
    await client.send(type="response.create")
    await client.wait(
        lambda: (
            bool(client.seen("response.output_audio.delta", asked))
            or bool(client.seen("response.done", asked))
        )
    )
    # The clip starts while the answer plays (the canceller is working).
    start = client.say(clip, at_ms=client.now_ms + 500)
    start_ms, end_ms = start * 1000 / RATE, (start + len(clip)) * 1000 / RATE
    await client.wait(
        has(client, "conversation.item.input_audio_transcription.completed", start_ms)
    )
    stopped = client.seen("input_audio_buffer.speech_stopped", start_ms)
    began = client.seen("input_audio_buffer.speech_started", start_ms - 1000)
    done = client.seen("conversation.item.input_audio_transcription.completed", start_ms)
    if not client.seen("response.done", asked):
        await client.send(type="response.cancel")
    await client.stop_playback()
    await client.wait(has(client, "response.done", asked))
    await client.sleep_until(client.now_ms + 500)
    return {
        "transcript": done[0][1]["transcript"],
        "start_ms": began[0][1]["audio_start_ms"] - start_ms if began else None,
        "end_ms": stopped[0][1]["audio_end_ms"] - end_ms if stopped else None,
    }


async def clean_run(url: str, clips: list[np.ndarray], cancel: bool) -> list[dict[str, Any]]:
    """Headphones: the answer plays, no echo; each clip is committed and transcribed."""
    detection = {"type": "server_vad", "create_response": False, "interrupt_response": False}
    settings = {
        **speaking_settings(cancel),
        "audio": {
            "input": {
                "echo_cancellation": cancel,
                "turn_detection": detection,
                "transcription": {"model": "whisper-1"},
            }
        },
    }
    client, tasks = await session(url, Speakerphone(ROOMS[0], 0.0), settings, False)
    results = []
    try:
        for n, clip in enumerate(clips):
            try:
                results.append(await clean_clip(client, clip, QUESTIONS[n % len(QUESTIONS)]))
            except TimeoutError:
                results.append({"transcript": "", "start_ms": None, "end_ms": None})
                errors = [e["error"]["message"] for _, e in client.seen("error")][-3:]
                log(f"clean clip {n} timed out: {[e['type'] for _, e in client.events[-5:]]}")
                log(f"  errors: {errors}")
            log(f"clean cancel={cancel} clip {n}: {results[-1]}")
    finally:
        await close(client, tasks)
    return results


# ---- offline replay: the gateway's processing and speexdsp on the recorded signals -------


def to_engine(audio: np.ndarray) -> np.ndarray:
    return soxr.resample(audio, RATE, ENGINE_RATE).astype(np.float32)


def replay(record: Recording, speex: bool) -> tuple[np.ndarray, float, float]:
    """The microphone through the canceller as the gateway fed it: output at 16 kHz,
    CPU seconds, and seconds of audio the canceller worked on."""
    mic = to_engine(np.concatenate(record.mic))
    clock = [0.0]
    far_end = FarEnd(lambda: clock[0])
    processing = InputProcessing(
        far_end, echo_cancellation=True, noise_reduction=None, start_ms=0.0
    )
    canceller = SpeexCanceller() if speex else None
    played = sorted(record.played, key=lambda p: p[0])
    truncated = sorted(record.truncated, key=lambda t: t[0])
    out: list[np.ndarray] = []
    cpu = 0.0
    step = ENGINE_RATE * 40 // 1000
    for lo in range(0, len(mic), step):
        mic_sample = lo * RATE // ENGINE_RATE
        while played and played[0][0] <= mic_sample:
            _, item, audio = played.pop(0)
            far_end.play(item, audio, RATE)
        while truncated and truncated[0][0] <= mic_sample:
            _, item, ms = truncated.pop(0)
            far_end.truncate(item, ms)
        chunk = mic[lo : lo + step]
        clock[0] += len(chunk) * 1000 / ENGINE_RATE
        begin = time.process_time()
        if canceller is None:
            out.append(processing.push(chunk))
        else:
            frames = []
            for f in range(0, len(chunk) - canceller.frame + 1, canceller.frame):
                at = lo + f
                frames.append(
                    canceller.process(
                        chunk[f : f + canceller.frame], far_end.read(at, canceller.frame)
                    )
                )
            far_end.forget_before(lo)
            out.append(np.concatenate(frames) if frames else np.zeros(0, np.float32))
        cpu += time.process_time() - begin
    worked_s = processing.frames_processed / 100 if canceller is None else len(mic) / ENGINE_RATE
    result = np.concatenate(out)
    return np.pad(result, (0, max(0, len(mic) - len(result))))[: len(mic)], cpu, worked_s


def erle_db(echo: np.ndarray, out: np.ndarray, near: np.ndarray) -> float:
    """Over the 10 ms frames with echo and no one speaking, after the first second of
    echo (while AEC3 converges)."""
    n = min(len(echo), len(out), len(near)) // 160 * 160

    def power(x: np.ndarray) -> np.ndarray:
        return np.mean(x[:n].reshape(-1, 160).astype(np.float64) ** 2, axis=1)

    e, o, s = power(echo), power(out), power(near)
    active = np.flatnonzero((e > 10 ** (-55 / 10)) & (s < 1e-9))
    if active.size < 200:
        return float("nan")
    frames = active[active >= active[0] + 100]
    return float(10 * np.log10(e[frames].sum() / max(o[frames].sum(), 1e-12)))


def person_kept_db(near: np.ndarray, out: np.ndarray, at: int, length: int) -> float:
    """The output's level against the person's while they talk over the echo: near 0 dB
    when the person comes through, far below when double talk is suppressed."""
    lo, hi = at * ENGINE_RATE // RATE, (at + length) * ENGINE_RATE // RATE
    n, o = near[lo:hi].astype(np.float64), out[lo:hi].astype(np.float64)
    return float(10 * np.log10(np.sum(o**2) / max(np.sum(n**2), 1e-12)))


def offline(trials: list[Trial], person_len: dict[str, int]) -> dict[str, Any]:
    """Each candidate replayed on every recorded session: ERLE where only echo plays,
    the person's level while they talk over it, CPU per second of audio worked on."""
    result: dict[str, Any] = {}
    trials = [t for t in trials if t.record is not None]
    for name, speex in (("aec3", False), ("speexdsp", True)):
        erles, kept, cpu, worked = [], [], 0.0, 0.0
        for trial in trials:
            assert trial.record is not None
            out, seconds, audio_s = replay(trial.record, speex)
            echo = to_engine(np.concatenate(trial.record.echo))
            near = to_engine(np.concatenate(trial.record.near))
            erles.append(erle_db(echo, out, near))
            kept.append(person_kept_db(near, out, trial.person_at, person_len[trial.room]))
            cpu, worked = cpu + seconds, worked + audio_s
        result[name] = {
            "erle_db_median": pct(erles, 50),
            "erle_db": [round(e, 1) for e in erles],
            "double_talk_person_kept_db_median": pct(kept, 50),
            "cpu_ms_per_audio_s": round(1000 * cpu / max(worked, 1e-9), 1),
        }
    raw = []
    for trial in trials:
        assert trial.record is not None
        near = to_engine(np.concatenate(trial.record.near))
        mic = to_engine(np.concatenate(trial.record.mic))
        raw.append(person_kept_db(near, mic, trial.person_at, person_len[trial.room]))
    result["none"] = {"double_talk_person_kept_db_median": pct(raw, 50)}
    return result


# ---- offline rooms: no gateway, the same rooms, what the VAD hears ---------------------

STORY = (
    "Once upon a time there was a brave little dog named Max. He lived on a farm with "
    "his family and loved to run in the fields every morning. One day he found a lost "
    "kitten near the river, and he carried it home in the rain."
)


def vad_runs(vad: Any, audio: np.ndarray) -> tuple[int, float | None]:
    """Silero (the gateway's VAD) over 16 kHz `audio`: the longest run of chunks at or
    above server VAD's default threshold, in ms, and the first such chunk, in s."""
    states: list[Any] = [None]
    size = vad.chunk_size
    probs = []
    for lo in range(0, len(audio) - size + 1, size):
        p, states = vad.speech_probability(audio[None, lo : lo + size], states)
        probs.append(float(p[0]))
    longest = run = 0
    first = None
    for n, p in enumerate(probs):
        run = run + 1 if p >= 0.5 else 0
        longest = max(longest, run)
        if p >= 0.5 and first is None:
            first = n * size / ENGINE_RATE
    return longest * size * 1000 // ENGINE_RATE, first


def process(mic: np.ndarray, far: np.ndarray, how: str) -> tuple[np.ndarray, float]:
    """`mic` (16 kHz) through a candidate with `far` playing from time 0; CPU seconds."""
    clock = [0.0]
    far_end = FarEnd(lambda: clock[0])
    far_end.play("item", far, ENGINE_RATE)
    far_end.flush()
    processing = InputProcessing(
        far_end, echo_cancellation=how == "aec3", noise_reduction=None, start_ms=0.0
    )
    canceller = SpeexCanceller() if how == "speexdsp" else None
    out, cpu, step = [], 0.0, ENGINE_RATE * 40 // 1000
    for lo in range(0, len(mic) - step + 1, step):
        clock[0] += 40
        begin = time.process_time()
        if canceller is None:
            out.append(processing.push(mic[lo : lo + step]))
        else:
            size = canceller.frame
            for f in range(lo, lo + step, size):
                out.append(canceller.process(mic[f : f + size], far_end.read(f, size)))
        cpu += time.process_time() - begin
    return np.concatenate(out), cpu


def offline_rooms(rooms: int) -> dict[str, Any]:
    from engine.vad import SileroVad

    vad = SileroVad.from_registry()
    far24 = espeak(STORY)
    far24 = (far24 * 10 ** (-20 / 20) / active_rms(far24)).astype(np.float32)
    far = to_engine(far24)
    person = to_engine(espeak(PERSON[0], "en-us+m3"))
    onset = int(PERSON_AFTER_S * ENGINE_RATE)
    result: dict[str, Any] = {}
    for how in ("off", "aec3", "speexdsp"):
        rows: list[dict[str, Any]] = []
        cpu = 0.0
        for room in [ROOMS[i % len(ROOMS)] for i in range(rooms)]:
            phone = Speakerphone(room, 10 ** ((VOICE_DBFS - room.echo_db) / 20) / 0.1)
            phone.play("item", far24)
            echo = to_engine(
                np.concatenate([phone.microphone(FRAME) for _ in range(len(far24) // FRAME)])
            )
            noise = np.random.default_rng(room.seed).standard_normal(len(echo)) * 10 ** (
                NOISE_DBFS / 20
            )
            mic = (echo + noise).astype(np.float32)
            out, seconds = process(mic, far[: len(mic)], how)
            cpu += seconds
            longest, _ = vad_runs(vad, out)
            # The same room, a person talking over the echo 1.5 s in.
            talk = mic.copy()
            talk[onset : onset + len(person)] += person[: len(talk) - onset]
            talk_out, _ = process(talk, far[: len(mic)], how)
            _, first = vad_runs(vad, talk_out[onset:])
            near = np.zeros_like(talk)
            near[onset : onset + len(person)] = person[: len(talk) - onset]
            # Headphones: the answer plays, no echo, the user talks 1.5 s in.
            clean = noise.astype(np.float32) + near
            clean_out, _ = process(clean, far[: len(mic)], how)
            span = slice(onset, onset + len(person))
            rows.append(
                {
                    "room": room.name,
                    "echo_vad_longest_ms": longest,
                    "erle_db": round(erle_db(echo, out, np.zeros_like(echo)), 1),
                    "person_vad_after_ms": None if first is None else round(first * 1000),
                    "person_kept_db": round(
                        person_kept_db(
                            near,
                            talk_out,
                            onset * RATE // ENGINE_RATE,
                            len(person) * RATE // ENGINE_RATE,
                        ),
                        1,
                    ),
                    "headset_speech_kept_db": round(
                        float(
                            10 * np.log10(np.sum(clean_out[span] ** 2) / np.sum(clean[span] ** 2))
                        ),
                        1,
                    ),
                }
            )
        audio_s = rooms * len(far) / ENGINE_RATE
        result[how] = {
            "rooms_where_echo_reads_as_speech_200ms": sum(
                r["echo_vad_longest_ms"] >= 200 for r in rows
            ),
            "echo_vad_longest_ms_max": max(r["echo_vad_longest_ms"] for r in rows),
            "erle_db_median": pct([r["erle_db"] for r in rows], 50),
            "person_vad_after_ms_p95": pct(
                [r["person_vad_after_ms"] for r in rows if r["person_vad_after_ms"] is not None], 95
            ),
            "person_heard": sum(r["person_vad_after_ms"] is not None for r in rows),
            "person_kept_db_median": pct([r["person_kept_db"] for r in rows], 50),
            "headset_speech_kept_db_min": min(r["headset_speech_kept_db"] for r in rows),
            "cpu_ms_per_audio_s": round(1000 * cpu / audio_s, 1),
            "per_room": rows,
        }
    return result


# ---- the run --------------------------------------------------------------------------


def text_item(text: str) -> dict[str, Any]:
    return {"type": "message", "role": "user", "content": [{"type": "input_text", "text": text}]}


async def measure_voice(url: str) -> float:
    """The assistant's active speech level: the echo is set against it (and warms up)."""
    client, tasks = await session(url, Speakerphone(ROOMS[0], 0.0), speaking_settings(True))
    try:
        item = {
            "type": "message",
            "role": "user",
            "content": [{"type": "input_text", "text": QUESTIONS[0]}],
        }
        await client.send(type="conversation.item.create", item=item)
        await client.send(type="response.create")
        await client.wait(lambda: bool(client.seen("response.done")))
    finally:
        await close(client, tasks)
    audio = np.concatenate([a for _, _, a in client.record.played])
    log(f"assistant voice at {20 * np.log10(active_rms(audio)):.1f} dBFS")
    return active_rms(audio)


async def run(url: str, rooms: int, clean: int) -> dict[str, Any]:
    voice_rms = await measure_voice(url)
    questions = [espeak(q) for q in QUESTIONS]
    persons = [espeak(PERSON[0], "en-us+m3"), espeak(PERSON[1], "en-gb")]
    clips = [espeak(text) for text in CLEAN[:clean]]
    clean_on = await clean_run(url, clips, True)
    clean_off = await clean_run(url, clips, False)
    chosen = [ROOMS[i % len(ROOMS)] for i in range(rooms)]
    trials: dict[bool, list[Trial]] = {True: [], False: []}
    person_len: dict[str, int] = {}
    for n, room in enumerate(chosen):
        gain = 10 ** ((VOICE_DBFS - room.echo_db) / 20) / voice_rms
        question = questions[n % len(questions)]
        person = persons[n % len(persons)]
        person_len[room.name] = len(person)
        # Alternate which goes first, so drift in the machine's load falls on both.
        for cancel in (n % 2 == 0, n % 2 == 1):
            trial = await room_trial(url, room, gain, question, cancel, person)
            trials[cancel].append(trial)
            log(
                f"{room.name} cancel={cancel}: {trial.self_interruptions} self-interruptions, "
                f"answer {trial.answer_s} s, person detected in {trial.detect_ms} ms "
                f"{trial.failed or ''}"
            )
    refs = list(CLEAN[:clean])
    wer_on = wer(refs, [r["transcript"] for r in clean_on])
    wer_off = wer(refs, [r["transcript"] for r in clean_off])

    def timing(key: str) -> float | None:
        pairs = [(a[key], b[key]) for a, b in zip(clean_on, clean_off, strict=True)]
        diffs = [abs(a - b) for a, b in pairs if a is not None and b is not None]
        return round(float(np.mean(diffs)), 1) if diffs else None

    def summary(cancel: bool) -> dict[str, Any]:
        ran = [t for t in trials[cancel] if not t.failed]
        detected = [t.detect_ms for t in ran if t.detect_ms is not None]
        return {
            "sessions": len(ran),
            "self_interruptions": sum(t.self_interruptions for t in ran),
            "rooms_with_self_interruption": sum(t.self_interruptions > 0 for t in ran),
            "first_answer_s_median": pct([t.answer_s for t in ran], 50),
            "double_talk_detected": len(detected),
            "double_talk_cut_by_echo_first": sum(t.cut_before_person for t in ran),
            "detect_ms_p50": pct(detected, 50),
            "detect_ms_p95": pct(detected, 95),
            "per_room": {
                t.room: {
                    "self_interruptions": t.self_interruptions,
                    "first_answer_s": t.answer_s,
                    "detect_ms": t.detect_ms,
                }
                for t in ran
            },
            "failed_trials": [f"{t.room}: {t.failed}" for t in trials[cancel] if t.failed],
        }

    return {
        "assistant_voice_dbfs": round(20 * np.log10(voice_rms), 1),
        "rooms": [room.__dict__ for room in chosen],
        "on": summary(True),
        "off": summary(False),
        "clean_wer_on": round(wer_on, 4),
        "clean_wer_off": round(wer_off, 4),
        "clean_wer_delta": round(wer_on - wer_off, 4),
        "clean_speech_start_ms_mean_abs_diff": timing("start_ms"),
        "clean_speech_end_ms_mean_abs_diff": timing("end_ms"),
        "clean_transcripts_on": [r["transcript"] for r in clean_on],
        "clean_transcripts_off": [r["transcript"] for r in clean_off],
        "replay": offline(trials[True], person_len),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", help="gateway ws base URL (default: start one)")
    parser.add_argument("--config", type=Path, help="gateway profile YAML (when started here)")
    parser.add_argument("--rooms", type=int, default=8)
    parser.add_argument("--clean", type=int, default=8, help="echo-free clips (at most 10)")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument(
        "--offline", action="store_true", help="no gateway: the rooms through each candidate"
    )
    args = parser.parse_args()
    if args.offline:
        print(json.dumps(offline_rooms(args.rooms), indent=None if args.json else 2))
        return 0
    if args.url and args.config:
        parser.error("--config applies to a gateway started here, not to --url")
    if args.url:
        result = asyncio.run(run(args.url, args.rooms, args.clean))
    else:
        extra = ("--config", str(args.config)) if args.config else ()
        with gateway_process(*extra) as gateway:
            result = asyncio.run(run(gateway.url, args.rooms, args.clean))
    if args.json:
        print(json.dumps(result))
    else:
        print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
