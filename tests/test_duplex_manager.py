"""The duplex session manager over a recording fake stage port.

The port records every call, so each test can check exactly which requests were
reserved, submitted, aborted and released, and by which session.
"""

from __future__ import annotations

import asyncio
import collections
import re
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import pytest_asyncio
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from duplex.contracts import (
    DuplexAppendPlan,
    DuplexStageRequestContext,
    DuplexStageSubmission,
    DuplexStageSubmissionResult,
    duplex_session_id_from_request_id,
)
from duplex.errors import (
    DuplexBackpressureError,
    DuplexCapacityError,
    DuplexSessionExistsError,
    DuplexStateError,
)
from duplex.events import DuplexEvent, SessionClosed, SessionOpened, TurnDone, TurnOutput
from duplex.manager import DuplexSessionHandle, DuplexSessionManager
from duplex.outputs import (
    DuplexStageOutput,
    DuplexStreamingStagePort,
    fence_from_request_id,
    stage_id_from_request_id,
)

PLAN = DuplexAppendPlan({"audio": b"\x00\x00" * 160})


class RecordingPort(DuplexStreamingStagePort):
    """A stage port that records every call and emits whatever a test tells it to."""

    def __init__(self, stage_count: int = 3) -> None:
        self._stage_count = stage_count
        self.sink: Callable[[DuplexStageOutput], None] | None = None
        self.ensured: list[DuplexStageRequestContext] = []
        self.submitted: list[DuplexStageSubmission] = []
        self.abort_calls: list[list[str]] = []
        self.cleanup_calls: list[list[str]] = []
        self.log: list[tuple[str, str]] = []
        self.submit_gate: asyncio.Event | None = None
        self.fail_submit: Exception | None = None
        self.fail_ensure: Exception | None = None
        self.wrong_result = False

    @property
    def stage_count(self) -> int:
        return self._stage_count

    def sampling_defaults(self) -> tuple[object, ...]:
        return tuple(f"defaults-{n}" for n in range(self._stage_count))

    def attach_output_sink(self, sink: Callable[[DuplexStageOutput], None]) -> None:
        self.sink = sink

    def ensure_request(self, context: DuplexStageRequestContext) -> None:
        if self.fail_ensure is not None:
            raise self.fail_ensure
        self.ensured.append(context)
        self.log.append(("ensure", context.request_id))

    async def submit(self, submission: DuplexStageSubmission) -> DuplexStageSubmissionResult:
        rid = submission.context.request_id
        self.log.append(("submit", rid))
        if self.submit_gate is not None:
            await self.submit_gate.wait()
        if self.fail_submit is not None:
            raise self.fail_submit
        self.submitted.append(submission)
        self.log.append(("submitted", rid))
        stage = submission.context.stage_id + (1 if self.wrong_result else 0)
        return DuplexStageSubmissionResult(request_id=rid, stage_id=stage, replica_id=0)

    async def abort_requests(self, request_ids: list[str]) -> None:
        self.abort_calls.append(list(request_ids))
        self.log.extend(("abort", r) for r in request_ids)

    async def cleanup(self, request_ids: list[str], *, abort: bool = False) -> None:
        assert abort is False, "the session core aborts explicitly, exactly once"
        self.cleanup_calls.append(list(request_ids))
        self.log.extend(("cleanup", r) for r in request_ids)

    # -- helpers for tests ------------------------------------------------------------

    @property
    def aborted(self) -> list[str]:
        return [r for call in self.abort_calls for r in call]

    @property
    def cleaned(self) -> list[str]:
        return [r for call in self.cleanup_calls for r in call]

    def ids(self, session_id: str) -> list[str]:
        return [c.request_id for c in self.ensured if c.session_id == session_id]

    def emit(self, out: DuplexStageOutput) -> None:
        assert self.sink is not None
        self.sink(out)


def out(
    request_id: str, kind: str, text: str = "", *, finished: bool = False, **meta: object
) -> DuplexStageOutput:
    stage = stage_id_from_request_id(request_id)
    assert stage is not None
    pcm = b"\x01\x00" * 480 if kind == "audio" else b""
    rate = 24000 if pcm else 0
    return DuplexStageOutput(
        request_id,
        stage,
        kind,
        text=text,
        audio=pcm,
        sample_rate=rate,
        finished=finished,
        metadata=meta,
    )


