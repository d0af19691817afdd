"""Three real agent frameworks against `duplex-gateway` started through its CLI with the
real embedded models, each with its own defaults: only the URL and the key are changed
(default voice, default tracing, default turn detection). Each test asserts what the
framework itself reports."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import soundfile as sf
import yaml

from tests.helpers import ROOT, running_gateway
from tests.realtime_client import FRAME_MS, RATE, silence, speech

pytestmark = pytest.mark.models

QUESTION = "What is the weather in Paris?"
KEY = "sk-local"


@pytest.fixture(scope="module")
def gateway(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """The default profile with greedy decoding, so the call does not depend on a draw."""
    profile = yaml.safe_load((ROOT / "configs" / "default.yaml").read_text())
    profile["stages"]["llm"]["sampling"]["temperature"] = 0.0
    path = tmp_path_factory.mktemp("profile") / "greedy.yaml"
    path.write_text(yaml.safe_dump(profile))
    with running_gateway("--config", str(path)) as gw:
        yield f"ws://127.0.0.1:{gw.port}/v1"


def question_audio() -> bytes:
    """The question as a microphone would give it: speech, then a second of silence."""
    return silence(300) + speech(QUESTION) + silence(1200)


def frames(pcm: bytes) -> Iterator[bytes]:
    step = RATE * 2 * FRAME_MS // 1000
    for i in range(0, len(pcm), step):
        yield pcm[i : i + step]


async def test_openai_agents_sdk_realtime_agent(gateway: str) -> None:
    """A `RealtimeAgent` with a function tool: the spoken question is transcribed, the
    tool called, and the answer spoken. The agent asks for the call (`tool_choice:
    "required"`): the embedded 135M model never chooses a function under "auto".
    Once called, the tool lets the model answer (as an app does that wants one lookup)."""
    from agents import function_tool
    from agents.realtime import RealtimeAgent, RealtimeRunner
    from agents.realtime.model_inputs import RealtimeModelSendRawMessage

    asked: list[str] = []
    session: Any = None

    @function_tool
    async def get_weather(city: str) -> str:
        """The current weather in a city."""
        asked.append(city)
        answer = {"type": "realtime", "tool_choice": "auto"}
        await session.model.send_event(
            RealtimeModelSendRawMessage(
                message={"type": "session.update", "other_data": {"session": answer}}
            )
        )
        return f"It is 18 degrees and cloudy in {city}."

    agent = RealtimeAgent(
        name="Weather", instructions="Answer weather questions.", tools=[get_weather]
    )
    runner = RealtimeRunner(agent, config={"model_settings": {"tool_choice": "required"}})
    session = await runner.run(model_config={"url": f"{gateway}/realtime", "api_key": KEY})
    kinds: list[str] = []
    spoken = 0  # bytes of PCM16 the agent played after the tool ran
    history: list[Any] = []
    async with session:
        for frame in frames(question_audio()):
            await session.send_audio(frame)
            await asyncio.sleep(FRAME_MS / 1000)
        async with asyncio.timeout(180):
            async for event in session:
                kinds.append(event.type)
                assert event.type != "error", event
                if event.type == "audio" and "tool_end" in kinds:
                    spoken += len(event.audio.data)
                if event.type == "history_updated":
                    history = event.history
                if event.type == "agent_end" and spoken:
                    break  # the spoken answer's response is done
    assert asked and "paris" in asked[0].lower(), kinds
    assert kinds.index("tool_start") < kinds.index("tool_end") < kinds.index("audio_end")
    assert spoken > RATE  # over half a second of the spoken answer (PCM16 at 24 kHz)
    said = [_transcript(item) for item in history if getattr(item, "role", None) == "user"]
    assert any("weather" in text.lower() for text in said), history
    answered = [_transcript(item) for item in history if getattr(item, "role", None) == "assistant"]
    assert any(text.strip() for text in answered), history


def _transcript(item: Any) -> str:
    """The words of a history item of the Agents SDK: its text or audio transcripts."""
    parts = getattr(item, "content", None) or []
    return " ".join(getattr(p, "transcript", None) or getattr(p, "text", None) or "" for p in parts)


def question_wav(folder: Path) -> Path:
    """The question as a 24 kHz mono wav file."""
    path = folder / "question.wav"
    samples = np.frombuffer(question_audio(), dtype="<i2")
    sf.write(path, samples, RATE, subtype="PCM_16")
    return path


async def test_pipecat_openai_realtime_service_in_a_pipeline(gateway: str, tmp_path: Path) -> None:
    """pipecat's `OpenAIRealtimeLLMService` in a pipeline fed from a wav file: the
    service opens the conversation (a response with nothing to answer), the user's
    speech is heard by the server's VAD, and the spoken answer comes back as pipecat's
    own frames (its words as LLMTextFrames, its audio as TTSAudioRawFrames)."""
    from pipecat.frames.frames import (
        EndFrame,
        InputAudioRawFrame,
        LLMContextFrame,
        LLMFullResponseEndFrame,
        LLMTextFrame,
        ProposedUserStoppedSpeakingFrame,
        TTSAudioRawFrame,
    )
    from pipecat.pipeline.pipeline import Pipeline
    from pipecat.pipeline.runner import PipelineRunner
    from pipecat.pipeline.task import PipelineParams, PipelineTask
    from pipecat.processors.aggregators.llm_context import LLMContext
    from pipecat.processors.frame_processor import FrameDirection, FrameProcessor
    from pipecat.services.openai.realtime.llm import OpenAIRealtimeLLMService

    class Heard(FrameProcessor):
        """Records what the service pushes downstream after the user's turn ended."""

        def __init__(self) -> None:
            super().__init__()
            self.turn_ended = False
            self.words: list[str] = []
            self.audio = 0
            self.answered = asyncio.Event()

        async def process_frame(self, frame: Any, direction: FrameDirection) -> None:
            await super().process_frame(frame, direction)
            if isinstance(frame, ProposedUserStoppedSpeakingFrame):
                self.turn_ended = True
            elif self.turn_ended and isinstance(frame, LLMTextFrame):
                self.words.append(frame.text)
            elif self.turn_ended and isinstance(frame, TTSAudioRawFrame):
                self.audio += len(frame.audio)
            elif self.turn_ended and isinstance(frame, LLMFullResponseEndFrame) and self.audio:
                self.answered.set()
            await self.push_frame(frame, direction)

    llm = OpenAIRealtimeLLMService(api_key=KEY, base_url=f"{gateway}/realtime")
    heard = Heard()
    task = PipelineTask(Pipeline([llm, heard]), params=PipelineParams(audio_in_sample_rate=RATE))
    samples, rate = sf.read(question_wav(tmp_path), dtype="int16")
    pcm = samples.astype("<i2").tobytes()

    async def talk() -> None:
        await task.queue_frame(LLMContextFrame(LLMContext()))
        for frame in frames(pcm):
            await task.queue_frame(
                InputAudioRawFrame(audio=frame, sample_rate=rate, num_channels=1)
            )
            await asyncio.sleep(FRAME_MS / 1000)
        try:
            async with asyncio.timeout(180):
                await heard.answered.wait()
        finally:
            await task.queue_frame(EndFrame())

    await asyncio.gather(PipelineRunner(handle_sigint=False).run(task), talk())
    assert heard.turn_ended and "".join(heard.words).strip()
    assert heard.audio > RATE  # over half a second of the spoken answer (PCM16 at 24 kHz)


