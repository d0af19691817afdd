"""One WebRTC call: a `RealtimeConnection` whose events travel on the `oai-events` data
channel (and on any sideband WebSocket joined to it), and whose audio travels on RTP.

Rules of this module:

1. One session core. The call's client events, from the data channel or a sideband
   WebSocket (`/v1/realtime?call_id=`), go to the same `RealtimeSession` as a
   WebSocket's do; its server events go to the data channel and to every sideband.
2. Audio never travels in events: the caller's decoded track is appended to the session
   (`RealtimeSession.receive_audio`, resampled once from 48 kHz by the input buffer) and
   the response's audio deltas, made at 48 kHz, are played on the paced track
   (`gateway.webrtc.call_audio`) instead of being sent.
3. A barge-in (`input_audio_buffer.speech_started` while the session interrupts
   responses) or the client's `output_audio_buffer.clear` stops the track at once; the
   items cut are truncated where the track stopped (`conversation.item.truncated`), and
   `output_audio_buffer.cleared` goes out.
4. The call ends when the peer connection fails or closes, the data channel closes, the
   call is hung up, or any reason a session ends (drain, limits); its peer connection
   and tracks are closed with it, its sidebands closed with the session's close code
   (1001 on a drain), or 1000 when the call simply ended.
"""

from __future__ import annotations

import asyncio
import base64
import logging
from collections.abc import AsyncIterator, Callable
from typing import Any

from aiortc import RTCDataChannel, RTCPeerConnection
from aiortc.mediastreams import MediaStreamError, MediaStreamTrack
from av import AudioFrame
from websockets.asyncio.server import ServerConnection
from websockets.exceptions import ConnectionClosed

from gateway.config import GatewayConfig
from gateway.protocol.audio import MEDIA_PCM
from gateway.server.connection import RealtimeConnection, TransportClosed
from gateway.server.metrics import GatewayMetrics
from gateway.session.actions import CloseSession
from gateway.session.backend import Backend
from gateway.webrtc.call_audio import PacedAudioTrack, mono_pcm

__all__ = ["CallConnection", "CallEvents", "EVENTS_CHANNEL"]

logger = logging.getLogger(__name__)

EVENTS_CHANNEL = "oai-events"
# Client frames waiting for the core; the data channel has no backpressure of its own.
INBOX_FRAMES = 256
# Bytes the data channel may hold unsent before `send` waits for it to drain.
CHANNEL_HIGH_WATER = 1 << 20
_END = object()


class CallEvents:
    """The call's event transport: the data channel and the sidebands (rule 1)."""

    def __init__(self) -> None:
        self._inbox: asyncio.Queue[str | bytes | object] = asyncio.Queue(INBOX_FRAMES)
        self._channel: RTCDataChannel | None = None
        self._open = asyncio.Event()
        self._drained = asyncio.Event()
        self._drained.set()
        self._sidebands: set[ServerConnection] = set()
        self._ended = False
        self._ended_event = asyncio.Event()

    def attach(self, channel: RTCDataChannel) -> None:
        """The client's `oai-events` channel arrived; another label is ignored."""
        if channel.label != EVENTS_CHANNEL or self._channel is not None:
            logger.info("ignored data channel %r", channel.label)
            return
        self._channel = channel
        channel.bufferedAmountLowThreshold = CHANNEL_HIGH_WATER // 2
        channel.on("message", self._receive)
        channel.on("close", self.end)
        channel.on("bufferedamountlow", self._drained.set)
        if channel.readyState == "open":
            self._open.set()
        else:
            channel.on("open", self._open.set)

    def end(self) -> None:
        """No more frames come: the call is over (rule 4)."""
        if not self._ended:
            self._ended = True
            self._ended_event.set()  # a sideband waiting for room gives up
            self._open.set()  # a sender waiting for the channel gives up
            if self._inbox.full():  # the end must get through: a frame makes room
                self._inbox.get_nowait()
            self._inbox.put_nowait(_END)

    def _receive(self, message: str | bytes) -> None:
        if self._ended:
            return
        if self._inbox.full():
            logger.warning("call: the data channel sent faster than events are handled")
            self.end()
            return
        self._inbox.put_nowait(message)

    async def join(self, websocket: ServerConnection) -> None:
        """Serve a sideband WebSocket until it or the call closes (rule 1)."""
        self._sidebands.add(websocket)
        try:
            async for frame in websocket:
                if self._ended or not await self._put(frame):
                    break
        except ConnectionClosed:
            pass
        finally:
            self._sidebands.discard(websocket)

    async def _put(self, frame: str | bytes) -> bool:
        """Queue a sideband's frame, waiting for room (its backpressure); False if the
        call ended meanwhile."""
        if not self._inbox.full():
            self._inbox.put_nowait(frame)
            return True
        put = asyncio.ensure_future(self._inbox.put(frame))
        ended = asyncio.ensure_future(self._ended_event.wait())
        done, pending = await asyncio.wait({put, ended}, return_when=asyncio.FIRST_COMPLETED)
        for task in pending:
            task.cancel()
        return put in done

    def __aiter__(self) -> AsyncIterator[str | bytes]:
        return self._frames()

    async def _frames(self) -> AsyncIterator[str | bytes]:
        while True:
            frame = await self._inbox.get()
            if frame is _END or self._ended:
                return
            assert isinstance(frame, (str, bytes))
            yield frame

    async def send(self, message: str) -> None:
        for websocket in list(self._sidebands):
            try:
                await websocket.send(message)
            except ConnectionClosed:
                self._sidebands.discard(websocket)
        await self._open.wait()
        channel = self._channel
        if self._ended or channel is None or channel.readyState != "open":
            raise TransportClosed
        await self._drained.wait()
        channel.send(message)
        if channel.bufferedAmount > CHANNEL_HIGH_WATER:
            self._drained.clear()

    async def close(self, code: int, reason: str) -> None:
        self.end()
        if self._channel is not None:
            self._channel.close()
        await asyncio.gather(
            *(ws.close(code, reason) for ws in list(self._sidebands)),
            return_exceptions=True,
        )