async def settle() -> None:
    for _ in range(10):
        await asyncio.sleep(0)


def drain(handle: DuplexSessionHandle) -> list[DuplexEvent]:
    events = []
    while not handle._queue.empty():
        events.append(handle._queue.get_nowait())
    return events


@pytest.fixture
def port() -> RecordingPort:
    return RecordingPort()


@pytest.fixture
def manager(port: RecordingPort) -> DuplexSessionManager:
    return DuplexSessionManager(port, max_sessions=4)


# -- open / close ---------------------------------------------------------------------


async def test_open_allocates_ids_and_caps_sessions(port: RecordingPort) -> None:
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


async def test_events_iterator_runs_from_opened_to_closed(manager: DuplexSessionManager) -> None:
    handle = manager.open("s")
    seen: list[DuplexEvent] = []

    async def read() -> None:
        async for event in handle.events():
            seen.append(event)

    reader = asyncio.ensure_future(read())
    await settle()
    with pytest.raises(DuplexStateError, match="already has an events\\(\\) reader"):
        await handle.events().__anext__()
    await handle.close()
    await asyncio.wait_for(reader, 1)
    assert seen == [SessionOpened(session_id="s"), SessionClosed(session_id="s")]
    assert [e async for e in handle.events()] == []


async def test_close_aborts_and_releases_everything_once(
    manager: DuplexSessionManager, port: RecordingPort
) -> None:
    handle = manager.open("s")
    await handle.start_turn(PLAN, entry_stage_id=0, final_stage_id=2)
    asr, llm, tts = port.ids("s")
    port.emit(out(asr, "transcript", "hi", finished=True))
    await handle.close()
    await handle.close()
    assert port.abort_calls == [[llm, tts]]
    assert port.cleanup_calls == [[asr, llm, tts]]
    events = drain(handle)
    assert events[-2:] == [
        TurnDone(turn_id=0, status="cancelled", reason="session_closed"),
        SessionClosed(session_id="s"),
    ]
    assert handle.closed and len(manager) == 0
    port.emit(out(tts, "audio", "late"))
    assert manager.dropped_outputs["unknown_session"] == 1
    with pytest.raises(DuplexStateError):
        await handle.start_turn(PLAN, entry_stage_id=0, final_stage_id=2)


async def test_close_finishes_even_if_the_caller_is_cancelled(
    manager: DuplexSessionManager, port: RecordingPort
) -> None:
    handle = manager.open("s")
    port.submit_gate = asyncio.Event()
    starter = asyncio.ensure_future(handle.start_turn(PLAN, entry_stage_id=1, final_stage_id=2))
    await settle()
    closer = asyncio.ensure_future(handle.close())
    await settle()
    closer.cancel()
    starter.cancel()
    port.submit_gate.set()
    await settle()
    await handle.close()
    assert port.aborted == port.ids("s") and port.cleaned == port.ids("s")
    # The submit finished before its abort went out: aborts never overtake submits.
    kinds = [k for k, _ in port.log]
    assert kinds.index("submitted") < kinds.index("abort")


async def test_close_all(manager: DuplexSessionManager, port: RecordingPort) -> None:
    handles = [manager.open() for _ in range(3)]
    for h in handles:
        await h.start_turn(PLAN, entry_stage_id=1, final_stage_id=1)
    await manager.close_all()
    assert len(manager) == 0
    assert sorted(port.aborted) == sorted(c.request_id for c in port.ensured)


# -- turns ----------------------------------------------------------------------------


