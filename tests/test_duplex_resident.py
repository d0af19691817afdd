"""The resident stage-0 request (`duplex.session` rules 4 and 5), checked through the
port: ids follow the seed's grammar, the first append of an epoch is the initial
submission and every later one an update, an epoch bump opens a new resident request,
and stale resident outputs are dropped."""

from __future__ import annotations

import asyncio

import pytest

from duplex.appends import Heard, Listen, UtteranceEnded, UtteranceStarted, read_append
from duplex.contracts import DuplexFence as Fence
from duplex.contracts import duplex_resource_request_id
from duplex.errors import DuplexStateError
from duplex.events import TurnDone, TurnOutput, UtteranceOutput
from duplex.manager import DuplexSessionManager
from duplex.session import RESIDENT_ROLE, DuplexSession
from duplex.turn import Stage, TurnRequest
from tests.fakes import FakeStagePort

FRAME = Heard(b"\x00\x00\x00\x3f" * 640)  # 40 ms at 16 kHz
TURN = TurnRequest(final=Stage.TTS, audio=b"\x00\x00\x00\x3f" * 160)


def resident(session: str, epoch: int) -> str:
    return duplex_resource_request_id(Fence(session, epoch), RESIDENT_ROLE)


@pytest.fixture
def port() -> FakeStagePort:
    return FakeStagePort()


@pytest.fixture
def manager(port: FakeStagePort) -> DuplexSessionManager:
    return DuplexSessionManager(port, max_sessions=4)


def test_appends_read_back_as_they_were_built() -> None:
    for value in (
        FRAME,
        UtteranceStarted("item_1", 1234.5),
        UtteranceEnded("item_1"),
        Listen(prompt="names: Ada", logprobs=True),
        Listen(enabled=False),
    ):
        assert read_append(value.plan().prompt) == value
    with pytest.raises(ValueError):
        read_append({"append": "heard", "audio": b"\x00\x00\x00"})
    with pytest.raises(ValueError):
        read_append({"append": "utterance_started", "utterance_id": "", "start_ms": 0})
    with pytest.raises(ValueError):
        read_append({"audio": b""})


async def test_the_first_append_of_an_epoch_opens_the_resident_request(
    port: FakeStagePort, manager: DuplexSessionManager
) -> None:
    handle = manager.open("s")
    for value in (Listen(), FRAME, UtteranceStarted("item_1", 0.0), FRAME):
        handle.append(value)
    await handle.settled()
    rid = resident("s", 0)
    assert rid.endswith(".e.0.r.stage0")
    assert port.kinds() == ["ensure", *["submit", "submitted"] * 4]
    assert [s.already_submitted for s in port.submitted] == [False, True, True, True]
    assert all(s.resumable and s.context.request_id == rid for s in port.submitted)
    assert port.ensured[0].stage_id == 0 and port.ensured[0].final_stage_id == 0
    assert handle.owned_request_ids == (rid,)
    await handle.close()
    assert port.aborted == [rid] and port.cleaned == [rid] and port.reserved == []


async def test_later_appends_reach_the_port_at_once_unless_port_calls_wait(
    port: FakeStagePort, manager: DuplexSessionManager
) -> None:
    port.appends_now = True
    handle = manager.open("s")
    handle.append(FRAME)
    await handle.settled()
    handle.append(FRAME)
    handle.append(UtteranceStarted("item_1", 0.0))
    # Taken on the caller's stack: no worker ran in between.
    assert port.kinds() == ["ensure", "submit", "submitted", "append_now", "append_now"]
    port.submit_gate = asyncio.Event()
    handle.start_turn(TURN, tag="resp")
    await port.submit_waiting.wait()  # the turn's submit is under way
    handle.append(FRAME)  # must not overtake it
    port.submit_gate.set()
    await handle.settled()
    kinds = port.kinds()
    assert kinds[-3:] == ["submitted", "submit", "submitted"]
    assert "append_now" not in kinds[5:]
    assert [s.already_submitted for s in port.submitted] == [False, True, True, False, True]
    await handle.close()