async def test_livekit_openai_realtime_model_session(gateway: str) -> None:
    """LiveKit Agents' OpenAI `RealtimeModel` with its defaults (voice "marin", its input
    transcription and turn detection). An `AgentSession` needs a LiveKit room, so the
    model's own `RealtimeSession` is driven as the agent session drives it: audio pushed
    as `rtc.AudioFrame`s, and what it reports read from its events: the transcript
    callback, the generation's text stream and its audio frames."""
    from livekit import rtc
    from livekit.plugins.openai.realtime import RealtimeModel

    model = RealtimeModel(api_key=KEY, base_url=gateway.replace("ws://", "http://"))
    session = model.session()
    transcripts: list[str] = []
    errors: list[Any] = []
    words: list[str] = []
    samples = 0
    answered = asyncio.Event()

    async def read(generation: Any) -> None:
        nonlocal samples

        async def text(message: Any) -> None:
            async for piece in message.text_stream:
                words.append(piece)

        async def audio(message: Any) -> None:
            nonlocal samples
            async for frame in message.audio_stream:
                samples += frame.samples_per_channel

        async for message in generation.message_stream:
            await asyncio.gather(text(message), audio(message))
        if transcripts:
            answered.set()  # the answer to the question, not an earlier reply

    readers: list[asyncio.Task[None]] = []
    session.on("input_audio_transcription_completed", lambda e: transcripts.append(e.transcript))
    session.on("error", errors.append)
    session.on("generation_created", lambda e: readers.append(asyncio.create_task(read(e))))
    try:
        pcm = question_audio()
        for frame in frames(pcm):
            session.push_audio(rtc.AudioFrame(frame, RATE, 1, len(frame) // 2))
            await asyncio.sleep(FRAME_MS / 1000)
        async with asyncio.timeout(180):
            await answered.wait()
    finally:
        await session.aclose()
        await model.aclose()
        await asyncio.gather(*readers, return_exceptions=True)
    assert not errors, errors
    assert any("weather" in t.lower() for t in transcripts), transcripts
    assert "".join(words).strip()
    assert samples > RATE // 2  # over half a second of the spoken answer