async def test_voice_turn_end_to_end(manager: DuplexSessionManager, port: RecordingPort) -> None:
    handle = manager.open("s", config={"voice": "joe"})
    assert await handle.start_turn(PLAN, entry_stage_id=0, final_stage_id=2) == 0
    asr, llm, tts = port.ids("s")
    assert [c.stage_sampling_params for c in port.ensured] == [
        "defaults-0",
        "defaults-1",
        "defaults-2",
    ]
    assert all(c.session_config == {"voice": "joe"} for c in port.ensured)
    assert [s.context.request_id for s in port.submitted] == [asr]
    assert port.submitted[0].resumable is False and port.submitted[0].prompt == PLAN.prompt
    emitted = [
        out(asr, "transcript", "what time is it", finished=True),
        out(llm, "text", "It is noon."),
        out(tts, "audio", "It is noon."),
        out(llm, "done", finished=True, usage={"total_tokens": 9}),
        out(tts, "done", finished=True),
    ]
    for o in emitted:
        port.emit(o)
    await settle()
    events = drain(handle)
    assert events == [
        SessionOpened(session_id="s"),
        *(TurnOutput(turn_id=0, output=o) for o in emitted[:3]),
        TurnDone(turn_id=0, status="completed", usage={"total_tokens": 9}),
    ]
    assert port.aborted == [] and port.cleanup_calls == [[asr, llm, tts]]
    assert handle.turn_id == 1 and handle.active_turn_id is None
    assert handle.heard_text(20) == "It is noon." and handle.audio_duration_ms() == pytest.approx(
        20
    )
    assert manager.session_for_request(asr) is handle
    assert manager.session_for_request("junk") is None


@pytest.mark.parametrize("busy", [0, 1, 2])
async def test_barge_in_while_each_stage_is_busy(
    manager: DuplexSessionManager, port: RecordingPort, busy: int
) -> None:
    handle = manager.open("s")
    await handle.start_turn(PLAN, entry_stage_id=0, final_stage_id=2)
    ids = port.ids("s")
    if busy >= 1:
        port.emit(out(ids[0], "transcript", "question", finished=True))
    if busy == 2:
        port.emit(out(ids[1], "text", "Answer.", finished=True))
        port.emit(out(ids[2], "audio", "Answer."))
    assert await handle.barge_in() is True
    assert await handle.barge_in() is False
    assert port.aborted == ids[busy:]
    assert port.cleaned == ids
    for rid in ids:  # late outputs of the old epoch, already in flight
        port.emit(out(rid, "audio" if rid == ids[2] else "text", "late", finished=True))
    await settle()
    events = drain(handle)
    done_at = next(i for i, e in enumerate(events) if isinstance(e, TurnDone))
    assert events[done_at] == TurnDone(turn_id=0, status="cancelled", reason="turn_detected")
    assert events[done_at + 1 :] == []
    assert manager.dropped_outputs["stale"] == 3
    assert handle.epoch == 1
    # The session goes on with a fresh fence.
    await handle.start_turn(PLAN, entry_stage_id=0, final_stage_id=2)
    assert all(".e.1.r." in rid for rid in port.ids("s")[3:])


async def test_barge_in_during_a_slow_submit(
    manager: DuplexSessionManager, port: RecordingPort
) -> None:
    handle = manager.open("s")
    port.submit_gate = asyncio.Event()
    starter = asyncio.ensure_future(handle.start_turn(PLAN, entry_stage_id=0, final_stage_id=2))
    await settle()
    barge = asyncio.ensure_future(handle.barge_in())
    await settle()
    # The cancellation reaches the reader at once; the abort waits for the submit.
    assert drain(handle)[-1] == TurnDone(turn_id=0, status="cancelled", reason="turn_detected")
    assert port.aborted == []
    port.submit_gate.set()
    assert await starter == 0 and await barge is True
    assert port.aborted == port.ids("s")
    assert [k for k, _ in port.log].index("submitted") < [k for k, _ in port.log].index("abort")


async def test_cancel_reports_client_cancelled(
    manager: DuplexSessionManager, port: RecordingPort
) -> None:
    handle = manager.open("s")
    assert await handle.cancel() is False
    await handle.start_turn(PLAN, entry_stage_id=1, final_stage_id=1)
    assert await handle.cancel() is True
    assert drain(handle)[-1] == TurnDone(turn_id=0, status="cancelled", reason="client_cancelled")
    assert port.aborted == port.ids("s")


async def test_two_sessions_never_touch_each_others_requests(
    manager: DuplexSessionManager, port: RecordingPort
) -> None:
    a, b = manager.open("a"), manager.open("b")
    await a.start_turn(PLAN, entry_stage_id=0, final_stage_id=2)
    await b.start_turn(PLAN, entry_stage_id=0, final_stage_id=2)
    a_ids, b_ids = port.ids("a"), port.ids("b")
    port.emit(out(b_ids[0], "transcript", "b speaks", finished=True))
    await a.barge_in()
    port.emit(out(b_ids[1], "text", "b answer"))
    await a.close()
    for call in port.abort_calls + port.cleanup_calls:
        assert {duplex_session_id_from_request_id(r) for r in call} == {"a"}
    assert set(port.aborted) == set(a_ids)
    b_events = [e for e in drain(b) if isinstance(e, TurnOutput)]
    assert [e.output.text for e in b_events] == ["b speaks", "b answer"]
    assert all(e.output.request_id in b_ids for e in b_events)
    assert not any(isinstance(e, TurnOutput) for e in drain(a))
    assert b.owned_request_ids == tuple(b_ids)


