"""WebRTC calls over a scripted engine (fast, no models): a real aiortc client posts its
offer, talks on `oai-events` and plays the gateway's Opus track; the real server."""

from __future__ import annotations

import asyncio
import json

import httpx
import numpy as np
import pytest
from websockets.asyncio.client import connect as ws_connect

from gateway.server.server import GatewayServer
from tests.helpers import wait_until
from tests.test_gateway_server import FakeBackend, start_server
from tests.webrtc_client import Call, connect, mint, post_sdp, post_unified

KEY = "sk-test-key"


def base(server: GatewayServer) -> str:
    return f"http://127.0.0.1:{server.port}"


def tone(ms: int, amp: float = 0.3) -> np.ndarray:
    t = np.arange(48 * ms) / 48000
    return (amp * np.sin(2 * np.pi * 200 * t)).astype(np.float32)


async def test_a_client_secret_needs_the_real_key_and_carries_its_session() -> None:
    server = await start_server(api_key=KEY)
    try:
        refused = await mint(base(server), None, {})
        assert refused.status_code == 401
        assert refused.json()["error"]["code"] == "invalid_api_key"
        session = {"type": "realtime", "instructions": "Be brief.", "output_modalities": ["text"]}
        minted = await mint(
            base(server),
            KEY,
            {"expires_after": {"anchor": "created_at", "seconds": 60}, "session": session},
        )
        assert minted.status_code == 200, minted.text
        body = minted.json()
        assert body["value"].startswith("ek_")
        assert body["session"]["instructions"] == "Be brief."
        assert body["session"]["output_modalities"] == ["text"]
        bad = await mint(base(server), KEY, {"session": {"voice": 7}})
        assert bad.status_code == 400 and bad.json()["error"]["type"] == "invalid_request_error"
        too_long = await mint(base(server), KEY, {"expires_after": {"seconds": 99999}})
        assert too_long.status_code == 400
        assert too_long.json()["error"]["param"] == "expires_after.seconds"
        # An ephemeral key is no key for anything but /calls.
        ws_refused = await asyncio.to_thread(_status_with_key, server, body["value"])
        assert ws_refused == 401
    finally:
        await server.shutdown()


def _status_with_key(server: GatewayServer, key: str) -> int:
    import urllib.error
    import urllib.request

    request = urllib.request.Request(
        f"{base(server)}/metrics", headers={"Authorization": f"Bearer {key}"}
    )
    try:
        with urllib.request.urlopen(request, timeout=5) as answer:
            return int(answer.status)
    except urllib.error.HTTPError as exc:
        return exc.code


async def test_an_ephemeral_call_answers_text_with_the_secret_session() -> None:
    server = await start_server(api_key=KEY)
    call: Call | None = None
    try:
        secret = (
            await mint(
                base(server),
                KEY,
                {"session": {"type": "realtime", "instructions": "From the secret."}},
            )
        ).json()["value"]
        assert (await post_sdp(base(server), "ek_unknown", "v=0")).status_code == 401
        call = await connect(base(server), secret)
        assert call.location is not None and call.location.startswith("/v1/realtime/calls/rtc_")
        created = await call.until("session.created")
        assert created["session"]["instructions"] == "From the secret."
        assert len(server.connections) == 1 and len(server.calls) == 1
        call.send({"type": "response.create", "response": {"output_modalities": ["text"]}})
        done = await call.until("response.done")
        assert done["response"]["status"] == "completed"
        assert "response.output_text.delta" in call.types()
    finally:
        if call is not None:
            await call.close()
        await server.shutdown()


async def test_a_spoken_turn_plays_on_the_track_between_started_and_stopped() -> None:
    server = await start_server(backend=FakeBackend(chunk_ms=100))
    call: Call | None = None
    try:
        call = await connect(base(server), None)
        await call.until("session.created")
        call.mic.say(np.concatenate([tone(600), np.zeros(48 * 800, np.float32)]))
        await call.until("input_audio_buffer.speech_started")
        await call.until("input_audio_buffer.speech_stopped")
        # `stopped` comes once the response is done and played out; `started` and
        # `response.done` come before it, in either order (answers outrun playback).
        stopped = await call.until("output_audio_buffer.stopped")
        started = await call.first("output_audio_buffer.started")
        done = await call.first("response.done")
        assert started["response_id"] == done["response"]["id"] == stopped["response_id"]
        assert call.types().index("output_audio_buffer.started") < call.types().index(
            "output_audio_buffer.stopped"
        )
        # Audio goes on the track, never in events.
        assert "response.output_audio.delta" not in call.types()
        assert "response.output_audio_transcript.delta" in call.types()
        await asyncio.wait_for(call.speaker.loud.wait(), 5)
    finally:
        if call is not None:
            await call.close()
        await server.shutdown()


