"""A speakerphone client against `duplex-gateway` started through its CLI, with the real
models: the client plays every answer on its loudspeaker and its microphone, streamed in
real time, picks that up through a room. The gateway's echo canceller keeps the answer
from interrupting itself; a person talking over the echo still interrupts it.
"""

from __future__ import annotations

import asyncio
import base64
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

from tests.helpers import running_gateway
from tests.realtime_client import RATE, client, speech

pytestmark = pytest.mark.models

FRAME = RATE * 40 // 1000  # one 40 ms append
STORYTELLER = "You are a storyteller. Answer every request with a story of four or five sentences."
VOICE_DBFS = -24.0  # the person's speech at the microphone
ECHO_DB = 6.0  # how far the echo lies below it
PIPER_RMS = 0.1  # the voice's active level as the gateway sends it (about -20 dBFS)


@pytest.fixture(scope="module")
def gateway() -> Iterator[str]:
    with running_gateway() as gw:
        yield f"ws://127.0.0.1:{gw.port}/v1"


def as_float(pcm: bytes) -> np.ndarray:
    return np.frombuffer(pcm, "<i2").astype(np.float32) / 32767


def level(audio: np.ndarray, dbfs: float) -> np.ndarray:
    """`audio` scaled so its active speech is at `dbfs`."""
    rms = np.sqrt(np.mean(audio[np.abs(audio) > 1e-3] ** 2))
    return (audio * 10 ** (dbfs / 20) / rms).astype(np.float32)


class Room:
    """A loudspeaker 120 ms (device buffers and air) from the microphone, with a 0.3 s
    reverberant tail; `gain` sets the echo's level."""

    def __init__(self, gain: float) -> None:
        rng = np.random.default_rng(0)
        delay, tail = RATE * 120 // 1000, RATE * 3 // 10
        response = np.zeros(delay + tail, np.float32)
        response[delay] = 1.0
        t = np.arange(tail) / RATE
        response[delay + 1 :] += 0.05 * rng.standard_normal(tail - 1) * np.exp(-23 * t[1:])
        self._response = response * gain
        self._fft = 1 << int(np.ceil(np.log2(len(response) + FRAME)))
        self._spectrum = np.fft.rfft(self._response, self._fft)
        self._played = np.zeros(len(response) + FRAME, np.float32)  # loudspeaker output
        self.queue = np.zeros(0, np.float32)  # received audio not yet played

    def echo(self) -> np.ndarray:
        """The next 40 ms of echo at the microphone; the loudspeaker plays on."""
        now, self.queue = self.queue[:FRAME], self.queue[FRAME:]
        now = np.pad(now, (0, FRAME - len(now)))
        self._played = np.concatenate([self._played[FRAME:], now])
        out = np.fft.irfft(np.fft.rfft(self._played, self._fft) * self._spectrum, self._fft)
        start = len(self._response) - 1
        return out[start : start + FRAME].astype(np.float32)