async def test_stage_error_fails_the_turn_and_session_goes_on(
    manager: DuplexSessionManager, port: RecordingPort
) -> None:
    handle = manager.open("s")
    await handle.start_turn(PLAN, entry_stage_id=0, final_stage_id=2)
    asr, llm, tts = port.ids("s")
    port.emit(out(asr, "error", finished=True, error="decoder crashed"))
    await settle()
    assert drain(handle)[-1] == TurnDone(
        turn_id=0, status="failed", reason="error", error="stage 0: decoder crashed"
    )
    assert port.aborted == [llm, tts] and port.cleaned == [asr, llm, tts]
    assert await handle.start_turn(PLAN, entry_stage_id=0, final_stage_id=2) == 1


@pytest.mark.parametrize("failure", ["submit", "ensure", "mismatch"])
async def test_failed_turn_start_fails_the_turn(
    manager: DuplexSessionManager, port: RecordingPort, failure: str
) -> None:
    handle = manager.open("s")
    if failure == "submit":
        port.fail_submit = RuntimeError("engine stopped")
    elif failure == "ensure":
        port.fail_ensure = RuntimeError("engine stopped")
    else:
        port.wrong_result = True
    assert await handle.start_turn(PLAN, entry_stage_id=0, final_stage_id=2) == 0
    done = drain(handle)[-1]
    assert isinstance(done, TurnDone) and done.status == "failed" and done.turn_id == 0
    assert done.error is not None and done.error.startswith("stage 0: ")
    if failure == "ensure":
        assert port.submitted == [] and port.ensured == []
    # Whatever was reserved is stopped once and released.
    assert len(port.aborted) == len(set(port.aborted)) == 3
    assert port.cleaned == port.aborted
    assert handle.owned_request_ids == () and handle.active_turn_id is None


async def test_backpressure_fails_the_turn_and_refuses_new_ones(port: RecordingPort) -> None:
    manager = DuplexSessionManager(port, max_sessions=1, max_events=4)
    handle = manager.open("s")
    await handle.start_turn(PLAN, entry_stage_id=1, final_stage_id=2)
    llm, tts = port.ids("s")
    for n in range(10):
        port.emit(out(tts, "audio", f"chunk{n} "))
        assert handle._queue.qsize() <= 6
    await settle()
    with pytest.raises(DuplexBackpressureError, match="waiting unread"):
        await handle.start_turn(PLAN, entry_stage_id=1, final_stage_id=2)
    events = drain(handle)
    assert len([e for e in events if isinstance(e, TurnOutput)]) == 3
    done = events[-1]
    assert isinstance(done, TurnDone) and (done.status, done.reason) == ("failed", "backpressure")
    assert port.aborted == [llm, tts]
    assert manager.dropped_outputs["stale"] == 7  # SessionOpened + 3 outputs filled it
    assert await handle.start_turn(PLAN, entry_stage_id=1, final_stage_id=2) == 1
    await handle.close()
    assert drain(handle)[-1] == SessionClosed(session_id="s")


async def test_update_config_reaches_the_next_turns_contexts(
    manager: DuplexSessionManager, port: RecordingPort
) -> None:
    handle = manager.open("s", config={"voice": "a"})
    assert handle.update_config({"voice": "b"}) == 1
    await handle.start_turn(PLAN, entry_stage_id=1, final_stage_id=1)
    ctx = port.ensured[-1]
    assert (ctx.config_generation, dict(ctx.session_config)) == (1, {"voice": "b"})
    assert handle.config_generation == 1 and handle.fence.session_id == "s"


# -- random interleavings -------------------------------------------------------------

KINDS = ["transcript", "text", "audio", "done", "error"]


