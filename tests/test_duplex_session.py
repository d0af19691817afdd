"""The sans-I/O duplex session: turns, fences, barge-in, stale filtering, playback."""

from __future__ import annotations

import pytest

from duplex.actions import (
    AbortRequests,
    CleanupRequests,
    EnsureRequest,
    OutputRoute,
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
from duplex.playback import PlaybackLedger
from duplex.session import DuplexSession
from duplex.state import TRANSITIONS, SessionState, TurnEvent, transition

SAMPLING = ("asr-params", "llm-params", "tts-params")
PLAN = DuplexAppendPlan({"audio": b"\x00\x01" * 8, "messages": ()})
RATE = 24000


def opened(session_id: str = "sess", **kwargs: object) -> DuplexSession:
    session = DuplexSession(session_id, stage_count=3, sampling_defaults=SAMPLING, **kwargs)  # type: ignore[arg-type]
    assert session.open() == [SessionOpened(session_id=session_id)]
    return session


def rid(
    session: DuplexSession, stage: int, *, turn: int | None = None, epoch: int | None = None
) -> str:
    fence = DuplexFence(
        session.session_id,
        session.epoch if epoch is None else epoch,
        session.turn_id if turn is None else turn,
    )
    return duplex_ephemeral_stage_request_id(fence, stage_id=stage)


def audio(request_id: str, text: str, ms: int, *, finished: bool = False) -> DuplexStageOutput:
    pcm = b"\x01\x00" * (RATE * ms // 1000)
    return DuplexStageOutput(
        request_id, 2, "audio", text=text, audio=pcm, sample_rate=RATE, finished=finished
    )


def text(
    request_id: str, delta: str, *, finished: bool = False, **metadata: object
) -> DuplexStageOutput:
    return DuplexStageOutput(
        request_id, 1, "text", text=delta, finished=finished, metadata=metadata
    )


def transcript(request_id: str, words: str) -> DuplexStageOutput:
    return DuplexStageOutput(request_id, 0, "transcript", text=words, finished=True)


def done_events(steps: object) -> list[TurnDone]:
    return [s for s in steps if isinstance(s, TurnDone)]  # type: ignore[attr-defined]


def aborted(steps: object) -> list[str]:
    return [r for s in steps if isinstance(s, AbortRequests) for r in s.request_ids]  # type: ignore[attr-defined]


def cleaned(steps: object) -> list[str]:
    return [r for s in steps if isinstance(s, CleanupRequests) for r in s.request_ids]  # type: ignore[attr-defined]


# -- turns ----------------------------------------------------------------------------


def test_voice_turn_reserves_every_stage_and_submits_the_entry() -> None:
    session = opened(config={"voice": "joe"})
    steps = session.start_turn(PLAN, entry_stage_id=0, final_stage_id=2)
    assert [type(s) for s in steps] == [EnsureRequest, EnsureRequest, EnsureRequest, SubmitRequest]
    contexts = [s.context for s in steps[:3]]  # type: ignore[union-attr]
    assert [c.request_id for c in contexts] == [rid(session, n) for n in range(3)]
    assert [c.stage_sampling_params for c in contexts] == list(SAMPLING)
    for ctx in contexts:
        assert ctx.fence == DuplexFence("sess", 0, 0)
        assert (ctx.final_stage_id, ctx.config_generation) == (2, 0)
        assert ctx.session_config == {"voice": "joe"}
    submission = steps[3].submission  # type: ignore[union-attr]
    assert submission.context == contexts[0]
    assert submission.prompt == PLAN.prompt
    assert (submission.already_submitted, submission.resumable) == (False, False)
    assert session.state is SessionState.RESPONDING
    assert session.active_turn_id == 0
    assert session.owned_request_ids == tuple(c.request_id for c in contexts)


def test_text_turn_with_text_response_uses_only_the_llm_stage() -> None:
    session = opened()
    steps = session.start_turn(PLAN, entry_stage_id=1, final_stage_id=1)
    assert [type(s) for s in steps] == [EnsureRequest, SubmitRequest]
    assert steps[0].context.request_id == rid(session, 1)  # type: ignore[union-attr]
    llm = rid(session, 1)
    routed = session.route_output(text(llm, "Hello", finished=True, usage={"total_tokens": 7}))
    assert routed.route is OutputRoute.FORWARD
    assert routed.steps == (
        TurnOutput(turn_id=0, output=text(llm, "Hello", finished=True, usage={"total_tokens": 7})),
        CleanupRequests((llm,)),
        TurnDone(turn_id=0, status="completed", usage={"total_tokens": 7}),
    )
    assert session.turn_id == 1 and session.state is SessionState.IDLE


def test_full_voice_turn_forwards_in_order_and_completes() -> None:
    session = opened()
    session.start_turn(PLAN, entry_stage_id=0, final_stage_id=2)
    asr, llm, tts = (rid(session, n) for n in range(3))
    outputs = [
        transcript(asr, "hi there"),
        text(llm, "Hello."),
        audio(tts, "Hello.", 200),
        text(llm, "", finished=True, finish_reason="stop", usage={"total_tokens": 12}),
        audio(tts, "", 0, finished=True),
    ]
    routes = [session.route_output(o) for o in outputs]
    assert [r.route for r in routes] == [OutputRoute.FORWARD] * 3 + [OutputRoute.CONSUME] * 2
    forwarded = [r.steps[0].output for r in routes[:3]]  # type: ignore[union-attr]
    assert forwarded == outputs[:3]
    assert routes[3].decision is not None
    assert routes[3].decision.action is DuplexOutputAction.DIRECT_RESPONSE
    assert routes[3].decision.final_output_type == "text"
    assert routes[4].steps == (
        CleanupRequests((asr, llm, tts)),
        TurnDone(turn_id=0, status="completed", usage={"total_tokens": 12}),
    )
    assert session.owned_request_ids == ()
    assert session.fence == DuplexFence("sess", 0, 1)
    assert session.heard_text(200) == "Hello."


def test_token_limit_makes_the_turn_incomplete() -> None:
    session = opened()
    session.start_turn(PLAN, entry_stage_id=1, final_stage_id=1)
    routed = session.route_output(
        text(rid(session, 1), "A long", finished=True, finish_reason="length")
    )
    assert done_events(routed.steps) == [
        TurnDone(turn_id=0, status="incomplete", reason="max_output_tokens")
    ]


def test_only_one_active_turn_and_stage_range_is_checked() -> None:
    session = opened()
    for entry, final in [(-1, 1), (2, 1), (0, 3)]:
        with pytest.raises(ValueError, match="0 <= entry"):
            session.start_turn(PLAN, entry_stage_id=entry, final_stage_id=final)
    with pytest.raises(ValueError, match="DuplexAppendPlan"):
        session.start_turn({"audio": b""}, entry_stage_id=0, final_stage_id=2)  # type: ignore[arg-type]
    session.start_turn(PLAN, entry_stage_id=0, final_stage_id=2)
    with pytest.raises(DuplexStateError, match="barge in or cancel it first"):
        session.start_turn(PLAN, entry_stage_id=0, final_stage_id=2)
    assert session.owned_request_ids == tuple(rid(session, n) for n in range(3))


def test_update_config_applies_from_the_next_turn() -> None:
    session = opened(config={"voice": "a"})
    session.start_turn(PLAN, entry_stage_id=1, final_stage_id=1)
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


# -- barge-in and cancel --------------------------------------------------------------


def _advance_to_busy_stage(session: DuplexSession, busy: int) -> None:
    asr, llm, tts = (rid(session, n) for n in range(3))
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
    session.start_turn(PLAN, entry_stage_id=0, final_stage_id=2)
    ids = [rid(session, n) for n in range(3)]
    _advance_to_busy_stage(session, busy)
    steps = session.barge_in()
    # Finished stages need no abort; everything the turn owned is released.
    still_running = ids[busy:] if busy < 2 else [ids[2]]
    assert aborted(steps) == still_running
    assert cleaned(steps) == ids
    assert [type(s) for s in steps][-1] is TurnDone
    assert done_events(steps) == [TurnDone(turn_id=0, status="cancelled", reason="turn_detected")]
    assert session.fence == DuplexFence("sess", epoch=1, turn_id=1)
    assert session.owned_request_ids == ()
    late = [transcript(ids[0], "late"), text(ids[1], "late"), audio(ids[2], "late", 20)]
    for out in late:
        routed = session.route_output(out)
        assert (routed.route, routed.drop_reason, routed.steps) == (OutputRoute.DROP, "stale", ())


def test_barge_in_and_cancel_are_idempotent_without_a_turn() -> None:
    session = opened()
    assert session.barge_in() == [] and session.cancel() == []
    assert session.fence == DuplexFence("sess", 0, 0)
    session.start_turn(PLAN, entry_stage_id=0, final_stage_id=2)
    first = session.cancel()
    assert done_events(first) == [
        TurnDone(turn_id=0, status="cancelled", reason="client_cancelled")
    ]
    assert session.barge_in() == [] and session.cancel() == []
    assert session.fence == DuplexFence("sess", 1, 1)


def test_next_turn_after_barge_in_uses_the_new_fence() -> None:
    session = opened()
    session.start_turn(PLAN, entry_stage_id=0, final_stage_id=2)
    old = rid(session, 2)
    session.barge_in()
    steps = session.start_turn(PLAN, entry_stage_id=0, final_stage_id=2)
    new = steps[2].context.request_id  # type: ignore[union-attr]
    assert new == rid(session, 2, epoch=1, turn=1) and new != old
    assert session.route_output(audio(old, "stale", 20)).route is OutputRoute.DROP
    assert session.route_output(audio(new, "fresh", 20)).route is OutputRoute.FORWARD


# -- failures and unknown outputs -----------------------------------------------------


def test_stage_error_fails_only_the_turn() -> None:
    session = opened()
    session.start_turn(PLAN, entry_stage_id=0, final_stage_id=2)
    asr, llm, tts = (rid(session, n) for n in range(3))
    session.route_output(transcript(asr, "hi"))
    err = DuplexStageOutput(llm, 1, "error", finished=True, metadata={"error": "out of memory"})
    routed = session.route_output(err)
    assert routed.route is OutputRoute.CONSUME and routed.decision is not None
    assert aborted(routed.steps) == [tts]
    assert cleaned(routed.steps) == [asr, llm, tts]
    assert done_events(routed.steps) == [
        TurnDone(turn_id=0, status="failed", reason="error", error="stage 1: out of memory")
    ]
    assert session.state is SessionState.IDLE
    assert session.route_output(audio(tts, "late", 20)).drop_reason == "stale"
    session.start_turn(PLAN, entry_stage_id=1, final_stage_id=1)
    assert session.active_turn_id == 1


def test_fail_turn_only_fails_the_named_active_turn() -> None:
    session = opened()
    session.start_turn(PLAN, entry_stage_id=1, final_stage_id=2)
    assert session.fail_turn(5, "submit failed") == []
    steps = session.fail_turn(0, "submit failed")
    assert aborted(steps) == [rid(session, 1, turn=0), rid(session, 2, turn=0)]
    assert done_events(steps)[0].error == "submit failed"
    assert session.fail_turn(0, "again") == []


def test_unknown_mismatched_and_post_finish_outputs_are_dropped() -> None:
    session = opened()
    session.start_turn(PLAN, entry_stage_id=0, final_stage_id=2)
    asr = rid(session, 0)
    other_session = duplex_ephemeral_stage_request_id(DuplexFence("other", 0, 0), stage_id=0)
    future_turn = rid(session, 0, turn=9)
    cases = {
        "unknown_request": [
            transcript(other_session, "x"),
            transcript(future_turn, "x"),
            transcript("not-an-id", "x"),
        ],
        "stage_mismatch": [DuplexStageOutput(asr, 1, "text", text="x")],
    }
    for reason, outs in cases.items():
        for out in outs:
            assert session.route_output(out).drop_reason == reason
    assert session.route_output(transcript(asr, "once")).route is OutputRoute.FORWARD
    assert session.route_output(transcript(asr, "twice")).drop_reason == "after_finish"


def test_payloadless_outputs_are_consumed_not_forwarded() -> None:
    session = opened()
    session.start_turn(PLAN, entry_stage_id=0, final_stage_id=2)
    llm = rid(session, 1)
    routed = session.route_output(text(llm, ""))
    assert routed.route is OutputRoute.CONSUME and routed.steps == ()
    done = session.route_output(DuplexStageOutput(llm, 1, "done", finished=True))
    assert done.route is OutputRoute.CONSUME and done.decision.final_output_type == "done"  # type: ignore[union-attr]
    # An empty transcript still tells the client transcription finished.
    assert session.route_output(transcript(rid(session, 0), "")).route is OutputRoute.FORWARD


# -- close ----------------------------------------------------------------------------


def test_close_releases_everything_exactly_once() -> None:
    session = opened()
    session.start_turn(PLAN, entry_stage_id=0, final_stage_id=2)
    ids = [rid(session, n) for n in range(3)]
    session.route_output(transcript(ids[0], "hi"))
    steps = session.close()
    assert aborted(steps) == ids[1:]
    assert cleaned(steps) == ids
    assert done_events(steps) == [TurnDone(turn_id=0, status="cancelled", reason="session_closed")]
    assert steps[-1] == SessionClosed(session_id="sess")
    assert session.close() == []
    assert session.route_output(text(ids[1], "late")).drop_reason == "closed"
    with pytest.raises(DuplexStateError, match="start_turn in state closed"):
        session.start_turn(PLAN, entry_stage_id=0, final_stage_id=2)
    with pytest.raises(DuplexStateError):
        session.update_config({})
    assert session.barge_in() == []


def test_close_without_turn_and_before_open() -> None:
    session = opened()
    assert session.close() == [SessionClosed(session_id="sess")]
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


# -- playback -------------------------------------------------------------------------


def test_heard_text_after_barge_in_is_what_played() -> None:
    session = opened()
    session.start_turn(PLAN, entry_stage_id=0, final_stage_id=2)
    tts = rid(session, 2)
    session.route_output(audio(tts, "Hello there. ", 500))
    session.route_output(audio(tts, "How are you today? ", 1000))
    session.barge_in()
    assert session.audio_duration_ms() == pytest.approx(1500)
    assert session.heard_text(500) == "Hello there. "
    assert session.heard_text(1100) == "Hello there. How are you"
    assert session.heard_text(5000) == "Hello there. How are you today? "
    assert session.heard_text(0) == ""
    session.start_turn(PLAN, entry_stage_id=1, final_stage_id=1)
    assert session.heard_text(1000) == ""  # latest turn: no audio yet
    assert session.heard_text(1100, turn_id=0) == "Hello there. How are you"


def test_playback_records_are_bounded() -> None:
    session = opened(playback_turns=2)
    for _ in range(3):
        session.start_turn(PLAN, entry_stage_id=1, final_stage_id=1)
        session.cancel()
    assert session.heard_text(10, turn_id=2) == ""
    with pytest.raises(ValueError, match="no playback record for turn 0"):
        session.heard_text(10, turn_id=0)
    with pytest.raises(ValueError, match="no playback record"):
        opened().heard_text(10)


def test_playback_ledger_cuts_at_word_boundaries() -> None:
    ledger = PlaybackLedger()
    ledger.add(100, "abc def")
    ledger.add(0, "")
    ledger.add(100, "ghi")
    assert ledger.duration_ms == 200 and ledger.text == "abc defghi"
    assert ledger.heard_text(50) == "abc"
    assert ledger.heard_text(60) == "abc "  # cut inside "def" keeps the words before it
    assert ledger.heard_text(90) == "abc "
    assert ledger.heard_text(20) == ""
    assert ledger.heard_text(100) == "abc def"
    assert ledger.heard_text(199) == "abc def"
    assert ledger.heard_text(200) == "abc defghi"
    with pytest.raises(ValueError):
        ledger.heard_text(-1)
    with pytest.raises(ValueError):
        ledger.add(-5, "x")


# -- the transition table -------------------------------------------------------------


@pytest.mark.parametrize("state", list(SessionState))
@pytest.mark.parametrize("event", list(TurnEvent))
def test_transition_table_is_total_or_raises(state: SessionState, event: TurnEvent) -> None:
    if event in TRANSITIONS[state]:
        assert transition(state, event) is TRANSITIONS[state][event]
    else:
        with pytest.raises(DuplexStateError, match=f"can't handle {event.value}"):
            transition(state, event)
