"""The committed audio a session holds is bounded: `max_committed_audio_s`."""

from __future__ import annotations

import base64
import json

import numpy as np

from gateway.config import GatewayConfig
from gateway.protocol.audio import PCM16
from gateway.session.actions import StartResponse
from gateway.session.backend import ResponseDone, ResponseOutput
from gateway.session.realtime import RealtimeSession

MANUAL = {"type": "realtime", "audio": {"input": {"turn_detection": None}}}


def manual_session(**limits: object) -> RealtimeSession:
    config = GatewayConfig(limits=limits) if limits else GatewayConfig()
    session = RealtimeSession(config=config, model="m", beta=False)
    send(session, type="session.update", session=MANUAL)
    session.actions()
    return session


def send(session: RealtimeSession, /, **event: object) -> list[dict]:
    session.receive_text(json.dumps(event))
    return session.events_to_send()


def audio_b64(seconds: float) -> str:
    """Quiet noise in the session's input format (pcm16 at 24 kHz)."""
    samples = np.random.default_rng(0).uniform(-0.1, 0.1, int(PCM16.rate * seconds))
    return base64.b64encode(PCM16.encode(samples)).decode()


def commit(session: RealtimeSession, *appends: str) -> tuple[list[dict], str | None]:
    """Append and commit; the events and the transcription job the commit started."""
    for append in appends:
        assert send(session, type="input_audio_buffer.append", audio=append) == []
    events = send(session, type="input_audio_buffer.commit")
    jobs = [a.response_id for a in session.actions() if isinstance(a, StartResponse)]
    return events, jobs[0] if jobs else None


def transcribe(session: RealtimeSession, job_id: str, words: str) -> None:
    session.receive_response_event(ResponseOutput(job_id, "transcript", text=words))
    session.receive_response_event(ResponseDone(job_id, "completed"))


def held_bytes(session: RealtimeSession) -> int:
    """Audio bytes the conversation's items hold: wire audio and 16 kHz turn audio."""
    return sum(
        len(item.audio or b"") + len(item.pending_audio or b"")
        for item in session.conversation.items()
    )


def held_seconds(session: RealtimeSession) -> float:
    return sum(item.audio_ms for item in session.conversation.items()) / 1000


def test_long_commits_one_after_another_keep_the_held_audio_bounded() -> None:
    # Five minutes per commit, ten commits: 50 minutes of audio, 15 of them held at most.
    session = manual_session()
    append = audio_b64(150)
    for turn in range(10):
        events, job = commit(session, append, append)
        assert events[0]["type"] == "input_audio_buffer.committed", events
        assert job is not None
        transcribe(session, job, f"turn {turn}")
        assert held_seconds(session) <= 900
        # 24 kHz pcm16 is 48 kB per second once transcribed.
        assert held_bytes(session) <= 900 * 48_000
    items = session.conversation.items()
    assert [item.text() for item in items] == [f"turn {turn}" for turn in range(10)]
    assert [item.audio_ms > 0 for item in items] == [False] * 7 + [True] * 3


def test_the_oldest_transcribed_audio_goes_first_and_its_words_stay() -> None:
    session = manual_session(max_committed_audio_s=10)
    four_s = audio_b64(4)
    ids = []
    for words in ("one", "two"):
        events, job = commit(session, four_s)
        ids.append(events[0]["item_id"])
        assert job is not None
        transcribe(session, job, words)
    events, _ = commit(session, four_s)
    assert events[0]["type"] == "input_audio_buffer.committed", events
    ids.append(events[0]["item_id"])
    first, second, third = (session.conversation.get(item_id) for item_id in ids)
    assert first is not None and second is not None and third is not None
    assert (first.audio_ms, second.audio_ms, third.audio_ms) == (0, 4000, 4000)
    assert first.text() == "one"
    (retrieved,) = send(session, type="conversation.item.retrieve", item_id=ids[0])
    assert retrieved["item"]["content"] == [{"type": "input_audio", "transcript": "one"}]
    (retrieved,) = send(session, type="conversation.item.retrieve", item_id=ids[1])
    assert len(base64.b64decode(retrieved["item"]["content"][0]["audio"])) == 4 * 48_000


def test_audio_not_transcribed_is_kept_and_the_commit_is_refused() -> None:
    session = manual_session(max_committed_audio_s=10)
    six_s = audio_b64(6)
    events, job = commit(session, six_s)
    first_id = events[0]["item_id"]
    assert job is not None
    (error,) = send(session, type="input_audio_buffer.append", audio=six_s) + send(
        session, type="input_audio_buffer.commit"
    )
    assert error["type"] == "error"
    assert error["error"]["code"] == "input_audio_buffer_commit_too_large"
    assert "max_committed_audio_s" in error["error"]["message"]
    assert "10 s" in error["error"]["message"]
    first = session.conversation.get(first_id)
    assert first is not None and first.pending_audio is not None and first.audio_ms == 6000
    assert len(session.conversation.items()) == 1
    # The refused audio is still buffered: once the first item is transcribed it fits.
    transcribe(session, job, "first")
    events, _ = commit(session)
    assert events[0]["type"] == "input_audio_buffer.committed", events
    assert first.audio_ms == 0 and first.text() == "first"
    assert held_seconds(session) == 6


def test_a_commit_longer_than_the_limit_is_refused_and_drops_nothing() -> None:
    session = manual_session(max_committed_audio_s=5)
    events, job = commit(session, audio_b64(3))
    assert job is not None
    transcribe(session, job, "kept")
    (error,) = commit(session, audio_b64(6))[0]
    assert error["error"]["code"] == "input_audio_buffer_commit_too_large"
    (item,) = session.conversation.items()
    assert item.audio_ms == 3000


def test_an_item_with_audio_counts_against_the_limit() -> None:
    session = manual_session(max_committed_audio_s=5)

    def create(seconds: float, **part: object) -> list[dict]:
        content = {"type": "input_audio", "audio": audio_b64(seconds), **part}
        item = {"type": "message", "role": "user", "content": [content]}
        return send(session, type="conversation.item.create", item=item)

    assert create(3, transcript="given")[0]["type"] == "conversation.item.added"
    # Its transcript came with it: its audio may go to make room.
    assert create(3)[0]["type"] == "conversation.item.added"
    (error,) = create(3)
    assert error["error"]["code"] == "invalid_value"
    assert error["error"]["param"] == "item.content"
    assert "max_committed_audio_s" in error["error"]["message"]
    assert [item.audio_ms for item in session.conversation.items()] == [0, 3000]
