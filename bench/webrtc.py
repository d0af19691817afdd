"""End of speech to first audio over WebRTC against over WebSocket, in the same run, and
the CPU a call costs the gateway.

    .venv/bin/python bench/webrtc.py [--config PROFILE] [--questions 3] [--idle-s 8] [--json]

One gateway is started through its CLI (real models). The same spoken questions (eSpeak
NG, each followed by 1.2 s of silence) are asked alternately over a WebSocket session
(PCM16 appended at real-time pace) and over a WebRTC call (an aiortc client: Opus on
RTP, events on `oai-events`). Latency is timed at the client from
`input_audio_buffer.speech_stopped` to the first answer audio with sound it receives:
over WebSocket, when a client that starts playing at the first
`response.output_audio.delta` plays the first sample above `LOUD`; over WebRTC, the
first decoded frame with one on the track (after aiortc's receive jitter
buffer, which holds 4 packets, 80 ms, before it plays, where a browser's adapts). Each
question is also timed by the gateway itself (its first-audio histogram, up to the
first audio it made): the client's figure less the gateway's is what the transport
adds. CPU: the gateway process's CPU time while one idle session streams silence for
`--idle-s` seconds, over WebRTC and over WebSocket, and with no session at all.
Last, the same questions from a browser: headless Chromium on the demo page (WebRTC, its
default), its fake microphone asking them; the page reads the browser's jitter buffer
delay (`chromium_receive_buffer_ms`: the average per sample played since the call began)
and the packets' arrival jitter from the call's statistics: the part of the WebRTC
figure that is the client's, which aiortc fixes at 80 ms.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import psutil
import soundfile as sf
import soxr
from aiortc import RTCPeerConnection, RTCSessionDescription
from aiortc.mediastreams import MediaStreamError, MediaStreamTrack
from av import AudioFrame
from playwright.sync_api import sync_playwright
from websockets.asyncio.client import ClientConnection, connect

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from _gateway import RATE, gateway_process, stream_audio  # noqa: E402
from realtime import QUESTIONS, TRAILING_SILENCE_S, percentile, spoken  # noqa: E402

from gateway.webrtc.call_audio import PacedAudioTrack  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
MEDIA_RATE = 48000
AIORTC_PREFETCH_MS = 80  # aiortc's audio jitter buffer plays 4 packets (20 ms) behind
LOUD = 0.02  # a decoded frame with a sample above this carries the answer's voice
SESSION = {
    "type": "realtime",
    "instructions": "Answer in one short sentence.",
    "output_modalities": ["audio"],
    "audio": {"input": {"turn_detection": {"type": "server_vad"}}},
}


class RtcClient:
    """An aiortc call: its microphone, the first loud frame after a mark, its events."""

    def __init__(self) -> None:
        self.peer = RTCPeerConnection()
        self.mic = PacedAudioTrack(lambda kind, response_id: None)
        self.events: asyncio.Queue[dict[str, Any]] = asyncio.Queue()
        self.channel = self.peer.createDataChannel("oai-events")
        self.opened = asyncio.Event()
        self.channel.on("open", self.opened.set)
        self.channel.on("message", lambda m: self.events.put_nowait(json.loads(m)))
        self.peer.addTrack(self.mic)
        self.peer.on("track", self._play)
        self.loud_at: float | None = None
        self._listen_from: float | None = None
        self._reader: asyncio.Task[None] | None = None

    def _play(self, track: MediaStreamTrack) -> None:
        self._reader = asyncio.create_task(self._read(track))

    async def _read(self, track: MediaStreamTrack) -> None:
        while True:
            try:
                frame = await track.recv()
            except MediaStreamError:
                return
            assert isinstance(frame, AudioFrame)
            listening = self._listen_from is not None and self.loud_at is None
            if listening and np.abs(frame.to_ndarray()).max() > LOUD * 32768:
                self.loud_at = time.monotonic()

    def listen(self) -> None:
        """Note the next loud frame from now on."""
        self._listen_from, self.loud_at = time.monotonic(), None

    async def open(self, base: str) -> None:
        await self.peer.setLocalDescription(await self.peer.createOffer())
        assert self.peer.localDescription is not None
        async with httpx.AsyncClient() as client:
            answer = await client.post(
                f"{base}/v1/realtime/calls",
                files={
                    "sdp": (None, self.peer.localDescription.sdp),
                    "session": (None, json.dumps(SESSION)),
                },
            )
        answer.raise_for_status()
        await self.peer.setRemoteDescription(RTCSessionDescription(answer.text, "answer"))
        await asyncio.wait_for(self.opened.wait(), 20)

    def say(self, pcm24k: bytes) -> None:
        samples = np.frombuffer(pcm24k, "<i2").astype(np.float32) / 32768
        up = soxr.resample(samples, RATE, MEDIA_RATE)
        self.mic.push("q", "q", (np.clip(up, -1, 1) * 32767).astype("<i2").tobytes())

    async def until(self, kind: str) -> dict[str, Any]:
        return await asyncio.wait_for(self._until(kind), 120)

    async def _until(self, kind: str) -> dict[str, Any]:
        while (event := await self.events.get())["type"] != kind:
            if event["type"] == "error":
                raise RuntimeError(event["error"]["message"])
        return event

    async def close(self) -> None:
        if self._reader is not None:
            self._reader.cancel()
        await self.peer.close()


async def rtc_question(call: RtcClient, pcm: bytes) -> float:
    call.say(pcm + bytes(int(RATE * 2 * TRAILING_SILENCE_S)))
    await call.until("input_audio_buffer.speech_stopped")
    stopped_at = time.monotonic()
    call.listen()
    await call.until("output_audio_buffer.started")
    await call.until("output_audio_buffer.stopped")  # played out: the next one is no barge-in
    assert call.loud_at is not None, "no sound on the track"
    return (call.loud_at - stopped_at) * 1000


async def ws_question(ws: ClientConnection, pcm: bytes) -> float:
    silence = bytes(int(RATE * 2 * TRAILING_SILENCE_S))
    sender = asyncio.create_task(stream_audio(ws, pcm + silence))
    try:
        return await asyncio.wait_for(ws_answer(ws), 120)
    finally:
        await sender


async def ws_answer(ws: ClientConnection) -> float:
    """From speech_stopped to when a client that plays each answer from its first delta
    on would play its first sample with sound; read up to response.done."""
    stopped_at: float | None = None
    began: float | None = None  # the first delta's arrival: playback starts there
    received = 0  # samples of the answer received so far
    heard: float | None = None
    while True:
        event = json.loads(await ws.recv())
        kind, now = event["type"], time.monotonic()
        if kind == "input_audio_buffer.speech_stopped" and stopped_at is None:
            stopped_at = now
        elif kind == "response.output_audio.delta" and heard is None and stopped_at:
            samples = np.frombuffer(base64.b64decode(event["delta"]), "<i2")
            began = now if began is None else began
            loud = np.flatnonzero(np.abs(samples) > LOUD * 32768)
            if loud.size:
                heard = max(now, began + (received + loud[0]) / RATE)
            received += len(samples)
        elif kind == "response.done":
            assert heard is not None and stopped_at is not None, "no audio"
            return (heard - stopped_at) * 1000
        elif kind == "error":
            raise RuntimeError(event["error"]["message"])


def server_first_audio(port: int) -> tuple[float, float]:
    """The gateway's own first-audio histogram (speech_stopped to the first delta made):
    its sum in seconds and its count, from /metrics."""
    text = httpx.get(f"http://127.0.0.1:{port}/metrics").text
    values = {}
    for line in text.splitlines():
        for suffix in ("_sum", "_count"):
            if line.startswith("duplex_gateway_first_audio_seconds" + suffix + " "):
                values[suffix] = float(line.split()[-1])
    return values["_sum"], values["_count"]


async def server_side(port: int, question: Any) -> tuple[float, float]:
    """Time a question at the client, and the gateway's figure for it, in ms."""
    before = await asyncio.to_thread(server_first_audio, port)
    client_ms = await question
    after = await asyncio.to_thread(server_first_audio, port)
    server_ms = (after[0] - before[0]) / max(after[1] - before[1], 1) * 1000
    return client_ms, server_ms


