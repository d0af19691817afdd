"""/metrics gauges an operator watches: engine requests pending per stage and the event
loop's lag. First over an in-process server (values set by the test), then over a real
`duplex-gateway` with its embedded models, started through the CLI.
"""

from __future__ import annotations

import asyncio
import base64
import json
import math
import time
import urllib.request
from collections.abc import Callable

import pytest
from prometheus_client.parser import text_string_to_metric_families
from websockets.asyncio.client import connect

from gateway.config import GatewayConfig
from gateway.server.server import GatewayServer
from tests.fake_backend import IdleBackend
from tests.helpers import running_gateway, wait_until

PENDING = "duplex_gateway_engine_pending_requests"
LAG = "duplex_gateway_event_loop_lag_seconds"
STAGES = {"asr", "llm", "tts", "turn", "vad"}
RATE = 24000

Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


class CountingBackend(IdleBackend):
    """A backend whose engine holds `counts` requests; no session is opened on it."""

    def __init__(self, counts: dict[str, int]) -> None:
        super().__init__()
        self.counts = counts

    def pending(self) -> dict[str, int]:
        return dict(self.counts)

    def llm_tokens(self) -> dict[str, int]:
        return {"prefill": 700, "decode": 40}

    def prepared_turns(self) -> dict[str, int]:
        return {"adopted": 3, "discarded": 1}

    def engine_caches(self) -> dict[str, tuple[int | None, int]]:
        return {"llm_prompt_cache": (2, 4096), "mlx_buffer_pool": (None, 512)}

    def open_session(self, session_id: str) -> None:
        raise AssertionError("this test opens no session")


def scrape(port: int) -> Samples:
    """Every sample of /metrics, keyed by (name, sorted labels)."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=30) as response:
        text = response.read().decode()
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def pending(samples: Samples) -> dict[str, float]:
    return {dict(labels)["stage"]: v for (name, labels), v in samples.items() if name == PENDING}


def lag(samples: Samples, suffix: str, le: str | None = None) -> float:
    labels = (("le", le),) if le is not None else ()
    return samples[(LAG + suffix, labels)]


async def test_pending_is_read_at_scrape_and_a_blocked_loop_shows_as_lag() -> None:
    backend = CountingBackend({"asr": 0, "llm": 2, "tts": 1, "vad": 3})
    server = GatewayServer(GatewayConfig(port=0), backend)
    await server.start()
    try:
        samples = await asyncio.to_thread(scrape, server.port)
        assert pending(samples) == {"asr": 0, "llm": 2, "tts": 1, "vad": 3}
        prepared = "duplex_gateway_prepared_responses_total"
        assert samples[(prepared, (("outcome", "adopted"),))] == 3
        assert samples[(prepared, (("outcome", "discarded"),))] == 1
        tokens = "duplex_gateway_llm_tokens_total"
        assert samples[(tokens, (("phase", "prefill"),))] == 700
        assert samples[(tokens, (("phase", "decode"),))] == 40
        caches = "duplex_gateway_engine_cache_"
        assert samples[(caches + "bytes", (("cache", "llm_prompt_cache"),))] == 4096
        assert samples[(caches + "entries", (("cache", "llm_prompt_cache"),))] == 2
        assert samples[(caches + "bytes", (("cache", "mlx_buffer_pool"),))] == 512
        assert (caches + "entries", (("cache", "mlx_buffer_pool"),)) not in samples
        backend.counts.update(llm=0, vad=4)
        samples = await asyncio.to_thread(scrape, server.port)
        assert pending(samples) == {"asr": 0, "llm": 0, "tts": 1, "vad": 4}

        await wait_until(lambda: lag_count(server) >= 2, 10, "two samples of the idle loop")
        before = lag_count(server)
        # Blocks the loop on purpose: the probe's timer falls due within 0.1 s of the
        # block and runs after it, so the probe's next sample is at least 0.2 s.
        time.sleep(0.3)
        await wait_until(lambda: lag_count(server) > before, 10, "the sample after the block")
        samples = await asyncio.to_thread(scrape, server.port)
        count = lag(samples, "_count")
        assert count >= 3
        assert lag(samples, "_bucket", "+Inf") == count
        assert lag(samples, "_bucket", "0.1") <= count - 1
        assert lag(samples, "_sum") >= 0.2
    finally:
        await server.shutdown()
    assert backend.closed
    assert not [t for t in asyncio.all_tasks() if t.get_name() == "loop-lag"]


def lag_count(server: GatewayServer) -> float:
    """How many lag samples the server's probe has taken, read in process."""
    families = text_string_to_metric_families(server.metrics.render().decode())
    return next(s.value for f in families for s in f.samples if s.name == LAG + "_count")


def speech_free_audio(ms: int) -> str:
    pcm = bytes(RATE * 2 * ms // 1000)
    return json.dumps(
        {"type": "input_audio_buffer.append", "audio": base64.b64encode(pcm).decode()}
    )


@pytest.mark.models
async def test_real_gateway_exports_engine_pending_and_loop_lag() -> None:
    with running_gateway() as gw:
        idle = await asyncio.to_thread(scrape, gw.port)
        assert pending(idle) == dict.fromkeys(STAGES, 0.0)
        url = f"ws://127.0.0.1:{gw.port}/v1/realtime?model=duplex-smollm2"
        async with connect(url) as ws:
            assert json.loads(await ws.recv())["type"] == "session.created"
            await ws.send(speech_free_audio(500))
            # Server VAD (the session default) keeps one streaming request on `vad`.
            streaming = await until_pending(gw.port, lambda p: p["vad"] == 1)
            assert set(streaming) == STAGES
            assert all(v >= 0 for v in streaming.values())
        await until_pending(gw.port, lambda p: p["vad"] == 0)
        # The probe observes every 0.1 s: wait for its next sample (the session above may
        # have come and gone within one interval).
        before = lag(idle, "_count")
        samples: Samples = {}

        async def sampled() -> bool:
            samples.update(await asyncio.to_thread(scrape, gw.port))
            return lag(samples, "_count") > before

        await wait_until(sampled, 60, "a lag sample of the busy loop", interval=0.05)
        count = lag(samples, "_count")
        assert lag(samples, "_bucket", "+Inf") == count
        assert math.isfinite(lag(samples, "_sum")) and lag(samples, "_sum") >= 0


async def until_pending(
    port: int, ready: Callable[[dict[str, float]], bool], timeout: float = 60
) -> dict[str, float]:
    """Scrape until `ready(pending)` holds; the last pending counts."""
    counts: dict[str, float] = {}

    async def holds() -> bool:
        counts.update(pending(await asyncio.to_thread(scrape, port)))
        return ready(counts)

    await wait_until(holds, timeout, lambda: f"pending requests; last: {counts}", interval=0.2)
    return counts
