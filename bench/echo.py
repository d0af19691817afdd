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
began (`detect_ms`: from their first sample to the event, on the client's clock;
`heard_ms`: from their first sample to the first voiced chunk of the speech the event
dates, on the session's audio clock, the rest being the confirmation).
Then on echo-free speech (headphones: no echo, the answer still playing), each clip is
committed by server VAD and transcribed: `clean_wer_delta` is on minus off, and the
speech timing (start, end) is compared clip by clip. The clips keep a fixed schedule on
the client's clock, so on and off get the same microphone sample for sample;
`clean_clips_over_answer` counts those (of both runs) whose answer was playing by then.

Offline, on the microphone signals the echo trials recorded, the gateway's input
processing and speexdsp (the other candidate) are replayed: `erle_db` (echo return loss
enhancement where only echo plays), the person's level kept while they talk over it,
and CPU ms per second of audio per stream. Timing and CPU figures are noisy on a shared
machine.

`--offline` runs no gateway: the same rooms, with eSpeak NG as the far end, through the
gateway's input processing, through speexdsp and through nothing, and the output heard
by the gateway's VAD (Silero): how long the echo reads as speech, ERLE, how soon a person
over the echo is heard and how much of their level is kept, and speech over an answer on
a headset. Then the `--clean` clips, spoken over an answer on a headset, transcribed by
the engine's Whisper as the microphone heard them, as AEC3 made them and as the
detectors hear them (`headset_wer_*`).
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from websockets.asyncio.client import ClientConnection, connect

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from _clips import (  # noqa: E402
    FRAME,
    NOISE_DBFS,
    PERSON,
    PERSON_AFTER_S,
    VOICE_DBFS,
    Recording,
    active_rms,
    espeak,
    log,
    pct,
    wer,
)
from _echo_offline import headset_wer, offline, offline_rooms  # noqa: E402
from _gateway import gateway_process  # noqa: E402
from _rooms import RATE, ROOMS, Room, Speakerphone  # noqa: E402

from gateway.protocol.session_config import TurnDetection  # noqa: E402

# The clean clips' schedule on the client's clock, on the VAD's 32 ms chunk grid (its
# stream starts at the session's first sample): each question at a multiple of the
# period, its clip this long after it, the answer playing by then.
CLEAN_PERIOD_MS = 9_600
CLEAN_LEAD_MS = 2_496
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


# ---- a real-time speakerphone client ------------------------------------------------------


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


# The session's turn detection (the gateway's default) dates a speech's start this far
# before its first voiced chunk: `heard_ms` adds it back to tell the VAD's onset from the
# confirmation.
PREFIX_PADDING_MS = TurnDetection.prefix_padding_ms


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
    heard_ms: float | None = None  # from the person's first sample to the VAD's onset
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
        after = [(t, e) for t, e in started if t >= onset_ms]
        trial.self_interruptions = len(before)
        trial.cut_before_person = bool(before)
        if after and not before:
            detected_ms, speech = after[0]
            trial.detect_ms = detected_ms - onset_ms
            trial.heard_ms = speech["audio_start_ms"] + PREFIX_PADDING_MS - onset_ms
        trial.record = client.record
    except TimeoutError:
        trial.failed = "timed out: " + ", ".join(e["type"] for _, e in client.events[-5:])
    finally:
        await close(client, tasks)
    return trial


async def clean_clip(client: Client, clip: np.ndarray, question: str, at_ms: int) -> dict[str, Any]:
    """One clip spoken while an answer plays; its transcript and speech timing.

    The question goes at `at_ms` of the client's clock and the clip `CLEAN_LEAD_MS`
    later, whenever the answer's audio began: on and off then send the gateway the same
    microphone, sample for sample (the noise is seeded by position), and only what the
    canceller does to it can tell them apart."""
    await client.sleep_until(at_ms)
    await client.send(type="conversation.item.create", item=text_item(question))
    asked = client.now_ms
    await client.send(type="response.create")
    start = client.say(clip, at_ms=at_ms + CLEAN_LEAD_MS)
    start_ms, end_ms = start * 1000 / RATE, (start + len(clip)) * 1000 / RATE
    await client.wait(
        has(client, "conversation.item.input_audio_transcription.completed", start_ms)
    )
    stopped = client.seen("input_audio_buffer.speech_stopped", start_ms)
    began = client.seen("input_audio_buffer.speech_started", start_ms - 1000)
    done = client.seen("conversation.item.input_audio_transcription.completed", start_ms)
    played = bool(client.seen("response.output_audio.delta", asked))
    if not client.seen("response.done", asked):
        await client.send(type="response.cancel")
    await client.stop_playback()
    await client.wait(has(client, "response.done", asked))
    return {
        "transcript": done[0][1]["transcript"],
        "start_ms": began[0][1]["audio_start_ms"] - start_ms if began else None,
        "end_ms": stopped[0][1]["audio_end_ms"] - end_ms if stopped else None,
        "over_answer": played
        and min(t for t, _ in client.seen("response.output_audio.delta", asked)) < start_ms,
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
            question, at_ms = QUESTIONS[n % len(QUESTIONS)], (n + 1) * CLEAN_PERIOD_MS
            try:
                results.append(await clean_clip(client, clip, question, at_ms))
            except TimeoutError:
                results.append(
                    {"transcript": "", "start_ms": None, "end_ms": None, "over_answer": False}
                )
                errors = [e["error"]["message"] for _, e in client.seen("error")][-3:]
                log(f"clean clip {n} timed out: {[e['type'] for _, e in client.events[-5:]]}")
                log(f"  errors: {errors}")
            log(f"clean cancel={cancel} clip {n}: {results[-1]}")
    finally:
        await close(client, tasks)
    return results


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
    # --clean 0 runs the rooms alone: no clip, no WER.
    wer_on = wer(refs, [r["transcript"] for r in clean_on]) if refs else float("nan")
    wer_off = wer(refs, [r["transcript"] for r in clean_off]) if refs else float("nan")

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
                    "heard_ms": t.heard_ms,
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
        "clean_clips_over_answer": sum(bool(r.get("over_answer")) for r in clean_on + clean_off),
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
        result = {**offline_rooms(args.rooms), **headset_wer(CLEAN[: args.clean])}
        print(json.dumps(result, indent=None if args.json else 2))
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
