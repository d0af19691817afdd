"""The duplex contracts: frozen value types and the strict, total request-id codec."""

from __future__ import annotations

import dataclasses
import inspect
from types import MappingProxyType

import pytest
from hypothesis import given
from hypothesis import strategies as st

from duplex.contracts import (
    DuplexAppendPlan,
    DuplexFence,
    DuplexOutputAction,
    DuplexOutputContext,
    DuplexOutputDecision,
    DuplexRequestIdentity,
    DuplexStagePort,
    DuplexStageRequestContext,
    DuplexStageSubmission,
    DuplexStageSubmissionResult,
    duplex_data_plane_request_info,
    duplex_ephemeral_stage_request_id,
    duplex_resource_request_belongs_to_session,
    duplex_resource_request_id,
    duplex_same_turn_request_ids,
    duplex_session_id_from_request_id,
    duplex_turn_id_from_request_id,
)
from duplex.outputs import (
    SAMPLE_BYTES,
    DuplexStageOutput,
    DuplexStreamingStagePort,
    fence_from_request_id,
    stage_id_from_request_id,
)

session_ids = st.one_of(
    st.text(),
    st.text(alphabet=".=-_ ", max_size=8),
    st.sampled_from(
        ["", " ", "=", "==", ".", "..", "a.b=c", "duplex-s.e.0.r", "\u00e9\u6f22\U0001f600"]
    ),
)
counts = st.integers(min_value=0, max_value=10**12)
roles = st.from_regex(r"\A[A-Za-z0-9_-]+\Z")


# -- reference examples ---------------------------------------------------------------


def test_reference_resumable_example() -> None:
    rid = duplex_resource_request_id(DuplexFence("duplex-test"), "stage0")
    assert rid == "duplex-s.ZHVwbGV4LXRlc3Q.e.0.r.stage0"
    assert duplex_session_id_from_request_id(rid) == "duplex-test"
    assert duplex_turn_id_from_request_id(rid) is None


def test_reference_session_with_space() -> None:
    rid = "duplex-s.c2VzcyBpZA.e.0.r.stage1-turn2"
    assert duplex_session_id_from_request_id(rid) == "sess id"
    assert duplex_turn_id_from_request_id(rid) == 2
    assert duplex_ephemeral_stage_request_id(DuplexFence("sess id", 0, 2), stage_id=1) == rid


def test_reference_server_allocated_id() -> None:
    sid = "duplex-3f9c2a7e5b6d4c1f8e0a9b2c3d4e5f6b"
    rid = duplex_ephemeral_stage_request_id(DuplexFence(sid, epoch=2, turn_id=7), stage_id=0)
    assert rid.startswith("duplex-s.ZHVwbGV4LTNmOWMy")
    assert rid.endswith(".e.2.r.stage0-turn7")
    assert duplex_session_id_from_request_id(rid) == sid
    assert duplex_turn_id_from_request_id(rid) == 7


def test_reference_same_turn_example() -> None:
    fence = DuplexFence("s", epoch=0, turn_id=4)
    rid = duplex_ephemeral_stage_request_id(fence, stage_id=3)
    turn4 = [duplex_ephemeral_stage_request_id(fence, stage_id=n) for n in range(3)]
    other_turn = duplex_ephemeral_stage_request_id(DuplexFence("s", 0, 5), stage_id=2)
    other_epoch = duplex_ephemeral_stage_request_id(DuplexFence("s", 1, 4), stage_id=0)
    candidates = [turn4[0], other_turn, turn4[1], rid, other_epoch, turn4[2]]
    assert duplex_same_turn_request_ids(rid, candidates) == turn4


def test_same_turn_ignores_other_sessions_resumable_and_junk() -> None:
    fence = DuplexFence("a", 3, 1)
    rid = duplex_ephemeral_stage_request_id(fence, stage_id=0)
    mine = duplex_ephemeral_stage_request_id(fence, stage_id=2)
    candidates = [
        duplex_ephemeral_stage_request_id(DuplexFence("b", 3, 1), stage_id=1),
        duplex_resource_request_id(fence, "stage1"),
        None,
        42,
        "garbage",
        mine,
    ]
    assert duplex_same_turn_request_ids(rid, candidates) == [mine]  # type: ignore[arg-type]
    assert duplex_same_turn_request_ids(duplex_resource_request_id(fence, "stage0"), [mine]) == []
    assert duplex_same_turn_request_ids("junk", [mine]) == []