class CallConnection(RealtimeConnection):
    """The shell of one call's session; `run` serves it until the call ends."""

    def __init__(
        self,
        call_id: str,
        peer: RTCPeerConnection,
        backend: Backend,
        config: GatewayConfig,
        metrics: GatewayMetrics,
        *,
        model: str,
        rate_limits: Callable[[], list[dict[str, Any]]] | None = None,
        made_with: str | None = None,
    ) -> None:
        self.events = CallEvents()
        super().__init__(
            self.events,
            backend,
            config,
            metrics,
            model=model,
            beta=False,
            rate_limits=rate_limits,
            media_format=MEDIA_PCM,
        )
        self.call_id = call_id
        self.made_with = made_with  # the client secret that made the call, if one did
        self.peer = peer
        self.track = PacedAudioTrack(self._report_playback)
        self._caller: MediaStreamTrack | None = None
        self._cut_asked = False
        peer.on("datachannel", self.events.attach)
        peer.on("track", self._on_track)
        peer.on("connectionstatechange", self._on_state)

    def hang_up(self) -> None:
        self._finish(CloseSession(1000, "call hung up"))

    def _finish(self, close: CloseSession | None) -> None:
        # The caller leaving (None) still closes the call's sidebands, with 1000.
        super()._finish(close or CloseSession(1000, "call ended"))

    async def abandon(self) -> None:
        """The call was never answered: free what it holds (`run` never started)."""
        await self._release()
        self.track.stop()
        await self.peer.close()

    async def join(self, websocket: ServerConnection) -> None:
        await self.events.join(websocket)

    async def run(self) -> None:
        listen = asyncio.create_task(self._listen(), name="call-listen")
        try:
            await super().run()
        finally:
            listen.cancel()
            await asyncio.gather(listen, return_exceptions=True)
            await self.events.close(1000, "call ended")  # if `_release` could not
            self.track.stop()
            await self.peer.close()

    def _on_track(self, track: MediaStreamTrack) -> None:
        if track.kind == "audio" and self._caller is None:
            self._caller = track

    def _on_state(self) -> None:
        if self.peer.connectionState in ("failed", "closed"):
            self.events.end()

    async def _listen(self) -> None:
        """The caller's audio, frame by frame, into the session (rule 2)."""
        if self._caller is None:
            return
        while True:
            try:
                frame = await self._caller.recv()
            except MediaStreamError:
                return
            assert isinstance(frame, AudioFrame)
            self.core.receive_audio(mono_pcm(frame))
            self._pump()
            await self.session.room()

    # -- outputs ------------------------------------------------------------------------

    def _queue_event(self, event: dict[str, Any]) -> None:
        kind = event["type"]
        if kind == "response.output_audio.delta":
            self._observe(event)  # counted as sent: it goes out on the track
            self.track.push(
                event["response_id"], event["item_id"], base64.b64decode(event["delta"])
            )
            return
        if kind == "response.done":
            self.track.done(event["response"]["id"])
        elif kind == "input_audio_buffer.speech_started":
            detection = self.core.settings.turn_detection
            self._cut_asked |= detection is not None and detection.interrupt_response
        super()._queue_event(event)

    def _clear_output_audio(self) -> None:
        self._cut_asked = True

    def _pump(self) -> None:
        super()._pump()
        if self._cut_asked:
            self._cut_asked = False
            self._cut()
            super()._pump()

    def _cut(self) -> None:
        """Stop the track and truncate what it had not played (rule 3)."""
        cuts = self.track.cut()
        for cut in cuts:
            self.core.truncate_played(cut.item_id, cut.played_ms)
        if cuts:
            self.core.emit("output_audio_buffer.cleared", response_id=cuts[0].response_id)

    def _report_playback(self, kind: str, response_id: str) -> None:
        self.core.emit(kind, response_id=response_id)
        self._pump()