async def test_turns_stay_ephemeral_beside_the_resident_request(
    port: FakeStagePort, manager: DuplexSessionManager
) -> None:
    handle = manager.open("s")
    handle.append(FRAME)
    handle.start_turn(TURN, tag="resp")
    await handle.settled()
    roles = [c.request_id.rsplit(".", 1)[1] for c in port.ensured]
    assert roles == ["stage0", "stage0-turn0", "stage1-turn0", "stage2-turn0"]
    turn_submission = port.submitted[1]
    assert (turn_submission.resumable, turn_submission.already_submitted) == (False, False)
    await handle.close()


async def test_a_barge_in_opens_a_new_epochs_resident_request(
    port: FakeStagePort, manager: DuplexSessionManager
) -> None:
    handle = manager.open("s")
    handle.append(FRAME)
    handle.start_turn(TURN, tag="resp")
    await handle.settled()
    assert handle.barge_in()
    handle.append(UtteranceStarted("item_2", 40.0))
    handle.append(FRAME)
    await handle.settled()
    old, new = resident("s", 0), resident("s", 1)
    assert new.endswith(".e.1.r.stage0")
    # The new one is reserved before the old one is let go; the next append opens it.
    assert port.calls.index(("ensure", new)) < port.calls.index(("abort", old))
    assert ("cleanup", old) in port.calls
    news = [s for s in port.submitted if s.context.request_id == new]
    assert [s.already_submitted for s in news] == [False, True]
    assert handle.owned_request_ids == (new,)
    await handle.close()
    assert port.reserved == []


async def test_a_cancel_with_no_listening_session_reserves_nothing(
    port: FakeStagePort, manager: DuplexSessionManager
) -> None:
    handle = manager.open("s")
    handle.start_turn(TURN, tag="resp")
    handle.barge_in()
    await handle.settled()
    assert not any(c.request_id.endswith(".r.stage0") for c in port.ensured)
    await handle.close()


async def test_deltas_of_the_epoch_are_events_and_stale_ones_are_dropped(
    port: FakeStagePort, manager: DuplexSessionManager
) -> None:
    handle = manager.open("s")
    handle.append(FRAME)
    handle.start_turn(TURN, tag="resp")
    await handle.settled()
    port.push(resident("s", 0), "transcript_delta", "Hello", utterance_id="item_1")
    handle.barge_in()
    port.push(resident("s", 0), "transcript_delta", " stale", utterance_id="item_1")
    port.push(resident("s", 1), "transcript_delta", " early", utterance_id="item_2")
    handle.append(FRAME)
    await handle.settled()
    port.push(resident("s", 1), "transcript_delta", "Again", utterance_id="item_2")
    events = handle.take_events()
    lives = [e for e in events if isinstance(e, UtteranceOutput)]
    assert [(e.utterance_id, e.output.text) for e in lives] == [
        ("item_1", "Hello"),
        ("item_2", " early"),  # reserved already: the epoch's own request
        ("item_2", "Again"),
    ]
    assert [type(e) for e in events if not isinstance(e, UtteranceOutput)][-1] is TurnDone
    assert not [e for e in events if isinstance(e, TurnOutput)]
    assert manager.dropped_outputs["stale"] == 1
    await handle.close()
    port.push(resident("s", 1), "transcript_delta", "late", utterance_id="item_2")
    assert not [e for e in handle.take_events() if isinstance(e, UtteranceOutput)]


def test_appends_need_an_open_session() -> None:
    session = DuplexSession("s", stage_count=3, sampling_defaults=("a", "b", "c"))
    with pytest.raises(DuplexStateError):
        session.append(FRAME.plan())
    session.open()
    assert len(session.append(FRAME.plan())) == 2
    session.close()
    with pytest.raises(DuplexStateError):
        session.append(FRAME.plan())