async def latency(port: int, count: int) -> dict[str, Any]:
    questions = [spoken(q) for q in QUESTIONS[:count]]
    base = f"http://127.0.0.1:{port}"
    call = RtcClient()
    await call.open(base)
    await call.until("session.created")
    ws_times: list[float] = []
    rtc_times: list[float] = []
    ws_server: list[float] = []
    rtc_server: list[float] = []
    async with connect(f"ws://127.0.0.1:{port}/v1/realtime", max_size=None) as ws:
        await ws.recv()  # session.created
        await ws.send(json.dumps({"type": "session.update", "session": SESSION}))
        for pcm in questions:  # alternating, so that load drifts hit both alike
            client_ms, server_ms = await server_side(port, ws_question(ws, pcm))
            ws_times.append(client_ms)
            ws_server.append(server_ms)
            client_ms, server_ms = await server_side(port, rtc_question(call, pcm))
            rtc_times.append(client_ms)
            rtc_server.append(server_ms)
    await call.close()
    return {
        # The same span as the gateway measures it, up to the first audio it made.
        "websocket_server_first_audio_ms_p50": round(percentile(ws_server, 50), 1),
        "webrtc_server_first_audio_ms_p50": round(percentile(rtc_server, 50), 1),
        "questions": count,
        "websocket_first_audio_ms_p50": round(percentile(ws_times, 50), 1),
        "webrtc_first_audio_ms_p50": round(percentile(rtc_times, 50), 1),
        "webrtc_minus_websocket_ms_p50": round(
            percentile(rtc_times, 50) - percentile(ws_times, 50), 1
        ),
        # Per question, the client's figure less the gateway's: what the transport
        # adds (delivery, and over WebRTC Opus, RTP and the receive jitter buffer),
        # free of the engine's own spread between questions.
        "websocket_delivery_ms_p50": round(percentile(_less(ws_times, ws_server), 50), 1),
        "webrtc_delivery_ms_p50": round(percentile(_less(rtc_times, rtc_server), 50), 1),
        "websocket_first_audio_ms": [round(t, 1) for t in ws_times],
        "webrtc_first_audio_ms": [round(t, 1) for t in rtc_times],
    }


