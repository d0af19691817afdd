"""The gateway's `Backend` over the duplex session manager and the engine's VAD stage.

One realtime connection owns one duplex session for its default conversation; every
out-of-band response (`conversation: "none"`) gets a short-lived duplex session of its
own, so it can run beside the default one. Commands to a duplex session go through one
worker task per session, so a barge-in and the next turn's start reach it in the order
the realtime core decided them.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from typing import Any

import numpy as np

from duplex.contracts import DuplexAppendPlan
from duplex.errors import DuplexError
from duplex.events import TurnDone
from duplex.events import TurnOutput as DuplexTurnOutput
from duplex.manager import DuplexSessionHandle, DuplexSessionManager
from gateway.backend import TurnOutput
from gateway.realtime import PrepareResponse, StartResponse
from gateway.turn_detection import EngineSpeechSource, VadEngine

__all__ = ["EngineBackend", "realtime_usage"]

logger = logging.getLogger(__name__)

_KINDS = {"transcript": "transcript", "text": "text", "audio": "audio"}


def realtime_usage(usage: Mapping[str, Any]) -> dict[str, Any] | None:
    """The engine's chat-completions usage in the Realtime `response.usage` shape."""
    if not usage:
        return None
    prompt = int(usage.get("prompt_tokens", 0))
    completion = int(usage.get("completion_tokens", 0))
    return {
        "total_tokens": prompt + completion,
        "input_tokens": prompt,
        "output_tokens": completion,
        "input_token_details": {
            "text_tokens": prompt,
            "audio_tokens": 0,
            "image_tokens": 0,
            "cached_tokens": int(usage.get("cached_tokens", 0)),
        },
        "output_token_details": {"text_tokens": completion, "audio_tokens": 0},
    }


class _Lane:
    """One duplex session: an ordered command worker and a reader of its events."""

    def __init__(self, handle: DuplexSessionHandle, sink: Callable[[TurnOutput], None]) -> None:
        self.handle = handle
        self._sink = sink
        self._turns: dict[int, str] = {}
        self._starting: str | None = None
        self._commands: asyncio.Queue[Callable[[], Awaitable[None]] | None] = asyncio.Queue()
        self._worker = asyncio.create_task(self._work(), name="duplex-commands")
        self._reader = asyncio.create_task(self._read(), name="duplex-events")

    def start(self, action: StartResponse) -> None:
        self._commands.put_nowait(lambda: self._start(action))

    def prepare(self, action: PrepareResponse) -> None:
        self._commands.put_nowait(lambda: self._prepare(action))

    def discard_prepared(self) -> None:
        self._commands.put_nowait(self._discard_prepared)

    def cancel(self, barge_in: bool) -> None:
        self._commands.put_nowait(self.handle.barge_in if barge_in else self.handle.cancel)

    async def close(self) -> None:
        self._commands.put_nowait(None)
        with contextlib.suppress(asyncio.CancelledError):
            await self._worker
        await self.handle.close()
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.wait_for(self._reader, 5.0)

    async def _work(self) -> None:
        while (command := await self._commands.get()) is not None:
            try:
                await command()
            except Exception:  # a failed command must not stop the ones after it
                logger.exception("duplex command failed on %s", self.handle.session_id)

    async def _prepare(self, action: PrepareResponse) -> None:
        try:
            self.handle.prepare_turn(
                DuplexAppendPlan(prompt=action.prompt),
                entry_stage_id=action.entry_stage_id,
                final_stage_id=action.final_stage_id,
            )
        except (DuplexError, ValueError) as exc:
            # Only an optimisation: the turn itself reports what is wrong when it starts.
            logger.debug("turn not prepared on %s: %s", self.handle.session_id, exc)

    async def _discard_prepared(self) -> None:
        self.handle.discard_prepared()

    async def _start(self, action: StartResponse) -> None:
        self._starting = action.response_id
        try:
            turn_id = await self.handle.start_turn(
                DuplexAppendPlan(prompt=action.prompt),
                entry_stage_id=action.entry_stage_id,
                final_stage_id=action.final_stage_id,
            )
        except (DuplexError, ValueError) as exc:
            self._sink(TurnOutput(action.response_id, "failed", text=str(exc)))
            return
        finally:
            self._starting = None
        self._turns.setdefault(turn_id, action.response_id)

    def _response_for(self, turn_id: int) -> str | None:
        if turn_id not in self._turns and self._starting is not None:
            # Outputs can overtake start_turn's return; the turn being started is theirs.
            self._turns[turn_id] = self._starting
        return self._turns.get(turn_id)

    async def _read(self) -> None:
        async for event in self.handle.events():
            if isinstance(event, DuplexTurnOutput):
                self._output(event)
            elif isinstance(event, TurnDone):
                self._done(event)

    def _output(self, event: DuplexTurnOutput) -> None:
        response_id = self._response_for(event.turn_id)
        out = event.output
        kind = _KINDS.get(out.kind)
        if response_id is None or kind is None:
            return
        self._sink(
            TurnOutput(
                response_id, kind, text=out.text, audio=out.audio, sample_rate=out.sample_rate
            )
        )

    def _done(self, event: TurnDone) -> None:
        response_id = self._response_for(event.turn_id)
        self._turns.pop(event.turn_id, None)
        if response_id is None or event.status == "cancelled":
            return  # the realtime core finished cancelled responses itself
        if event.status == "failed":
            self._sink(TurnOutput(response_id, "failed", text=event.error or "failed"))
            return
        finish = "length" if event.status == "incomplete" else "stop"
        self._sink(
            TurnOutput(response_id, "done", usage=realtime_usage(event.usage), finish=finish)
        )


