"""A session that ends leaves nothing behind in the engine, on the real models: its
cached LLM context, its live KV and its listener's audio go when it is closed, when its
client vanishes without a close, and when a drain closes it."""

from __future__ import annotations

import asyncio
import base64
import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import pytest_asyncio
from websockets.asyncio.client import ClientConnection, connect

from duplex.manager import DuplexSessionManager
from gateway.config import GatewayConfig
from gateway.server.server import GatewayServer
from gateway.session.engine_backend import EngineBackend
from tests.helpers import wait_until

pytestmark = pytest.mark.models

ROOT = Path(__file__).resolve().parent.parent
# 200 ms of silence as the client sends it (pcm16, 24 kHz).
SILENCE = base64.b64encode(bytes(24000 * 2 // 5)).decode()


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def gateway() -> AsyncIterator[tuple[GatewayServer, Any]]:
    from engine.build import build_engine
    from engine.config import load_config

    bundle = await build_engine(load_config(ROOT / "configs" / "default.yaml"), progress=False)
    manager = DuplexSessionManager(bundle.orchestrator, max_sessions=8)
    backend = EngineBackend(
        manager, bundle.engine, on_close=bundle.aclose, caches=bundle.cache_stats
    )
    server = GatewayServer(GatewayConfig(port=0, max_sessions=8), backend)
    await server.start()
    try:
        yield server, bundle
    finally:
        await server.shutdown()


async def answered_session(server: GatewayServer) -> ClientConnection:
    """A session with one answered turn and some audio heard."""
    ws = await connect(f"ws://127.0.0.1:{server.port}/v1/realtime", max_size=None)
    session = {
        "type": "realtime",
        "output_modalities": ["text"],
        "max_output_tokens": 8,
        # Transcribed input: the engine keeps a listener with the session's recent audio.
        "audio": {"input": {"transcription": {"model": "whisper-1"}}},
    }
    await ws.send(json.dumps({"type": "session.update", "session": session}))
    for _ in range(3):
        await ws.send(json.dumps({"type": "input_audio_buffer.append", "audio": SILENCE}))
    content = [{"type": "input_text", "text": "Name a colour."}]
    item = {"type": "message", "role": "user", "content": content}
    await ws.send(json.dumps({"type": "conversation.item.create", "item": item}))
    await ws.send(json.dumps({"type": "response.create"}))
    async with asyncio.timeout(300):
        while (event := json.loads(await ws.recv()))["type"] != "response.done":
            pass
    # The system prompt's prefix was cached, and the usage says so.
    assert event["response"]["usage"]["input_token_details"]["cached_tokens"] > 0
    return ws


def caches(bundle: Any) -> dict[str, tuple[int | None, int]]:
    return {k: v for k, v in bundle.cache_stats().items() if k != "mlx_buffer_pool"}


def prompt_cache_entries(bundle: Any) -> int:
    return bundle.cache_stats()["llm_prompt_cache"][0]


@pytest.mark.asyncio(loop_scope="module")
async def test_close_drop_and_drain_leave_nothing_in_any_engine_cache(
    gateway: tuple[GatewayServer, Any],
) -> None:
    server, bundle = gateway
    empty = caches(bundle)  # the shared system-prompt prefix only
    assert empty["llm_prompt_cache"][0] == 1 and empty["listener_audio"] == (0, 0)
    closed, dropped, drained = [await answered_session(server) for _ in range(3)]
    assert prompt_cache_entries(bundle) == 4
    listeners, heard = caches(bundle)["listener_audio"]
    assert listeners == 3 and heard is not None and heard > 0

    await closed.close()
    await wait_until(lambda: prompt_cache_entries(bundle) == 3, 60, "the closed session freed")
    dropped.transport.abort()  # no close frame: the client's network went away
    await wait_until(lambda: prompt_cache_entries(bundle) == 2, 60, "the dropped session freed")
    await server.drain(60)
    await wait_until(lambda: caches(bundle) == empty, 60, "the drained session freed")
    assert bundle.orchestrator.session_count() == 0
    # With the last session gone, MLX's cache of freed buffers goes back to the system.
    pool = lambda: bundle.cache_stats()["mlx_buffer_pool"][1]  # noqa: E731
    await wait_until(lambda: pool() == 0, 60, "MLX's buffer cache emptied")
    # The last session's aborts reach the engine thread at its next iteration.
    await wait_until(
        lambda: not any(bundle.engine.pending().values()),
        60,
        lambda: f"every engine request ended; pending: {bundle.engine.pending()}",
    )
    await drained.close()
