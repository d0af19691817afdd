"""The orchestrator's resident stage-0 request (rule 5 of `engine.pipeline.orchestrator`), with
fake stages in a real EngineCore: live transcript deltas while an utterance grows, a
turn that finishes the live transcript (only the tail decoded), prepared turns that
freeze and thaw it, and an abort that stops everything of it at once."""

from __future__ import annotations

from collections.abc import AsyncIterator

import numpy as np
import pytest

from duplex.appends import Append, Heard, Listen, UtteranceEnded, UtteranceStarted
from duplex.contracts import (
    DuplexFence,
    DuplexStageRequestContext,
    DuplexStageSubmission,
    duplex_resource_request_id,
)
from duplex.events import SpeechDecision
from duplex.outputs import DuplexPreparedTurn, DuplexStageOutput
from duplex.session import RESIDENT_ROLE
from duplex.turn import Stage
from engine.config import parse_config
from engine.listening.listener import LOOKBACK_S, SAMPLE_RATE
from tests.fake_engine import BLOCK, FakeAsrRequest, Harness, spoken, turn

FRAME = 640  # 40 ms
WORDS = tuple(range(1, 9))


@pytest.fixture
async def h() -> AsyncIterator[Harness]:
    harness = Harness(parse_config({"stages": {"asr": {"live_interval_ms": 200}}}))
    yield harness
    harness.core.shutdown()


class Resident:
    """The session's resident request as the duplex session drives it."""

    def __init__(self, h: Harness, session: str = "s1", epoch: int = 0) -> None:
        self.h = h
        fence = DuplexFence(session, epoch)
        self.rid = duplex_resource_request_id(fence, RESIDENT_ROLE)
        self.context = DuplexStageRequestContext(
            request_id=self.rid,
            session_id=session,
            fence=fence,
            stage_id=0,
            final_stage_id=0,
            config_generation=0,
            sampling_params=h.orch.sampling_defaults(),
        )
        h.orch.ensure_request(self.context)
        self.submitted = False

    async def append(self, value: Append) -> None:
        submission = DuplexStageSubmission(
            self.context, value.plan().prompt, already_submitted=self.submitted, resumable=True
        )
        self.submitted = True
        result = await self.h.orch.submit(submission)
        assert (result.request_id, result.stage_id) == (self.rid, 0)

    async def say(self, audio: np.ndarray) -> None:
        for start in range(0, len(audio), FRAME):
            await self.append(Heard(audio[start : start + FRAME].astype("<f4").tobytes()))

    def deltas(self) -> list[DuplexStageOutput]:
        return [o for o in self.h.of(self.rid) if o.kind == "transcript_delta"]

    def text(self) -> str:
        return "".join(o.text for o in self.deltas())


async def speak(h: Harness, resident: Resident, words: tuple[int, ...] = WORDS) -> None:
    """Listen, start utterance item_1 and say `words`, until some of them are agreed."""
    await resident.append(Listen(logprobs=True))
    await resident.append(UtteranceStarted("item_1", 0.0))
    for pair in range(0, len(words), 2):
        await resident.say(spoken(*words[pair : pair + 2]))
        await partial_done(h)
    await h.until(lambda: len(resident.deltas()) >= 1)


async def partial_done(h: Harness) -> None:
    """Wait until a partial over everything heard so far has been answered."""
    listener = h.orch.listener("s1")
    assert listener is not None and listener.utterance is not None
    utterance = listener.utterance
    await h.until(lambda: utterance.partial_at == listener.heard.end and not h.asr.waiting)


async def test_deltas_come_while_the_utterance_grows(h: Harness) -> None:
    resident = Resident(h)
    await speak(h, resident)
    deltas = resident.deltas()
    assert all(d.metadata["utterance_id"] == "item_1" for d in deltas)
    assert all(d.session_id == "s1" and d.stage_id == 0 for d in deltas)
    said = " ".join(f"w{n}" for n in WORDS)
    assert said.startswith(resident.text()) and resident.text().startswith("w1")
    assert all(d.metadata["logprobs"] for d in deltas)
    partials = [r for _, r in h.asr.requests if isinstance(r, FakeAsrRequest)]
    assert partials and all(r.partial for r in partials)
    await resident.append(UtteranceEnded("item_1"))