class EngineBackendSession:
    def __init__(self, manager: DuplexSessionManager, session_id: str) -> None:
        self._manager = manager
        self._session_id = session_id
        self._outputs: asyncio.Queue[TurnOutput | None] = asyncio.Queue()
        self._default = _Lane(manager.open(session_id), self._outputs.put_nowait)
        self._out_of_band: dict[str, _Lane] = {}
        self._serial = itertools.count()
        self._closed = False

    def start(self, action: StartResponse) -> None:
        if not action.out_of_band:
            self._default.start(action)
            return
        try:
            handle = self._manager.open(f"{self._session_id}.oob{next(self._serial)}")
        except DuplexError as exc:
            self._outputs.put_nowait(TurnOutput(action.response_id, "failed", text=str(exc)))
            return
        lane = _Lane(handle, lambda out: self._out_of_band_output(action.response_id, out))
        self._out_of_band[action.response_id] = lane
        lane.start(action)

    def transcribe(self, job_id: str, audio: np.ndarray) -> None:
        # A turn that ends at the ASR stage, on a duplex session of its own so it can
        # run beside the default conversation's response.
        self.start(StartResponse(job_id, {"audio": audio}, 0, 0, out_of_band=True))

    def _out_of_band_output(self, response_id: str, out: TurnOutput) -> None:
        self._outputs.put_nowait(out)
        if out.kind in ("done", "failed"):
            lane = self._out_of_band.pop(response_id, None)
            if lane is not None:
                asyncio.create_task(lane.close())

    def prepare(self, action: PrepareResponse) -> None:
        self._default.prepare(action)

    def discard_prepared(self) -> None:
        self._default.discard_prepared()

    def cancel(self, response_id: str, barge_in: bool) -> None:
        lane = self._out_of_band.pop(response_id, None)
        if lane is not None:
            lane.cancel(barge_in)
            asyncio.create_task(lane.close())
        else:
            self._default.cancel(barge_in)

    async def outputs(self) -> AsyncIterator[TurnOutput]:
        while (out := await self._outputs.get()) is not None:
            yield out

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        lanes = [self._default, *self._out_of_band.values()]
        self._out_of_band.clear()
        await asyncio.gather(*(lane.close() for lane in lanes), return_exceptions=True)
        self._outputs.put_nowait(None)


class EngineBackend:
    """`Backend` over an engine bundle: `manager` for turns, `vad_engine` for server VAD."""

    def __init__(
        self,
        manager: DuplexSessionManager,
        vad_engine: VadEngine,
        *,
        on_close: Callable[[], Awaitable[None]] | None = None,
    ) -> None:
        self.manager = manager
        self.vad_engine = vad_engine
        self._on_close = on_close

    def open_session(self, session_id: str) -> EngineBackendSession:
        return EngineBackendSession(self.manager, session_id)

    def open_speech(self, session_id: str) -> EngineSpeechSource:
        return EngineSpeechSource(self.vad_engine, session_id)

    def pending(self) -> dict[str, int]:
        # The VAD port is the whole engine (`AsyncEngine`), so it counts every stage.
        return self.vad_engine.pending()

    def prepared_turns(self) -> dict[str, int]:
        # A port that never works ahead has no such counts.
        return dict(getattr(self.manager.port, "prepare_stats", {}))

    async def close(self) -> None:
        await self.manager.close_all()
        if self._on_close is not None:
            await self._on_close()