async def test_barge_in_and_clear_cut_the_track_and_truncate_what_was_played() -> None:
    # Ten words of a second each: far longer than the test speaks over it.
    words = [f"w{i}" for i in range(10)]
    server = await start_server(backend=FakeBackend(words=words, chunk_ms=1000))
    call: Call | None = None
    try:
        call = await connect(base(server), None)
        await call.until("session.created")
        # Speech interrupts, but answers only come when asked for.
        detection = {"type": "server_vad", "create_response": False, "interrupt_response": True}
        update = {"type": "realtime", "audio": {"input": {"turn_detection": detection}}}
        call.send({"type": "session.update", "session": update})
        await call.until("session.updated")
        call.send({"type": "response.create"})
        started = await call.until("output_audio_buffer.started")
        await call.first("response.done")
        call.mic.say(tone(600))  # barge-in while the answer plays
        await call.until("input_audio_buffer.speech_started")
        truncated = await call.until("conversation.item.truncated")
        cleared = await call.until("output_audio_buffer.cleared")
        assert cleared["response_id"] == started["response_id"]
        assert 0 <= truncated["audio_end_ms"] < 10_000
        assert "output_audio_buffer.stopped" not in call.types()
        # The client's own clear, over a second answer.
        await call.until("input_audio_buffer.speech_stopped")
        call.send({"type": "response.create"})
        second = await call.until("output_audio_buffer.started")
        call.send({"type": "output_audio_buffer.clear"})
        cleared = await call.until("output_audio_buffer.cleared")
        assert cleared["response_id"] == second["response_id"]
        assert "error" not in call.types()
    finally:
        if call is not None:
            await call.close()
        await server.shutdown()


async def test_the_unified_form_and_hangup_with_the_real_key() -> None:
    server = await start_server(api_key=KEY)
    call = Call()
    try:
        offer = await call.offer()
        secret = (await mint(base(server), KEY, {})).json()["value"]
        refused = await post_unified(base(server), secret, offer, None)
        assert refused.status_code == 401
        answer = await post_unified(
            base(server), KEY, offer, {"type": "realtime", "instructions": "Unified."}
        )
        assert answer.status_code == 201, answer.text
        await call.answer(answer.text)
        created = await call.until("session.created")
        assert created["session"]["instructions"] == "Unified."
        location = answer.headers["location"]
        call_id = location.rsplit("/", 1)[1]
        headers = {"Authorization": f"Bearer {KEY}"}
        sideband_url = f"ws://127.0.0.1:{server.port}/v1/realtime?call_id={call_id}"
        async with ws_connect(sideband_url, additional_headers=headers) as sideband:
            async with httpx.AsyncClient() as client:
                hangup = f"{base(server)}{location}/hangup"
                assert (await client.post(hangup)).status_code == 401
                ok = await client.post(hangup, headers=headers)
                assert ok.status_code == 200
            # The sideband ends with the call.
            await asyncio.wait_for(sideband.wait_closed(), 10)
            assert sideband.close_code == 1000
        await wait_until(lambda: not server.connections, 10, "the call ended")
        assert not server.calls
    finally:
        await call.close()
        await server.shutdown()


async def test_a_sideband_websocket_joins_the_call_session() -> None:
    server = await start_server(api_key=KEY)
    call: Call | None = None
    try:
        call = await connect(base(server), KEY)
        await call.until("session.created")
        assert call.location is not None
        call_id = call.location.rsplit("/", 1)[1]
        headers = {"Authorization": f"Bearer {KEY}"}
        url = f"ws://127.0.0.1:{server.port}/v1/realtime?call_id={call_id}"
        async with ws_connect(url, additional_headers=headers) as sideband:
            sideband_update = {
                "type": "session.update",
                "session": {"type": "realtime", "instructions": "Side."},
            }
            await sideband.send(json.dumps(sideband_update))
            updated = await call.until("session.updated")
            assert updated["session"]["instructions"] == "Side."
            async with asyncio.timeout(5):
                while json.loads(await sideband.recv())["type"] != "session.updated":
                    pass
            assert len(server.connections) == 1  # the sideband is no session of its own
        with pytest.raises(Exception, match="404"):
            async with ws_connect(
                f"ws://127.0.0.1:{server.port}/v1/realtime?call_id=rtc_none",
                additional_headers=headers,
            ):
                pass
    finally:
        if call is not None:
            await call.close()
        await server.shutdown()


async def test_calls_count_as_sessions_for_room_health_and_drain() -> None:
    server = await start_server(max_sessions=1, idle_session_s=None)
    call: Call | None = None
    other = Call()
    try:
        call = await connect(base(server), None)
        await call.until("session.created")
        health = (await asyncio.to_thread(httpx.get, f"{base(server)}/healthz")).json()
        assert health["sessions"] == 1
        full = await post_sdp(base(server), None, await other.offer())
        assert full.status_code == 503 and full.json()["error"]["code"] == "too_many_sessions"
        closed = asyncio.Event()
        call.channel.on("close", closed.set)
        await server.drain(5.0)  # idle: closed at once
        await asyncio.wait_for(closed.wait(), 10)
        assert not server.connections and not server.calls
        draining = await post_sdp(base(server), None, await other.offer())
        assert draining.status_code == 503
        assert draining.json()["error"]["code"] == "server_draining"
    finally:
        await other.close()
        if call is not None:
            await call.close()
        await server.shutdown()