class Speakerphone:
    """A realtime client without an echo canceller of its own."""

    def __init__(self, conn: Any, room: Room) -> None:
        self.conn = conn
        self.room = room
        self.sent = 0  # microphone samples streamed: the session clock
        self.events: list[Any] = []
        self._speech: list[tuple[int, np.ndarray]] = []  # (first sample, audio)
        self._playing: str | None = None
        self._played: dict[str, int] = {}  # item -> samples played
        self.arrived = asyncio.Condition()

    def say(self, audio: np.ndarray, at: int) -> None:
        """Someone in the room speaks `audio` from microphone sample `at` on."""
        self._speech.append((at, audio))

    async def microphone(self) -> None:
        loop = asyncio.get_running_loop()
        start, noise = loop.time(), np.random.default_rng(1)
        while True:
            mic = self.room.echo() + 3e-4 * noise.standard_normal(FRAME).astype(np.float32)
            for at, audio in self._speech:
                part = audio[max(self.sent - at, 0) : max(self.sent - at + FRAME, 0)]
                offset = max(at - self.sent, 0)
                mic[offset : offset + len(part)] += part[: FRAME - offset]
            if self._playing is not None:
                self._played[self._playing] += FRAME
            pcm = (np.clip(mic, -1, 1) * 32767).astype("<i2").tobytes()
            await self.conn.input_audio_buffer.append(audio=base64.b64encode(pcm).decode())
            self.sent += FRAME
            await asyncio.sleep(max(0.0, start + self.sent / RATE - loop.time()))

    async def speaker(self) -> None:
        async for event in self.conn:
            if event.type == "response.output_audio.delta":
                self._playing = event.item_id
                self._played.setdefault(event.item_id, 0)
                audio = as_float(base64.b64decode(event.delta))
                self.room.queue = np.concatenate([self.room.queue, audio])
            elif event.type == "input_audio_buffer.speech_started" and self._playing:
                # As the realtime guide asks: stop playback, say how much was heard.
                played = self._played[self._playing]
                self.room.queue = np.zeros(0, np.float32)
                await self.conn.conversation.item.truncate(
                    item_id=self._playing, content_index=0, audio_end_ms=played * 1000 // RATE
                )
                self._playing = None
            async with self.arrived:
                self.events.append(event)
                self.arrived.notify_all()

    async def until(self, kind: str, after: int = 0, timeout: float = 400) -> tuple[int, Any]:
        """The first event of `kind` after the first `after` events, and its index."""
        async with asyncio.timeout(timeout), self.arrived:
            while True:
                for index, event in enumerate(self.events[after:], after):
                    if event.type == kind:
                        return index, event
                await self.arrived.wait()


async def test_a_speakerphone_does_not_interrupt_itself_and_a_person_does(gateway: str) -> None:
    async with client(gateway).realtime.connect(model="duplex-smollm2") as conn:
        await conn.session.update(
            session={
                "type": "realtime",
                "instructions": STORYTELLER,
                "max_output_tokens": 80,
                "audio": {"input": {"echo_cancellation": True}},
            }
        )
        assert (await conn.recv()).type == "session.created"
        updated = await conn.recv()
        assert updated.type == "session.updated"
        assert updated.session.audio.input.model_extra["echo_cancellation"] is True
        phone = Speakerphone(conn, Room(gain=10 ** ((VOICE_DBFS - ECHO_DB) / 20) / PIPER_RMS))
        tasks = [asyncio.create_task(phone.microphone()), asyncio.create_task(phone.speaker())]
        try:
            # A spoken question: its answer plays back into the microphone.
            question = speech("Tell me a story about a brave little dog.")
            phone.say(level(as_float(question), VOICE_DBFS), phone.sent)
            asked, _ = await phone.until("input_audio_buffer.speech_started")
            answered, _ = await phone.until("response.created", asked + 1)
            _, done = await phone.until("response.done", answered)
            # Not cut by its own echo: it ends as the model ended it.
            assert done.response.status in ("completed", "incomplete"), done.response
            # A second answer, asked in text; a person talks over its echo.
            await conn.conversation.item.create(
                item={
                    "type": "message",
                    "role": "user",
                    "content": [{"type": "input_text", "text": "Tell me a story about the sea."}],
                }
            )
            await conn.response.create()
            second, _ = await phone.until("response.created", answered + 1)
            await phone.until("response.output_audio.delta", second)
            onset = phone.sent + RATE * 3 // 2
            # Long enough to be confirmed by its length alone, however busy the engine.
            person = speech("Wait, stop, I would rather hear about the weather tomorrow.", "en-gb")
            phone.say(level(as_float(person), VOICE_DBFS), onset)
            # The first speech since the first answer began is the person's: neither
            # answer's echo started one.
            _, started = await phone.until("input_audio_buffer.speech_started", answered)
            onset_ms = onset * 1000 // RATE
            assert started.audio_start_ms >= onset_ms - 400, (started.audio_start_ms, onset_ms)
            _, cancelled = await phone.until("response.done", second)
            assert cancelled.response.status == "cancelled"
            assert cancelled.response.status_details.reason == "turn_detected"
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
