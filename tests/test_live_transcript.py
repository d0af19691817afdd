"""LiveTranscript (LocalAgreement-2 over a growing utterance) with a fake recogniser, and
the ASR stage's scheduling of partial requests, with a fake transcriber."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import pytest

from engine.listening.live_transcript import LiveDelta, LiveTranscript
from engine.stages.asr import AsrRequest, AsrStage, Transcription

RATE = 16000
WORD_S, GAP_S = 0.3, 0.15

# A byte-level vocabulary: " café" takes three tokens, two of them halves of "é".
VOCAB: list[bytes] = [
    b" one", b" two", b" three", b" caf", b"\xc3", b"\xa9", b" don", b"'t", b" stop",
    b",", b" go", b".", b" ",
]  # fmt: skip
WORDS: list[list[int]] = [[0], [1], [2], [3, 4, 5], [6, 7], [8, 9], [10], [10, 11]]
MISHEARD = 12  # what a word cut off by the end of the audio sounds like: a lone space


def decode(tokens: Sequence[int]) -> str:
    return b"".join(VOCAB[t] for t in tokens).decode("utf-8", errors="replace")


def speech(words: list[int]) -> np.ndarray:
    """Each word a run of samples holding its number (so the fake can hear it), with
    silence between words."""
    parts = []
    for w in words:
        parts += [np.full(int(WORD_S * RATE), (w + 1) / 100, np.float32)]
        parts += [np.zeros(int(GAP_S * RATE), np.float32)]
    return np.concatenate(parts)


def heard_words(audio: np.ndarray) -> list[list[int]]:
    """Each run of a word's samples: its tokens if whole, else a mishearing."""
    words: list[list[int]] = []
    edges = np.flatnonzero(np.diff(np.concatenate([[0.0], audio, [0.0]])) != 0)
    for start, end in zip(edges[::2], edges[1::2], strict=False):
        w = round(float(audio[start]) * 100) - 1
        whole = end - start >= int(WORD_S * RATE) - 1
        words.append(WORDS[w % len(WORDS)] if whole else [MISHEARD])
    return words


@dataclass
class FakeRecogniser:
    """Transcribes fake speech like Whisper would: forced prefix first, then what it hears."""

    seen: list[AsrRequest] = field(default_factory=list)
    unsure: set[int] = field(default_factory=set)  # tokens heard with a low probability

    def __call__(self, request: AsrRequest) -> Transcription:
        self.seen.append(request)
        heard = [t for word in heard_words(request.audio) for t in word]
        prefix = list(request.prefix)
        tokens = prefix + (heard[len(prefix) :] if heard[: len(prefix)] == prefix else [])
        logprobs = [-2.0 if t in self.unsure else -0.01 * (t + 1) for t in tokens]
        logprobs = logprobs if request.logprobs else []
        text = decode(tokens).strip()
        return Transcription(text, tokens, 0, 1, len(request.audio) / RATE, logprobs)


def expected_text(words: list[int]) -> str:
    return decode([t for w in words for t in WORDS[w % len(WORDS)]]).strip()


def stream(
    live: LiveTranscript, audio: np.ndarray, recognise: FakeRecogniser, every_s: float = 0.5
) -> list[LiveDelta]:
    """Partials every `every_s` of audio, then the final: every delta returned."""
    deltas = []
    step = int(every_s * RATE)
    for end in range(step, len(audio), step):
        delta = live.agree(recognise(live.request(audio[:end], final=False)))
        if delta is not None:
            assert live.text.endswith(delta.text)
            deltas.append(delta)
    deltas.append(live.finish(recognise(live.request(audio, final=True))))
    return deltas


# ---------------------------------------------------------------- LiveTranscript