# -- property-based round trips -------------------------------------------------------


@given(session_ids, counts, counts, counts)
def test_ephemeral_id_round_trips(session_id: str, epoch: int, turn: int, stage: int) -> None:
    fence = DuplexFence(session_id, epoch, turn)
    rid = duplex_ephemeral_stage_request_id(fence, stage_id=stage)
    assert rid.count(".") == 5
    assert duplex_session_id_from_request_id(rid) == session_id
    assert duplex_turn_id_from_request_id(rid) == turn
    assert fence_from_request_id(rid) == fence
    assert stage_id_from_request_id(rid) == stage
    assert duplex_resource_request_belongs_to_session(rid, session_id)
    assert not duplex_resource_request_belongs_to_session(rid, session_id + "x")


@given(session_ids, counts, roles)
def test_resource_id_round_trips(session_id: str, epoch: int, role: str) -> None:
    rid = duplex_resource_request_id(DuplexFence(session_id, epoch), role)
    assert rid.endswith(f".e.{epoch}.r.{role}")
    assert duplex_session_id_from_request_id(rid) == session_id
    assert duplex_resource_request_belongs_to_session(rid, session_id)


@given(session_ids, session_ids)
def test_distinct_sessions_give_distinct_ids(a: str, b: str) -> None:
    rid_a = duplex_resource_request_id(DuplexFence(a), "stage0")
    rid_b = duplex_resource_request_id(DuplexFence(b), "stage0")
    assert (rid_a == rid_b) == (a == b)


@given(st.one_of(st.text(), st.binary(), st.integers(), st.none(), st.lists(st.text())))
def test_parsers_are_total(value: object) -> None:
    # Any input at all: parsers answer, never raise.
    duplex_session_id_from_request_id(value)  # type: ignore[arg-type]
    duplex_turn_id_from_request_id(value)  # type: ignore[arg-type]
    assert isinstance(duplex_resource_request_belongs_to_session(value, "s"), bool)  # type: ignore[arg-type]
    assert duplex_same_turn_request_ids(value, [value]) == []  # type: ignore[arg-type, list-item]
    fence_from_request_id(value)
    stage_id_from_request_id(value)


@given(st.text(alphabet="duplex-s.ZHVwbGV4LXRlc3Q=e0123456789r.stagetrn_", max_size=48))
def test_near_miss_ids_never_raise_and_round_trip_when_accepted(value: str) -> None:
    session_id = duplex_session_id_from_request_id(value)
    if session_id is not None:
        encoded = value.split(".")[1]
        assert duplex_resource_request_id(DuplexFence(session_id), "x").split(".")[1] == encoded


# -- malformed ids --------------------------------------------------------------------