class DuplexInterleavings(RuleBasedStateMachine):
    """Random append / commit / barge-in / cancel / stage output / close sequences."""

    def __init__(self) -> None:
        super().__init__()
        self.loop = asyncio.new_event_loop()
        self.port = RecordingPort()
        self.manager = DuplexSessionManager(self.port, max_sessions=3, max_events=64)
        self.handles: dict[str, DuplexSessionHandle] = {}
        self.events: dict[str, list[DuplexEvent]] = collections.defaultdict(list)
        self.readers: list[asyncio.Task[None]] = []
        self.buffers: dict[str, bytes] = collections.defaultdict(bytes)
        self.forwardable: set[int] = set()  # ids of outputs emitted while their request was owned
        self.finished: set[str] = set()  # requests that reported their end while owned

    def run(self, coro: object) -> object:
        return self.loop.run_until_complete(coro)  # type: ignore[arg-type]

    async def _read(self, handle: DuplexSessionHandle) -> None:
        async for event in handle.events():
            self.events[handle.session_id].append(event)

    def _open_handles(self) -> list[DuplexSessionHandle]:
        return [h for h in self.handles.values() if not h.closed]

    @precondition(lambda self: len(self.manager) < 3)
    @rule()
    def open_session(self) -> None:
        handle = self.manager.open()
        self.handles[handle.session_id] = handle
        self.readers.append(self.loop.create_task(self._read(handle)))

    @precondition(lambda self: self._open_handles())
    @rule(pick=st.integers(0, 2), chunk=st.binary(min_size=2, max_size=8))
    def append(self, pick: int, chunk: bytes) -> None:
        handle = self._pick(pick)
        self.buffers[handle.session_id] += chunk

    @precondition(lambda self: self._open_handles())
    @rule(pick=st.integers(0, 2), voice_in=st.booleans(), voice_out=st.booleans())
    def commit(self, pick: int, voice_in: bool, voice_out: bool) -> None:
        handle = self._pick(pick)
        plan = DuplexAppendPlan({"audio": self.buffers.pop(handle.session_id, b"")})
        entry, final = (0 if voice_in else 1), (2 if voice_out else 1)
        if handle.active_turn_id is not None:
            with pytest.raises(DuplexStateError):
                self.run(handle.start_turn(plan, entry_stage_id=entry, final_stage_id=final))
            return
        self.run(handle.start_turn(plan, entry_stage_id=entry, final_stage_id=final))

    @precondition(lambda self: self._open_handles())
    @rule(pick=st.integers(0, 2), client=st.booleans())
    def barge_in(self, pick: int, client: bool) -> None:
        handle = self._pick(pick)
        self.run(handle.cancel() if client else handle.barge_in())

    @precondition(lambda self: self.port.ensured)
    @rule(pick=st.integers(0, 10**6), kind=st.sampled_from(KINDS), finished=st.booleans())
    def stage_output(self, pick: int, kind: str, finished: bool) -> None:
        # Any request ever reserved: current, stale, of a closed session, of another one.
        rid = self.port.ensured[pick % len(self.port.ensured)].request_id
        handle = self.manager.session_for_request(rid)
        output = out(rid, kind, "x", finished=finished, error="boom")
        if handle is not None and rid in handle.owned_request_ids:
            self.forwardable.add(id(output))
            if finished or kind == "error":
                self.finished.add(rid)
        self.run(self._emit(output))

    async def _emit(self, output: DuplexStageOutput) -> None:
        # The port calls its sink on the event loop's thread, from inside the loop.
        self.port.emit(output)
        await settle()

    @precondition(lambda self: self._open_handles())
    @rule(pick=st.integers(0, 2))
    def close(self, pick: int) -> None:
        self.run(self._pick(pick).close())

    def _pick(self, pick: int) -> DuplexSessionHandle:
        handles = self._open_handles()
        return handles[pick % len(handles)]

    @invariant()
    def aborts_and_cleanups_happen_once_per_session(self) -> None:
        self.run(settle())
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
        cleaned = set(self.port.cleaned)
        for sid, handle in self.handles.items():
            live = [r for r in self.port.ids(sid) if r not in cleaned]
            assert list(handle.owned_request_ids) == live
            if handle.closed:
                assert live == []

    @invariant()
    def ended_turns_hold_nothing_and_abort_exactly_the_unfinished(self) -> None:
        aborted, cleaned = set(self.port.aborted), set(self.port.cleaned)
        for sid, handle in self.handles.items():
            for rid in handle.owned_request_ids:
                fence = fence_from_request_id(rid)
                assert fence is not None and fence.turn_id == handle.active_turn_id
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
            assert events[0] == SessionOpened(session_id=sid)
            ended: set[int] = set()
            for n, event in enumerate(events):
                assert not isinstance(event, SessionOpened) or n == 0
                assert not isinstance(event, SessionClosed) or n == len(events) - 1
                if isinstance(event, TurnOutput):
                    fence = fence_from_request_id(event.output.request_id)
                    assert fence is not None and fence.session_id == sid
                    assert fence.turn_id == event.turn_id and event.turn_id not in ended
                    assert id(event.output) in self.forwardable, "a stale output was forwarded"
                if isinstance(event, TurnDone):
                    assert event.turn_id not in ended, "two terminal events for one turn"
                    ended.add(event.turn_id)

    def teardown(self) -> None:
        self.run(self.manager.close_all())
        self.run(settle())
        assert sorted(self.port.cleaned) == sorted(c.request_id for c in self.port.ensured)
        assert all(isinstance(e[-1], SessionClosed) for e in self.events.values())
        for task in self.readers:
            assert task.done()
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


