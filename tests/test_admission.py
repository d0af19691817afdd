"""Admission control and the playback runway, with an injected clock and scripted
sessions: saturation queues or refuses new spoken responses with `server_busy`, waiting
ones start in order when load falls, and cancels and closed sessions leave the queue.
Then the same through a real `GatewayServer` and a WebSocket client, with /healthz and
/metrics. tests/test_admission_real.py runs it with the real models and the SDK."""

from __future__ import annotations

import asyncio
import json
import urllib.request
from typing import Any

import numpy as np
import pytest
from websockets.asyncio.client import ClientConnection, connect

from duplex.turn import Stage, TurnRequest
from gateway.config import CapacitySettings, GatewayConfig
from gateway.server.admission import BUSY_CODE, Admission, AdmittedSession
from gateway.server.metrics import GatewayMetrics
from gateway.server.runway import Runway
from gateway.server.server import GatewayServer
from gateway.session.backend import ResponseDone, ResponseOutput
from tests.fake_backend import IdleBackend, Reply, ScriptedSession
from tests.helpers import wait_until

VOICE_RATE = 16_000
SPOKEN = TurnRequest(final=Stage.TTS, text="Hello.")
TEXT_ONLY = TurnRequest(final=Stage.LLM, text="Hello.")


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def audio(response_id: str, seconds: float) -> ResponseOutput:
    samples = np.zeros(int(VOICE_RATE * seconds), "<f4")
    return ResponseOutput(response_id, "audio", audio=samples.tobytes(), sample_rate=VOICE_RATE)


def metric(metrics: GatewayMetrics, name: str, **labels: str) -> float:
    value = metrics.registry.get_sample_value(name, labels)
    return 0.0 if value is None else value


# -- the runway ------------------------------------------------------------------------


def test_runway_is_audio_sent_less_the_time_since_the_first_delta() -> None:
    runway = Runway()
    assert runway.left(0.0) is None
    first = runway.send(10.0, 1.0)
    assert first.runway_s is None and first.stall_s == 0.0
    assert runway.left(10.4) == pytest.approx(0.6)
    on_time = runway.send(10.8, 1.0)
    assert on_time.runway_s == pytest.approx(0.2) and on_time.stall_s == 0.0
    assert runway.left(11.0) == pytest.approx(1.0)


def test_a_stall_is_the_gap_before_late_audio_and_playback_resumes_with_it() -> None:
    runway = Runway()
    runway.send(0.0, 1.0)
    late = runway.send(1.5, 2.0)  # the client ran dry at 1.0 and waited 0.5 s
    assert late.runway_s == pytest.approx(-0.5) and late.stall_s == pytest.approx(0.5)
    assert runway.left(1.5) == pytest.approx(2.0)  # it plays the new audio from now
    assert runway.send(2.0, 1.0).stall_s == 0.0


# -- admission -------------------------------------------------------------------------


class Calls:
    """What admission decided for each response: started, or refused with a message."""

    def __init__(self, admission: Admission) -> None:
        self.admission = admission
        self.started: list[str] = []
        self.refused: dict[str, str] = {}
        self.refusal = asyncio.Event()

    def request(self, response_id: str) -> None:
        self.admission.request(
            response_id,
            lambda: self.started.append(response_id),
            lambda message: self._refuse(response_id, message),
        )

    def _refuse(self, response_id: str, message: str) -> None:
        self.refused[response_id] = message
        self.refusal.set()


def admission(clock: Clock | None = None, **capacity: Any) -> tuple[Admission, GatewayMetrics]:
    metrics = GatewayMetrics()
    settings = CapacitySettings(**capacity)
    return Admission(settings, metrics, clock=clock or Clock()), metrics


