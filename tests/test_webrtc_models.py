"""WebRTC calls to `duplex-gateway` started through its CLI with the real embedded models:
an aiortc client mints a client secret, posts its offer, speaks a real recording over
Opus and hears the spoken answer; a sideband WebSocket serves the same call."""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import yaml
from websockets.asyncio.client import connect as ws_connect

from tests.helpers import ROOT, read_audio, running_gateway
from tests.webrtc_client import Call, connect, mint

pytestmark = pytest.mark.models

RECORDING = Path("/usr/share/sounds/alsa/Front_Center.wav")
KEY = "sk-webrtc-test"


@pytest.fixture(scope="module")
def gateway(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """The gateway with greedy decoding and a key; yields its http base URL."""
    profile = yaml.safe_load((ROOT / "configs" / "default.yaml").read_text())
    profile["stages"]["llm"]["sampling"]["temperature"] = 0.0
    path = tmp_path_factory.mktemp("profile") / "greedy.yaml"
    path.write_text(yaml.safe_dump(profile))
    with running_gateway("--config", str(path), "--api-key", KEY) as gw:
        yield f"http://127.0.0.1:{gw.port}"
    assert gw.proc.returncode == 0, "SIGTERM must shut down cleanly:\n" + "".join(gw.lines[-30:])


def words(text: str) -> list[str]:
    return re.findall(r"[a-z']+", text.lower())


async def ephemeral_call(base: str, session: dict[str, object]) -> Call:
    minted = await mint(base, KEY, {"session": {"type": "realtime", **session}})
    assert minted.status_code == 200, minted.text
    return await connect(base, minted.json()["value"])


async def test_a_text_turn_over_the_data_channel(gateway: str) -> None:
    call = await ephemeral_call(gateway, {"output_modalities": ["text"]})
    try:
        await call.until("session.created")
        call.send(
            {
                "type": "conversation.item.create",
                "item": {
                    "type": "message",
                    "role": "user",
                    "content": [{"type": "input_text", "text": "What is the capital of France?"}],
                },
            }
        )
        call.send({"type": "response.create"})
        done = await call.until("response.done", timeout=120)
        assert done["response"]["status"] == "completed"
        text = "".join(e["delta"] for e in call.seen if e["type"] == "response.output_text.delta")
        assert "paris" in words(text), text
    finally:
        await call.close()


async def test_a_voice_turn_over_opus(gateway: str) -> None:
    session = {
        "output_modalities": ["audio"],
        "audio": {
            "input": {
                "transcription": {"model": "whisper-1"},
                "turn_detection": {"type": "server_vad", "silence_duration_ms": 400},
            }
        },
    }
    call = await ephemeral_call(gateway, session)
    try:
        await call.until("session.created")
        speech = read_audio(RECORDING, 48000)
        call.mic.say(np.concatenate([np.zeros(48 * 300, np.float32), speech]))
        user = await call.until("conversation.item.input_audio_transcription.completed", 120)
        assert {"front", "center"} <= set(words(user["transcript"])), user["transcript"]
        started = await call.until("output_audio_buffer.started", 120)
        await asyncio.wait_for(call.speaker.loud.wait(), 30)
        stopped = await call.until("output_audio_buffer.stopped", 120)
        done = await call.first("response.done")
        assert done["response"]["status"] == "completed"
        assert started["response_id"] == done["response"]["id"] == stopped["response_id"]
        assert "response.output_audio.delta" not in call.types()
        heard = call.speaker.heard()
        assert (np.abs(heard) > 0.05).sum() > 48000 * 0.3  # at least 0.3 s of voice
    finally:
        await call.close()


async def test_a_sideband_serves_the_call(gateway: str) -> None:
    call = await ephemeral_call(gateway, {"output_modalities": ["text"]})
    try:
        await call.until("session.created")
        assert call.location is not None
        call_id = call.location.rsplit("/", 1)[1]
        url = gateway.replace("http", "ws") + f"/v1/realtime?call_id={call_id}"
        headers = {"Authorization": f"Bearer {KEY}"}
        async with ws_connect(url, additional_headers=headers) as sideband:
            await sideband.send(
                json.dumps(
                    {
                        "type": "response.create",
                        "response": {
                            "instructions": "Answer in one word.",
                            "input": [
                                {
                                    "type": "message",
                                    "role": "user",
                                    "content": [
                                        {"type": "input_text", "text": "Say the word yes."}
                                    ],
                                }
                            ],
                        },
                    }
                )
            )
            seen: list[str] = []
            async with asyncio.timeout(120):
                while (event := json.loads(await sideband.recv()))["type"] != "response.done":
                    seen.append(event["type"])
            assert "response.output_text.delta" in seen
        done = await call.until("response.done", 30)  # the browser side saw it too
        assert done["response"]["status"] == "completed"
    finally:
        await call.close()
