"""The duplex session manager over a recording fake stage port (`tests.fakes`).

The port records every call, so each test can check exactly which requests were
reserved, submitted, aborted and released, by which session and in which order.
Commands are synchronous; `handle.settled()` waits for the port calls they caused.
"""

from __future__ import annotations

import asyncio
import collections
import re
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any, TypeVar

import numpy as np
import pytest
import pytest_asyncio
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from duplex.contracts import duplex_session_id_from_request_id
from duplex.errors import (
    DuplexBackpressureError,
    DuplexCapacityError,
    DuplexSessionExistsError,
    DuplexStateError,
)
from duplex.events import DuplexEvent, SessionClosed, SessionOpened, TurnDone, TurnOutput
from duplex.manager import DuplexSessionHandle, DuplexSessionManager
from duplex.outputs import DuplexStageOutput, fence_from_request_id
from duplex.turn import Stage, TurnRequest
from tests.fakes import FakeStagePort

AUDIO = b"\x00\x00\x00\x3f" * 160  # 10 ms of 0.5 at 16 kHz


def turn_request(entry: int, final: int) -> TurnRequest:
    """The request whose stages are `entry` to `final`: audio enters at ASR, text at LLM."""
    if entry == Stage.ASR:
        return TurnRequest(final=Stage(final), audio=AUDIO)
    return TurnRequest(final=Stage(final), text="hello")


T = TypeVar("T")


def start(
    handle: DuplexSessionHandle,
    entry: int = 0,
    final: int = 2,
    *,
    tag: str | None = None,
    conversation: bool = True,
) -> int:
    return handle.start_turn(turn_request(entry, final), tag=tag, conversation=conversation)


async def drain(handle: DuplexSessionHandle) -> list[DuplexEvent]:
    """The events queued now, read through `events()`; stops when the queue is empty,
    so it never waits for an event to come."""
    events: list[DuplexEvent] = []
    stream = handle.events()
    while handle._queue:
        events.append(await anext(stream))
    await stream.aclose()
    return events


async def close_and_read(handle: DuplexSessionHandle) -> list[DuplexEvent]:
    """Close the session, then read every event left, up to `SessionClosed`."""
    await handle.close()
    return [event async for event in handle.events()]


def outputs(events: list[DuplexEvent]) -> list[tuple[str | None, str]]:
    return [(e.tag, e.output.text) for e in events if isinstance(e, TurnOutput)]


@pytest.fixture
def port() -> FakeStagePort:
    return FakeStagePort()


@pytest.fixture
def manager(port: FakeStagePort) -> DuplexSessionManager:
    return DuplexSessionManager(port, max_sessions=4)


# -- open / close ---------------------------------------------------------------------


async def test_open_allocates_ids_and_caps_sessions(port: FakeStagePort) -> None:
    manager = DuplexSessionManager(port, max_sessions=2)
    first = manager.open()
    assert re.fullmatch(r"duplex-[0-9a-f]{32}", first.session_id)
    assert port.sink is not None
    second = manager.open("client-chosen", config={"voice": "joe"})
    assert second.config == {"voice": "joe"}
    with pytest.raises(DuplexCapacityError, match="limit reached \\(2 sessions\\)"):
        manager.open()
    await first.close()
    assert len(manager) == 1 and manager.get(first.session_id) is None
    with pytest.raises(DuplexSessionExistsError):
        manager.open("client-chosen")
    with pytest.raises(DuplexSessionExistsError):
        manager.open(first.session_id)  # closed ids are not reused
    third = manager.open()
    assert third.session_id != first.session_id
    with pytest.raises(ValueError, match="max_sessions"):
        DuplexSessionManager(port, max_sessions=0)
    with pytest.raises(ValueError, match="max_events"):
        DuplexSessionManager(port, max_sessions=1, max_events=0)


async def test_events_iterator_runs_from_opened_to_closed(manager: DuplexSessionManager) -> None:
    handle = manager.open("s")
    seen: list[DuplexEvent] = []
    reading = asyncio.Event()

    async def read() -> None:
        async for event in handle.events():
            seen.append(event)
            reading.set()

    reader = asyncio.ensure_future(read())
    await reading.wait()
    with pytest.raises(DuplexStateError, match="already has an events\\(\\) reader"):
        await handle.events().__anext__()
    await handle.close()
    await asyncio.wait_for(reader, 5)
    assert seen == [SessionOpened(session_id="s"), SessionClosed(session_id="s")]
    assert [e async for e in handle.events()] == []


