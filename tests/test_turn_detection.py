"""semantic_vad settings, the turn-end decision and confirmed interruptions, driven event
by event (sans-I/O session; the speech source with a scripted engine)."""

from __future__ import annotations

import asyncio
import base64
import json
from collections.abc import AsyncIterator, Callable
from typing import Any, TypeVar

import numpy as np
import pytest
from pydantic import ValidationError

from engine.listening.listener import HeardAudio
from engine.listening.turn_words import (
    ends_unsure,
    is_backchannel,
    sounds_unfinished,
    sounds_unsure,
)
from engine.runtime.stage import StageOutput
from engine.stages.asr_request import AsrRequest, Transcription
from gateway.config import GatewayConfig, TurnSettings
from gateway.protocol.session_config import TurnDetection
from gateway.session.actions import (
    CancelResponse,
    ConfigureVad,
    PrepareResponse,
    StartResponse,
    WatchWords,
)
from gateway.session.backend import ResponseDone, ResponseOutput, SpeechDecision
from gateway.session.realtime import RealtimeSession
from tests.helpers import wait_until
from tests.speech_harness import DetectionHarness

T = TypeVar("T")

RATE = 24000


def make(beta: bool = False, **config: Any) -> RealtimeSession:
    config.setdefault("semantic_vad", True)
    return RealtimeSession(config=GatewayConfig(**config), model="m", beta=beta)


def send(rt: RealtimeSession, /, **event: object) -> list[dict]:
    rt.receive_text(json.dumps(event))
    return rt.events_to_send()


def types(events: list[dict]) -> list[str]:
    return [e["type"] for e in events]