async def test_partials_end_on_their_grid_whatever_the_frames(h: Harness) -> None:
    # Appends of 1000 samples never end on the 100 ms grid (half of live_interval_ms,
    # the first 1.5 s): each partial still ends on it, so the same speech gets the same
    # partials however its frames came.
    resident = Resident(h)
    await resident.append(Listen())
    await resident.append(UtteranceStarted("item_1", 0.0))
    await h.until(lambda: bool(h.asr.lives))
    listener = h.orch.listener("s1")
    assert listener is not None and listener.utterance is not None
    utterance, audio = listener.utterance, spoken(*WORDS)
    for start in range(0, len(audio), 1000):
        await resident.say(audio[start : start + 1000])
        point = listener.heard.end // BLOCK * BLOCK
        await h.until(lambda p=point: utterance.partial_at == p and not h.asr.waiting)
    partials = [r for _, r in h.asr.requests if isinstance(r, FakeAsrRequest) and r.partial]
    assert len(partials) >= 4
    assert all(len(r.audio) % BLOCK == 0 for r in partials), [len(r.audio) for r in partials]
    await resident.append(UtteranceEnded("item_1"))


async def test_no_partial_runs_on_less_audio_than_counts(h: Harness) -> None:
    h.asr.counts_from_s = 0.5  # five spoken words
    resident = Resident(h)
    await resident.append(Listen())
    await resident.append(UtteranceStarted("item_1", 0.0))
    await resident.say(spoken(1, 2))
    await h.until(lambda: bool(h.asr.lives))  # its partials are waiting for audio
    for word in WORDS[2:]:
        await resident.say(spoken(word))
        await h.until(lambda: not h.asr.waiting)  # any partial due has been answered

    def partials() -> list[FakeAsrRequest]:
        return [r for _, r in h.asr.requests if isinstance(r, FakeAsrRequest) and r.partial]

    await h.until(lambda: bool(partials()))
    assert all(len(r.audio) >= 5 * BLOCK for r in partials())
    await resident.append(UtteranceEnded("item_1"))


async def test_audio_not_sent_before_listening_still_counts_on_the_clock(h: Harness) -> None:
    resident = Resident(h)
    await resident.append(Listen(clock=10 * BLOCK))  # ten words went by unsent
    await resident.say(spoken(*WORDS))
    listener = h.orch.listener("s1")
    assert listener is not None
    assert (listener.heard.start, listener.heard.end) == (10 * BLOCK, (10 + len(WORDS)) * BLOCK)
    # An utterance started where it was spoken gets its own audio, from its first word.
    await resident.append(UtteranceStarted("item_1", 10 * BLOCK * 1000 / SAMPLE_RATE))
    assert listener.utterance is not None
    assert np.array_equal(listener.heard.since(listener.utterance.start), spoken(*WORDS))
    await resident.append(UtteranceEnded("item_1"))


async def test_a_turn_naming_the_utterance_finishes_its_live_transcript(h: Harness) -> None:
    resident = Resident(h)
    await speak(h, resident)
    live = h.asr.lives[0]
    contexts = h.reserve(final=0)
    request = turn(Stage.ASR, audio=spoken(*WORDS).tobytes(), utterance="item_1", logprobs=True)
    await h.submit(contexts, request)
    await resident.append(UtteranceEnded("item_1"))
    await h.until(lambda: h.finished(contexts[0].request_id))
    transcript = h.of(contexts[0].request_id)[0]
    assert transcript.text == " ".join(f"w{n}" for n in WORDS)
    assert transcript.text.startswith(resident.text())  # every delta is in it, first
    assert transcript.metadata["live"] is True
    assert [t for t, _ in transcript.metadata["logprobs"]] == [f" w{n}" for n in WORDS]
    final = h.asr.requests[-1][1]
    assert isinstance(final, FakeAsrRequest) and not final.partial
    # Only the tail is decoded: the committed words are forced as its prefix.
    assert final.prefix == tuple(live.committed) and len(final.prefix) >= 4
    await h.idle()


async def test_a_turn_stopped_unfinished_leaves_the_utterance_to_the_next(h: Harness) -> None:
    resident = Resident(h)
    await speak(h, resident)
    said = spoken(*WORDS).tobytes()
    h.asr.hold = True
    job = h.reserve(final=0)
    await h.submit(job, turn(Stage.ASR, audio=said, utterance="item_1"))
    await resident.append(UtteranceEnded("item_1"))
    await h.until(lambda: any(rid == job[0].request_id for rid, _ in h.asr.requests))
    await h.orch.abort_requests([job[0].request_id])  # superseded before it transcribed
    h.asr.hold = False
    response = h.reserve(turn=1, final=0)
    await h.submit(response, turn(Stage.ASR, audio=said, utterance="item_1"))
    await h.until(lambda: h.finished(response[0].request_id))
    transcript = h.of(response[0].request_id)[0]
    assert transcript.metadata["live"] is True
    assert transcript.text.startswith(resident.text())
    assert h.of(job[0].request_id) == []
    await h.idle()