async def test_close_aborts_and_releases_everything_once(
    manager: DuplexSessionManager, port: FakeStagePort
) -> None:
    handle = manager.open("s")
    start(handle, tag="resp_1")
    await handle.settled()
    asr, llm, tts = port.ids("s")
    port.push(asr, "transcript", "hi", finished=True)
    await handle.close()
    await handle.close()
    assert port.abort_calls == [[llm, tts]]
    assert port.cleanup_calls == [[asr, llm, tts]]
    assert port.discarded == ["s"]  # work the port did ahead is dropped too
    assert [e async for e in handle.events()] == [
        SessionOpened(session_id="s"),
        TurnDone(turn_id=0, status="cancelled", reason="session_closed", tag="resp_1"),
        SessionClosed(session_id="s"),
    ]
    assert manager.dropped_outputs == {"stale": 1}  # the unread transcript left with its turn
    assert handle.closed and len(manager) == 0
    port.push(tts, "audio", "late")
    assert manager.dropped_outputs["unknown_session"] == 1
    with pytest.raises(DuplexStateError):
        start(handle)


async def test_close_finishes_even_if_the_caller_is_cancelled(
    manager: DuplexSessionManager, port: FakeStagePort
) -> None:
    handle = manager.open("s")
    port.submit_gate = asyncio.Event()
    start(handle, 1, 2)
    await port.submit_waiting.wait()
    closer = asyncio.ensure_future(handle.close())
    while not handle.closed:  # no event marks that the close began: let it run a step
        await asyncio.sleep(0)
    closer.cancel()
    with pytest.raises(asyncio.CancelledError):
        await closer
    port.submit_gate.set()
    await handle.close()  # the same close, carried on by itself
    assert port.kinds().count("discard") == 1
    ids = port.ids("s")
    assert port.aborted == ids and port.cleaned == ids and len(manager) == 0
    # The submit finished before its abort went out: aborts never overtake submits.
    kinds = port.kinds()
    assert kinds.index("submitted") < kinds.index("abort")


async def test_close_all(manager: DuplexSessionManager, port: FakeStagePort) -> None:
    handles = [manager.open() for _ in range(3)]
    for h in handles:
        start(h, 1, 1)
    await manager.close_all()
    assert len(manager) == 0
    assert sorted(port.aborted) == sorted(c.request_id for c in port.ensured)
    assert port.reserved == []


# -- turns ----------------------------------------------------------------------------


async def test_voice_turn_end_to_end(manager: DuplexSessionManager, port: FakeStagePort) -> None:
    handle = manager.open("s", config={"voice": "joe"})
    assert start(handle, tag="resp_1") == 0
    assert handle.turn_id == 1 and handle.active_turn_id == 0
    await handle.settled()
    asr, llm, tts = port.ids("s")
    assert port.kinds() == ["ensure", "ensure", "ensure", "submit", "submitted"]
    assert [c.stage_sampling_params for c in port.ensured] == [
        "defaults-0",
        "defaults-1",
        "defaults-2",
    ]
    assert all(c.session_config == {"voice": "joe"} for c in port.ensured)
    assert [s.context.request_id for s in port.submitted] == [asr]
    assert (
        port.submitted[0].resumable is False
        and port.submitted[0].prompt == turn_request(0, 2).plan().prompt
    )
    emitted = [
        port.push(asr, "transcript", "what time is it", finished=True),
        port.push(llm, "text", "It is noon."),
        port.push(tts, "audio", "It is noon."),
        port.push(llm, "done", finished=True, usage={"total_tokens": 9}),
        port.push(tts, "done", finished=True),
    ]
    assert emitted[2].audio and emitted[2].duration_ms == pytest.approx(20)
    assert await close_and_read(handle) == [
        SessionOpened(session_id="s"),
        *(TurnOutput(turn_id=0, output=o, tag="resp_1") for o in emitted[:3]),
        TurnDone(turn_id=0, status="completed", usage={"total_tokens": 9}, tag="resp_1"),
        SessionClosed(session_id="s"),
    ]
    assert port.aborted == [] and port.cleanup_calls == [[asr, llm, tts]]
    assert manager.dropped_outputs == {}


async def test_session_for_request_decodes_the_request_id(
    manager: DuplexSessionManager, port: FakeStagePort
) -> None:
    handle = manager.open("s")
    start(handle)
    await handle.settled()
    assert manager.session_for_request(port.ids("s")[0]) is handle
    assert manager.session_for_request("junk") is None


async def test_outputs_are_routed_by_their_session_id(
    manager: DuplexSessionManager, port: FakeStagePort
) -> None:
    a, b = manager.open("a"), manager.open("b")
    start(a, 1, 1)
    start(b, 1, 1)
    await asyncio.gather(a.settled(), b.settled())
    (a_llm,) = port.ids("a")
    # Labelled for b, the output goes to b, which owns no such request.
    port.push(a_llm, "text", "mislabelled", session_id="b")
    port.push(a_llm, "text", "nobody's", session_id="c")
    port.push(a_llm, "text", "right")
    assert manager.dropped_outputs == {"unknown_request": 1, "unknown_session": 1}
    assert outputs(await drain(a)) == [(None, "right")]
    assert outputs(await drain(b)) == []