async def test_saturated_by_count_queues_then_refuses_and_recovers_in_order() -> None:
    adm, metrics = admission(max_speaking=2, max_queued=2)
    calls = Calls(adm)
    for response_id in ("a", "b", "c", "d", "e"):
        calls.request(response_id)
    assert calls.started == ["a", "b"] and adm.saturated()
    assert (adm.speaking, adm.queued) == (2, 2)
    assert list(calls.refused) == ["e"] and "capacity" in calls.refused["e"]
    adm.finished("a")
    assert calls.started == ["a", "b", "c"]
    adm.finished("b")
    adm.finished("c")
    assert calls.started == ["a", "b", "c", "d"] and not adm.saturated()
    assert metric(metrics, "duplex_gateway_admissions_total", outcome="started") == 2
    assert metric(metrics, "duplex_gateway_admissions_total", outcome="queued") == 2
    assert metric(metrics, "duplex_gateway_admissions_total", outcome="refused") == 1


async def test_rate_limits_report_the_spoken_responses_that_may_start() -> None:
    adm, _ = admission(max_speaking=2, max_queued=2, max_wait_s=2.5)
    calls = Calls(adm)
    limits = {"name": "requests", "limit": 2, "remaining": 2, "reset_seconds": 0.0}
    assert adm.rate_limits() == [limits]
    calls.request("a")
    assert adm.rate_limits() == [{**limits, "remaining": 1}]
    calls.request("b")
    calls.request("c")  # waits
    assert adm.rate_limits() == [{**limits, "remaining": 0, "reset_seconds": 2.5}]
    for response_id in ("a", "b", "c"):
        adm.finished(response_id)
    assert adm.rate_limits() == [limits]


async def test_a_runway_under_the_floor_saturates_until_audio_catches_up() -> None:
    clock = Clock()
    adm, metrics = admission(clock, max_speaking=4, runway_floor_s=0.5)
    calls = Calls(adm)
    calls.request("a")
    adm.audio("a", 1.0)
    assert not adm.saturated()
    clock.now += 0.7  # 0.3 s left to play: under the floor
    assert adm.saturated()
    calls.request("b")
    assert calls.started == ["a"] and adm.queued == 1
    adm.audio("a", 1.0)  # 1.3 s left again
    assert calls.started == ["a", "b"] and adm.queued == 0
    assert metric(metrics, "duplex_gateway_playback_runway_seconds_count") == 1
    assert metric(metrics, "duplex_gateway_playback_runway_seconds_sum") == pytest.approx(0.3)


async def test_stalls_are_counted_with_their_length() -> None:
    clock = Clock()
    adm, metrics = admission(clock)
    Calls(adm).request("a")
    adm.audio("a", 0.5)
    clock.now += 0.8
    adm.audio("a", 0.5)
    assert metric(metrics, "duplex_gateway_playback_stalls_total") == 1
    assert metric(metrics, "duplex_gateway_playback_stalled_seconds_total") == pytest.approx(0.3)


async def test_a_withdrawn_response_leaves_the_queue_and_never_starts() -> None:
    adm, _ = admission(max_speaking=1)
    calls = Calls(adm)
    calls.request("a")
    calls.request("b")
    calls.request("c")
    assert adm.withdraw("b") and not adm.withdraw("b")
    adm.finished("a")
    assert calls.started == ["a", "c"] and adm.queued == 0 and not calls.refused


async def test_a_response_that_waits_too_long_is_refused() -> None:
    adm, metrics = admission(max_speaking=1, max_wait_s=0.01)
    calls = Calls(adm)
    calls.request("a")
    calls.request("b")
    await asyncio.wait_for(calls.refusal.wait(), 5)
    assert list(calls.refused) == ["b"] and "waited" in calls.refused["b"]
    assert adm.queued == 0
    assert metric(metrics, "duplex_gateway_admissions_total", outcome="expired") == 1


async def test_no_queue_refuses_at_once() -> None:
    adm, _ = admission(max_speaking=1, max_queued=0)
    calls = Calls(adm)
    calls.request("a")
    calls.request("b")
    assert calls.started == ["a"] and list(calls.refused) == ["b"]


# -- a session through admission -------------------------------------------------------


