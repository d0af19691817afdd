"""Whisper tiny.en for live transcription: forced prefixes, previous text, token
log-probabilities, short commands as the full window hears them, and an utterance streamed
through LiveTranscript and the ASR stage."""

from __future__ import annotations

import math
import re
from itertools import count
from pathlib import Path

import numpy as np
import pytest

from bench.asr_short import compare, short_clips
from engine.listening.live_transcript import LiveDelta, LiveTranscript
from engine.stages.asr import AsrRequest, AsrStage, Transcriber, Transcription, load_transcriber
from engine.weights import registry
from tests.helpers import espeak

pytestmark = pytest.mark.models

RATE = 16000
SENTENCES = [
    "Can you remind me to call my mother tomorrow morning?",
    "The children played in the park until the sun went down.",
    "The meeting has been moved to Monday afternoon.",
    "It is raining outside, so take an umbrella.",
    "She likes to walk her dog in the morning.",
]


def speak(text: str) -> np.ndarray:
    return espeak(text, RATE, "-v", "en-us", "-s", "150")


def words(text: str) -> list[str]:
    return re.sub(r"[^a-z0-9' ]+", " ", text.lower()).split()


def word_error_rate(ref: str, hyp: str) -> float:
    r, h = words(ref), words(hyp)
    row = list(range(len(h) + 1))
    for i, rw in enumerate(r, 1):
        prev, row[0] = row[:], i
        for j, hw in enumerate(h, 1):
            row[j] = min(prev[j] + 1, row[j - 1] + 1, prev[j - 1] + (rw != hw))
    return row[-1] / max(1, len(r))


@pytest.fixture(scope="module")
def model_dir() -> Path:
    return registry.prepare("whisper-tiny.en", progress=False)


@pytest.fixture(scope="module")
def transcriber(model_dir: Path) -> Transcriber:
    return load_transcriber(model_dir)


@pytest.fixture(scope="module")
def sentence() -> np.ndarray:
    return speak(SENTENCES[0])


def one(transcriber: Transcriber, request: AsrRequest) -> Transcription:
    return transcriber.transcribe_requests([request])[0]


# ---------------------------------------------------------------- requests


def test_a_forced_prefix_starts_the_transcript(
    transcriber: Transcriber, sentence: np.ndarray
) -> None:
    free = one(transcriber, AsrRequest(sentence, logprobs=True))
    assert len(free.logprobs) == len(free.tokens) and all(lp <= 0 for lp in free.logprobs)
    # Forcing the start it would have chosen changes nothing; forced tokens are not scored.
    forced = one(transcriber, AsrRequest(sentence, tuple(free.tokens[:4]), logprobs=True))
    assert (forced.tokens, forced.text) == (free.tokens, free.text)
    assert all(math.isnan(lp) for lp in forced.logprobs[:4])
    assert forced.logprobs[4:] == pytest.approx(free.logprobs[4:], abs=1e-3)
    # Forcing another start: the transcript goes on from it.
    other = tuple(transcriber.tokenizer.encode(" Could you", add_special_tokens=False).ids)
    steered = one(transcriber, AsrRequest(sentence, other))
    assert tuple(steered.tokens[: len(other)]) == other
    assert steered.text.startswith("Could you") and "mother" in steered.text
    assert steered.logprobs == []


def test_previous_text_is_heard(transcriber: Transcriber) -> None:
    audio = speak("Send it to Jaxon.")
    assert "Jaxon" not in one(transcriber, AsrRequest(audio)).text
    assert "Jaxon" in one(transcriber, AsrRequest(audio, prompt="Names: Jaxon.")).text


