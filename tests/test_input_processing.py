"""The session's input processing: AEC3 against the far end on the session clock, noise
suppression, and the settings that switch them, on synthetic rooms and real speech."""

from __future__ import annotations

import base64
import json
import threading
from pathlib import Path

import numpy as np
import pytest
import soundfile as sf
import soxr
from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.config import GatewayConfig
from gateway.protocol.audio import ENGINE_RATE, PCM16, Samples
from gateway.session import input_processing
from gateway.session.actions import CancelResponse, Hear, WatchWords
from gateway.session.backend import ResponseDone, ResponseOutput
from gateway.session.far_end import KEPT_S, FarEnd
from gateway.session.input_processing import FRAME, InputProcessing, NoiseReduction, _History
from gateway.session.realtime import RealtimeSession

RECORDING = Path("/usr/share/sounds/alsa/Front_Center.wav")
OTHER = Path("/usr/share/sounds/alsa/Rear_Left.wav")
CHUNK = 640  # 40 ms at 16 kHz, as a client appends


def recording(path: Path = RECORDING) -> Samples:
    audio, rate = sf.read(path, dtype="float32")
    return soxr.resample(audio, rate, ENGINE_RATE).astype(np.float32)


def room(far: Samples, delay_ms: int, gain_db: float, seed: int = 0) -> Samples:
    """What the microphone hears of `far`: delayed, attenuated, with a reverberant tail."""
    rng = np.random.default_rng(seed)
    delay = delay_ms * ENGINE_RATE // 1000
    tail = np.arange(ENGINE_RATE // 5)
    response = np.zeros(delay + len(tail), np.float32)
    response[delay] = 1.0
    response[delay:] += 0.1 * rng.standard_normal(len(tail)) * np.exp(-tail / 800)
    response *= 10 ** (gain_db / 20) / np.sqrt(np.sum(response**2))
    return np.convolve(far, response)[: len(far)].astype(np.float32)


class Clock:
    def __init__(self) -> None:
        self.ms = 0.0

    def __call__(self) -> float:
        return self.ms


def run(mic: Samples, far: Samples | None, **settings: object) -> Samples:
    """Feed `mic` in 40 ms chunks, the far end playing `far` from time 0."""
    return processed(mic, far, **settings)[0]


def processed(
    mic: Samples, far: Samples | None, **settings: object
) -> tuple[Samples, InputProcessing]:
    """`run`'s output, and the processing that made it."""
    clock = Clock()
    far_end = FarEnd(clock)
    if far is not None:
        far_end.play("item_1", far, ENGINE_RATE)
        far_end.flush()
    processing = InputProcessing(
        far_end,
        echo_cancellation=bool(settings.get("echo", True)),
        noise_reduction=settings.get("noise"),  # type: ignore[arg-type]
        start_ms=0.0,
    )
    out = []
    for lo in range(0, len(mic), CHUNK):
        chunk = mic[lo : lo + CHUNK]
        clock.ms += len(chunk) / 16
        out.append(processing.push(chunk, last=lo + CHUNK >= len(mic)))
    return np.concatenate(out), processing


def power_db(samples: Samples) -> float:
    return float(10 * np.log10(np.mean(samples.astype(np.float64) ** 2) + 1e-12))


def test_a_synthetic_echo_is_cancelled() -> None:
    far = np.tile(recording(), 4)
    mic = room(far, delay_ms=140, gain_db=-6)
    out, processing = processed(mic, far)
    assert processing.echo_heard  # the canceller took the echo off: its output goes on
    assert len(out) == len(mic)
    settled = slice(len(mic) // 2, None)  # after the delay estimate and filter converge
    erle = power_db(mic[settled]) - power_db(out[settled])
    assert erle > 20, erle


def test_a_person_over_the_echo_is_kept() -> None:
    far = np.tile(recording(), 5)
    near = recording(OTHER)
    mic = room(far, delay_ms=80, gain_db=-4, seed=1)
    start = len(mic) * 3 // 5  # the echo heard (rule 7) a second of echo before
    mic[start : start + len(near)] += near
    out = run(mic, far)
    talk = slice(start, start + len(near))
    echo_only = slice(start - len(near), start)
    # The person comes through near their own level; the echo alone does not.
    assert power_db(out[talk]) > power_db(near) - 6
    assert power_db(out[talk]) - power_db(out[echo_only]) > 15


def test_speech_over_an_answer_without_echo_is_kept_from_the_start() -> None:
    # A headset, or a browser that cancelled its own echo: the answer plays, none of it
    # comes back, and the user talks over it one second in.
    far = np.tile(recording(), 3)
    near = recording(OTHER)
    mic = np.zeros(len(far), np.float32)
    mic[ENGINE_RATE : ENGINE_RATE + len(near)] = near
    out, processing = processed(mic, far)
    # No echo was heard: the speech goes on as it came, not as the canceller made it
    # (which keeps its level but costs Whisper words).
    assert not processing.echo_heard
    np.testing.assert_array_equal(out, mic)


def test_speech_over_a_quiet_headset_leak_is_kept() -> None:
    # Headphones that leak a little of the answer into the microphone, 40 dB down: the
    # canceller takes it off, but nothing reached the microphone above its noise, so
    # the user's speech over it goes on as it came.
    far = np.tile(recording(), 3)
    near = recording(OTHER)
    mic = room(far, delay_ms=30, gain_db=-40)
    mic[ENGINE_RATE : ENGINE_RATE + len(near)] += near
    out, processing = processed(mic, far)
    assert not processing.echo_heard
    np.testing.assert_array_equal(out, mic)


def test_input_passes_untouched_while_nothing_plays(monkeypatch: pytest.MonkeyPatch) -> None:
    # ... and without work frame by frame: most sessions, most of the time, play nothing.
    frames: list[int] = []
    monkeypatch.setattr(InputProcessing, "_frame", lambda self, frame: frames.append(1))
    mic = recording()
    out = run(mic, None)
    np.testing.assert_array_equal(out, mic)
    assert frames == []


def test_the_canceller_is_made_and_warmed_on_a_worker_once_a_spoken_response_starts(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The warm-up is tens of ms of CPU: on the event loop it would hold up every session.
    # The canceller's state is about 0.4 MiB: a session that never speaks needs none.
    threads: list[str] = []
    started = threading.Event()
    warm_up, module = input_processing._warm_up, input_processing._module
    made: list[object] = []

    def recorded(apm: object) -> None:
        threads.append(threading.current_thread().name)
        started.set()
        warm_up(apm)  # type: ignore[arg-type]

    def counted(*args: object) -> object:
        made.append(module(*args))  # type: ignore[arg-type]
        return made[-1]

    monkeypatch.setattr(input_processing, "_warm_up", recorded)
    monkeypatch.setattr(input_processing, "_module", counted)
    rt = RealtimeSession(config=GatewayConfig(), model="m", beta=False)
    heard(rt, np.zeros(ENGINE_RATE, np.float32))
    assert made == []
    rt.receive_text(json.dumps({"type": "response.create"}))
    (start,) = [a for a in rt.actions() if type(a).__name__ == "StartResponse"]
    heard(rt, np.zeros(CHUNK, np.float32))  # the answer has not played yet
    assert started.wait(timeout=10)
    assert threads[0].startswith("echo-warm-up")
    far = np.tile(recording(), 2)
    rt.receive_response_event(
        ResponseOutput(start.response_id, "audio", audio=far.tobytes(), sample_rate=ENGINE_RATE)
    )
    echo = room(far, delay_ms=60, gain_db=-6)
    settled = slice(len(far) // 2, None)
    assert power_db(echo[settled]) - power_db(heard(rt, echo)[settled]) > 15
    assert len(threads) == len(made) == 1


def test_the_stream_keeps_every_sample_in_order() -> None:
    clock = Clock()
    processing = InputProcessing(
        FarEnd(clock), echo_cancellation=True, noise_reduction=None, start_ms=0.0
    )
    sizes = [7, FRAME, 333, 1, 2 * FRAME + 5]
    out = [processing.push(np.ones(n, np.float32)) for n in sizes]
    out.append(processing.push(np.zeros(0, np.float32), last=True))
    assert sum(len(o) for o in out) == sum(sizes)


@given(
    st.lists(st.tuples(st.integers(-3 * FRAME, 5 * FRAME), st.booleans()), min_size=1, max_size=40),
    st.integers(0, 3 * _History._SIZE),
    st.integers(0, FRAME * 12),
)
@settings(max_examples=200, deadline=None)
def test_the_history_reads_what_was_written_last_within_its_span(
    steps: list[tuple[int, bool]], offset: int, count: int
) -> None:
    """Against a model that keeps every sample by clock index: a frame written at `at`,
    silence over a gap, and nothing before the span the history still holds."""
    history, model = _History(), {}
    at, start, end = offset, offset, offset
    for n, (step, silent) in enumerate(steps):
        at = max(at + step, 0)
        frame = None if silent else np.arange(FRAME, dtype=np.float32) + 1000 * n + 1
        history.write(at, frame)
        if at < start:
            start = at
        model.update({i: 0.0 for i in range(max(end, at - _History._SIZE), at)})
        model.update({at + i: 0.0 if frame is None else float(frame[i]) for i in range(FRAME)})
        end = at + FRAME
        start = max(start, end - _History._SIZE)
    for first in (end - count, start - FRAME, at):
        expected = [model[i] if start <= i < end else 0.0 for i in range(first, first + count)]
        assert history.read(first, count).tolist() == expected


def test_noise_suppression_lowers_stationary_noise() -> None:
    noise = (0.05 * np.random.default_rng(2).standard_normal(3 * ENGINE_RATE)).astype(np.float32)
    out = run(noise, None, echo=False, noise=NoiseReduction("far_field"))
    settled = slice(ENGINE_RATE, None)
    assert power_db(noise[settled]) - power_db(out[settled]) > 6


def test_a_truncated_item_stops_playing_where_the_client_stopped() -> None:
    clock = Clock()
    far_end = FarEnd(clock)
    far_end.play("item_1", np.ones(ENGINE_RATE, np.float32), ENGINE_RATE)
    clock.ms = 100
    far_end.truncate("item_1", 250)
    assert far_end.played_until == 250 * 16
    assert not far_end.read(250 * 16, 160).any() and far_end.read(0, 160).all()


def test_the_far_end_knows_what_its_audio_said_where_it_played() -> None:
    clock = Clock()
    far_end = FarEnd(clock)
    second = np.ones(ENGINE_RATE, np.float32)
    far_end.play("item_1", second, ENGINE_RATE, "Once upon a time")
    far_end.play("item_1", second, ENGINE_RATE, " there was a dog.")
    far_end.flush()
    clock.ms = 3000  # the client went quiet; the next answer plays from now
    far_end.play("item_2", second, ENGINE_RATE, "Hello.")
    assert far_end.said_between(0, 100) == "Once upon a time"
    assert far_end.said_between(ENGINE_RATE + 100, 2 * ENGINE_RATE) == " there was a dog."
    assert far_end.said_between(2 * ENGINE_RATE + 100, 3 * ENGINE_RATE) == ""  # the gap
    assert far_end.said_between(0, 10 * ENGINE_RATE) == (
        "Once upon a time  there was a dog. Hello."
    )
    far_end.truncate("item_2", 0)  # never played
    assert far_end.said_between(3 * ENGINE_RATE, 10 * ENGINE_RATE) == ""


def test_audio_sent_ahead_plays_after_the_audio_before_it() -> None:
    clock = Clock()
    far_end = FarEnd(clock)
    far_end.play("item_1", np.ones(1600, np.float32), ENGINE_RATE)
    clock.ms = 20  # the next delta goes out while the first still plays
    far_end.play("item_1", np.full(1600, 2.0, np.float32), ENGINE_RATE)
    far_end.flush()
    assert far_end.read(1590, 20).tolist() == [1.0] * 10 + [2.0] * 10
    clock.ms = 1000  # after a gap, the next answer starts when it is sent
    far_end.play("item_2", np.ones(160, np.float32), ENGINE_RATE)
    far_end.flush()
    assert far_end.read(16_000, 160).all() and not far_end.read(15_000, 160).any()


def test_a_client_that_sends_no_input_keeps_a_bounded_far_end() -> None:
    far_end = FarEnd(Clock())  # the clock never moves: no input arrives
    second = np.ones(ENGINE_RATE, np.float32)
    for n in range(KEPT_S + 5):
        far_end.play(f"item_{n}", second, ENGINE_RATE)
        far_end.flush()
    assert far_end.end == (KEPT_S + 5) * ENGINE_RATE
    assert far_end.read(0, 16).sum() == 0  # the oldest audio is gone
    assert far_end.read(far_end.end - 16, 16).all()


# ---- settings: the session fields, both shapes ------------------------------------------


def session(beta: bool = False, **config: object) -> RealtimeSession:
    config = {"echo_cancellation": True, **config}
    rt = RealtimeSession(config=GatewayConfig(**config), model="m", beta=beta)  # type: ignore[arg-type]
    rt.events_to_send()
    return rt


def update(rt: RealtimeSession, fields: dict[str, object]) -> dict:
    body = fields if rt.beta else {"type": "realtime", **fields}
    rt.receive_text(json.dumps({"type": "session.update", "session": body}))
    (event,) = rt.events_to_send()
    return event


def heard(rt: RealtimeSession, samples: Samples) -> Samples:
    """Append `samples` (16 kHz) as PCM16 24 kHz; what the engine hears of them."""
    pcm = PCM16.encode(soxr.resample(samples, ENGINE_RATE, 24000))
    rt.actions()
    for lo in range(0, len(pcm), 1920):
        audio = base64.b64encode(pcm[lo : lo + 1920]).decode()
        rt.receive_text(json.dumps({"type": "input_audio_buffer.append", "audio": audio}))
    return np.concatenate([a.samples for a in rt.actions() if isinstance(a, Hear)])


GA_NEAR = {"audio": {"input": {"noise_reduction": {"type": "near_field"}}}}
BETA_FAR = {"input_audio_noise_reduction": {"type": "far_field"}}


@pytest.mark.parametrize(
    ("beta", "fields", "kind"), [(False, GA_NEAR, "near_field"), (True, BETA_FAR, "far_field")]
)
def test_noise_reduction_is_accepted_and_applied(beta: bool, fields: dict, kind: str) -> None:
    noise = (0.05 * np.random.default_rng(3).standard_normal(3 * ENGINE_RATE)).astype(np.float32)
    plain = session(beta)
    update(plain, {})
    reduced = session(beta)
    event = update(reduced, fields)
    assert event["type"] == "session.updated", event
    shown = event["session"]
    value = shown["input_audio_noise_reduction"] if beta else shown["audio"]["input"]
    assert (value if beta else value["noise_reduction"]) == {"type": kind}
    settled = slice(ENGINE_RATE, None)
    before, after = heard(plain, noise)[settled], heard(reduced, noise)[settled]
    assert power_db(before) - power_db(after) > 6
    # null turns it off again, as with OpenAI.
    off = (
        {"input_audio_noise_reduction": None}
        if beta
        else {"audio": {"input": {"noise_reduction": None}}}
    )
    event = update(reduced, off)
    value = event["session"]["input_audio_noise_reduction" if beta else "audio"]
    assert (value if beta else value["input"]["noise_reduction"]) is None


@pytest.mark.parametrize(
    ("beta", "fields"),
    [
        (False, {"audio": {"input": {"echo_cancellation": False}}}),
        (True, {"input_audio_echo_cancellation": False}),
    ],
)
def test_the_session_field_turns_echo_cancellation_off(beta: bool, fields: dict) -> None:
    far = np.tile(recording(), 2)
    on, off = session(beta), session(beta)
    event = update(off, fields)
    assert event["type"] == "session.updated", event
    for rt in (on, off):
        play(rt, far)
    echo = room(far, delay_ms=60, gain_db=-6)
    settled = slice(len(far) // 2, None)
    assert power_db(heard(off, echo)[settled]) - power_db(heard(on, echo)[settled]) > 15


def test_echo_cancellation_is_on_by_default() -> None:
    far = np.tile(recording(), 2)
    rt = RealtimeSession(config=GatewayConfig(), model="m", beta=False)
    (created,) = (e for e in rt.events_to_send() if e["type"] == "session.created")
    assert created["session"]["audio"]["input"]["echo_cancellation"] is True
    play(rt, far)
    echo = room(far, delay_ms=60, gain_db=-6)
    settled = slice(len(far) // 2, None)
    assert power_db(echo[settled]) - power_db(heard(rt, echo)[settled]) > 15


def test_the_profile_turns_echo_cancellation_off() -> None:
    far = np.tile(recording(), 2)
    rt = session(echo_cancellation=False)
    assert rt.settings.echo_cancellation is False
    play(rt, far)
    echo = room(far, delay_ms=60, gain_db=-6)
    out = heard(rt, echo)
    assert abs(power_db(out) - power_db(echo)) < 1


def play(rt: RealtimeSession, far: Samples, text: str = "") -> None:
    """A spoken answer (saying `text`): its audio goes out to the client now, as the
    engine produced it."""
    rt.receive_text(
        json.dumps(
            {
                "type": "conversation.item.create",
                "item": {
                    "type": "message",
                    "role": "user",
                    "content": [{"type": "input_text", "text": "hi"}],
                },
            }
        )
    )
    rt.receive_text(json.dumps({"type": "response.create"}))
    (start,) = [a for a in rt.actions() if type(a).__name__ == "StartResponse"]
    rt.receive_response_event(
        ResponseOutput(
            start.response_id, "audio", text, audio=far.tobytes(), sample_rate=ENGINE_RATE
        )
    )
    rt.events_to_send()


# ---- double talk: what confirms an interruption ------------------------------------------


def test_the_answers_echo_does_not_confirm_an_interruption_and_a_person_does() -> None:
    # A canceller that has not yet learnt the room lets the first answer's echo through;
    # the voice detector hears speech and confirms it. The far end explains it: it is a
    # candidate again. A person talking over the echo is confirmed.
    far = np.tile(recording(), 3)
    rt = session(turns={"min_interruption_ms": 1000})
    play(rt, far)
    answer = rt.active_id
    echo = room(far, delay_ms=120, gain_db=-6)
    heard(rt, echo[:ENGINE_RATE])
    rt.speech_started(200)
    rt.speech_confirmed(200)
    assert rt.events_to_send() == [] and rt.active_id == answer
    actions = rt.actions()
    assert WatchWords(again=True) in actions
    assert not [a for a in actions if isinstance(a, CancelResponse)]
    person = recording(OTHER)
    heard(rt, echo[ENGINE_RATE : ENGINE_RATE + len(person)] + person)
    rt.speech_confirmed(1000)
    events = rt.events_to_send()
    assert [e["type"] for e in events] == ["input_audio_buffer.speech_started"]
    assert CancelResponse(answer, "turn_detected") in rt.actions()


def test_a_person_saying_the_answers_own_words_is_its_echo() -> None:
    # Whisper hears the canceller's residue as the words the answer was speaking: those
    # are its echo, whatever share of the energy the far end explains.
    far = np.tile(recording(), 3)
    rt = session(turns={"min_interruption_ms": 1000})
    play(rt, far, "Front center. Once upon a time there was a dog.")
    answer = rt.active_id
    echo = room(far, delay_ms=120, gain_db=-6)
    person = recording(OTHER)
    heard(rt, echo[: ENGINE_RATE + len(person)] + np.pad(person, (ENGINE_RATE, 0)))
    rt.speech_started(1000)
    rt.speech_confirmed(1000, "Front center.")
    assert rt.events_to_send() == [] and rt.active_id == answer
    assert WatchWords(again=True) in rt.actions()
    rt.speech_confirmed(1000, "Rear left.")  # their own words: a person
    assert [e["type"] for e in rt.events_to_send()] == ["input_audio_buffer.speech_started"]


def test_the_answers_words_from_a_microphone_without_its_echo_are_a_persons() -> None:
    # A headset: nothing of the answer reaches the microphone, and the person happens
    # to say a word the answer has just said.
    far = np.tile(recording(), 3)
    rt = session(turns={"min_interruption_ms": 1000})
    play(rt, far, "Stop right there, said the dragon.")
    person = recording(OTHER)
    heard(rt, np.pad(person, (ENGINE_RATE, 0)))
    rt.speech_started(1000)
    rt.speech_confirmed(1000, "Stop.")
    assert [e["type"] for e in rt.events_to_send()] == ["input_audio_buffer.speech_started"]


@pytest.mark.parametrize(
    ("share", "cancelled_db", "said", "echo"),
    [
        # Live, in bench/echo.py's rooms (bench/RESULTS.md, "The answer's own words"):
        (0.34, 1.6, True, True),  # "Follow.": a hall's echo, little of it explained
        (0.34, 1.6, False, False),  # the same without the answer's words: a person
        (0.35, 3.2, False, True),  # "Girl not me": a kiosk's echo, garbled; weak signs agree
        (0.22, 3.3, False, False),  # "for me, please.": a person
        (0.80, 21.3, False, True),  # "Bye bye.": echo, misheard; strong signs
        (0.01, 0.3, True, False),  # no echo in the microphone: the words are a person's
    ],
)
def test_the_answers_own_words_are_its_echo_and_other_words_prove_nothing(
    share: float, cancelled_db: float, said: bool, echo: bool
) -> None:
    assert input_processing.is_echo(share, cancelled_db, said) is echo


@pytest.mark.parametrize(
    ("share", "cancelled_db", "said", "excess_db", "echo"),
    [
        # Live, a speakerphone's echo 6 dB below the voice (tests/test_echo_real.py,
        # bench/RESULTS.md, "How loud the room's echo is"): persons whose pauses let
        # the echo through and whom AEC3's suppressor took down with it.
        (0.54, 12.4, False, 5.5, False),
        (0.33, 3.9, False, 5.8, False),
        (0.98, 12.8, False, -1.2, True),  # the echo alone
        (0.35, 3.2, False, 1.1, True),  # not clearly louder: the other signs decide
        (0.22, 3.3, False, 1.0, False),
        # Live, a kiosk's echo while AEC3 learnt the room (bench/RESULTS.md, "Speech no
        # louder than the room's echo"): too little explained or taken off to tell.
        (0.46, 1.1, False, -0.6, True),
        (0.46, 1.1, False, None, False),
        (0.34, 1.6, True, 6.0, True),  # the answer's words
    ],
)
def test_the_rooms_learnt_echo_tells_a_person_from_the_echo(
    share: float, cancelled_db: float, said: bool, excess_db: float | None, echo: bool
) -> None:
    assert input_processing.is_echo(share, cancelled_db, said, excess_db) is echo


def test_without_echo_cancellation_a_confirmation_stands() -> None:
    far = np.tile(recording(), 3)
    rt = session(echo_cancellation=False, turns={"min_interruption_ms": 1000})
    play(rt, far)
    heard(rt, room(far, delay_ms=120, gain_db=-6)[:ENGINE_RATE])
    rt.speech_started(200)
    rt.speech_confirmed(200)
    assert [e["type"] for e in rt.events_to_send()] == ["input_audio_buffer.speech_started"]


def test_speech_while_a_finished_answer_still_plays_waits_to_be_confirmed() -> None:
    # The answer was written out long before its audio finished playing: its echo
    # still comes back, so speech then is a candidate, and the echo does not count.
    far = np.tile(recording(), 3)
    rt = session(turns={"min_interruption_ms": 1000})
    play(rt, far)
    answer = rt.active_id
    assert answer is not None
    rt.receive_response_event(ResponseDone(answer, "completed"))
    rt.events_to_send()
    assert rt.active_id is None
    heard(rt, room(far, delay_ms=120, gain_db=-6)[:ENGINE_RATE])
    rt.speech_started(200)
    assert rt.events_to_send() == []
    assert WatchWords() in rt.actions()
    rt.speech_confirmed(200)
    assert rt.events_to_send() == []
    assert WatchWords(again=True) in rt.actions()


def test_a_check_right_after_a_commit_sees_the_speech_before_it() -> None:
    # A commit flushes the processing (its last frame padded) and takes the clock back
    # to the end of the real samples; the echo check that follows must still look at
    # the speech before the commit, and the far end before that.
    far = np.tile(recording(), 3)
    mic = room(far, delay_ms=120, gain_db=-10)
    clock = Clock()
    far_end = FarEnd(clock)
    far_end.play("item_1", far, ENGINE_RATE)
    far_end.flush()
    processing = InputProcessing(
        far_end, echo_cancellation=True, noise_reduction=None, start_ms=0.0
    )
    commit = 2 * ENGINE_RATE + 100  # not on a 10 ms frame: the flush pads
    for lo in range(0, commit, CHUNK):
        chunk = mic[lo : min(lo + CHUNK, commit)]
        clock.ms += len(chunk) / 16
        processing.push(chunk, last=lo + CHUNK >= commit)
    processing.restart(commit / 16)
    after = commit + 1600
    for lo in range(commit, after, CHUNK):
        clock.ms += CHUNK / 16
        processing.push(mic[lo : lo + CHUNK])
    assert processing.heard_echo(commit / 16 - 800, after / 16) is True


def test_one_window_the_canceller_took_much_off_is_not_yet_an_echo() -> None:
    # On a headset, AEC3's suppressor once took 18 dB off one quiet window (a person's
    # speech starting over the answer); an echo is taken off window after window.
    processing = InputProcessing(
        FarEnd(Clock()), echo_cancellation=True, noise_reduction=None, start_ms=0.0
    )
    window = input_processing.COUPLING_WINDOW_MS * ENGINE_RATE // 1000
    heard = np.full(window, 0.01, np.float32)  # -40 dBFS: the microphone heard something

    def weigh(cancelled_db: float) -> None:
        left = heard * np.float32(10 ** (-cancelled_db / 20))
        for lo in range(0, window, FRAME):
            processing._weigh(heard[lo : lo + FRAME], left[lo : lo + FRAME])

    weigh(18.0)
    weigh(1.0)
    weigh(18.0)
    assert not processing.echo_heard
    for _ in range(input_processing.COUPLING_WINDOWS - 1):
        weigh(12.0)
    assert processing.echo_heard