@pytest.mark.parametrize("busy", [0, 1, 2])
async def test_barge_in_while_each_stage_is_busy(
    manager: DuplexSessionManager, port: FakeStagePort, busy: int
) -> None:
    handle = manager.open("s")
    start(handle, tag="resp_1")
    await handle.settled()
    ids = port.ids("s")
    if busy >= 1:
        port.push(ids[0], "transcript", "question", finished=True)
    if busy == 2:
        port.push(ids[1], "text", "Answer.", finished=True)
        port.push(ids[2], "audio", "Answer.")
    assert handle.barge_in() is True
    assert handle.barge_in() is False
    assert handle.epoch == 1 and handle.active_turn_id is None
    await handle.settled()
    assert port.aborted == ids[busy:]
    assert port.cleaned == ids
    for rid in ids:  # late outputs of the old epoch, already in flight
        port.push(rid, "audio" if rid == ids[2] else "text", "late", finished=True)
    # The outputs the reader had not taken left with the turn.
    assert await drain(handle) == [
        SessionOpened(session_id="s"),
        TurnDone(turn_id=0, status="cancelled", reason="turn_detected", tag="resp_1"),
    ]
    assert manager.dropped_outputs == {"stale": 3 + busy + (busy == 2)}
    # The session goes on with a fresh fence.
    start(handle)
    await handle.settled()
    assert all(".e.1.r." in rid for rid in port.ids("s")[3:])


async def test_barge_in_during_a_slow_submit(
    manager: DuplexSessionManager, port: FakeStagePort
) -> None:
    handle = manager.open("s")
    port.submit_gate = asyncio.Event()
    assert start(handle) == 0
    await port.submit_waiting.wait()
    assert handle.barge_in() is True
    # The cancellation reaches the reader at once; the abort waits for the submit.
    assert (await drain(handle))[-1] == TurnDone(
        turn_id=0, status="cancelled", reason="turn_detected"
    )
    assert port.aborted == []
    port.submit_gate.set()
    await handle.settled()
    assert port.aborted == port.ids("s")
    assert port.kinds().index("submitted") < port.kinds().index("abort")


async def test_a_cancel_then_a_start_reach_the_port_in_order(
    manager: DuplexSessionManager, port: FakeStagePort
) -> None:
    handle = manager.open("s")
    port.submit_gate = asyncio.Event()
    start(handle, 1, 2, tag="resp_1")
    await port.submit_waiting.wait()  # the first turn holds the port
    assert handle.cancel() is True
    assert start(handle, 1, 2, tag="resp_2") == 1
    port.submit_gate.set()
    await handle.settled()
    first, second = port.ids("s")[:2], port.ids("s")[2:]
    assert port.calls == [
        *(("ensure", r) for r in first),
        ("submit", first[0]),
        ("submitted", first[0]),
        *(("abort", r) for r in first),
        *(("cleanup", r) for r in first),
        *(("ensure", r) for r in second),
        ("submit", second[0]),
        ("submitted", second[0]),
    ]


async def test_cancel_reports_its_reason(
    manager: DuplexSessionManager, port: FakeStagePort
) -> None:
    handle = manager.open("s")
    assert handle.cancel() is False
    start(handle, 1, 1)
    assert handle.cancel() is True
    start(handle, 1, 1, tag="resp_2")
    assert handle.cancel(reason="superseded") is True
    await handle.settled()
    assert [e for e in await drain(handle) if isinstance(e, TurnDone)] == [
        TurnDone(turn_id=0, status="cancelled", reason="client_cancelled"),
        TurnDone(turn_id=1, status="cancelled", reason="superseded", tag="resp_2"),
    ]
    assert port.aborted == port.ids("s")
    start(handle, 1, 1)
    with pytest.raises(ValueError, match="cancel reason"):
        handle.cancel(reason="bored")
    assert handle.running_turn_ids == (2,)  # refused, so nothing was cancelled


async def test_cancel_by_tag_bumps_the_epoch_only_for_the_conversations_turn(
    manager: DuplexSessionManager, port: FakeStagePort
) -> None:
    handle = manager.open("s")
    start(handle, 1, 2, tag="resp_conv")
    start(handle, 1, 1, tag="resp_oob", conversation=False)
    assert handle.running_turn_ids == (0, 1) and handle.active_turn_id == 0
    assert handle.cancel(tag="resp_missing") is False
    assert handle.cancel(tag="resp_oob") is True
    assert handle.epoch == 0 and handle.running_turn_ids == (0,)
    assert handle.cancel(tag="resp_conv") is True
    assert handle.epoch == 1 and handle.running_turn_ids == ()
    await handle.settled()
    conv, side = port.ids("s")[:2], port.ids("s")[2:]
    assert port.abort_calls == [side, conv]
    assert [(e.tag, e.status) for e in await drain(handle) if isinstance(e, TurnDone)] == [
        ("resp_oob", "cancelled"),
        ("resp_conv", "cancelled"),
    ]


