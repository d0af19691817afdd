"""What the real-gateway tests share as a client of the official `openai` SDK: the
client, eSpeak NG speech as PCM16 24 kHz, a microphone-paced stream of it, and reading
events up to a kind."""

from __future__ import annotations

import asyncio
import base64
import re
from typing import Any

from openai import AsyncOpenAI

from tests.helpers import espeak, pcm16

__all__ = ["FRAME_MS", "RATE", "client", "silence", "speech", "stream", "until", "words"]

RATE = 24000
FRAME_MS = 40


def client(base: str) -> AsyncOpenAI:
    return AsyncOpenAI(api_key="sk-local", websocket_base_url=base)


def speech(text: str, voice: str = "en-us") -> bytes:
    """PCM16 24 kHz of eSpeak NG saying `text` (SSML allowed)."""
    return pcm16(espeak(text, RATE, "-m", "-v", voice))


def silence(ms: int) -> bytes:
    return bytes(RATE * 2 * ms // 1000)


async def stream(conn: Any, pcm: bytes) -> None:
    """Append `pcm` in 40 ms frames at a microphone's pace."""
    step = RATE * 2 * FRAME_MS // 1000
    loop = asyncio.get_running_loop()
    start = loop.time()
    for n, i in enumerate(range(0, len(pcm), step)):
        await conn.input_audio_buffer.append(audio=base64.b64encode(pcm[i : i + step]).decode())
        await asyncio.sleep(max(0.0, start + (n + 1) * FRAME_MS / 1000 - loop.time()))


async def until(conn: Any, *kinds: str, timeout: float = 180) -> list[Any]:
    """Events up to and including the first of one of `kinds`."""
    events = []
    async with asyncio.timeout(timeout):
        while True:
            event = await conn.recv()
            events.append(event)
            if event.type in kinds:
                return events


def words(text: str) -> set[str]:
    return set(re.findall(r"[a-z']+", text.lower()))