def _less(times: list[float], server: list[float]) -> list[float]:
    return [t - s for t, s in zip(times, server, strict=True)]


async def cpu_while(process: psutil.Process, seconds: float) -> float:
    """The process's CPU over the next `seconds`, in % of one core."""
    before = process.cpu_times()
    await asyncio.sleep(seconds)
    after = process.cpu_times()
    used = (after.user - before.user) + (after.system - before.system)
    return round(100 * used / seconds, 2)


async def cpu(port: int, pid: int, seconds: float) -> dict[str, float]:
    process = psutil.Process(pid)
    result = {"cpu_no_session_pct": await cpu_while(process, seconds)}
    call = RtcClient()  # its microphone sends silence frames when it has nothing to say
    await call.open(f"http://127.0.0.1:{port}")
    await call.until("session.created")
    result["cpu_idle_webrtc_call_pct"] = await cpu_while(process, seconds)
    await call.close()
    async with connect(f"ws://127.0.0.1:{port}/v1/realtime", max_size=None) as ws:
        await ws.recv()
        silence = bytes(int(RATE * 2 * seconds))
        sender = asyncio.create_task(stream_audio(ws, silence))
        result["cpu_idle_websocket_session_pct"] = await cpu_while(process, seconds)
        await sender
    return result


CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"


def browser_receive_buffer(port: int, questions: list[bytes]) -> dict[str, float]:
    """Chromium on the demo page (WebRTC, its default), its fake microphone asking
    `questions`: the browser's jitter buffer delay and the packets' arrival jitter once
    the last answer is done, in ms."""
    gap = np.zeros(RATE * 8, np.int16)
    parts = [np.zeros(RATE, np.int16)]
    for pcm in questions:
        parts += [np.frombuffer(pcm, "<i2"), gap]
    with tempfile.TemporaryDirectory() as tmp:
        wav = Path(tmp) / "microphone.wav"
        sf.write(wav, np.concatenate(parts + [gap] * 4), RATE, subtype="PCM_16")
        with sync_playwright() as pw:
            browser = pw.chromium.launch(
                executable_path=CHROMIUM,
                headless=True,
                args=[
                    "--no-sandbox",
                    "--use-fake-ui-for-media-stream",
                    "--use-fake-device-for-media-stream",
                    f"--use-file-for-fake-audio-capture={wav}%noloop",
                    "--autoplay-policy=no-user-gesture-required",
                ],
            )
            try:
                page = browser.new_page()
                page.goto(f"http://127.0.0.1:{port}/web/")
                page.click("#connect")
                page.wait_for_function(
                    f"window.duplexDemo.receiveBufferMs.length >= {len(questions)}",
                    timeout=60_000 * len(questions),
                )
                demo = page.evaluate("window.duplexDemo")
            finally:
                browser.close()
    return {
        "chromium_receive_buffer_ms": demo["receiveBufferMs"][-1],
        "chromium_receive_jitter_ms": demo["receiveJitterMs"][-1],
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", type=Path, default=ROOT / "configs" / "default.yaml")
    parser.add_argument("--questions", type=int, default=3)
    parser.add_argument("--idle-s", type=float, default=8.0)
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    args = parser.parse_args()
    result: dict[str, Any] = {"load_average_at_start": list(psutil.getloadavg())}
    with gateway_process("--config", str(args.config)) as gw:
        result.update(asyncio.run(latency(gw.port, args.questions)))
        result.update(asyncio.run(cpu(gw.port, gw.pid, args.idle_s)))
        asked = [spoken(q) for q in QUESTIONS[: args.questions]]
        result.update(browser_receive_buffer(gw.port, asked))
    result["aiortc_receive_buffer_ms"] = AIORTC_PREFETCH_MS
    if args.json:
        print(json.dumps(result))
    else:
        for key, value in result.items():
            print(f"{key:>34}: {value}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