def tone_b64(ms: int) -> str:
    t = np.arange(RATE * ms // 1000) / RATE
    pcm = (0.3 * np.sin(2 * np.pi * 220 * t) * 32767).astype("<i2")
    return base64.b64encode(pcm.tobytes()).decode()


def ga_detection(rt: RealtimeSession, detection: object) -> list[dict]:
    session = {"type": "realtime", "audio": {"input": {"turn_detection": detection}}}
    return send(rt, type="session.update", session=session)


# -- settings ----------------------------------------------------------------------------


def test_semantic_vad_in_the_ga_shape() -> None:
    rt = make()
    rt.events_to_send()
    (event,) = ga_detection(rt, {"type": "semantic_vad", "eagerness": "high"})
    detection = event["session"]["audio"]["input"]["turn_detection"]
    assert detection == {
        "type": "semantic_vad",
        "eagerness": "high",
        "create_response": True,
        "interrupt_response": True,
    }
    configure = [a for a in rt.actions() if isinstance(a, ConfigureVad)][-1]
    assert configure.settings is not None and configure.settings.max_wait_ms == 2000
    # The answer is prepared where the words the model scores with are asked for.
    assert configure.pause_after_ms == TurnSettings().semantic_words_after_ms


def test_semantic_vad_in_the_beta_shape_and_partial_updates() -> None:
    rt = make(beta=True)
    rt.events_to_send()
    detection = {"type": "semantic_vad", "eagerness": "low", "create_response": False}
    (event,) = send(rt, type="session.update", session={"turn_detection": detection})
    assert event["type"] == "session.updated"
    assert event["session"]["turn_detection"]["eagerness"] == "low"
    # A partial update keeps the type and the other fields.
    update = {"turn_detection": {"eagerness": "auto"}}
    (event,) = send(rt, type="session.update", session=update)
    assert event["session"]["turn_detection"] == {
        "type": "semantic_vad",
        "eagerness": "auto",
        "create_response": False,
        "interrupt_response": True,
    }
    # Back to server_vad: its own defaults, not semantic_vad's leftovers.
    update = {"turn_detection": {"type": "server_vad"}}
    (event,) = send(rt, type="session.update", session=update)
    assert event["session"]["turn_detection"]["silence_duration_ms"] == 500
    assert "eagerness" not in event["session"]["turn_detection"]


@pytest.mark.parametrize(
    ("detection", "param", "words"),
    [
        ({"type": "semantic_vad", "eagerness": "eager"}, "eagerness", "low"),
        ({"type": "semantic_vad", "silence_duration_ms": 300}, "silence_duration_ms", "only"),
        ({"type": "semantic_vad", "threshold": 0.7}, "threshold", "only to server_vad"),
        ({"type": "server_vad", "eagerness": "low"}, "eagerness", "only to semantic_vad"),
        ({"type": "semantic_vad", "eagerness": 3}, "eagerness", "low"),
    ],
)
def test_refused_semantic_settings_get_a_clear_error(
    detection: dict, param: str, words: str
) -> None:
    rt = make()
    rt.events_to_send()
    (event,) = ga_detection(rt, detection)
    assert event["type"] == "error"
    assert param in event["error"]["param"] and words in event["error"]["message"]
    # The session goes on with its settings unchanged.
    (event,) = ga_detection(rt, {"type": "server_vad", "silence_duration_ms": 400})
    assert event["type"] == "session.updated"


def test_semantic_vad_without_the_model_is_refused() -> None:
    rt = make(semantic_vad=False)
    rt.events_to_send()
    (event,) = ga_detection(rt, {"type": "semantic_vad"})
    assert event["type"] == "error"
    assert event["error"]["param"] == "session.audio.input.turn_detection.type"
    assert "turn-end model" in event["error"]["message"]


def test_the_word_rules() -> None:
    assert sounds_unfinished("I would like to book a table for")
    assert sounds_unfinished("Can you add eggs and")
    assert sounds_unfinished("I would like to book a table for it.")  # whisper's guess
    assert not sounds_unfinished("What is the capital of France?")
    assert not sounds_unfinished("")
    assert not ends_unsure([-0.1, -2.0, -0.2, -0.1, -0.3])  # only the last tokens count...
    assert ends_unsure([-0.1, -0.9, -1.2])  # ...and one unsure token of them is enough
    assert not ends_unsure([])
    # Whisper puts a stop after a whole sentence: without one, the ending is in doubt.
    assert sounds_unsure("I think the best way to get there is", [-0.1, -0.1, -0.1])
    assert not sounds_unsure("How far away is the moon?", [-0.1, -0.1, -0.1])
    assert not sounds_unsure('He said "stop."', [])
    assert sounds_unsure("Could you tell me what?", [-0.1, -1.4])
    # A stop Whisper gives even odds or less: it doubts the sentence is over.
    assert sounds_unsure("I think the best way to get married.", [-0.0, -0.3, -0.89])
    assert not sounds_unsure("And that's it all I needed to know.", [-0.01, -0.0, -0.62])
    assert is_backchannel("Mm-hmm.") and is_backchannel("Yeah, okay.") and is_backchannel("")
    assert not is_backchannel("Wait, stop.")
    # Whisper spells a hum with as many letters as it hears.
    assert is_backchannel("MMMM") and is_backchannel("Hmmmm.") and is_backchannel("Mhmmm")
    assert is_backchannel("Amen.")  # whisper-tiny's hearing of a short "mm hmm"
    assert not is_backchannel("Mom")


# -- interruptions -------------------------------------------------------------------------


def answering(rt: RealtimeSession) -> str:
    """Speak a turn and have its answer's audio going out; the answer's response id."""
    rt.events_to_send()
    for _ in range(10):
        send(rt, type="input_audio_buffer.append", audio=tone_b64(100))
    rt.speech_started(100)
    rt.speech_stopped(800)
    rt.events_to_send()
    (start,) = [a for a in rt.actions() if isinstance(a, StartResponse)]
    samples = np.full(22050, 0.03, np.float32).astype("<f4").tobytes()
    rt.receive_response_event(
        ResponseOutput(start.response_id, "audio", text="one two", audio=samples, sample_rate=22050)
    )
    rt.events_to_send()
    return start.response_id


def test_unconfirmed_speech_over_an_answer_changes_nothing() -> None:
    rt = make(turns={"min_interruption_ms": 1000})
    response_id = answering(rt)
    for _ in range(5):
        send(rt, type="input_audio_buffer.append", audio=tone_b64(100))
    rt.speech_started(1000)
    rt.speech_paused(1300)
    rt.speech_stopped(1300)
    assert rt.events_to_send() == []
    actions = rt.actions()
    assert not [a for a in actions if isinstance(a, (CancelResponse, PrepareResponse))]
    assert WatchWords() in actions
    assert rt.active_id == response_id


def test_confirmed_speech_interrupts_from_its_true_start() -> None:
    rt = make(turns={"min_interruption_ms": 1000})
    response_id = answering(rt)
    for _ in range(5):
        send(rt, type="input_audio_buffer.append", audio=tone_b64(100))
    rt.speech_started(1000)
    assert rt.events_to_send() == [] and rt.active_id == response_id
    rt.speech_confirmed(1000)
    events = rt.events_to_send()
    assert types(events) == ["input_audio_buffer.speech_started"]
    assert events[0]["audio_start_ms"] == 1000
    assert CancelResponse(response_id, "turn_detected") in rt.actions()


def test_speech_while_the_assistant_is_silent_starts_at_once() -> None:
    rt = make(turns={"min_interruption_ms": 1000})
    rt.events_to_send()
    send(rt, type="input_audio_buffer.append", audio=tone_b64(500))
    rt.speech_started(100)
    assert types(rt.events_to_send()) == ["input_audio_buffer.speech_started"]


# -- the speech source: the turn-end decision ---------------------------------------------


class ScriptedEngine:
    """VAD probabilities as the test pushes them; turn scores and transcripts from
    scripts; records the requests."""

    def __init__(
        self, score: float | list[float], transcript: str, ending: tuple[float, ...] = ()
    ) -> None:
        self.scores = score if isinstance(score, list) else [score]
        self.transcript = transcript
        self.ending = ending  # the log-probabilities of the transcript's last tokens
        self.vad: asyncio.Queue[StageOutput] = asyncio.Queue()
        self.requests: list[tuple[str, int]] = []
        self.transcriptions: list[AsrRequest] = []
        self.fed = 0
        self.asr_asked = asyncio.Event()
        self.vad_idle = asyncio.Event()
        self.words_ready: asyncio.Event | None = None  # set: transcripts wait for it

    async def stream(
        self, stage: str, request_id: str, inputs: object
    ) -> AsyncIterator[StageOutput]:
        if stage == "vad":
            while True:
                if self.vad.empty():
                    self.vad_idle.set()  # every pushed probability has been acted on
                yield await self.vad.get()
        if isinstance(inputs, AsrRequest):  # the words before a silence, and how sure
            self.requests.append((stage, len(inputs.audio)))
            self.transcriptions.append(inputs)
            self.asr_asked.set()
            if self.words_ready is not None:
                await self.words_ready.wait()
            scores = [-0.1, *self.ending] if inputs.logprobs else []
            heard = Transcription(self.transcript, [0] * len(scores), 0, 1, 0.0, scores)
            yield StageOutput(request_id, heard, finished=True)
            return
        assert isinstance(inputs, np.ndarray)
        self.requests.append((stage, len(inputs)))
        score = self.scores.pop(0) if len(self.scores) > 1 else self.scores[0]
        payload: object = score if stage == "turn" else self.transcript
        yield StageOutput(request_id, payload, finished=True)

    async def run(self, stage: str, fn: Callable[[Any], T]) -> T:
        assert stage == "vad"
        return fn(self)

    def feed_many(self, pieces: list[tuple[str, np.ndarray]]) -> list[Exception | None]:
        """The VAD stage's, for `run`: the audio is counted; the test says what it heard."""
        self.fed += sum(len(samples) for _, samples in pieces)
        return [None] * len(pieces)

    def abort(self, stage: str, request_id: str) -> None:
        pass

    def pending(self) -> dict[str, int]:
        return {}

    def push(self, *probabilities: float) -> None:
        self.vad_idle.clear()
        self.vad.put_nowait(StageOutput("vad", np.array(probabilities, np.float32)))


async def decisions(source: DetectionHarness, count: int) -> list[SpeechDecision]:
    out: list[SpeechDecision] = []
    async with asyncio.timeout(5):
        async for event in source.events():
            out.append(event)
            if len(out) == count:
                return out
    return out


def semantic_source(engine: ScriptedEngine, **turns: Any) -> DetectionHarness:
    source = DetectionHarness(engine, "s", TurnSettings(**turns))
    settings = TurnDetection(type="semantic_vad", eagerness="auto")
    source.configure(settings, start_ms=0, pause_after_ms=160)
    source.feed(np.zeros(16000 * 3, np.float32))
    return source


async def test_a_complete_turn_ends_at_the_start_of_its_silence() -> None:
    engine = ScriptedEngine(score=0.9, transcript="What is the capital of France?")
    source = semantic_source(engine)
    engine.push(*[0.9] * 20, *[0.0] * 6)  # 640 ms of speech, then 192 ms of silence
    events = await decisions(source, 3)
    assert [e.kind for e in events] == ["started", "paused", "stopped"]
    assert events[2].ms == 640
    assert events[1].words == "What is the capital of France?"  # the answer starts from them
    assert {stage for stage, _ in engine.requests} == {"turn", "asr"}
    # The turn's own words: no hurry over the answer, decoded as the profile decodes.
    [words] = engine.transcriptions
    assert (words.urgent, words.greedy) == (False, False)
    await source.close()


async def test_the_words_and_the_pause_come_before_the_score() -> None:
    engine = ScriptedEngine(score=0.9, transcript="What is the capital of France?")
    source = semantic_source(engine)
    engine.push(*[0.9] * 20, *[0.0] * 3)  # 96 ms of silence: words, not yet a score
    events = await decisions(source, 2)
    assert [e.kind for e in events] == ["started", "paused"]
    assert events[1].words == "What is the capital of France?"
    assert [stage for stage, _ in engine.requests] == ["asr"]
    engine.push(*[0.0] * 3)  # 192 ms: scored, with the words already in
    (event,) = await decisions(source, 1)
    assert (event.kind, event.ms) == ("stopped", 640)
    assert [stage for stage, _ in engine.requests] == ["asr", "turn"]
    await source.close()


async def test_the_score_waits_for_the_words() -> None:
    # The answer is prepared from the words: a score beside them would only slow them.
    engine = ScriptedEngine(score=0.9, transcript="What is the capital of France?")
    engine.words_ready = asyncio.Event()
    source = semantic_source(engine)
    engine.push(*[0.9] * 20, *[0.0] * 8)  # 256 ms of silence: a score is due at 160
    (started,) = await decisions(source, 1)
    await engine.vad_idle.wait()
    await engine.asr_asked.wait()  # the transcript is on its way, the silence all heard
    assert not source.scoring and [stage for stage, _ in engine.requests] == ["asr"]
    engine.words_ready.set()
    paused, stopped = await decisions(source, 2)
    assert paused.words == "What is the capital of France?"
    assert (stopped.kind, stopped.ms) == ("stopped", 640)
    assert [stage for stage, _ in engine.requests] == ["asr", "turn"]
    await source.close()


def test_the_words_cannot_wait_for_the_score() -> None:
    with pytest.raises(ValidationError, match="semantic_words_after_ms"):
        TurnSettings(semantic_words_after_ms=200, semantic_score_after_ms=160)


@pytest.mark.parametrize(
    ("score", "transcript", "ending"),
    [
        (0.2, "What is the capital of France?", ()),
        (0.9, "I would like to book a table for", ()),
        # "Can you add eggs and", completed by Whisper on its own and unsure of it.
        (0.9, "Can you have excellent?", (-0.7, -1.69, -0.3)),
        # A cut phrase Whisper left without a stop, sure of its words.
        (0.9, "I think the best way to get there is", ()),
        # The same phrase completed with a word and a stop Whisper doubts.
        (0.9, "I think the best way to get married.", (-0.0, -0.3, -0.89)),
    ],
)
async def test_an_unfinished_turn_waits(
    score: float, transcript: str, ending: tuple[float, ...]
) -> None:
    engine = ScriptedEngine(score=score, transcript=transcript, ending=ending)
    source = semantic_source(engine)
    engine.push(*[0.9] * 20, *[0.0] * 6)
    events = await decisions(source, 2)
    assert [e.kind for e in events] == ["started", "paused"]
    # Both answers are in once the speaker goes on; the turn did not end meanwhile.
    await wait_until(lambda: len(engine.requests) >= 2, 5, "both answers", interval=0.001)
    engine.push(*[0.9] * 5)
    (event,) = await decisions(source, 1)
    assert event.kind == "resumed"
    await source.close()


async def test_an_unfinished_turn_ends_at_the_eagerness_cap() -> None:
    engine = ScriptedEngine(score=0.1, transcript="and")
    source = semantic_source(engine)
    engine.push(*[0.9] * 20, *[0.0] * 6)  # scored 160 ms into the silence...
    assert [e.kind for e in await decisions(source, 2)] == ["started", "paused"]
    engine.push(*[0.0] * 124)  # ...and it lasts 4.16 s: past auto's 4 s
    (stopped,) = await decisions(source, 1)
    assert (stopped.kind, stopped.ms) == ("stopped", 640)
    await source.close()


async def test_an_unsure_ending_waits_part_of_the_cap_then_ends() -> None:
    # "Could you tell me what the", completed by Whisper as "Could you tell me what?".
    engine = ScriptedEngine(score=0.9, transcript="Could you tell me what?", ending=(-1.4,))
    source = semantic_source(engine)
    engine.push(*[0.9] * 20, *[0.0] * 30)  # 960 ms of silence: under auto's 1.2 s
    assert [e.kind for e in await decisions(source, 2)] == ["started", "paused"]
    await wait_until(lambda: engine.vad.empty() and not source.scoring, 5, "the scoring")
    engine.push(*[0.0] * 10)  # 1.28 s: scored again, and the turn ends where it fell silent
    (stopped,) = await decisions(source, 1)
    assert (stopped.kind, stopped.ms) == ("stopped", 640)
    await source.close()


async def speech_over_an_answer(
    engine: ScriptedEngine, min_interruption_ms: int = 1000, every_ms: int | None = None
) -> tuple[DetectionHarness, SpeechDecision]:
    """A source whose speech started (one chunk heard) while an answer was running."""
    turns = TurnSettings(
        min_interruption_ms=min_interruption_ms,
        interruption_words_after_ms=256,
        interruption_words_every_ms=every_ms,
    )
    source = DetectionHarness(engine, "s", turns)
    source.configure(TurnDetection(), start_ms=0)
    source.feed(np.zeros(32000, np.float32))
    engine.push(0.9)
    (started,) = await decisions(source, 1)
    source.watch_words()  # the session saw it start over a running answer
    return source, started


async def test_words_confirm_an_interruption_before_the_minimum() -> None:
    engine = ScriptedEngine(score=0.1, transcript="Wait, stop")
    source, started = await speech_over_an_answer(engine)
    engine.push(*[0.9] * 7)  # 256 ms heard: the words are checked
    (confirmed,) = await decisions(source, 1)
    assert (started.kind, confirmed.kind) == ("started", "confirmed")
    assert confirmed.ms == started.ms
    assert ("asr", 256 * 16) in engine.requests
    # Ahead of the answer it may cancel, and greedy: they only tell words from a backchannel.
    [check] = engine.transcriptions
    assert (check.urgent, check.greedy) == (True, True)
    await source.close()


async def test_words_are_checked_once_the_speech_lasted_long_enough_voiced_or_not() -> None:
    # Consonants such as the "x" of "excuse" fall between the VAD's two thresholds: not
    # voiced, not silence. The check is due by the time since the speech began.
    engine = ScriptedEngine(score=0.1, transcript="Excuse me")
    source, started = await speech_over_an_answer(engine)
    engine.push(*[0.4] * 6, 0.9)  # 256 ms since the start, 64 ms of it voiced
    (confirmed,) = await decisions(source, 1)
    assert confirmed.kind == "confirmed"
    assert engine.requests == [("asr", 256 * 16)]
    await source.close()


@pytest.mark.parametrize(("every_ms", "chunks"), [(None, 8), (64, 2)])
async def test_words_that_say_nothing_are_checked_again_every_interval(
    every_ms: int | None, chunks: int
) -> None:
    # "Hold on" heard at 256 ms as "So": the next check hears more, `every_ms` later.
    engine = ScriptedEngine(score=0.1, transcript="So")
    source, _ = await speech_over_an_answer(engine, every_ms=every_ms)
    engine.push(*[0.9] * 7)
    await wait_until(lambda: bool(engine.requests) and not source.scoring, 5, "the check")
    engine.transcript = "So, hold on"
    engine.push(*[0.9] * (chunks - 1))
    await wait_until(lambda: engine.vad.empty() and not source.scoring, 5, "the feed")
    assert len(engine.requests) == 1  # not due yet
    engine.push(0.9)
    (confirmed,) = await decisions(source, 1)
    assert confirmed.kind == "confirmed"
    assert engine.requests == [("asr", 256 * 16), ("asr", (256 + chunks * 32) * 16)]
    await source.close()


async def test_backchannel_words_do_not_confirm() -> None:
    engine = ScriptedEngine(score=0.1, transcript="Mm-hmm.")
    source, _ = await speech_over_an_answer(engine)
    engine.push(*[0.9] * 9)  # the words are checked after this much speech ...
    await wait_until(lambda: bool(engine.requests) and not source.scoring, 5, "the check")
    engine.push(*[0.0] * 16)  # ... and said nothing: the speech stops unconfirmed
    (event,) = await decisions(source, 1)
    assert event.kind == "stopped"
    assert [stage for stage, _ in engine.requests] == ["asr"]
    await source.close()


async def candidate_in_semantic_mode(engine: ScriptedEngine) -> DetectionHarness:
    """semantic_vad speech that started over an answer (or its echo) and was confirmed."""
    source = semantic_source(engine, min_interruption_ms=1000, interruption_words_after_ms=256)
    engine.push(0.9)
    (started,) = await decisions(source, 1)
    source.watch_words()
    engine.push(*[0.9] * 7)  # 256 ms: the words confirm it
    (confirmed,) = await decisions(source, 1)
    assert (started.kind, confirmed.kind) == ("started", "confirmed")
    return source


async def test_a_candidate_not_yet_taken_as_a_turn_ends_at_the_candidate_silence() -> None:
    engine = ScriptedEngine(score=0.1, transcript="I would like to book a table for")
    source = await candidate_in_semantic_mode(engine)
    engine.push(*[0.0] * 20)  # 640 ms of silence, over CANDIDATE_SILENCE_MS
    assert [e.kind for e in await decisions(source, 2)] == ["paused", "stopped"]
    await source.close()


async def test_a_confirmed_interruption_taken_as_a_turn_ends_as_a_turn_does() -> None:
    # A hesitation over the echo of an answer: once the session took the speech as its
    # turn, a 640 ms pause mid-sentence is a pause, not the end of the turn.
    engine = ScriptedEngine(score=0.1, transcript="I would like to book a table for")
    source = await candidate_in_semantic_mode(engine)
    source.turn_taken()
    engine.push(*[0.0] * 20)
    await wait_until(lambda: engine.vad.empty() and not source.scoring, 5, "the silence")
    engine.push(0.9)  # the speaker goes on
    assert [e.kind for e in await decisions(source, 2)] == ["paused", "resumed"]
    await source.close()


async def test_a_confirmed_interruption_is_not_checked_again() -> None:
    engine = ScriptedEngine(score=0.1, transcript="Wait, stop")
    source, _ = await speech_over_an_answer(engine, min_interruption_ms=2000)
    engine.push(*[0.9] * 7)
    (confirmed,) = await decisions(source, 1)
    assert confirmed.kind == "confirmed"
    engine.push(*[0.9] * 30)  # a second more of the interruption
    await wait_until(lambda: engine.vad.empty() and not source.scoring, 5, "the speech heard")
    assert len(engine.requests) == 1
    await source.close()


async def test_a_confirmation_that_did_not_count_is_made_afresh() -> None:
    # The session found the confirmed speech to be the answer's echo (WatchWords(again)):
    # its words are checked again, and its length counts from there.
    engine = ScriptedEngine(score=0.1, transcript="Wait, stop")
    source, _ = await speech_over_an_answer(engine, min_interruption_ms=2000)
    engine.push(*[0.9] * 7)
    (first,) = await decisions(source, 1)
    assert first.kind == "confirmed"
    source.watch_words(again=True)
    engine.push(*[0.9] * 2)
    (second,) = await decisions(source, 1)
    assert (second.kind, second.ms) == ("confirmed", first.ms)
    assert len(engine.requests) == 2
    await source.close()


class HeldWords(ScriptedEngine):
    """Transcripts that answer only once the test lets them."""

    def __init__(self, transcript: str) -> None:
        super().__init__(0.1, transcript)
        self.answer = asyncio.Event()

    async def stream(
        self, stage: str, request_id: str, inputs: object
    ) -> AsyncIterator[StageOutput]:
        if stage == "asr":
            await self.answer.wait()
        async for output in super().stream(stage, request_id, inputs):
            yield output


async def test_speech_over_an_answer_is_checked_once_at_a_time() -> None:
    engine = HeldWords(transcript="Mm-hmm.")
    source, _ = await speech_over_an_answer(engine, min_interruption_ms=2000)
    engine.push(*[0.9] * 24)  # 800 ms heard: past three check times, the first unanswered
    await wait_until(engine.vad.empty, 5, "the speech heard")
    engine.answer.set()
    await wait_until(lambda: not source.scoring, 5, "the first check")
    assert len(engine.requests) == 1
    engine.push(0.9)  # the next chunk heard: checked again at once, with all of it
    await wait_until(lambda: len(engine.requests) == 2, 5, "the second check")
    assert engine.requests[1] == ("asr", 832 * 16)
    await source.close()


async def test_words_are_checked_only_when_asked() -> None:
    engine = ScriptedEngine(score=0.1, transcript="Wait, stop")
    source = DetectionHarness(
        engine, "s", TurnSettings(min_interruption_ms=1000, interruption_words_after_ms=256)
    )
    source.configure(TurnDetection(), start_ms=0)
    source.feed(np.zeros(16000, np.float32))
    engine.push(*[0.9] * 10, *[0.0] * 16)
    events = await decisions(source, 2)
    assert [e.kind for e in events] == ["started", "stopped"]
    assert engine.requests == []
    await source.close()


def test_a_backchannel_stays_no_turn_when_the_answer_ends_meanwhile() -> None:
    rt = make(turns={"min_interruption_ms": 1000})
    response_id = answering(rt)
    for _ in range(5):
        send(rt, type="input_audio_buffer.append", audio=tone_b64(100))
    rt.speech_started(1000)
    rt.receive_response_event(ResponseDone(response_id, "completed"))
    assert types(rt.events_to_send())[-1] == "response.done"
    rt.speech_stopped(1300)
    assert rt.events_to_send() == []
    assert not [a for a in rt.actions() if isinstance(a, StartResponse)]


def test_the_audio_heard_is_clipped_in_order_across_appends() -> None:
    heard = HeardAudio()
    fed = np.arange(3 * 16_000 + 123, dtype=np.float32)
    for i in range(0, len(fed), 640):  # 40 ms appends
        heard.append(fed[i : i + 640])
    heard.keep_from(16_000 + 5)
    np.testing.assert_array_equal(heard.between(20_000, 40_321), fed[20_000:40_321])
    # Whole appends are let go: the one that holds sample 16,005 is kept entire.
    np.testing.assert_array_equal(heard.between(0, 16_100), fed[16_000:16_100])
    np.testing.assert_array_equal(heard.since(48_000), fed[48_000:])
    assert heard.between(60_000, 70_000).size == 0


async def test_a_turn_scored_again_ends_when_the_model_changes_its_mind() -> None:
    engine = ScriptedEngine(score=[0.2, 0.8], transcript="How far away is the moon?")
    source = semantic_source(engine)
    engine.push(*[0.9] * 20, *[0.0] * 6)  # scored at 160 ms of silence: incomplete
    assert [e.kind for e in await decisions(source, 2)] == ["started", "paused"]
    await wait_until(lambda: len(engine.requests) == 2, 5, "the first scoring")
    engine.push(*[0.0] * 13)  # 576 ms of silence: scored again, complete
    (event,) = await decisions(source, 1)
    assert (event.kind, event.ms) == ("stopped", 640)
    await source.close()


async def test_speech_over_an_answer_ends_after_a_short_silence_in_semantic_mode() -> None:
    engine = ScriptedEngine(score=0.1, transcript="Mm-hmm.")
    source = semantic_source(engine)
    engine.push(0.9)
    await decisions(source, 1)
    source.watch_words()
    engine.push(*[0.9] * 9)
    engine.push(*[0.0] * 17)  # 544 ms: not the eagerness's 4 s
    kinds = [e.kind for e in await decisions(source, 2)]
    assert kinds == ["paused", "stopped"]
    await source.close()


async def test_scorings_in_one_silence_share_one_transcript() -> None:
    engine = ScriptedEngine(score=[0.2, 0.8], transcript="How far away is the moon?")
    source = semantic_source(engine)
    engine.push(*[0.9] * 20, *[0.0] * 6)  # scored at 160 ms of silence: incomplete
    assert [e.kind for e in await decisions(source, 2)] == ["started", "paused"]
    await wait_until(lambda: len(engine.requests) == 2, 5, "the first scoring")
    engine.push(*[0.0] * 13)  # 576 ms: scored again, complete
    (event,) = await decisions(source, 1)
    assert (event.kind, event.ms) == ("stopped", 640)
    assert [stage for stage, _ in engine.requests] == ["asr", "turn", "turn"]
    await source.close()


async def test_unfinished_words_stop_the_scoring_until_speech_comes_back() -> None:
    engine = ScriptedEngine(score=0.9, transcript="Can you add eggs and")
    source = semantic_source(engine)
    engine.push(*[0.9] * 20, *[0.0] * 6)
    assert [e.kind for e in await decisions(source, 2)] == ["started", "paused"]
    await wait_until(lambda: not source.scoring, 5, "the first scoring")
    engine.push(*[0.0] * 30)  # a second of silence more: the words have not changed
    engine.push(*[0.9] * 5)
    (event,) = await decisions(source, 1)
    assert event.kind == "resumed"
    assert [stage for stage, _ in engine.requests] == ["asr", "turn"]
    # The next silence is scored (and transcribed) afresh.
    engine.push(*[0.0] * 6)
    (event,) = await decisions(source, 1)
    assert event.kind == "paused"
    await wait_until(lambda: len(engine.requests) == 4, 5, "the next scoring")
    await source.close()


class HeldScores(ScriptedEngine):
    """Turn scores that answer only once the test lets them."""

    def __init__(self, score: float, transcript: str) -> None:
        super().__init__(score, transcript)
        self.answer = asyncio.Event()

    async def stream(
        self, stage: str, request_id: str, inputs: object
    ) -> AsyncIterator[StageOutput]:
        if stage == "turn":
            await self.answer.wait()
        async for output in super().stream(stage, request_id, inputs):
            yield output


async def test_a_silence_is_scored_again_only_once_the_last_scoring_answered() -> None:
    engine = HeldScores(score=0.2, transcript="How far away is the moon?")
    source = semantic_source(engine)
    engine.push(*[0.9] * 20, *[0.0] * 6)  # 192 ms of silence: scored
    assert [e.kind for e in await decisions(source, 2)] == ["started", "paused"]
    engine.push(*[0.0] * 30)  # past two more scoring times, the first still unanswered
    await wait_until(engine.vad.empty, 5, "the silence heard")
    engine.answer.set()
    await wait_until(lambda: not source.scoring, 5, "the first answer")
    assert sorted(stage for stage, _ in engine.requests) == ["asr", "turn"]
    engine.push(0.0)  # the next chunk heard: scored again at once
    await wait_until(lambda: len(engine.requests) == 3, 5, "the second scoring")
    assert engine.requests[-1][0] == "turn"
    await source.close()
