"""An aiortc client of the gateway's WebRTC endpoints, as OpenAI's WebRTC guide has a
browser do it: mint a client secret, post the SDP offer, talk on `oai-events`."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import httpx
import numpy as np
from aiortc import RTCPeerConnection, RTCSessionDescription
from aiortc.mediastreams import MediaStreamError, MediaStreamTrack
from av import AudioFrame

from gateway.webrtc.call_audio import PacedAudioTrack

RATE = 48000


class Microphone(PacedAudioTrack):
    """The client's microphone: what is `say`d, in real time, then silence."""

    def __init__(self) -> None:
        super().__init__(lambda kind, response_id: None)

    def say(self, samples: np.ndarray) -> None:
        pcm = np.clip(np.round(samples * 32767), -32768, 32767).astype("<i2")
        self.push("mic", "mic", pcm.tobytes())


class Speaker:
    """The remote track, read to its end: the samples heard, 48 kHz mono float32."""

    def __init__(self) -> None:
        self.chunks: list[np.ndarray] = []
        self.loud = asyncio.Event()  # set once a frame carries sound
        self._task: asyncio.Task[None] | None = None

    def play(self, track: MediaStreamTrack) -> None:
        self._task = asyncio.create_task(self._read(track))

    async def _read(self, track: MediaStreamTrack) -> None:
        while True:
            try:
                frame = await track.recv()
            except MediaStreamError:
                return
            assert isinstance(frame, AudioFrame)
            pcm = frame.to_ndarray().reshape(-1, frame.layout.nb_channels)[:, 0]
            samples = pcm.astype(np.float32) / 32768
            self.chunks.append(samples)
            if np.abs(samples).max() > 0.02:
                self.loud.set()

    def heard(self) -> np.ndarray:
        return np.concatenate(self.chunks) if self.chunks else np.zeros(0, np.float32)

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)


class Call:
    """One call from the client side: its peer connection, events and audio."""

    def __init__(self) -> None:
        self.peer = RTCPeerConnection()
        self.mic = Microphone()
        self.speaker = Speaker()
        self.events: asyncio.Queue[dict[str, Any]] = asyncio.Queue()
        self.seen: list[dict[str, Any]] = []
        self.channel = self.peer.createDataChannel("oai-events")
        self.open = asyncio.Event()
        self.channel.on("open", self.open.set)
        self.channel.on("message", lambda m: self.events.put_nowait(json.loads(m)))
        self.peer.addTrack(self.mic)
        self.peer.on("track", self.speaker.play)
        self.location: str | None = None

    async def offer(self) -> str:
        await self.peer.setLocalDescription(await self.peer.createOffer())
        assert self.peer.localDescription is not None
        return self.peer.localDescription.sdp

    async def answer(self, sdp: str) -> None:
        await self.peer.setRemoteDescription(RTCSessionDescription(sdp=sdp, type="answer"))
        await asyncio.wait_for(self.open.wait(), 10)

    def send(self, event: dict[str, Any]) -> None:
        self.channel.send(json.dumps(event))

    async def until(self, kind: str, timeout: float = 10.0) -> dict[str, Any]:
        """Events up to the first of type `kind`, which is returned (all are kept)."""
        async with asyncio.timeout(timeout):
            while True:
                event = await self.events.get()
                self.seen.append(event)
                if event["type"] == kind:
                    return event

    async def first(self, kind: str, timeout: float = 10.0) -> dict[str, Any]:
        """The first event of type `kind`, whether already seen or still to come."""
        for event in self.seen:
            if event["type"] == kind:
                return event
        return await self.until(kind, timeout)

    def types(self) -> list[str]:
        return [e["type"] for e in self.seen]

    async def close(self) -> None:
        await self.speaker.stop()
        self.mic.stop()
        await self.peer.close()


async def mint(base: str, key: str | None, body: dict[str, Any]) -> httpx.Response:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    async with httpx.AsyncClient() as client:
        return await client.post(f"{base}/v1/realtime/client_secrets", json=body, headers=headers)


async def post_sdp(base: str, key: str | None, sdp: str) -> httpx.Response:
    headers = {"Content-Type": "application/sdp"}
    if key:
        headers["Authorization"] = f"Bearer {key}"
    async with httpx.AsyncClient() as client:
        return await client.post(f"{base}/v1/realtime/calls", content=sdp, headers=headers)


async def post_unified(
    base: str, key: str | None, sdp: str, session: dict[str, Any] | None
) -> httpx.Response:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    files: dict[str, tuple[None, str]] = {"sdp": (None, sdp)}
    if session is not None:
        files["session"] = (None, json.dumps(session))
    async with httpx.AsyncClient() as client:
        return await client.post(f"{base}/v1/realtime/calls", files=files, headers=headers)


async def connect(base: str, key: str | None) -> Call:
    """A call made with the SDP form and `key` (an ephemeral or the real one)."""
    call = Call()
    answer = await post_sdp(base, key, await call.offer())
    assert answer.status_code == 201, answer.text
    assert answer.headers["content-type"] == "application/sdp"
    call.location = answer.headers["location"]
    await call.answer(answer.text)
    return call
