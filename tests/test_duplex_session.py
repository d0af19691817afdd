"""The sans-I/O duplex session: turns and their tags, side turns, fences, barge-in,
cancel, rejection and stale filtering."""

from __future__ import annotations

from collections.abc import Sequence

import pytest

from duplex.actions import (
    AbortRequests,
    CleanupRequests,
    EnsureRequest,
    OutputRoute,
    SessionStep,
    SubmitRequest,
)
from duplex.contracts import (
    DuplexAppendPlan,
    DuplexFence,
    DuplexOutputAction,
    duplex_ephemeral_stage_request_id,
)
from duplex.errors import DuplexStateError
from duplex.events import SessionClosed, SessionOpened, TurnDone, TurnOutput
from duplex.outputs import DuplexStageOutput
from duplex.session import DuplexSession
from duplex.state import TRANSITIONS, SessionState, TurnEvent, transition

SESSION = "sess"
SAMPLING = ("asr-params", "llm-params", "tts-params")
PLAN = DuplexAppendPlan({"audio": b"\x00\x00\x00\x3f" * 8})
RATE = 24000


def opened(**kwargs: object) -> DuplexSession:
    session = DuplexSession(SESSION, stage_count=3, sampling_defaults=SAMPLING, **kwargs)  # type: ignore[arg-type]
    assert session.open() == [SessionOpened(session_id=SESSION)]
    return session


def start(
    session: DuplexSession,
    entry: int = 0,
    final: int = 2,
    *,
    tag: str | None = None,
    conversation: bool = True,
) -> list[str]:
    """Start a turn; returns the request ids it reserved, entry stage first."""
    steps = session.start_turn(
        PLAN, entry_stage_id=entry, final_stage_id=final, tag=tag, conversation=conversation
    )
    return [s.context.request_id for s in steps if isinstance(s, EnsureRequest)]


def rid(stage: int, *, turn: int, epoch: int = 0) -> str:
    return duplex_ephemeral_stage_request_id(DuplexFence(SESSION, epoch, turn), stage_id=stage)