async def test_a_side_turn_runs_beside_the_conversation_and_outlives_a_barge_in(
    manager: DuplexSessionManager, port: FakeStagePort
) -> None:
    handle = manager.open("s")
    start(handle, 1, 2, tag="resp_conv")
    start(handle, 1, 1, tag="resp_oob", conversation=False)
    with pytest.raises(DuplexStateError):
        start(handle, 1, 2, tag="resp_conv2")  # one conversation turn at a time
    await handle.settled()
    conv_llm, conv_tts, side_llm = port.ids("s")
    port.push(side_llm, "text", "Side one.")
    port.push(conv_llm, "text", "Main.")
    assert handle.barge_in() is True
    port.push(side_llm, "text", " Side two.", finished=True)
    await handle.settled()
    assert port.aborted == [conv_llm, conv_tts]
    assert await close_and_read(handle) == [
        SessionOpened(session_id="s"),
        TurnOutput(turn_id=1, output=port.output(side_llm, "text", "Side one."), tag="resp_oob"),
        TurnDone(turn_id=0, status="cancelled", reason="turn_detected", tag="resp_conv"),
        TurnOutput(
            turn_id=1,
            output=port.output(side_llm, "text", " Side two.", finished=True),
            tag="resp_oob",
        ),
        TurnDone(turn_id=1, status="completed", tag="resp_oob"),
        SessionClosed(session_id="s"),
    ]


async def test_two_sessions_never_touch_each_others_requests(
    manager: DuplexSessionManager, port: FakeStagePort
) -> None:
    a, b = manager.open("a"), manager.open("b")
    start(a)
    start(b)
    await asyncio.gather(a.settled(), b.settled())
    a_ids, b_ids = port.ids("a"), port.ids("b")
    port.push(b_ids[0], "transcript", "b speaks", finished=True)
    a.barge_in()
    port.push(b_ids[1], "text", "b answer")
    await a.close()
    for call in port.abort_calls + port.cleanup_calls:
        assert {duplex_session_id_from_request_id(r) for r in call} == {"a"}
    assert set(port.aborted) == set(a_ids)
    b_events = [e for e in await drain(b) if isinstance(e, TurnOutput)]
    assert [e.output.text for e in b_events] == ["b speaks", "b answer"]
    assert all(e.output.request_id in b_ids for e in b_events)
    assert not any(isinstance(e, TurnOutput) for e in await close_and_read(a))
    assert b.owned_request_ids == tuple(b_ids)


# -- failures -------------------------------------------------------------------------


async def test_stage_error_fails_the_turn_and_session_goes_on(
    manager: DuplexSessionManager, port: FakeStagePort
) -> None:
    handle = manager.open("s")
    start(handle, tag="resp_1")
    await handle.settled()
    asr, llm, tts = port.ids("s")
    port.push(asr, "transcript", "hello", finished=True)
    port.push(llm, "error", finished=True, error="decoder crashed")
    assert await drain(handle) == [
        SessionOpened(session_id="s"),
        TurnDone(
            turn_id=0,
            status="failed",
            reason="error",
            error="stage 1: decoder crashed",
            tag="resp_1",
        ),
    ]
    await handle.settled()
    assert port.aborted == [tts] and port.cleaned == [asr, llm, tts]
    assert start(handle) == 1


@pytest.mark.parametrize("failure", ["submit", "ensure", "mismatch"])
async def test_failed_turn_start_fails_the_turn(
    manager: DuplexSessionManager, port: FakeStagePort, failure: str
) -> None:
    handle = manager.open("s")
    if failure == "submit":
        port.fail_submit = RuntimeError("engine stopped")
    elif failure == "ensure":
        port.fail_ensure = RuntimeError("engine stopped")
    else:
        port.wrong_result = True
    assert start(handle, tag="resp_1") == 0
    await handle.settled()
    done = (await drain(handle))[-1]
    assert isinstance(done, TurnDone) and done.status == "failed" and done.turn_id == 0
    assert done.tag == "resp_1" and done.error is not None and done.error.startswith("stage 0: ")
    if failure == "ensure":
        assert port.submitted == [] and port.ensured == []
    # Whatever was reserved is stopped once and released.
    assert len(port.aborted) == len(set(port.aborted)) == 3
    assert port.cleaned == port.aborted
    assert handle.owned_request_ids == () and handle.running_turn_ids == ()