async def events_until_done(stream: AsyncIterator[DuplexEvent]) -> list[DuplexEvent]:
    events: list[DuplexEvent] = []
    while not events or not isinstance(events[-1], TurnDone):
        events.append(await asyncio.wait_for(anext(stream), REAL_WAIT_S))
    return events


def outputs_of(events: list[DuplexEvent], kind: str) -> list[DuplexStageOutput]:
    return [e.output for e in events if isinstance(e, TurnOutput) and e.output.kind == kind]


def speech_16k() -> np.ndarray:
    import soundfile
    import soxr

    pcm, rate = soundfile.read(SPEECH_WAV, dtype="float32")
    return soxr.resample(pcm, rate, 16000).astype(np.float32)


@pytest.mark.models
@pytest.mark.asyncio(loop_scope="module")
async def test_real_voice_turn_transcribes_and_answers(
    real: tuple[DuplexSessionManager, Any],
) -> None:
    manager, bundle = real
    handle = manager.open()
    stream = handle.events()
    assert await anext(stream) == SessionOpened(session_id=handle.session_id)
    plan = DuplexAppendPlan({"audio": speech_16k(), "output_modalities": ["text"]})
    await handle.start_turn(plan, entry_stage_id=0, final_stage_id=1)
    events = await events_until_done(stream)
    (heard,) = outputs_of(events, "transcript")
    assert "front" in heard.text.lower() and "center" in heard.text.lower()
    reply = "".join(o.text for o in outputs_of(events, "text"))
    done = events[-1]
    assert isinstance(done, TurnDone) and done.status in ("completed", "incomplete")
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
    await handle.start_turn(DuplexAppendPlan({"text": prompt}), entry_stage_id=1, final_stage_id=2)
    first_audio: DuplexStageOutput | None = None
    while first_audio is None:
        event = await asyncio.wait_for(anext(stream), REAL_WAIT_S)
        assert isinstance(event, TurnOutput), event
        if event.output.kind == "audio":
            first_audio = event.output
    assert first_audio.sample_rate == 24000 and first_audio.text.strip()
    assert await handle.barge_in() is True
    events = await events_until_done(stream)
    assert events[-1] == TurnDone(turn_id=0, status="cancelled", reason="turn_detected")
    # The engine is told to stop; nothing of the turn arrives afterwards.
    await asyncio.sleep(1.5)
    assert handle._queue.empty()
    assert bundle.orchestrator.running_turns() == 0
    assert bundle.orchestrator.reserved_requests() == 0
    assert handle.heard_text(first_audio.duration_ms, turn_id=0) == first_audio.text
    # The session goes on: the next turn runs under the bumped epoch.
    await handle.start_turn(
        DuplexAppendPlan({"text": "Say hi."}), entry_stage_id=1, final_stage_id=1
    )
    done = (await events_until_done(stream))[-1]
    assert isinstance(done, TurnDone) and done.turn_id == 1 and done.status != "failed"
    await handle.close()
    assert isinstance(await anext(stream), SessionClosed)