def test_deltas_are_appended_and_concatenate_to_the_final_transcript() -> None:
    words = list(range(len(WORDS))) * 2
    audio, recognise = speech(words), FakeRecogniser()
    live = LiveTranscript(decode)
    deltas = stream(live, audio, recognise)
    final = recognise(AsrRequest(audio)).text
    assert final == expected_text(words)
    assert "".join(d.text for d in deltas) == final
    assert len(deltas) > 5  # committed while speaking, not all at the end
    assert not deltas[0].text.startswith(" ")  # the transcript's leading space is dropped
    assert all(d.text for d in deltas[:-1])  # no empty deltas while speaking
    assert all("\ufffd" not in d.text for d in deltas)  # never half an "é"
    assert "café" in final and "don't" in final


def test_the_final_request_decodes_only_the_tail() -> None:
    words = [0, 1, 2, 4, 6, 5]
    audio, recognise = speech(words), FakeRecogniser()
    live = LiveTranscript(decode)
    stream(live, audio, recognise)
    final = recognise.seen[-1]
    assert not final.partial and final.prefix  # the committed tokens are forced
    assert decode(final.prefix).strip() == live.text


def test_a_word_cut_off_by_the_end_of_the_audio_is_not_committed() -> None:
    audio = speech([0, 1, 2])
    live, recognise = LiveTranscript(decode, min_agree_s=0.5), FakeRecogniser()
    # Both hypotheses end with a word still being spoken: only whole words commit.
    assert live.agree(recognise(live.request(audio[: int(0.55 * RATE)], final=False))) is None
    delta = live.agree(recognise(live.request(audio[: int(1.05 * RATE)], final=False)))
    assert delta == LiveDelta("one")
    assert live.text == "one"