async def test_a_rejected_turn_gets_its_failed_done_in_queue_order(
    manager: DuplexSessionManager, port: FakeStagePort
) -> None:
    handle = manager.open("s")
    start(handle, 1, 1, tag="resp_1")
    await handle.settled()
    (llm,) = port.ids("s")
    port.push(llm, "text", "Hi")
    handle.reject_turn("resp_2", "a response is active")
    assert await drain(handle) == [
        SessionOpened(session_id="s"),
        TurnOutput(turn_id=0, output=port.output(llm, "text", "Hi"), tag="resp_1"),
        TurnDone(
            turn_id=1,
            status="failed",
            reason="rejected",
            error="a response is active",
            tag="resp_2",
        ),
    ]
    assert handle.running_turn_ids == (0,) and port.ids("s") == [llm]  # nothing reached the port
    await handle.close()
    handle.reject_turn("resp_3", "closed")
    assert isinstance(handle._queue[-1], SessionClosed)  # it stays the last event


# -- the reader's queue ---------------------------------------------------------------


async def test_a_cancelled_turns_unread_outputs_are_dropped_a_completed_turns_are_not(
    manager: DuplexSessionManager, port: FakeStagePort
) -> None:
    handle = manager.open("s")
    start(handle, 1, 2, tag="resp_1")
    await handle.settled()
    llm, tts = port.ids("s")
    port.push(llm, "text", "One.", finished=True)
    port.push(tts, "audio", "One.")
    port.push(tts, "done", finished=True)
    start(handle, 1, 2, tag="resp_2")
    await handle.settled()
    llm2, tts2 = port.ids("s")[2:]
    port.push(llm2, "text", "Two.")
    port.push(tts2, "audio", "Two.")
    handle.cancel()
    port.push(tts2, "audio", "late")
    events = await close_and_read(handle)
    assert outputs(events) == [("resp_1", "One."), ("resp_1", "One.")]
    assert [(e.tag, e.status) for e in events if isinstance(e, TurnDone)] == [
        ("resp_1", "completed"),
        ("resp_2", "cancelled"),
    ]
    assert manager.dropped_outputs == {"stale": 3}


async def test_the_reader_sees_no_output_of_a_turn_after_barging_into_it(
    manager: DuplexSessionManager, port: FakeStagePort
) -> None:
    handle = manager.open("s")
    start(handle, 1, 2, tag="resp_1")
    await handle.settled()
    _, tts = port.ids("s")
    for n in range(5):
        port.push(tts, "audio", f"chunk{n} ")
    seen: list[DuplexEvent] = []
    async for event in handle.events():
        seen.append(event)
        if isinstance(event, TurnOutput):
            # The user speaks over the first chunk the client plays.
            assert handle.barge_in() is True
            port.push(tts, "audio", "in flight")
        if isinstance(event, TurnDone):
            await handle.close()
    assert [type(e) for e in seen] == [SessionOpened, TurnOutput, TurnDone, SessionClosed]
    assert manager.dropped_outputs == {"stale": 5}


async def test_backpressure_fails_a_turn_its_reader_cannot_keep_up_with(
    port: FakeStagePort,
) -> None:
    manager = DuplexSessionManager(port, max_sessions=1, max_events=4)
    handle = manager.open("s")
    start(handle, 1, 2, tag="resp_1")
    await handle.settled()
    llm, tts = port.ids("s")
    for n in range(10):
        port.push(tts, "audio", f"chunk{n} ")
    await handle.settled()
    # The fifth chunk found the queue full: the turn failed and took its chunks with it.
    done = TurnDone(
        turn_id=0,
        status="failed",
        reason="backpressure",
        error="4 events waiting unread; the reader is too slow",
        tag="resp_1",
    )
    assert await drain(handle) == [SessionOpened(session_id="s"), done]
    assert port.aborted == [llm, tts]
    assert manager.dropped_outputs == {"stale": 10}
    assert start(handle, 1, 2) == 1


async def test_backpressure_fails_the_turn_that_owns_the_output(port: FakeStagePort) -> None:
    manager = DuplexSessionManager(port, max_sessions=1, max_events=4)
    handle = manager.open("s")
    start(handle, 1, 2, tag="resp_conv")
    start(handle, 1, 1, tag="resp_oob", conversation=False)
    await handle.settled()
    conv_llm, conv_tts, side = port.ids("s")
    for n in range(4):
        port.push(side, "text", f"side{n} ")
    # The side turn's last output shows the client nothing, so it still completes it.
    port.push(side, "done", finished=True)
    port.push(conv_tts, "audio", "main")  # no room: the conversation's turn fails
    with pytest.raises(DuplexBackpressureError, match="4 events are waiting unread"):
        start(handle, 1, 1, tag="resp_next", conversation=False)
    await handle.settled()
    assert port.aborted == [conv_llm, conv_tts]
    events = await drain(handle)
    assert outputs(events) == [("resp_oob", f"side{n} ") for n in range(4)]
    assert [(e.tag, e.status, e.reason) for e in events if isinstance(e, TurnDone)] == [
        ("resp_oob", "completed", None),
        ("resp_conv", "failed", "backpressure"),
    ]
    assert manager.dropped_outputs == {"stale": 1}
    # The reader caught up: turns start again.
    assert start(handle, 1, 1, tag="resp_next") == 2


