"""Drop-in model names: the OpenAI realtime names are served by the default profile,
`session.model` reports the name asked for, unknown names are still refused, /healthz
lists the names, and /healthz requests are logged at DEBUG.

The real check is the official `openai` SDK asking for `gpt-realtime` (GA) and a dated
preview name (beta) against `duplex-gateway` started through its CLI.
"""

from __future__ import annotations

import asyncio
import base64
import json
import logging
import re
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from openai import AsyncOpenAI
from pydantic import ValidationError

from gateway.config import GatewayConfig
from gateway.server.server import GatewayServer
from gateway.session.realtime import RealtimeSession
from tests.fake_backend import IdleBackend
from tests.helpers import RATE, GatewayProcess, pcm16, read_audio, running_gateway

RECORDING = Path("/usr/share/sounds/alsa/Front_Center.wav")


# -- which names are served ----------------------------------------------------------


@pytest.mark.parametrize(
    "name",
    [
        "duplex-smollm2",
        "gpt-realtime",
        "gpt-realtime-mini",
        "gpt-realtime-2025-08-28",
        "gpt-4o-realtime-preview",
        "gpt-4o-realtime-preview-2024-12-17",
        "gpt-4o-mini-realtime-preview-2024-12-17",
    ],
)
def test_the_openai_realtime_names_are_served_by_default(name: str) -> None:
    assert GatewayConfig().serves(name)


@pytest.mark.parametrize("name", ["gpt-4o", "gpt-4o-mini", "whisper-1", "duplex", "realtime"])
def test_other_names_are_not(name: str) -> None:
    assert not GatewayConfig().serves(name)


def test_aliases_come_from_the_profile_exact_or_by_prefix() -> None:
    config = GatewayConfig(model_aliases=("my-voice", "team-*"))
    assert config.serves("my-voice") and config.serves("team-a") and config.serves("team-")
    assert not config.serves("my-voice-2") and not config.serves("gpt-realtime")
    assert GatewayConfig(model_aliases=()).served_models == ("duplex-smollm2",)


@pytest.mark.parametrize("alias", ["*", "a*b", "a**", ""])
def test_a_star_only_ends_a_prefix(alias: str) -> None:
    with pytest.raises(ValidationError):
        GatewayConfig(model_aliases=(alias,))


def session_events(session: RealtimeSession) -> list[dict[str, Any]]:
    return session.events_to_send()


def test_session_update_may_switch_to_another_served_name() -> None:
    session = RealtimeSession(config=GatewayConfig(), model="gpt-realtime", beta=False)
    assert session_events(session)[0]["session"]["model"] == "gpt-realtime"
    update = {
        "type": "session.update",
        "session": {"type": "realtime", "model": "gpt-realtime-mini"},
    }
    session.receive_text(json.dumps(update))
    (updated,) = session_events(session)
    assert updated["type"] == "session.updated"
    assert updated["session"]["model"] == "gpt-realtime-mini"


def test_session_update_to_an_unknown_name_is_an_error_and_the_session_goes_on() -> None:
    session = RealtimeSession(config=GatewayConfig(), model="gpt-realtime", beta=True)
    session_events(session)
    session.receive_text(json.dumps({"type": "session.update", "session": {"model": "gpt-4o"}}))
    (error,) = session_events(session)
    assert error["type"] == "error" and error["error"]["param"] == "session.model"
    assert "'gpt-4o' is not served here" in error["error"]["message"]
    session.receive_text(json.dumps({"type": "session.update", "session": {"voice": "joe"}}))
    (updated,) = session_events(session)
    assert updated["type"] == "session.updated" and updated["session"]["model"] == "gpt-realtime"


# -- /healthz lists the names and is logged at DEBUG -----------------------------------


def http_json(port: int, path: str) -> tuple[int, dict[str, Any]]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=10) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