async def test_without_listening_a_turn_is_transcribed_whole(h: Harness) -> None:
    resident = Resident(h)
    await resident.append(UtteranceStarted("item_1", 0.0))
    await resident.say(spoken(*WORDS))
    contexts = h.reserve(final=0)
    await h.submit(contexts, turn(Stage.ASR, audio=spoken(*WORDS).tobytes(), utterance="item_1"))
    await h.until(lambda: h.finished(contexts[0].request_id))
    assert h.of(contexts[0].request_id)[0].text == "question 1"  # the plain path
    assert resident.deltas() == [] and h.asr.lives == []


QUESTION = "What is the capital of France?"


async def heard_then_decided(h: Harness, *decisions: SpeechDecision) -> Resident:
    """Utterance item_1 said without listening, then `decisions` as the session's speech
    detection makes them (the listener hears them first, then they go up)."""
    resident = Resident(h)
    await resident.append(UtteranceStarted("item_1", 0.0))
    await resident.say(spoken(*WORDS))
    listener = h.orch.listener("s1")
    assert listener is not None
    for decision in decisions:
        listener.speech._emit(decision)  # as the detection decides it
    return resident


async def test_words_the_detection_heard_at_the_stop_are_the_transcript(h: Harness) -> None:
    resident = await heard_then_decided(
        h, SpeechDecision("paused", 900.0, QUESTION), SpeechDecision("stopped", 900.0)
    )
    up = [o.metadata for o in h.of(resident.rid) if o.kind == "speech"]
    assert [m["words"] for m in up] == [QUESTION, None]  # they go up once, with the pause
    contexts = h.reserve(final=0)
    await h.submit(contexts, turn(Stage.ASR, audio=spoken(*WORDS).tobytes(), utterance="item_1"))
    await h.until(lambda: h.finished(contexts[0].request_id))
    (transcript, _) = h.of(contexts[0].request_id)
    assert (transcript.text, transcript.metadata["heard"]) == (QUESTION, True)
    assert h.asr.requests == []  # the utterance was transcribed once: by the detection


@pytest.mark.parametrize(
    "after",
    [SpeechDecision("resumed", 900.0), SpeechDecision("stopped", 1400.0)],
    ids=["resumed", "stopped-later"],
)
async def test_words_heard_before_speech_went_on_are_not_the_transcript(
    h: Harness, after: SpeechDecision
) -> None:
    await heard_then_decided(h, SpeechDecision("paused", 900.0, "What is the"), after)
    contexts = h.reserve(final=0)
    await h.submit(contexts, turn(Stage.ASR, audio=spoken(*WORDS).tobytes(), utterance="item_1"))
    await h.until(lambda: h.finished(contexts[0].request_id))
    assert h.of(contexts[0].request_id)[0].text == "question 1"  # transcribed whole
    assert "heard" not in h.of(contexts[0].request_id)[0].metadata


async def test_a_listening_session_finishes_its_live_transcript_not_the_detections_words(
    h: Harness,
) -> None:
    resident = Resident(h)
    await speak(h, resident)
    listener = h.orch.listener("s1")
    assert listener is not None and listener.utterance is not None
    listener.speech._emit(SpeechDecision("paused", 900.0, QUESTION))
    assert listener.utterance.words is None
    await resident.append(UtteranceEnded("item_1"))


async def test_a_prompt_or_logprobs_transcribe_whole_through_their_own_transcript(
    h: Harness,
) -> None:
    contexts = h.reserve(final=0)
    request = turn(
        Stage.ASR, audio=spoken(3, 4).tobytes(), transcription_prompt="Ada", logprobs=True
    )
    await h.submit(contexts, request)
    await h.until(lambda: h.finished(contexts[0].request_id))
    transcript = h.of(contexts[0].request_id)[0]
    assert transcript.text == "w3 w4"
    assert "live" not in transcript.metadata
    assert transcript.metadata["logprobs"] == ((" w3", -0.25), (" w4", -0.25))
    assert (h.asr.lives[0].prompt, h.asr.lives[0].logprobs) == ("Ada", True)