async def test_update_config_reaches_the_next_turns_contexts(
    manager: DuplexSessionManager, port: FakeStagePort
) -> None:
    handle = manager.open("s", config={"voice": "a"})
    assert handle.update_config({"voice": "b"}) == 1
    start(handle, 1, 1)
    await handle.settled()
    ctx = port.ensured[-1]
    assert (ctx.config_generation, dict(ctx.session_config)) == (1, {"voice": "b"})
    assert handle.config_generation == 1 and handle.fence.session_id == "s"


# -- random interleavings -------------------------------------------------------------

KINDS = ["transcript", "text", "audio", "done", "error"]


class DuplexInterleavings(RuleBasedStateMachine):
    """Random turns (conversation and side), barge-ins, cancels by tag, stage outputs,
    reads and closes over several sessions."""

    def __init__(self) -> None:
        super().__init__()
        self.loop = asyncio.new_event_loop()
        self.port = FakeStagePort()
        self.manager = DuplexSessionManager(self.port, max_sessions=3, max_events=64)
        self.handles: dict[str, DuplexSessionHandle] = {}
        self.events: dict[str, list[DuplexEvent]] = collections.defaultdict(list)
        self.tags: dict[tuple[str, int], str] = {}  # (session, turn id) -> its tag
        # (session, turn id) -> how many events the reader had read when it was cancelled
        self.cancelled_at: dict[tuple[str, int], int] = {}
        # Outputs emitted while their request was owned, by id (kept, so no id is reused).
        self.forwardable: dict[int, DuplexStageOutput] = {}
        self.finished: set[str] = set()  # requests that reported their end while owned

    def run(self, aw: Awaitable[T]) -> T:
        return self.loop.run_until_complete(aw)

    def call(self, command: Callable[[], T]) -> T:
        """Run a synchronous command inside the loop, where the gateway calls it."""

        async def inside() -> T:
            return command()

        return self.run(inside())

    def settle(self) -> None:
        """Wait until every port call decided so far has been carried out."""
        self.run(self._settled())

    async def _settled(self) -> None:
        for handle in self.handles.values():
            await handle.settled()

    def _open_handles(self) -> list[DuplexSessionHandle]:
        return [h for h in self.handles.values() if not h.closed]

    def _pick(self, pick: int) -> DuplexSessionHandle:
        handles = self._open_handles()
        return handles[pick % len(handles)]

    @precondition(lambda self: len(self.manager) < 3)
    @rule()
    def open_session(self) -> None:
        handle = self.manager.open()
        self.handles[handle.session_id] = handle

    @precondition(lambda self: self._open_handles())
    @rule(pick=st.integers(0, 2), voice=st.booleans(), spoken=st.booleans(), side=st.booleans())
    def start_turn(self, pick: int, voice: bool, spoken: bool, side: bool) -> None:
        handle = self._pick(pick)
        entry, final = (0 if voice else 1), (2 if spoken else 1)
        tag = f"resp_{handle.turn_id}"
        if handle.active_turn_id is not None and not side:
            with pytest.raises(DuplexStateError):
                self.call(lambda: start(handle, entry, final, tag=tag))
            return
        turn_id = self.call(lambda: start(handle, entry, final, tag=tag, conversation=not side))
        self.tags[handle.session_id, turn_id] = tag

    @precondition(lambda self: self._open_handles())
    @rule(pick=st.integers(0, 2), how=st.sampled_from(["barge_in", "cancel", "by_tag"]))
    def cancel(self, pick: int, how: str) -> None:
        handle = self._pick(pick)
        sid = handle.session_id
        if how == "by_tag":  # the newest running turn, conversation's or side
            running = handle.running_turn_ids
            target = running[-1] if running else None
            tag = "resp_none" if target is None else self.tags[sid, target]
            cancelled = self.call(lambda: handle.cancel(tag=tag, reason="superseded"))
        else:
            target = handle.active_turn_id
            cancelled = self.call(handle.barge_in if how == "barge_in" else handle.cancel)
        assert cancelled == (target is not None)
        if target is not None:
            self.cancelled_at[sid, target] = len(self.events[sid])

    @precondition(lambda self: self._open_handles())
    @rule(pick=st.integers(0, 2))
    def reject_turn(self, pick: int) -> None:
        handle = self._pick(pick)
        tag = f"resp_{handle.turn_id}"
        self.tags[handle.session_id, handle.turn_id] = tag
        self.call(lambda: handle.reject_turn(tag, "refused"))

    @precondition(lambda self: self.port.ensured)
    @rule(pick=st.integers(0, 10**6), kind=st.sampled_from(KINDS), finished=st.booleans())
    def stage_output(self, pick: int, kind: str, finished: bool) -> None:
        # Any request ever reserved: current, stale, of a closed session, of another one.
        rid = self.port.ensured[pick % len(self.port.ensured)].request_id
        handle = self.manager.session_for_request(rid)
        output = self.port.output(rid, kind, "x", finished=finished, error="boom")
        if handle is not None and rid in handle.owned_request_ids:
            self.forwardable[id(output)] = output
            if finished or kind == "error":
                self.finished.add(rid)
        # The port calls its sink on the event loop's thread, from inside the loop.
        self.call(lambda: self.port.emit(output))

    @precondition(lambda self: self.handles)
    @rule(pick=st.integers(0, 2))
    def read(self, pick: int) -> None:
        handles = list(self.handles.values())
        handle = handles[pick % len(handles)]
        self.events[handle.session_id] += self.run(drain(handle))

    @precondition(lambda self: self._open_handles())
    @rule(pick=st.integers(0, 2))
    def close(self, pick: int) -> None:
        self.run(self._pick(pick).close())

    @invariant()
    def aborts_and_cleanups_happen_once_per_session(self) -> None:
        self.settle()
        ensured = [c.request_id for c in self.port.ensured]
        assert len(ensured) == len(set(ensured))
        for released in (self.port.aborted, self.port.cleaned):
            assert len(released) == len(set(released)), "a request was aborted/cleaned twice"
            assert set(released) <= set(ensured)
        assert set(self.port.aborted) <= set(self.port.cleaned)
        for call in self.port.abort_calls + self.port.cleanup_calls:
            assert len({duplex_session_id_from_request_id(r) for r in call}) == 1

    @invariant()
    def ownership_matches_the_port(self) -> None:
        self.settle()
        cleaned = set(self.port.cleaned)
        for sid, handle in self.handles.items():
            live = [r for r in self.port.ids(sid) if r not in cleaned]
            assert list(handle.owned_request_ids) == live
            if handle.closed:
                assert live == []

    @invariant()
    def running_turns_own_their_requests_and_ended_ones_nothing(self) -> None:
        self.settle()
        aborted, cleaned = set(self.port.aborted), set(self.port.cleaned)
        for sid, handle in self.handles.items():
            for rid in handle.owned_request_ids:
                fence = fence_from_request_id(rid)
                assert fence is not None and fence.turn_id in handle.running_turn_ids
                assert fence.epoch <= handle.epoch
                if fence.turn_id == handle.active_turn_id:
                    assert fence.epoch == handle.epoch
            ended = {e.turn_id for e in self.events[sid] if isinstance(e, TurnDone)}
            for rid in self.port.ids(sid):
                fence = fence_from_request_id(rid)
                assert fence is not None
                if fence.turn_id in ended:
                    assert rid in cleaned
                    assert (rid in aborted) == (rid not in self.finished)

    @invariant()
    def event_streams_are_well_formed(self) -> None:
        for sid, events in self.events.items():
            assert events[:1] in ([], [SessionOpened(session_id=sid)])  # [] until read
            ended: set[int] = set()
            for n, event in enumerate(events):
                assert not isinstance(event, SessionOpened) or n == 0
                assert not isinstance(event, SessionClosed) or n == len(events) - 1
                if isinstance(event, (TurnOutput, TurnDone)):
                    assert event.tag == self.tags[sid, event.turn_id]
                if isinstance(event, TurnOutput):
                    fence = fence_from_request_id(event.output.request_id)
                    assert fence is not None and fence.session_id == sid
                    assert fence.turn_id == event.turn_id and event.turn_id not in ended
                    assert id(event.output) in self.forwardable, "a stale output was forwarded"
                    read_by_cancel = self.cancelled_at.get((sid, event.turn_id), n + 1)
                    assert n < read_by_cancel, "an output was read after its turn's cancel"
                if isinstance(event, TurnDone):
                    assert event.turn_id not in ended, "two terminal events for one turn"
                    ended.add(event.turn_id)

    def teardown(self) -> None:
        self.run(self.manager.close_all())
        for handle in self.handles.values():
            self.events[handle.session_id] += self.run(drain(handle))
        self.event_streams_are_well_formed()
        assert sorted(self.port.cleaned) == sorted(c.request_id for c in self.port.ensured)
        assert all(isinstance(e[-1], SessionClosed) for e in self.events.values())
        self.loop.close()