async def test_healthz_lists_the_names_and_logs_at_debug(caplog: pytest.LogCaptureFixture) -> None:
    server = GatewayServer(GatewayConfig(port=0, instance="gw-a"), IdleBackend())  # type: ignore[arg-type]
    await server.start()
    try:
        with caplog.at_level(logging.INFO, logger="websockets.server"):
            status, health = await asyncio.to_thread(http_json, server.port, "/healthz")
            assert status == 200 and health["instance"] == "gw-a"
            assert health["models"][:2] == ["duplex-smollm2", "gpt-realtime*"]
            # Other plain GETs are still logged at INFO, so the filter is in place.
            await asyncio.to_thread(http_json, server.port, "/nowhere")
        answered = [r for r in caplog.records if "connection rejected" in r.getMessage()]
        assert [r.getMessage() for r in answered] == ["connection rejected (404 Not Found)"]
        caplog.clear()
        with caplog.at_level(logging.DEBUG, logger="websockets.server"):
            await asyncio.to_thread(http_json, server.port, "/healthz")
        health_lines = [r for r in caplog.records if "(200 OK)" in r.getMessage()]
        assert [r.levelno for r in health_lines] == [logging.DEBUG]
    finally:
        await server.shutdown()


# -- the official SDK with OpenAI's names, against the CLI gateway ---------------------


@pytest.fixture(scope="module")
def gateway() -> Iterator[GatewayProcess]:
    with running_gateway() as gw:
        yield gw
    assert gw.proc.returncode == 0, "".join(gw.lines[-30:])


def client(gw: GatewayProcess) -> AsyncOpenAI:
    return AsyncOpenAI(api_key="sk-local", websocket_base_url=f"ws://127.0.0.1:{gw.port}/v1")


def recording_pcm() -> bytes:
    return pcm16(read_audio(RECORDING, RATE))


async def until(conn: Any, *kinds: str, timeout: float = 180) -> list[Any]:
    events = []
    async with asyncio.timeout(timeout):
        while True:
            events.append(await conn.recv())
            if events[-1].type in kinds:
                return events


@pytest.mark.models
async def test_sdk_voice_turn_with_gpt_realtime(gateway: GatewayProcess) -> None:
    async with client(gateway).realtime.connect(model="gpt-realtime") as conn:
        created = await conn.recv()
        assert created.type == "session.created" and created.session.model == "gpt-realtime"
        await conn.session.update(
            session={
                "type": "realtime",
                "audio": {
                    "input": {
                        "transcription": {"model": "whisper-1"},
                        "turn_detection": {"type": "server_vad", "silence_duration_ms": 400},
                    }
                },
            }
        )
        updated = (await until(conn, "session.updated"))[-1]
        assert updated.session.model == "gpt-realtime"
        pcm = bytes(RATE * 2 * 300 // 1000) + recording_pcm() + bytes(RATE * 2)
        step = RATE * 2 // 10
        for i in range(0, len(pcm), step):
            await conn.input_audio_buffer.append(audio=base64.b64encode(pcm[i : i + step]).decode())
        events = await until(conn, "response.done")
        heard = next(
            e for e in events if e.type == "conversation.item.input_audio_transcription.completed"
        )
        assert {"front", "center"} <= set(re.findall(r"[a-z]+", heard.transcript.lower()))
        assert any(e.type == "response.output_audio.delta" for e in events)
        assert events[-1].response.status == "completed"


@pytest.mark.models
async def test_sdk_beta_with_a_dated_preview_name(gateway: GatewayProcess) -> None:
    name = "gpt-4o-realtime-preview-2024-12-17"
    async with client(gateway).beta.realtime.connect(model=name) as conn:
        created = await conn.recv()
        assert created.session.model == name
        await conn.session.update(
            session={
                "model": "gpt-4o-mini-realtime-preview",
                "modalities": ["text"],
                "turn_detection": None,
            }
        )
        updated = (await until(conn, "session.updated"))[-1]
        assert updated.session.model == "gpt-4o-mini-realtime-preview"
        await conn.conversation.item.create(
            item={
                "type": "message",
                "role": "user",
                "content": [{"type": "input_text", "text": "Say hello."}],
            }
        )
        await conn.response.create()
        events = await until(conn, "response.done")
        assert events[-1].response.status == "completed"
        assert "".join(e.delta for e in events if e.type == "response.text.delta").strip()


@pytest.mark.models
async def test_sdk_unknown_name_is_refused_clearly(gateway: GatewayProcess) -> None:
    async with client(gateway).realtime.connect(model="gpt-4o") as conn:
        error = await conn.recv()
        assert error.type == "error" and error.error.code == "invalid_model"
        assert "'gpt-4o' is not served here" in error.error.message
    status, health = await asyncio.to_thread(http_json, gateway.port, "/healthz")
    assert status == 200 and "gpt-realtime*" in health["models"]