GOOD = "duplex-s.ZHVwbGV4LXRlc3Q.e.0.r.stage0-turn1"
MALFORMED = [
    None,
    42,
    b"duplex-s.ZHVwbGV4LXRlc3Q.e.0.r.stage0-turn1",
    ["duplex-s", "ZHVwbGV4LXRlc3Q"],
    "",
    "duplex-s",
    "duplex-s.ZHVwbGV4LXRlc3Q.e.0.r",  # too few parts
    "duplex-s.ZHVwbGV4LXRlc3Q.e.0.r.stage0.turn1",  # too many parts
    "duplex-x.ZHVwbGV4LXRlc3Q.e.0.r.stage0-turn1",  # wrong prefix
    "duplex-s.ZHVwbGV4LXRlc3Q.E.0.r.stage0-turn1",  # wrong epoch tag
    "duplex-s.ZHVwbGV4LXRlc3Q.e.0.R.stage0-turn1",  # wrong role tag
    "duplex-s.ZHVwbGV4LXRlc3Q=.e.0.r.stage0-turn1",  # padding kept
    "duplex-s.ZHVwbGV4LXRlc3Q+.e.0.r.stage0-turn1",  # standard (not url-safe) alphabet
    "duplex-s.ZHVwbGV4LXRlc3R.e.0.r.stage0-turn1",  # non-zero padding bits
    "duplex-s.Z.e.0.r.stage0-turn1",  # impossible base64 length
    "duplex-s.__8.e.0.r.stage0-turn1",  # valid base64, not UTF-8
    "duplex-s.ZHVwbGV4LXRlc3Q.e.-1.r.stage0-turn1",  # negative epoch
    "duplex-s.ZHVwbGV4LXRlc3Q.e.+1.r.stage0-turn1",  # signed epoch
    "duplex-s.ZHVwbGV4LXRlc3Q.e.01.r.stage0-turn1",  # leading zero
    "duplex-s.ZHVwbGV4LXRlc3Q.e.1_0.r.stage0-turn1",  # underscore digits
    "duplex-s.ZHVwbGV4LXRlc3Q.e.\u0661.r.stage0-turn1",  # non-ASCII digit
    "duplex-s.ZHVwbGV4LXRlc3Q.e. 1.r.stage0-turn1",  # whitespace
    "duplex-s.ZHVwbGV4LXRlc3Q.e..r.stage0-turn1",  # empty epoch
    "duplex-s.ZHVwbGV4LXRlc3Q.e.x.r.stage0-turn1",  # non-integer epoch
    "duplex-s.ZHVwbGV4LXRlc3Q.e.0.r.",  # empty role
    "duplex-s.ZHVwbGV4LXRlc3Q.e.0.r.stage 0",  # space in role
    "duplex-s.ZHVwbGV4LXRlc3Q.e.0.r.stage0-turn1\n",  # trailing newline
    "duplex-s.ZHVwbGV4LXRlc3Q.e.0.r.st\u00e4ge0",  # non-ASCII role
    " duplex-s.ZHVwbGV4LXRlc3Q.e.0.r.stage0-turn1",  # leading space
]


@pytest.mark.parametrize("rid", MALFORMED, ids=repr)
def test_malformed_ids_parse_to_none(rid: object) -> None:
    assert duplex_session_id_from_request_id(rid) is None  # type: ignore[arg-type]
    assert duplex_turn_id_from_request_id(rid) is None  # type: ignore[arg-type]
    assert fence_from_request_id(rid) is None
    assert stage_id_from_request_id(rid) is None
    assert duplex_resource_request_belongs_to_session(rid, "duplex-test") is False  # type: ignore[arg-type]
    assert duplex_same_turn_request_ids(rid, [GOOD]) == []  # type: ignore[arg-type]
    assert rid not in duplex_same_turn_request_ids(GOOD.replace("stage0", "stage1"), [rid])  # type: ignore[list-item]


def test_malformed_table_is_one_edit_from_a_good_id() -> None:
    assert duplex_session_id_from_request_id(GOOD) == "duplex-test"
    assert duplex_turn_id_from_request_id(GOOD) == 1


@pytest.mark.parametrize(
    "rid,turn",
    [
        ("duplex-s.ZHVwbGV4LXRlc3Q.e.0.r.stage0_t9", None),  # legacy form is not a turn
        ("duplex-s.ZHVwbGV4LXRlc3Q.e.0.r.stage0-turn09", None),
        ("duplex-s.ZHVwbGV4LXRlc3Q.e.0.r.stage-turn1", None),
        ("duplex-s.ZHVwbGV4LXRlc3Q.e.0.r.stage0-turn", None),
        ("duplex-s.ZHVwbGV4LXRlc3Q.e.0.r.xstage0-turn1", None),
        ("duplex-s.ZHVwbGV4LXRlc3Q.e.0.r.stage12-turn345", 345),
    ],
)
def test_turn_parser_requires_the_exact_ephemeral_role(rid: str, turn: int | None) -> None:
    assert duplex_turn_id_from_request_id(rid) == turn
    assert duplex_session_id_from_request_id(rid) == "duplex-test"


@pytest.mark.parametrize("role", ["", "a.b", "a b", "stage0=", "é", "x\n", None, 3])
def test_invalid_role_raises_clear_error(role: object) -> None:
    with pytest.raises(ValueError, match=r"role must be a non-empty string of \[A-Za-z0-9_-\]"):
        duplex_resource_request_id(DuplexFence("s"), role)  # type: ignore[arg-type]