TestDuplexInterleavings = DuplexInterleavings.TestCase
TestDuplexInterleavings.settings = settings(max_examples=60, stateful_step_count=30, deadline=None)


# -- the real engine ------------------------------------------------------------------
# The manager over the real orchestrator and the embedded models (Whisper tiny.en,
# SmolLM2-135M, Piper joe): one engine for the module, as a gateway process has.

ROOT = Path(__file__).resolve().parent.parent
SPEECH_WAV = Path("/usr/share/sounds/alsa/Front_Center.wav")
REAL_WAIT_S = 300.0


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def real() -> AsyncIterator[tuple[DuplexSessionManager, Any]]:
    from engine.build import build_engine
    from engine.config import load_config

    bundle = await build_engine(load_config(ROOT / "configs" / "default.yaml"), progress=False)
    manager = DuplexSessionManager(bundle.orchestrator, max_sessions=4)
    try:
        yield manager, bundle
    finally:
        await manager.close_all()
        await bundle.aclose()


def start_request(handle: DuplexSessionHandle, request: TurnRequest) -> int:
    return handle.start_turn(request, tag="resp")


async def events_until_done(stream: AsyncIterator[DuplexEvent]) -> list[DuplexEvent]:
    events: list[DuplexEvent] = []
    while not events or not isinstance(events[-1], TurnDone):
        events.append(await asyncio.wait_for(anext(stream), REAL_WAIT_S))
    return events


