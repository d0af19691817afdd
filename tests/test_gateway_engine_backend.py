"""The gateway's engine backend over the real duplex session manager and a scripted port:
one duplex session per connection, the response id on every output, cancels that end in
the duplex layer."""

from __future__ import annotations

import asyncio
import weakref
from collections.abc import AsyncIterator, Callable

from duplex.contracts import (
    DuplexStageRequestContext,
    DuplexStageSubmission,
    DuplexStageSubmissionResult,
)
from duplex.manager import DuplexSessionManager
from duplex.outputs import DuplexStageOutput, DuplexStreamingStagePort
from duplex.turn import Stage, TurnRequest
from gateway.backend import ResponseDone, ResponseEvent, ResponseOutput
from gateway.engine_backend import EngineBackendSession


class ScriptedPort(DuplexStreamingStagePort):
    """Answers each final-stage request with "hi", then finishes it; a turn whose text is
    "hold" gets no answer (it runs until cancelled)."""

    def __init__(self) -> None:
        self.sink: Callable[[DuplexStageOutput], None] | None = None
        self.contexts: dict[str, DuplexStageRequestContext] = {}
        self.aborted: list[str] = []

    @property
    def stage_count(self) -> int:
        return 3

    def sampling_defaults(self) -> tuple[object, ...]:
        return (None, None, None)

    def attach_output_sink(self, sink: Callable[[DuplexStageOutput], None]) -> None:
        self.sink = sink

    def ensure_request(self, context: DuplexStageRequestContext) -> None:
        self.contexts[context.request_id] = context

    async def submit(self, submission: DuplexStageSubmission) -> DuplexStageSubmissionResult:
        ctx = submission.context
        if TurnRequest.from_plan(submission.prompt).text != "hold":
            asyncio.get_running_loop().call_soon(self.answer, ctx)
        return DuplexStageSubmissionResult(
            request_id=ctx.request_id, stage_id=ctx.stage_id, replica_id=0
        )

    def answer(self, ctx: DuplexStageRequestContext, *, finish: bool = True) -> None:
        assert self.sink is not None
        sid, rid, stage = ctx.session_id, ctx.request_id, ctx.stage_id
        self.sink(DuplexStageOutput(sid, rid, stage, "text", text="hi"))
        if finish:
            usage = {"prompt_tokens": 7, "completion_tokens": 1, "total_tokens": 8}
            done = DuplexStageOutput(
                sid, rid, stage, "done", finished=True, metadata={"usage": usage}
            )
            self.sink(done)

    async def abort_requests(self, request_ids: list[str]) -> None:
        self.aborted += request_ids

    async def cleanup(self, request_ids: list[str], *, abort: bool = False) -> None:
        for rid in request_ids:
            self.contexts.pop(rid, None)


def text_turn(text: str = "hello") -> TurnRequest:
    return TurnRequest(final=Stage.LLM, text=text)


_readers: weakref.WeakKeyDictionary[EngineBackendSession, AsyncIterator[ResponseEvent]] = (
    weakref.WeakKeyDictionary()
)


async def collect(session: EngineBackendSession, count: int) -> list[ResponseEvent]:
    """The next `count` events; a session's outputs have one reader for its lifetime."""
    reader = _readers.setdefault(session, aiter(session.outputs()))
    async with asyncio.timeout(5):
        return [await anext(reader) for _ in range(count)]


def opened(
    port: ScriptedPort, session_id: str
) -> tuple[DuplexSessionManager, EngineBackendSession]:
    manager = DuplexSessionManager(port, max_sessions=4)
    return manager, EngineBackendSession(manager.open(session_id))


async def test_outputs_carry_the_response_id_and_a_barge_in_ends_the_turn_below() -> None:
    port = ScriptedPort()
    manager, session = opened(port, "sess_a")
    session.start("resp_1", text_turn(), conversation=True)
    first = await collect(session, 2)
    assert first[0] == ResponseOutput("resp_1", "text", text="hi")
    assert first[1] == ResponseDone(
        "resp_1", "completed", usage={"prompt_tokens": 7, "completion_tokens": 1, "total_tokens": 8}
    )
    session.start("resp_2", text_turn("hold"), conversation=True)
    session.cancel("resp_2", reason="turn_detected")
    session.start("resp_3", text_turn(), conversation=True)
    events = await collect(session, 3)
    assert events == [
        ResponseDone("resp_2", "cancelled", reason="turn_detected"),
        ResponseOutput("resp_3", "text", text="hi"),
        ResponseDone(
            "resp_3",
            "completed",
            usage={"prompt_tokens": 7, "completion_tokens": 1, "total_tokens": 8},
        ),
    ]
    assert port.aborted  # the barged-in turn's request was aborted
    await session.close()
    assert len(manager) == 0


async def test_out_of_band_turns_run_beside_the_conversation_in_one_duplex_session() -> None:
    port = ScriptedPort()
    manager, session = opened(port, "sess_b")
    session.start("resp_main", text_turn("hold"), conversation=True)
    session.start("resp_side", text_turn(), conversation=False)
    events = await collect(session, 2)
    assert [(e.response_id, type(e).__name__) for e in events] == [
        ("resp_side", "ResponseOutput"),
        ("resp_side", "ResponseDone"),
    ]
    assert len(manager) == 1
    session.cancel("resp_main", reason="client_cancelled")
    assert await collect(session, 1) == [
        ResponseDone("resp_main", "cancelled", reason="client_cancelled")
    ]
    await session.close()


async def test_a_turn_that_cannot_start_ends_failed() -> None:
    port = ScriptedPort()
    _, session = opened(port, "sess_c")
    session.start("resp_1", text_turn("hold"), conversation=True)
    session.start("resp_2", text_turn(), conversation=True)  # the conversation is busy
    [done] = await collect(session, 1)
    assert isinstance(done, ResponseDone)
    assert (done.response_id, done.status, done.reason) == ("resp_2", "failed", "rejected")
    assert done.error is not None and "active" in done.error
    await session.close()


async def test_outputs_still_queued_when_a_turn_is_cancelled_never_come_out() -> None:
    port = ScriptedPort()
    manager, session = opened(port, "sess_d")
    session.start("resp_1", text_turn("hold"), conversation=True)
    await manager.get("sess_d").settled()  # type: ignore[union-attr]
    [ctx] = port.contexts.values()
    port.answer(ctx, finish=False)  # queued for the reader, not read yet
    port.answer(ctx, finish=False)
    session.cancel("resp_1", reason="turn_detected")
    assert await collect(session, 1) == [
        ResponseDone("resp_1", "cancelled", reason="turn_detected")
    ]
    assert manager.dropped_outputs["stale"] == 2
    await session.close()