def test_requests_of_different_lengths_share_a_batch(
    transcriber: Transcriber, sentence: np.ndarray
) -> None:
    other = speak(SENTENCES[2])
    prefix = tuple(one(transcriber, AsrRequest(other)).tokens[:3])
    requests = [
        AsrRequest(sentence, prompt="A call to make, and a meeting.", logprobs=True),
        AsrRequest(other, prefix, logprobs=True),
        AsrRequest(sentence[: RATE // 2], partial=True),
        AsrRequest(other),
    ]
    batched = transcriber.transcribe_requests(requests)
    for request, result in zip(requests, batched, strict=True):
        alone = one(transcriber, request)
        assert result.tokens == alone.tokens
        assert result.logprobs == pytest.approx(alone.logprobs, abs=1e-3, nan_ok=True)


def test_bad_prefixes_are_refused(transcriber: Transcriber, sentence: np.ndarray) -> None:
    stage = AsrStage(transcriber)
    with pytest.raises(ValueError, match="text tokens"):
        stage.add("a", AsrRequest(sentence, (transcriber.eot,)))
    with pytest.raises(ValueError, match="longer than"):
        stage.add("b", AsrRequest(sentence, (1,) * transcriber.max_tokens))
    assert not stage.has_work()


# ---------------------------------------------------------------- short commands


def test_short_commands_are_heard_as_the_full_window_hears_them(model_dir: Path) -> None:
    clips = short_clips(with_voice=False)
    assert len(clips) >= 10 and all(len(audio) < 1.5 * RATE for _, audio in clips)
    result = compare(model_dir, clips)
    assert result["agree"] >= 0.9 * len(clips), result["transcripts"]


# ---------------------------------------------------------------- live


def transcribe_live(
    stage: AsrStage, live: LiveTranscript, audio: np.ndarray, every_s: float = 0.5
) -> tuple[list[LiveDelta], LiveDelta, list[float]]:
    """Stream `audio` through the stage: a partial each `every_s`, then the final. Returns
    the deltas while speaking, the final delta, and when each delta came (audio seconds)."""
    ids = count()

    def run(request: AsrRequest) -> Transcription:
        request_id = f"live{next(ids)}"
        stage.add(request_id, request)
        [out] = stage.step()
        assert out.request_id == request_id and out.error is None
        return out.payload

    deltas, times = [], []
    step = int(every_s * RATE)
    for end in range(step, len(audio) + 1, step):
        delta = live.agree(run(live.request(audio[:end], final=False)))
        if delta is not None:
            deltas.append(delta)
            times.append(end / RATE)
    return deltas, live.finish(run(live.request(audio, final=True))), times


def test_an_utterance_streamed_live_ends_as_transcribed_whole(
    transcriber: Transcriber,
) -> None:
    gap = np.zeros(RATE // 2, np.float32)
    audio = np.concatenate([speak(SENTENCES[0]), gap, speak(SENTENCES[1])])
    stage = AsrStage(transcriber)
    live = stage.new_live_transcript(logprobs=True)
    deltas, last, times = transcribe_live(stage, live, audio)
    final = live.text + last.text
    assert "".join(d.text for d in [*deltas, last]) == final
    assert len(deltas) >= 3 and times[0] < len(audio) / RATE / 2  # words while speaking
    assert all(d.tokens and all(lp <= 0 for _, lp in d.tokens) for d in deltas)
    whole = transcriber.transcribe(audio)
    assert word_error_rate(whole, final) <= 0.1, (whole, final)
    assert word_error_rate(" ".join(SENTENCES[:2]), final) <= 0.15, final


def test_a_long_utterance_is_streamed_in_bounded_windows(transcriber: Transcriber) -> None:
    gap = np.zeros(int(0.4 * RATE), np.float32)
    audio = np.concatenate([x for s in SENTENCES * 2 for x in (speak(s), gap)])
    assert len(audio) > 28 * RATE
    stage = AsrStage(transcriber)
    live = stage.new_live_transcript()
    seen: list[int] = []
    add = stage.add

    def recording_add(request_id: str, inputs: AsrRequest) -> None:
        seen.append(len(inputs.audio))
        add(request_id, inputs)

    stage.add = recording_add  # type: ignore[method-assign]
    deltas, last, _ = transcribe_live(stage, live, audio, every_s=1.0)
    final = live.text + last.text
    assert "".join(d.text for d in [*deltas, last]) == final
    assert max(seen) <= 13 * RATE and live.window_start_s > 10.0
    assert word_error_rate(" ".join(SENTENCES * 2), final) <= 0.15, final
