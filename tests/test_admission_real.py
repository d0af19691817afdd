"""Admission control for real: `duplex-gateway` started through its CLI with the
embedded models and room for one spoken response (`--max-speaking 1`, no queue), two
official `openai` SDK sessions. While the first answers aloud the second's response is
refused with `server_busy`; once the first is done the second is served. /healthz and
/metrics report the capacity, the runway and the stalls."""

from __future__ import annotations

import asyncio
import json
import urllib.request
from collections.abc import Iterator
from typing import Any

import pytest
import yaml
from openai import AsyncOpenAI

from tests.helpers import ROOT, running_gateway

pytestmark = pytest.mark.models

MODEL = "duplex-smollm2"


@pytest.fixture(scope="module")
def gateway(tmp_path_factory: pytest.TempPathFactory) -> Iterator[int]:
    profile = yaml.safe_load((ROOT / "configs" / "default.yaml").read_text())
    profile["gateway"]["capacity"] = {"max_queued": 0}
    path = tmp_path_factory.mktemp("profile") / "one-speaker.yaml"
    path.write_text(yaml.safe_dump(profile))
    with running_gateway("--config", str(path), "--max-speaking", "1") as gw:
        yield gw.port


def get(port: int, path: str) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=30) as response:
        body: bytes = response.read()
    return body.decode()


async def until(conn: Any, kind: str, timeout: float = 120) -> list[Any]:
    events = []
    async with asyncio.timeout(timeout):
        while not events or events[-1].type != kind:
            events.append(await conn.recv())
    return events


async def ask(conn: Any, question: str) -> None:
    content = [{"type": "input_text", "text": question}]
    item = {"type": "message", "role": "user", "content": content}
    await conn.conversation.item.create(item=item)
    await conn.response.create()


async def test_one_speaker_at_a_time_then_the_refused_session_is_served(gateway: int) -> None:
    client = AsyncOpenAI(api_key="sk-local", websocket_base_url=f"ws://127.0.0.1:{gateway}/v1")
    quiet = {"type": "realtime", "audio": {"input": {"turn_detection": None}}}
    async with (
        client.realtime.connect(model=MODEL) as first,
        client.realtime.connect(model=MODEL) as second,
    ):
        for conn in (first, second):
            await conn.session.update(session=quiet)
            await until(conn, "session.updated")

        await ask(first, "Tell me a long story about a lighthouse keeper.")
        await until(first, "response.created")  # admitted: the one speaker
        await ask(second, "What is the capital of France?")
        refused = await until(second, "response.done")
        errors = [e.error for e in refused if e.type == "error"]
        assert [e.code for e in errors] == ["server_busy"], errors
        assert errors[0].type == "server_error" and "capacity" in errors[0].message
        assert refused[-1].response.status == "failed"

        answered = await until(first, "response.done")
        assert answered[-1].response.status in ("completed", "incomplete")
        assert any(e.type == "response.output_audio.delta" for e in answered)

        await second.response.create()  # load fell: served now
        served = await until(second, "response.done")
        assert served[-1].response.status in ("completed", "incomplete")
        assert any(e.type == "response.output_audio.delta" for e in served)

    health = json.loads(await asyncio.to_thread(get, gateway, "/healthz"))
    assert health["saturated"] is False and health["speaking"] == 0 and health["queued"] == 0
    assert health["capacity"]["max_speaking"] == 1 and health["capacity"]["max_queued"] == 0
    metrics = await asyncio.to_thread(get, gateway, "/metrics")
    assert 'duplex_gateway_admissions_total{outcome="refused"} 1.0' in metrics
    assert 'duplex_gateway_admissions_total{outcome="started"} 2.0' in metrics
    runway_count = next(
        line
        for line in metrics.splitlines()
        if line.startswith("duplex_gateway_playback_runway_seconds_count")
    )
    assert float(runway_count.split()[-1]) > 0  # both answers spoke in more than one piece
    assert "duplex_gateway_playback_stalls_total" in metrics