def test_invalid_stage_id_raises() -> None:
    with pytest.raises(ValueError, match="stage_id"):
        duplex_ephemeral_stage_request_id(DuplexFence("s"), stage_id=-1)


# -- value types ----------------------------------------------------------------------


def test_fence_defaults_and_validation() -> None:
    fence = DuplexFence("s")
    assert (fence.epoch, fence.turn_id) == (0, 0)
    assert not hasattr(fence, "__dict__")  # slotted
    with pytest.raises(dataclasses.FrozenInstanceError):
        fence.epoch = 1  # type: ignore[misc]
    for bad in [{"epoch": -1}, {"turn_id": -2}, {"epoch": True}, {"turn_id": 1.5}]:
        with pytest.raises(ValueError):
            DuplexFence("s", **bad)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="session_id"):
        DuplexFence(None)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="UTF-8"):
        DuplexFence("\ud800")


def _context(**overrides: object) -> DuplexStageRequestContext:
    fence = DuplexFence("s", 1, 2)
    values: dict[str, object] = {
        "request_id": duplex_ephemeral_stage_request_id(fence, stage_id=1),
        "session_id": "s",
        "fence": fence,
        "stage_id": 1,
        "final_stage_id": 2,
        "config_generation": 3,
        "sampling_params": ["asr", "llm", "tts"],
    }
    values.update(overrides)
    return DuplexStageRequestContext(**values)  # type: ignore[arg-type]


def test_stage_request_context_freezes_and_indexes_sampling() -> None:
    config = {"voice": "joe"}
    context = _context(session_config=config, runtime_config={"x": 1})
    config["voice"] = "changed"
    assert context.sampling_params == ("asr", "llm", "tts")
    assert context.stage_sampling_params == "llm"
    assert isinstance(context.session_config, MappingProxyType)
    assert context.session_config == {"voice": "joe"}
    with pytest.raises(TypeError):
        context.runtime_config["x"] = 2  # type: ignore[index]
    assert _context().session_config == {} and _context().runtime_config == {}
    with pytest.raises(ValueError, match="none for stage 5"):
        _context(stage_id=5)
    with pytest.raises(ValueError, match="another session"):
        _context(session_id="t")
    with pytest.raises(ValueError, match="config_generation"):
        _context(config_generation=-1)


def test_submission_defaults_and_frozen_prompt() -> None:
    prompt = {"text": "hi"}
    sub = DuplexStageSubmission(context=_context(), prompt=prompt, already_submitted=False)
    prompt["text"] = "bye"
    assert sub.resumable is True
    assert sub.prompt == {"text": "hi"}
    with pytest.raises(TypeError):
        sub.prompt["text"] = "x"  # type: ignore[index]
    result = DuplexStageSubmissionResult(request_id="r", stage_id=1, replica_id=0)
    assert (result.request_id, result.stage_id, result.replica_id) == ("r", 1, 0)


def test_append_plan_prompt_is_read_only_copy() -> None:
    prompt: dict[str, object] = {"audio": b"\x00\x00"}
    plan = DuplexAppendPlan(prompt)
    prompt["audio"] = b""
    assert plan.prompt["audio"] == b"\x00\x00"
    with pytest.raises(TypeError):
        plan.prompt["audio"] = b""  # type: ignore[index]
    with pytest.raises(ValueError, match="mapping"):
        DuplexAppendPlan(["not", "a", "mapping"])  # type: ignore[arg-type]


def test_output_decision_and_context() -> None:
    decision = DuplexOutputDecision("direct_response")  # type: ignore[arg-type]
    assert decision.action is DuplexOutputAction.DIRECT_RESPONSE
    assert decision.final_output_type == "text" and decision.metadata == {}
    assert DuplexOutputAction.DIRECT_RESPONSE == "direct_response"
    with pytest.raises(ValueError):
        DuplexOutputDecision("listen")  # type: ignore[arg-type]
    fence = DuplexFence("s", 0, 1)
    ctx = DuplexOutputContext(
        identity=DuplexRequestIdentity("s", fence),
        final_stage_id=2,
        segment_finished=True,
        segment_token_ids=[1, 2],  # type: ignore[arg-type]
        segment_output_metadata={"k": 1},
    )
    assert ctx.segment_token_ids == (1, 2)
    assert isinstance(ctx.segment_output_metadata, MappingProxyType)
    with pytest.raises(ValueError, match="belongs to session"):
        DuplexRequestIdentity("other", fence)