async def test_a_session_queues_cancels_and_is_refused_through_admission() -> None:
    adm, _ = admission(max_speaking=1, max_queued=2, max_wait_s=0.01)
    first, second = ScriptedSession(), ScriptedSession()
    one, two = AdmittedSession(first, adm), AdmittedSession(second, adm)
    one.start("a", SPOKEN, conversation=True)
    two.start("b", SPOKEN, conversation=True)
    two.start("t", TEXT_ONLY, conversation=False)  # text is never held back
    assert list(first.turns) == ["a"] and list(second.turns) == ["t"] and adm.queued == 1

    two.cancel("b", reason="client_cancelled")  # waiting: out of the queue, done at once
    assert adm.queued == 0 and second.cancelled == []
    assert two.take_events() == [ResponseDone("b", "cancelled", reason="client_cancelled")]

    two.start("c", SPOKEN, conversation=True)
    assert await asyncio.wait_for(two.wait_events(), 5)  # woken by the refusal
    (refused,) = two.take_events()
    assert isinstance(refused, ResponseDone) and refused.status == "failed"
    assert refused.error_code == BUSY_CODE and "capacity" in (refused.error or "")

    first.put(ResponseDone("a", "completed"))
    one.take_events()
    assert adm.speaking == 0 and not adm.saturated()


async def test_closing_a_session_takes_its_responses_out() -> None:
    adm, _ = admission(max_speaking=1)
    first, second = ScriptedSession(), ScriptedSession()
    one, two = AdmittedSession(first, adm), AdmittedSession(second, adm)
    one.start("a", SPOKEN, conversation=True)
    two.start("b", SPOKEN, conversation=True)
    await two.close()
    assert adm.queued == 0
    two_after = AdmittedSession(ScriptedSession(), adm)
    two_after.start("c", SPOKEN, conversation=True)
    await one.close()  # its running response ends with it: the next one starts
    assert adm.speaking == 1 and adm.queued == 0


# -- through the server ----------------------------------------------------------------


def held_speaker(release: asyncio.Event) -> Reply:
    """Each response speaks 0.2 s at once, then is done only when the test says so."""

    async def reply(session: ScriptedSession, response_id: str, turn: TurnRequest) -> None:
        session.put(audio(response_id, 0.2))
        await release.wait()
        session.put(ResponseDone(response_id, "completed"))

    return reply


class HeldBackend(IdleBackend):
    def __init__(self) -> None:
        super().__init__()
        self.release = asyncio.Event()

    def open_session(self, session_id: str) -> ScriptedSession:
        return ScriptedSession(held_speaker(self.release))


async def events_until(ws: ClientConnection, kind: str) -> list[dict[str, Any]]:
    events: list[dict[str, Any]] = []
    async with asyncio.timeout(10):
        while not events or events[-1]["type"] != kind:
            events.append(json.loads(await ws.recv()))
    return events


async def ask(ws: ClientConnection) -> None:
    content = [{"type": "input_text", "text": "Hello."}]
    item = {"type": "message", "role": "user", "content": content}
    await ws.send(json.dumps({"type": "conversation.item.create", "item": item}))
    await ws.send(json.dumps({"type": "response.create"}))


def http_json(server: GatewayServer, path: str) -> Any:
    with urllib.request.urlopen(f"http://127.0.0.1:{server.port}{path}", timeout=5) as r:
        body = r.read()
    return json.loads(body) if path == "/healthz" else body.decode()


