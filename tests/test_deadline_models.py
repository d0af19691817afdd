"""A long answer in one session does not hold up a short one in another, on the real
embedded models through the duplex stage port (the TTS stage's deadline order, the LLM
stage's pacing)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import pytest_asyncio

from engine.build import EngineBundle, build_engine
from engine.config import load_config
from engine.stages.tts import AHEAD_S
from tests.test_pipeline_e2e import Client

pytestmark = [pytest.mark.models, pytest.mark.asyncio(loop_scope="module")]

ROOT = Path(__file__).resolve().parent.parent


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def bundle() -> AsyncIterator[EngineBundle]:
    engine = await build_engine(load_config(ROOT / "configs" / "default.yaml"), progress=False)
    yield engine
    await engine.aclose()


async def test_a_short_answer_finishes_before_a_long_one_started_earlier(
    bundle: EngineBundle,
) -> None:
    client = Client(bundle)

    def audio_s(rid: str) -> float:
        return sum(o.metadata["duration_ms"] for o in client.of(rid, "audio")) / 1000

    story = "Tell me a long story about a dragon, a knight and a village, with many details."
    _, long_tts = await client.turn("long", 0, text=story, max_output_tokens=160)
    # The long answer gets well ahead of its listener before the short one is asked.
    await client.until(lambda: audio_s(long_tts) >= AHEAD_S + 20)
    asked = len(client.outputs)
    short_llm, short_tts = await client.turn("short", 0, text="Say hello.", max_output_tokens=12)
    await client.until(lambda: client.finished(short_tts) and client.finished(long_tts))

    # The long answer really is long: most of it was still to be spoken.
    assert audio_s(long_tts) > 3 * audio_s(short_tts) > 0
    done = [o.request_id for o in client.outputs if o.finished and o.kind == "done"]
    assert done.index(short_tts) < done.index(long_tts)
    # Nothing of the long answer, far ahead of its listener, was rendered once the short
    # one's text was all written and until it was all spoken: the short answer had the
    # stage to itself. (While its text is still being written the stage has nothing of
    # the short one to render, and a chunk of the long one may be rendered meanwhile.)
    short_audio = [
        i for i, o in enumerate(client.outputs) if o.request_id == short_tts and o.kind == "audio"
    ]
    assert min(short_audio) >= asked
    written = next(
        i for i, o in enumerate(client.outputs) if o.request_id == short_llm and o.finished
    )
    between = client.outputs[written : max(short_audio)]
    assert not [o for o in between if o.request_id == long_tts and o.kind == "audio"]
    assert all(o.kind != "error" for o in client.outputs)
    await client.idle()