async def test_a_prepared_turn_freezes_the_utterance_and_a_discard_thaws_it(h: Harness) -> None:
    resident = Resident(h)
    await speak(h, resident, WORDS[:4])
    live = h.asr.lives[0]
    request = turn(Stage.ASR, audio=spoken(*WORDS[:4]).tobytes(), utterance="item_1")
    prepared = DuplexPreparedTurn("s1", 0, h.orch.sampling_defaults(), request.plan().prompt, 0, 0)
    h.orch.prepare_turn(prepared)
    await h.until(lambda: live.frozen)  # the prepared turn's final request froze it
    assert live.events[-1] == "final"
    h.orch.discard_prepared("s1")
    assert live.events[-1] == "thaw" and not live.frozen
    before = len(resident.deltas())
    for pair in (WORDS[4:6], WORDS[6:]):
        await resident.say(spoken(*pair))
        await partial_done(h)
    await h.until(lambda: len(resident.deltas()) > before)  # partials resumed
    await resident.append(UtteranceEnded("item_1"))


async def test_an_abort_of_the_resident_request_stops_its_live_work_at_once(h: Harness) -> None:
    resident = Resident(h)
    await speak(h, resident)
    h.asr.hold = True
    await resident.say(spoken(9, 10, 11))
    await h.until(lambda: bool(h.asr.waiting))  # a partial is in flight
    await h.orch.abort_requests([resident.rid])
    count = len(h.outputs)
    h.asr.hold = False
    await h.until(lambda: sum(h.engine.pending().values()) == 0)
    assert len(h.outputs) == count
    listener = h.orch.listener("s1")
    assert listener is not None and listener.resident_id is None
    # The next epoch's resident request hears on; the session's clock goes on.
    heard = listener.heard.end
    following = Resident(h, epoch=1)
    await following.append(Heard(spoken(1)[:FRAME].tobytes()))
    assert listener.heard.end == heard + FRAME
    await h.orch.cleanup([resident.rid, following.rid])
    assert h.orch.listener("s1") is None and h.orch.reserved_requests() == 0


async def test_an_utterance_spoken_across_an_epoch_goes_on_under_the_next_one(
    h: Harness,
) -> None:
    """A cancel in mid-utterance (the client's `response.cancel`) bumps the epoch: the
    words still being spoken keep their live transcript, so the deltas sent under both
    resident requests join into the final transcript."""
    resident = Resident(h)
    await speak(h, resident, WORDS[:4])
    before = resident.text()
    await h.orch.abort_requests([resident.rid])
    following = Resident(h, epoch=1)
    for pair in (WORDS[4:6], WORDS[6:]):
        await following.say(spoken(*pair))
        await partial_done(h)
    await h.until(lambda: bool(following.deltas()))
    assert len(h.asr.lives) == 1  # the same live transcript, not a new one
    contexts = h.reserve(epoch=1, final=0)
    await h.submit(contexts, turn(Stage.ASR, audio=spoken(*WORDS).tobytes(), utterance="item_1"))
    await following.append(UtteranceEnded("item_1"))
    await h.until(lambda: h.finished(contexts[0].request_id))
    transcript = h.of(contexts[0].request_id)[0]
    assert transcript.metadata["live"] is True
    assert transcript.text == " ".join(f"w{n}" for n in WORDS)
    assert transcript.text.startswith(before + following.text())
    await h.idle()


async def test_submissions_follow_the_seeds_resumable_semantics(h: Harness) -> None:
    resident = Resident(h)
    wrong = DuplexStageSubmission(
        resident.context, Listen().plan().prompt, already_submitted=True, resumable=True
    )
    with pytest.raises(ValueError, match="already_submitted"):
        await h.orch.submit(wrong)
    await resident.append(Listen())
    again = DuplexStageSubmission(
        resident.context, Listen().plan().prompt, already_submitted=False, resumable=True
    )
    with pytest.raises(ValueError, match="already_submitted"):
        await h.orch.submit(again)
    with pytest.raises(ValueError, match="append"):
        await h.orch.submit(
            DuplexStageSubmission(resident.context, {"x": 1}, already_submitted=True)
        )


async def test_the_audio_kept_without_speech_is_bounded(h: Harness) -> None:
    resident = Resident(h)
    second = np.zeros(SAMPLE_RATE, np.float32).astype("<f4").tobytes()
    for _ in range(int(LOOKBACK_S) * 3):
        await resident.append(Heard(second))
    listener = h.orch.listener("s1")
    assert listener is not None
    assert listener.heard.end == 3 * int(LOOKBACK_S) * SAMPLE_RATE
    assert listener.heard.end - listener.heard.start <= (LOOKBACK_S + 1) * SAMPLE_RATE
    assert len(listener.heard.since(0)) == listener.heard.end - listener.heard.start
    assert BLOCK * 10 == SAMPLE_RATE
