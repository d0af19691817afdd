"""The gateway's engine backend over the real duplex session manager and a scripted port:
one duplex session per connection, the response id on every output, cancels that end in
the duplex layer."""

from __future__ import annotations

import asyncio

from duplex.contracts import DuplexStageSubmission
from duplex.manager import DuplexSessionManager
from duplex.turn import Stage, TurnRequest
from gateway.session.backend import ResponseDone, ResponseEvent, ResponseOutput
from gateway.session.engine_backend import EngineBackendSession
from tests.fakes import FakeStagePort

USAGE = {"prompt_tokens": 7, "completion_tokens": 1, "total_tokens": 8}


def scripted_port() -> FakeStagePort:
    """Answers each turn's final-stage request with "hi", then finishes it; a turn whose
    text is "hold" gets no answer (it runs until cancelled)."""
    port = FakeStagePort()

    def answer(submission: DuplexStageSubmission) -> None:
        if TurnRequest.from_plan(submission.prompt).text != "hold":
            rid = submission.context.request_id
            asyncio.get_running_loop().call_soon(answer_now, port, rid)

    port.on_submit = answer
    return port


def answer_now(port: FakeStagePort, rid: str, *, finish: bool = True) -> None:
    port.push(rid, "text", "hi")
    if finish:
        port.push(rid, "done", finished=True, usage=USAGE)


def text_turn(text: str = "hello") -> TurnRequest:
    return TurnRequest(final=Stage.LLM, text=text)


async def collect(session: EngineBackendSession, count: int) -> list[ResponseEvent]:
    """The next `count` events (the tests ask for exactly as many as will come)."""
    events: list[ResponseEvent] = []
    async with asyncio.timeout(5):
        while len(events) < count and await session.wait_events():
            events += session.take_events()
    assert len(events) == count, events
    return events


def opened(
    port: FakeStagePort, session_id: str
) -> tuple[DuplexSessionManager, EngineBackendSession]:
    manager = DuplexSessionManager(port, max_sessions=4)
    return manager, EngineBackendSession(manager.open(session_id))


async def test_outputs_carry_the_response_id_and_a_barge_in_ends_the_turn_below() -> None:
    port = scripted_port()
    manager, session = opened(port, "sess_a")
    session.start("resp_1", text_turn(), conversation=True)
    first = await collect(session, 2)
    assert first[0] == ResponseOutput("resp_1", "text", text="hi")
    assert first[1] == ResponseDone("resp_1", "completed", usage=USAGE)
    session.start("resp_2", text_turn("hold"), conversation=True)
    session.cancel("resp_2", reason="turn_detected")
    session.start("resp_3", text_turn(), conversation=True)
    events = await collect(session, 3)
    assert events == [
        ResponseDone("resp_2", "cancelled", reason="turn_detected"),
        ResponseOutput("resp_3", "text", text="hi"),
        ResponseDone("resp_3", "completed", usage=USAGE),
    ]
    assert port.aborted  # the barged-in turn's request was aborted
    await session.close()
    assert len(manager) == 0


async def test_out_of_band_turns_run_beside_the_conversation_in_one_duplex_session() -> None:
    port = scripted_port()
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
    port = scripted_port()
    _, session = opened(port, "sess_c")
    session.start("resp_1", text_turn("hold"), conversation=True)
    session.start("resp_2", text_turn(), conversation=True)  # the conversation is busy
    [done] = await collect(session, 1)
    assert isinstance(done, ResponseDone)
    assert (done.response_id, done.status, done.reason) == ("resp_2", "failed", "rejected")
    assert done.error is not None and "active" in done.error
    await session.close()


async def test_outputs_still_queued_when_a_turn_is_cancelled_never_come_out() -> None:
    port = scripted_port()
    manager, session = opened(port, "sess_d")
    session.start("resp_1", text_turn("hold"), conversation=True)
    await manager.get("sess_d").settled()  # type: ignore[union-attr]
    [rid] = port.reserved
    answer_now(port, rid, finish=False)  # queued for the reader, not read yet
    answer_now(port, rid, finish=False)
    session.cancel("resp_1", reason="turn_detected")
    assert await collect(session, 1) == [
        ResponseDone("resp_1", "cancelled", reason="turn_detected")
    ]
    assert manager.dropped_outputs["stale"] == 2
    await session.close()