def test_a_guess_that_ends_a_sentence_leaves_its_last_word_to_the_next() -> None:
    audio = np.concatenate([speech([0, 7]), np.zeros(RATE // 2, np.float32)])
    live, recognise = LiveTranscript(decode, min_agree_s=0.5), FakeRecogniser()
    for seconds in (1.0, 1.2):  # both guesses are "one go.", whole
        delta = live.agree(recognise(live.request(audio[: int(seconds * RATE)], final=False)))
    assert delta == LiveDelta("one")  # not "one go.": the speaker may go on
    assert live.finish(recognise(live.request(audio, final=True))) == LiveDelta(" go.")


def test_guesses_over_the_first_fraction_of_a_second_count_for_nothing() -> None:
    audio = speech([0, 1, 2, 3])
    live, recognise = LiveTranscript(decode, min_agree_s=1.0), FakeRecogniser()
    for seconds in (0.4, 0.6, 0.8, 0.95):  # these guesses agree, but are too short
        guess = recognise(live.request(audio[: int(seconds * RATE)], final=False))
        assert live.agree(guess) is None
    assert live.text == ""
    live.agree(recognise(live.request(audio[: int(1.05 * RATE)], final=False)))
    delta = live.agree(recognise(live.request(audio[: int(1.5 * RATE)], final=False)))
    assert delta is not None and live.text == delta.text != ""


def test_an_unsure_word_and_those_after_it_wait_until_a_guess_is_sure_of_it() -> None:
    audio = speech([0, 1, 4, 2, 5])
    live, recognise = LiveTranscript(decode, min_agree_s=0.5), FakeRecogniser(unsure={6})
    for seconds in (1.0, 1.5, 2.0, 2.3):  # the guesses agree on "one two don't three"
        live.agree(recognise(live.request(audio[: int(seconds * RATE)], final=False)))
    assert live.text == "one two"
    assert all(r.logprobs for r in recognise.seen)  # partials always ask for them
    recognise.unsure.clear()  # more audio: Whisper is sure of "don't" now
    delta = live.agree(recognise(live.request(audio[: int(2.4 * RATE)], final=False)))
    assert delta == LiveDelta(" don't three stop,")
    assert delta.tokens == ()  # the caller did not ask for log-probabilities


def test_logprobs_come_with_each_committed_token() -> None:
    words = [3, 4, 0, 1]
    audio, recognise = speech(words), FakeRecogniser()
    live = LiveTranscript(decode, logprobs=True)
    deltas = stream(live, audio, recognise)
    pairs = [p for d in deltas for p in d.tokens]
    tokens = [t for w in words for t in WORDS[w]]
    assert [text for text, _ in pairs] == [decode([t]) for t in tokens]
    assert [lp for _, lp in pairs] == pytest.approx([-0.01 * (t + 1) for t in tokens])
    assert all(r.logprobs for r in recognise.seen)
    assert LiveTranscript(decode).request(audio, final=True).logprobs is False
    assert LiveTranscript(decode).request(audio, final=False).logprobs is True


def test_prompt_goes_to_every_request() -> None:
    live, recognise = LiveTranscript(decode, prompt="Names: Ana."), FakeRecogniser()
    stream(live, speech([0, 1]), recognise)
    assert {r.prompt for r in recognise.seen} == {"Names: Ana."}


def test_after_a_final_request_nothing_commits_until_thawed() -> None:
    words = [0, 1, 2, 6, 5, 10, 1, 2]
    audio, recognise = speech(words), FakeRecogniser()
    live = LiveTranscript(decode)
    pause = int(2.0 * RATE)  # a prepared turn at 2 s, then the speech goes on
    for end in (RATE // 2, RATE, int(1.5 * RATE)):
        live.agree(recognise(live.request(audio[:end], final=False)))
    late = live.request(audio[: pause - RATE // 4], final=False)
    committed = live.text
    prepared = live.finish(recognise(live.request(audio[:pause], final=True)))
    assert live.frozen and prepared.text  # the tail, not emitted: the turn is discarded
    assert live.agree(recognise(late)) is None  # a partial arriving after the final
    assert live.text == committed
    with pytest.raises(RuntimeError, match="thaw"):
        live.request(audio[:pause], final=False)
    live.thaw()
    deltas = [LiveDelta(committed)]
    for end in range(pause, len(audio), RATE // 2):
        delta = live.agree(recognise(live.request(audio[:end], final=False)))
        if delta is not None:
            deltas.append(delta)
    deltas.append(live.finish(recognise(live.request(audio, final=True))))
    assert "".join(d.text for d in deltas) == expected_text(words)


def test_finish_may_add_nothing() -> None:
    audio, recognise = speech([0, 1, 2]), FakeRecogniser()
    silence = np.zeros(RATE, np.float32)
    live = LiveTranscript(decode)
    deltas = stream(live, np.concatenate([audio, silence]), recognise)
    assert deltas[-1] == LiveDelta("")
    assert "".join(d.text for d in deltas) == "one two three"


def test_a_long_utterance_re_decodes_a_bounded_window() -> None:
    words = [i % 5 for i in range(140)]  # over 60 s, past Whisper's 30 s window
    audio, recognise = speech(words), FakeRecogniser()
    live = LiveTranscript(decode, window_s=8.0)
    deltas = stream(live, audio, recognise)
    assert len(audio) > 60 * RATE
    assert "".join(d.text for d in deltas) == expected_text(words)
    assert max(len(r.audio) for r in recognise.seen) <= (8.0 + 0.5) * RATE
    assert live.window_start_s > 50.0
    # Sealed text becomes Whisper's previous text, so later windows keep the context.
    prompt = recognise.seen[-1].prompt
    assert len(prompt) > 100 and prompt in expected_text(words)


def test_a_seal_commits_the_window_up_to_a_pause_after_the_committed_words() -> None:
    audio, recognise = speech([i % 3 for i in range(30)]), FakeRecogniser()
    live = LiveTranscript(decode, window_s=6.0)
    end = 0
    while not live.sealing:
        end += RATE // 2
        request = live.request(audio[:end], final=False)
        result = recognise(request)
        if not live.sealing:
            live.agree(result)
    committed = live.text
    assert decode(request.prefix).strip() == committed  # the committed words come first
    assert 3 * RATE <= len(request.audio) <= end - RATE // 2  # second half, not the end
    assert request.audio[-1] == 0.0  # cut in a pause
    delta = live.agree(result)
    assert delta is not None and committed + delta.text == result.text
    assert live.window_start_s == len(request.audio) / RATE
    assert live.request(audio[: end + RATE // 2], final=False).prompt == result.text


def test_a_seal_that_may_cut_before_the_last_committed_word_is_tried_again() -> None:
    words = [i % 3 for i in range(40)]
    live = LiveTranscript(decode, window_s=6.0)

    @dataclass
    class Deaf(FakeRecogniser):
        # The first seals hear no word after the committed ones: unless every committed
        # word was first heard before the cut, it may lie after it, and they must not seal.
        refused: int = 0

        def __call__(self, request: AsrRequest) -> Transcription:
            out = super().__call__(request)
            if live.sealing and self.refused < 3:
                self.refused += 1
                prefix = list(request.prefix)
                return Transcription(decode(prefix).strip(), prefix, 0, 1, out.duration_s)
            return out

    recognise = Deaf()
    deltas = stream(live, speech(words), recognise, every_s=0.25)
    assert recognise.refused == 3 and live.window_start_s > 0
    assert "".join(d.text for d in deltas) == expected_text(words)


def test_window_limits_are_checked() -> None:
    with pytest.raises(ValueError, match="window"):
        LiveTranscript(decode, window_s=1.0)
    with pytest.raises(ValueError, match="window"):
        LiveTranscript(decode, window_s=12.0, hard_window_s=30.0)
    with pytest.raises(ValueError, match="window"):
        LiveTranscript(decode, window_s=12.0, hard_window_s=10.0)


# ---------------------------------------------------------------- stage scheduling


@dataclass
class FakeTranscriber:
    batches: list[list[AsrRequest]] = field(default_factory=list)

    def check(self, request: AsrRequest) -> AsrRequest:
        return request

    def decode(self, tokens: Sequence[int]) -> str:
        return decode(tokens)

    def transcribe_requests(self, requests: list[AsrRequest]) -> list[Transcription]:
        self.batches.append(requests)
        return [FakeRecogniser()(r) for r in requests]


def test_final_requests_go_before_partials_which_are_batched() -> None:
    fake = FakeTranscriber()
    stage = AsrStage(fake, max_batch=2, max_partial_batch=3)  # type: ignore[arg-type]
    audio = speech([0, 1])
    for i in range(4):
        stage.add(f"p{i}", AsrRequest(audio, partial=True))
    stage.add("f0", AsrRequest(audio))
    stage.add("plain", audio)
    first = stage.step()
    assert [o.request_id for o in first] == ["f0", "plain"]
    assert isinstance(first[0].payload, Transcription) and first[1].payload == "one two"
    stage.add("f1", AsrRequest(audio, prefix=(0,)))
    assert [o.request_id for o in stage.step()] == ["f1"]  # a final overtakes waiting partials
    assert [o.request_id for o in stage.step()] == ["p0", "p1", "p2"]  # one shared pass
    stage.abort("p3")
    assert stage.step() == [] and not stage.has_work()
    assert [len(b) for b in fake.batches] == [2, 1, 3]


def test_a_live_transcript_comes_from_the_stage() -> None:
    stage = AsrStage(FakeTranscriber())  # type: ignore[arg-type]
    live = stage.new_live_transcript("Names: Ana.", True)
    request = live.request(speech([0]), final=False)
    assert (request.prompt, request.logprobs, request.partial) == ("Names: Ana.", True, True)
    with pytest.raises(ValueError, match="AsrRequest"):
        stage.add("x", [0.0])
    with pytest.raises(ValueError, match="max_partial_batch"):
        AsrStage(FakeTranscriber(), max_partial_batch=0)  # type: ignore[arg-type]