def test_stage_port_is_abstract_with_the_seed_surface() -> None:
    with pytest.raises(TypeError):
        DuplexStagePort()  # type: ignore[abstract]
    assert DuplexStagePort.__abstractmethods__ == {
        "stage_count",
        "sampling_defaults",
        "ensure_request",
        "submit",
        "cleanup",
        "abort_requests",
    }
    for name in ("submit", "cleanup", "abort_requests"):
        assert inspect.iscoroutinefunction(getattr(DuplexStagePort, name))
    assert inspect.signature(DuplexStagePort.cleanup).parameters["abort"].default is False
    assert DuplexStreamingStagePort.__abstractmethods__ >= {"attach_output_sink"}


def test_data_plane_request_info() -> None:
    result = {
        "ok": True,
        "operation": "append",
        "stage_results": [
            {"stage_id": 0, "replica_id": 0, "result": {"data_plane_append": False}},
            {"stage_id": 0, "result": {"data_plane_append": True, "request_id": ""}},
            "junk",
            {
                "stage_id": 0,
                "result": {"data_plane_append": True, "request_id": "r1", "response_stage_id": 2},
            },
            {"stage_id": 1, "result": {"data_plane_append": True, "request_id": "r2"}},
        ],
    }
    assert duplex_data_plane_request_info(result) == ("r1", 2)
    no_stage = {
        "stage_results": [
            {"result": {"data_plane_append": True, "request_id": "r", "response_stage_id": True}}
        ]
    }
    assert duplex_data_plane_request_info(no_stage) == ("r", None)
    for bad in [{}, {"stage_results": None}, {"stage_results": [{"result": "x"}]}, None, []]:
        assert duplex_data_plane_request_info(bad) == (None, None)  # type: ignore[arg-type]


# -- stage output contract ------------------------------------------------------------


def test_stage_output_validates_and_freezes() -> None:
    out = DuplexStageOutput(
        session_id="s",
        request_id=GOOD,
        stage_id=2,
        kind="audio",
        text="Hi.",
        audio=bytearray(b"\x00\x00\x00\x3f" * 240),  # float32 0.5
        sample_rate=24000,
        metadata={"finish_reason": "stop"},
    )
    assert out.duration_ms == pytest.approx(10.0)
    assert isinstance(out.audio, bytes)
    with pytest.raises(TypeError):
        out.metadata["x"] = 1  # type: ignore[index]
    assert DuplexStageOutput("s", GOOD, 1, "text", text="a").duration_ms == 0.0
    with pytest.raises(ValueError, match="kind"):
        DuplexStageOutput("s", GOOD, 1, "token")
    with pytest.raises(ValueError, match="sample_rate"):
        DuplexStageOutput("s", GOOD, 2, "audio", audio=bytes(SAMPLE_BYTES))
    for partial in (b"\x00", b"\x00\x00", b"\x00" * 6):  # PCM16 sizes are not float32
        with pytest.raises(ValueError, match="whole float32 samples"):
            DuplexStageOutput("s", GOOD, 2, "audio", audio=partial, sample_rate=16000)


def test_stage_output_shows_the_client_payload_and_transcripts() -> None:
    def shown(kind: str, text: str = "", audio: bytes = b"") -> bool:
        rate = 16000 if audio else 0
        return DuplexStageOutput("s", GOOD, 1, kind, text, audio, rate).shows_client

    assert shown("text", "hi") and shown("audio", audio=bytes(SAMPLE_BYTES))
    assert shown("transcript") and shown("done", "last words")
    assert not shown("text") and not shown("done") and not shown("error", "boom")


def test_stage_id_from_resumable_and_other_roles() -> None:
    fence = DuplexFence("s", 0, 0)
    assert stage_id_from_request_id(duplex_resource_request_id(fence, "stage3")) == 3
    assert stage_id_from_request_id(duplex_resource_request_id(fence, "stage03")) is None
    assert stage_id_from_request_id(duplex_resource_request_id(fence, "vad")) is None
    assert fence_from_request_id(duplex_resource_request_id(fence, "stage3")) is None