async def test_a_saturated_server_refuses_with_server_busy_and_serves_once_load_falls() -> None:
    backend = HeldBackend()
    capacity = {"max_speaking": 1, "max_queued": 0}
    server = GatewayServer(GatewayConfig(port=0, capacity=capacity), backend)
    await server.start()
    url = f"ws://127.0.0.1:{server.port}/v1/realtime?model=gpt-realtime"
    try:
        async with connect(url) as speaker, connect(url) as late:
            await events_until(speaker, "session.created")
            await events_until(late, "session.created")
            await ask(speaker)
            await events_until(speaker, "response.output_audio.delta")
            health = await asyncio.to_thread(http_json, server, "/healthz")
            assert health["saturated"] is True and health["speaking"] == 1
            assert health["capacity"]["max_speaking"] == 1 and health["status"] == "ok"

            await ask(late)
            events = await events_until(late, "response.done")
            (error,) = [e["error"] for e in events if e["type"] == "error"]
            assert error["code"] == BUSY_CODE and error["type"] == "server_error"
            done = events[-1]["response"]
            assert done["status"] == "failed"
            assert done["status_details"]["error"]["code"] == BUSY_CODE

            backend.release.set()  # the speaker finishes: load falls
            await events_until(speaker, "response.done")
            await ask(late)
            events = await events_until(late, "response.done")
            assert events[-1]["response"]["status"] == "completed"
            assert "response.output_audio.delta" in [e["type"] for e in events]
        health = await asyncio.to_thread(http_json, server, "/healthz")
        assert health["saturated"] is False and health["queued"] == 0
        text = await asyncio.to_thread(http_json, server, "/metrics")
        for name in (
            "duplex_gateway_playback_runway_seconds_bucket",
            "duplex_gateway_playback_stalls_total",
            "duplex_gateway_playback_stalled_seconds_total",
            'duplex_gateway_admissions_total{outcome="refused"} 1.0',
            "duplex_gateway_saturated 0.0",
        ):
            assert name in text
    finally:
        await server.shutdown()


async def test_a_queued_response_starts_when_the_running_one_finishes() -> None:
    backend = HeldBackend()
    capacity = {"max_speaking": 1, "max_queued": 1, "max_wait_s": 60}
    server = GatewayServer(GatewayConfig(port=0, capacity=capacity), backend)
    await server.start()
    url = f"ws://127.0.0.1:{server.port}/v1/realtime?model=gpt-realtime"
    try:
        async with connect(url) as speaker, connect(url) as waiter:
            await events_until(speaker, "session.created")
            await events_until(waiter, "session.created")
            await ask(speaker)
            await events_until(speaker, "response.output_audio.delta")
            await ask(waiter)
            await events_until(waiter, "response.created")
            await wait_until(lambda: server.admission.queued == 1, 10, "the response to wait")
            assert (await asyncio.to_thread(http_json, server, "/healthz"))["queued"] == 1
            backend.release.set()
            events = await events_until(waiter, "response.done")
            assert events[-1]["response"]["status"] == "completed"
            assert not [e for e in events if e["type"] == "error"]
    finally:
        await server.shutdown()


async def test_a_cancelled_or_disconnected_waiter_leaves_the_queue() -> None:
    backend = HeldBackend()
    capacity = {"max_speaking": 1, "max_queued": 2, "max_wait_s": 60}
    server = GatewayServer(GatewayConfig(port=0, capacity=capacity), backend)
    await server.start()
    url = f"ws://127.0.0.1:{server.port}/v1/realtime?model=gpt-realtime"
    try:
        async with connect(url) as speaker, connect(url) as waiter:
            await events_until(speaker, "session.created")
            await events_until(waiter, "session.created")
            await ask(speaker)
            await events_until(speaker, "response.output_audio.delta")
            await ask(waiter)
            await events_until(waiter, "response.created")
            await waiter.send(json.dumps({"type": "response.cancel"}))
            done = (await events_until(waiter, "response.done"))[-1]["response"]
            assert done["status"] == "cancelled" and server.admission.queued == 0

            await waiter.send(json.dumps({"type": "response.create"}))
            await events_until(waiter, "response.created")
            await wait_until(lambda: server.admission.queued == 1, 10, "the response to wait")
        await wait_until(lambda: server.admission.queued == 0, 10, "the waiter to leave")
        await wait_until(lambda: server.admission.speaking == 0, 10, "the speaker to leave")
    finally:
        await server.shutdown()