def audio(request_id: str, text: str, ms: int, *, finished: bool = False) -> DuplexStageOutput:
    samples = b"\x00\x00\x00\x3f" * (RATE * ms // 1000)  # float32 0.5
    return DuplexStageOutput(
        SESSION, request_id, 2, "audio", text, samples, RATE, finished=finished
    )


def text(
    request_id: str, delta: str, *, finished: bool = False, **metadata: object
) -> DuplexStageOutput:
    return DuplexStageOutput(
        SESSION, request_id, 1, "text", text=delta, finished=finished, metadata=metadata
    )


def transcript(request_id: str, words: str) -> DuplexStageOutput:
    return DuplexStageOutput(SESSION, request_id, 0, "transcript", text=words, finished=True)


def done_events(steps: Sequence[SessionStep]) -> list[TurnDone]:
    return [s for s in steps if isinstance(s, TurnDone)]


def aborted(steps: Sequence[SessionStep]) -> list[str]:
    return [r for s in steps if isinstance(s, AbortRequests) for r in s.request_ids]


def cleaned(steps: Sequence[SessionStep]) -> list[str]:
    return [r for s in steps if isinstance(s, CleanupRequests) for r in s.request_ids]


# -- turns ----------------------------------------------------------------------------


def test_voice_turn_reserves_every_stage_and_submits_the_entry() -> None:
    session = opened(config={"voice": "joe"})
    steps = session.start_turn(PLAN, entry_stage_id=0, final_stage_id=2)
    assert [type(s) for s in steps] == [EnsureRequest, EnsureRequest, EnsureRequest, SubmitRequest]
    contexts = [s.context for s in steps if isinstance(s, EnsureRequest)]
    assert [c.request_id for c in contexts] == [rid(n, turn=0) for n in range(3)]
    assert [c.stage_sampling_params for c in contexts] == list(SAMPLING)
    for ctx in contexts:
        assert ctx.fence == DuplexFence(SESSION, 0, 0)
        assert (ctx.final_stage_id, ctx.config_generation) == (2, 0)
        assert ctx.session_config == {"voice": "joe"}
    submission = steps[3].submission  # type: ignore[union-attr]
    assert submission.context == contexts[0]
    assert submission.prompt == PLAN.prompt
    assert (submission.already_submitted, submission.resumable) == (False, False)
    assert session.state is SessionState.RESPONDING
    assert session.active_turn_id == 0 and session.running_turn_ids == (0,)
    assert session.owned_request_ids == tuple(c.request_id for c in contexts)
    assert all(session.turn_of(c.request_id) == 0 for c in contexts)


def test_turn_id_counts_turns_started() -> None:
    session = opened()
    assert session.turn_id == 0
    start(session)
    # The fence moves when a turn starts, so the running turn's ids are already older.
    assert session.turn_id == 1 and session.fence == DuplexFence(SESSION, 0, 1)
    start(session, 1, 1, conversation=False)
    assert session.turn_id == 2 and session.running_turn_ids == (0, 1)


def test_text_turn_with_text_response_uses_only_the_llm_stage() -> None:
    session = opened()
    assert start(session, 1, 1, tag="resp_1") == [rid(1, turn=0)]
    llm = rid(1, turn=0)
    reply = text(llm, "Hello", finished=True, usage={"total_tokens": 7})
    routed = session.route_output(reply)
    assert routed.route is OutputRoute.FORWARD
    assert routed.steps == (
        TurnOutput(turn_id=0, output=reply, tag="resp_1"),
        CleanupRequests((llm,)),
        TurnDone(turn_id=0, status="completed", usage={"total_tokens": 7}, tag="resp_1"),
    )
    assert session.turn_id == 1 and session.state is SessionState.IDLE
    assert session.turn_of(llm) is None and session.running_turn_ids == ()


def test_full_voice_turn_forwards_in_order_and_completes() -> None:
    session = opened()
    asr, llm, tts = start(session, tag="resp_1")
    outputs = [
        transcript(asr, "hi there"),
        text(llm, "Hello."),
        audio(tts, "Hello.", 200),
        text(llm, "", finished=True, finish_reason="stop", usage={"total_tokens": 12}),
        audio(tts, "", 0, finished=True),
    ]
    routes = [session.route_output(o) for o in outputs]
    assert [r.route for r in routes] == [OutputRoute.FORWARD] * 3 + [OutputRoute.CONSUME] * 2
    assert [r.steps[0] for r in routes[:3]] == [
        TurnOutput(turn_id=0, output=o, tag="resp_1") for o in outputs[:3]
    ]
    assert routes[3].decision is not None
    assert routes[3].decision.action is DuplexOutputAction.DIRECT_RESPONSE
    assert routes[3].decision.final_output_type == "text"
    assert routes[4].steps == (
        CleanupRequests((asr, llm, tts)),
        TurnDone(turn_id=0, status="completed", usage={"total_tokens": 12}, tag="resp_1"),
    )
    assert session.owned_request_ids == ()
    assert session.fence == DuplexFence(SESSION, 0, 1)


def test_token_limit_makes_the_turn_incomplete() -> None:
    session = opened()
    (llm,) = start(session, 1, 1)
    routed = session.route_output(text(llm, "A long", finished=True, finish_reason="length"))
    assert done_events(routed.steps) == [
        TurnDone(turn_id=0, status="incomplete", reason="max_output_tokens")
    ]


def test_one_conversation_turn_at_a_time_and_the_stage_range_is_checked() -> None:
    session = opened()
    for entry, final in [(-1, 1), (2, 1), (0, 3)]:
        with pytest.raises(ValueError, match="0 <= entry"):
            session.start_turn(PLAN, entry_stage_id=entry, final_stage_id=final)
    with pytest.raises(ValueError, match="DuplexAppendPlan"):
        session.start_turn({"audio": b""}, entry_stage_id=0, final_stage_id=2)  # type: ignore[arg-type]
    ids = start(session)
    with pytest.raises(DuplexStateError, match="barge in or cancel it first"):
        start(session)
    assert session.owned_request_ids == tuple(ids) and session.turn_id == 1
    with pytest.raises(ValueError, match="0 <= entry"):
        start(session, 2, 1, conversation=False)
    assert session.turn_id == 1  # a refused turn takes no id


def test_update_config_applies_from_the_next_turn() -> None:
    session = opened(config={"voice": "a"})
    start(session, 1, 1)
    assert session.update_config({"voice": "b"}) == 1
    assert session.update_config({"voice": "c"}) == 2
    session.cancel()
    steps = session.start_turn(PLAN, entry_stage_id=1, final_stage_id=1)
    ctx = steps[0].context  # type: ignore[union-attr]
    assert (ctx.config_generation, dict(ctx.session_config)) == (2, {"voice": "c"})
    with pytest.raises(TypeError):
        session.config["voice"] = "d"  # type: ignore[index]
    with pytest.raises(ValueError, match="mapping"):
        session.update_config([("voice", "x")])  # type: ignore[arg-type]


# -- side turns -----------------------------------------------------------------------


def test_side_turns_run_beside_the_conversations_turn() -> None:
    session = opened()
    side_idle = start(session, 0, 0, tag="transcribe", conversation=False)
    assert session.state is SessionState.IDLE and session.active_turn_id is None
    conv = start(session, tag="resp_conv")
    side_busy = start(session, 1, 1, tag="resp_oob", conversation=False)
    assert session.state is SessionState.RESPONDING
    assert session.active_turn_id == 1 and session.running_turn_ids == (0, 1, 2)
    assert (side_idle, side_busy) == ([rid(0, turn=0)], [rid(1, turn=2)])
    assert conv == [rid(n, turn=1) for n in range(3)]

    # Each output goes to the turn that owns its request, under that turn's tag.
    heard = session.route_output(transcript(side_idle[0], "hello"))
    assert heard.steps == (
        TurnOutput(turn_id=0, output=transcript(side_idle[0], "hello"), tag="transcribe"),
        CleanupRequests(tuple(side_idle)),
        TurnDone(turn_id=0, status="completed", tag="transcribe"),
    )
    assert session.state is SessionState.RESPONDING  # a side turn never ends the response
    reply = session.route_output(text(conv[1], "Hi."))
    assert reply.steps == (TurnOutput(turn_id=1, output=text(conv[1], "Hi."), tag="resp_conv"),)
    oob = session.route_output(text(side_busy[0], "Sure.", finished=True))
    assert done_events(oob.steps) == [TurnDone(turn_id=2, status="completed", tag="resp_oob")]
    assert session.running_turn_ids == (1,) and session.owned_request_ids == tuple(conv)


def test_barge_in_cancels_the_conversations_turn_only() -> None:
    session = opened()
    conv = start(session, tag="resp_conv")
    (side,) = start(session, 1, 1, tag="resp_oob", conversation=False)
    steps = session.barge_in()
    assert done_events(steps) == [
        TurnDone(turn_id=0, status="cancelled", reason="turn_detected", tag="resp_conv")
    ]
    assert aborted(steps) == cleaned(steps) == conv
    assert session.epoch == 1 and session.running_turn_ids == (1,)
    assert session.state is SessionState.IDLE
    # The side turn's requests keep their epoch and still deliver.
    routed = session.route_output(text(side, "Still here.", finished=True))
    assert routed.route is OutputRoute.FORWARD and routed.steps[0].tag == "resp_oob"  # type: ignore[union-attr]
    assert session.barge_in() == []  # no conversation turn left, though a side turn ran


def test_cancel_by_tag_bumps_the_epoch_only_for_the_conversations_turn() -> None:
    session = opened()
    conv = start(session, 1, 2, tag="resp_conv")
    (side,) = start(session, 1, 1, tag="resp_oob", conversation=False)
    assert session.cancel(tag="resp_missing") == []
    steps = session.cancel(tag="resp_oob", reason="superseded")
    assert done_events(steps) == [
        TurnDone(turn_id=1, status="cancelled", reason="superseded", tag="resp_oob")
    ]
    assert aborted(steps) == [side]
    assert session.epoch == 0 and session.active_turn_id == 0
    assert session.state is SessionState.RESPONDING
    assert session.route_output(text(side, "late")).drop_reason == "stale"
    steps = session.cancel(tag="resp_conv")
    assert done_events(steps) == [
        TurnDone(turn_id=0, status="cancelled", reason="client_cancelled", tag="resp_conv")
    ]
    assert aborted(steps) == conv
    assert session.epoch == 1 and session.running_turn_ids == ()
    assert session.cancel(tag="resp_conv") == []


def test_cancel_without_a_tag_leaves_side_turns_running() -> None:
    session = opened()
    (side,) = start(session, 1, 1, tag="resp_oob", conversation=False)
    assert session.cancel() == []  # no conversation turn
    assert session.epoch == 0 and session.turn_of(side) == 0


def test_close_cancels_side_turns_too() -> None:
    session = opened()
    conv = start(session, 1, 2, tag="resp_conv")
    (side,) = start(session, 1, 1, tag="resp_oob", conversation=False)
    steps = session.close()
    assert done_events(steps) == [
        TurnDone(turn_id=0, status="cancelled", reason="session_closed", tag="resp_conv"),
        TurnDone(turn_id=1, status="cancelled", reason="session_closed", tag="resp_oob"),
    ]
    assert aborted(steps) == cleaned(steps) == [*conv, side]


def test_side_turn_stage_error_fails_only_that_turn() -> None:
    session = opened()
    conv = start(session, 1, 2)
    (side,) = start(session, 1, 1, tag="resp_oob", conversation=False)
    error = DuplexStageOutput(SESSION, side, 1, "error", finished=True, metadata={"error": "boom"})
    steps = session.route_output(error).steps
    assert done_events(steps) == [
        TurnDone(turn_id=1, status="failed", reason="error", error="stage 1: boom", tag="resp_oob")
    ]
    assert aborted(steps) == [] and cleaned(steps) == [side]  # the error finished it
    assert session.running_turn_ids == (0,) and session.owned_request_ids == tuple(conv)


def test_a_refused_stage_request_fails_the_turn_with_its_code() -> None:
    session = opened()
    (asr, llm, tts) = start(session, 0, 2, tag="resp_1")
    metadata = {"error": "a user message has 9 tokens", "error_code": "user_message_too_long"}
    session.route_output(DuplexStageOutput(SESSION, asr, 0, "transcript", text="hi", finished=True))
    refusal = DuplexStageOutput(SESSION, llm, 1, "error", finished=True, metadata=metadata)
    assert done_events(session.route_output(refusal).steps) == [
        TurnDone(
            turn_id=0,
            status="failed",
            reason="error",
            error="a user message has 9 tokens",
            error_code="user_message_too_long",
            tag="resp_1",
        )
    ]


# -- rejected turns -------------------------------------------------------------------


def test_reject_turn_ends_a_turn_that_never_started() -> None:
    session = opened()
    conv = start(session, tag="resp_1")
    assert session.reject_turn("resp_2", "busy") == [
        TurnDone(turn_id=1, status="failed", reason="rejected", error="busy", tag="resp_2")
    ]
    # It takes a turn id, and nothing else changes.
    assert session.turn_id == 2 and session.running_turn_ids == (0,)
    assert session.owned_request_ids == tuple(conv) and session.epoch == 0
    with pytest.raises(ValueError, match="error message"):
        session.reject_turn("resp_3", "")


def test_reject_turn_after_close_adds_nothing_after_session_closed() -> None:
    session = opened()
    session.close()
    assert session.reject_turn("resp_1", "session closed") == []


# -- barge-in and cancel --------------------------------------------------------------


def _advance_to_busy_stage(ids: list[str], session: DuplexSession, busy: int) -> None:
    asr, llm, tts = ids
    if busy == 0:
        return
    session.route_output(transcript(asr, "question"))
    session.route_output(text(llm, "Part"))
    if busy == 2:
        session.route_output(text(llm, " answer.", finished=True))
        session.route_output(audio(tts, "Part answer.", 40))


@pytest.mark.parametrize("busy", [0, 1, 2])
def test_barge_in_while_each_stage_is_busy(busy: int) -> None:
    session = opened()
    ids = start(session, tag="resp_1")
    _advance_to_busy_stage(ids, session, busy)
    steps = session.barge_in()
    # Finished stages need no abort; everything the turn owned is released.
    still_running = ids[busy:] if busy < 2 else [ids[2]]
    assert aborted(steps) == still_running
    assert cleaned(steps) == ids
    assert [type(s) for s in steps][-1] is TurnDone
    assert done_events(steps) == [
        TurnDone(turn_id=0, status="cancelled", reason="turn_detected", tag="resp_1")
    ]
    assert session.fence == DuplexFence(SESSION, epoch=1, turn_id=1)
    assert session.owned_request_ids == ()
    late = [transcript(ids[0], "late"), text(ids[1], "late"), audio(ids[2], "late", 20)]
    for out in late:
        routed = session.route_output(out)
        assert (routed.route, routed.drop_reason, routed.steps) == (OutputRoute.DROP, "stale", ())


def test_barge_in_and_cancel_are_idempotent_without_a_turn() -> None:
    session = opened()
    assert session.barge_in() == [] and session.cancel() == []
    assert session.fence == DuplexFence(SESSION, 0, 0)
    start(session)
    first = session.cancel()
    assert done_events(first) == [
        TurnDone(turn_id=0, status="cancelled", reason="client_cancelled")
    ]
    assert session.barge_in() == [] and session.cancel() == []
    assert session.fence == DuplexFence(SESSION, 1, 1)


def test_next_turn_after_barge_in_uses_the_new_fence() -> None:
    session = opened()
    old = start(session)[2]
    session.barge_in()
    new = start(session)[2]
    assert new == rid(2, epoch=1, turn=1) and new != old
    assert session.route_output(audio(old, "stale", 20)).route is OutputRoute.DROP
    assert session.route_output(audio(new, "fresh", 20)).route is OutputRoute.FORWARD


def test_a_refused_cancel_or_failure_changes_nothing() -> None:
    session = opened()
    ids = start(session, tag="resp_1")
    with pytest.raises(ValueError, match="cancel reason"):
        session.cancel(reason="bored")
    with pytest.raises(ValueError, match="error message"):
        session.fail_turn(0, "")
    assert session.fence == DuplexFence(SESSION, 0, 1) and session.active_turn_id == 0
    assert session.owned_request_ids == tuple(ids)
    assert aborted(session.cancel()) == ids


# -- failures and unknown outputs -----------------------------------------------------


def test_stage_error_fails_only_the_turn() -> None:
    session = opened()
    asr, llm, tts = start(session)
    session.route_output(transcript(asr, "hi"))
    err = DuplexStageOutput(
        SESSION, llm, 1, "error", finished=True, metadata={"error": "out of memory"}
    )
    routed = session.route_output(err)
    assert routed.route is OutputRoute.CONSUME and routed.decision is not None
    assert aborted(routed.steps) == [tts]
    assert cleaned(routed.steps) == [asr, llm, tts]
    assert done_events(routed.steps) == [
        TurnDone(turn_id=0, status="failed", reason="error", error="stage 1: out of memory")
    ]
    assert session.state is SessionState.IDLE and session.epoch == 0
    assert session.route_output(audio(tts, "late", 20)).drop_reason == "stale"
    start(session, 1, 1)
    assert session.active_turn_id == 1


def test_fail_turn_only_fails_the_named_running_turn() -> None:
    session = opened()
    ids = start(session, 1, 2)
    assert session.fail_turn(5, "submit failed") == []
    steps = session.fail_turn(0, "submit failed")
    assert aborted(steps) == ids == [rid(1, turn=0), rid(2, turn=0)]
    assert done_events(steps)[0].error == "submit failed"
    assert session.fail_turn(0, "again") == []


def test_unknown_mismatched_and_post_finish_outputs_are_dropped() -> None:
    session = opened()
    asr = start(session)[0]
    other_session = duplex_ephemeral_stage_request_id(DuplexFence("other", 0, 0), stage_id=0)
    cases = {
        "unknown_request": [
            transcript(other_session, "x"),
            transcript(rid(0, turn=9), "x"),  # a turn not started yet
            transcript("not-an-id", "x"),
        ],
        "stage_mismatch": [DuplexStageOutput(SESSION, asr, 1, "text", text="x")],
    }
    for reason, outs in cases.items():
        for out in outs:
            assert session.route_output(out).drop_reason == reason
    assert session.route_output(transcript(asr, "once")).route is OutputRoute.FORWARD
    assert session.route_output(transcript(asr, "twice")).drop_reason == "after_finish"


def test_payloadless_outputs_are_consumed_not_forwarded() -> None:
    session = opened()
    asr, llm, _ = start(session)
    routed = session.route_output(text(llm, ""))
    assert routed.route is OutputRoute.CONSUME and routed.steps == ()
    done = session.route_output(DuplexStageOutput(SESSION, llm, 1, "done", finished=True))
    assert done.route is OutputRoute.CONSUME and done.decision is not None
    assert done.decision.final_output_type == "done"
    # An empty transcript still tells the client transcription finished.
    assert session.route_output(transcript(asr, "")).route is OutputRoute.FORWARD


# -- close ----------------------------------------------------------------------------


def test_close_releases_everything_exactly_once() -> None:
    session = opened()
    ids = start(session)
    session.route_output(transcript(ids[0], "hi"))
    steps = session.close()
    assert aborted(steps) == ids[1:]
    assert cleaned(steps) == ids
    assert done_events(steps) == [TurnDone(turn_id=0, status="cancelled", reason="session_closed")]
    assert steps[-1] == SessionClosed(session_id=SESSION)
    assert session.close() == []
    assert session.route_output(text(ids[1], "late")).drop_reason == "closed"
    with pytest.raises(DuplexStateError, match="start_turn in state closed"):
        start(session)
    with pytest.raises(DuplexStateError, match="start_side_turn in state closed"):
        start(session, conversation=False)
    with pytest.raises(DuplexStateError):
        session.update_config({})
    assert session.barge_in() == [] and session.cancel(tag="resp_1") == []


def test_close_without_turn_and_before_open() -> None:
    session = opened()
    assert session.close() == [SessionClosed(session_id=SESSION)]
    fresh = DuplexSession("new", stage_count=1, sampling_defaults=("p",))
    assert fresh.close() == [SessionClosed(session_id="new")]
    with pytest.raises(DuplexStateError):
        fresh.open()


def test_constructor_validates_stage_layout() -> None:
    with pytest.raises(ValueError, match="2 entries for 3 stages"):
        DuplexSession("s", stage_count=3, sampling_defaults=("a", "b"))
    with pytest.raises(ValueError, match="stage_count"):
        DuplexSession("s", stage_count=0, sampling_defaults=())
    with pytest.raises(DuplexStateError, match="start_turn in state created"):
        DuplexSession("s", stage_count=1, sampling_defaults=("a",)).start_turn(
            PLAN, entry_stage_id=0, final_stage_id=0
        )


# -- the transition table -------------------------------------------------------------


@pytest.mark.parametrize("state", list(SessionState))
@pytest.mark.parametrize("event", list(TurnEvent))
def test_transition_table_is_total_or_raises(state: SessionState, event: TurnEvent) -> None:
    if event in TRANSITIONS[state]:
        assert transition(state, event) is TRANSITIONS[state][event]
    else:
        with pytest.raises(DuplexStateError, match=f"can't handle {event.value}"):
            transition(state, event)


def test_side_turns_never_change_the_sessions_state() -> None:
    for state, moves in TRANSITIONS.items():
        if TurnEvent.START_SIDE_TURN in moves:
            assert moves[TurnEvent.START_SIDE_TURN] is state