def outputs_of(events: list[DuplexEvent], kind: str) -> list[DuplexStageOutput]:
    return [e.output for e in events if isinstance(e, TurnOutput) and e.output.kind == kind]


def speech_16k() -> bytes:
    import soundfile
    import soxr

    samples, rate = soundfile.read(SPEECH_WAV, dtype="float32")
    return soxr.resample(samples, rate, 16000).astype("<f4").tobytes()


@pytest.mark.models
@pytest.mark.asyncio(loop_scope="module")
async def test_real_voice_turn_transcribes_and_answers(
    real: tuple[DuplexSessionManager, Any],
) -> None:
    manager, bundle = real
    handle = manager.open()
    stream = handle.events()
    assert await anext(stream) == SessionOpened(session_id=handle.session_id)
    start_request(handle, TurnRequest(audio=speech_16k(), final=Stage.LLM))
    events = await events_until_done(stream)
    (heard,) = outputs_of(events, "transcript")
    assert "front" in heard.text.lower() and "center" in heard.text.lower()
    reply = "".join(o.text for o in outputs_of(events, "text"))
    done = events[-1]
    assert isinstance(done, TurnDone) and done.status in ("completed", "incomplete")
    assert done.tag == "resp"
    assert reply.strip() and int(done.usage["completion_tokens"]) > 0  # type: ignore[call-overload]
    await handle.close()
    assert bundle.orchestrator.reserved_requests() == 0


@pytest.mark.models
@pytest.mark.asyncio(loop_scope="module")
async def test_real_barge_in_stops_speech_and_leaves_nothing_behind(
    real: tuple[DuplexSessionManager, Any],
) -> None:
    manager, bundle = real
    handle = manager.open()
    stream = handle.events()
    await anext(stream)
    prompt = "Tell me a long story about a lighthouse keeper and the sea."
    start_request(handle, TurnRequest(text=prompt, final=Stage.TTS))
    first_audio: DuplexStageOutput | None = None
    while first_audio is None:
        event = await asyncio.wait_for(anext(stream), REAL_WAIT_S)
        assert isinstance(event, TurnOutput), event
        if event.output.kind == "audio":
            first_audio = event.output
    assert first_audio.sample_rate > 0 and first_audio.text.strip()
    samples = np.frombuffer(first_audio.audio, dtype="<f4")
    assert samples.size > 0 and np.isfinite(samples).all() and np.abs(samples).max() <= 1.0
    assert handle.barge_in() is True
    events = await events_until_done(stream)
    assert events[-1] == TurnDone(turn_id=0, status="cancelled", reason="turn_detected", tag="resp")
    # Once the abort has returned, the engine sends nothing more of the turn.
    await handle.settled()
    assert not handle._queue
    assert bundle.orchestrator.running_turns() == 0
    assert bundle.orchestrator.reserved_requests() == 0
    # The session goes on: the next turn runs under the bumped epoch.
    assert start_request(handle, TurnRequest(text="Say hi.", final=Stage.LLM)) == 1
    done = (await events_until_done(stream))[-1]
    assert isinstance(done, TurnDone) and done.turn_id == 1 and done.status != "failed"
    await handle.close()
    assert isinstance(await anext(stream), SessionClosed)
