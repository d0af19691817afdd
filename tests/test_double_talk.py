"""The double-talk measure on real speech through synthetic rooms: the echo alone is
explained by the far end, a person talking over it is not."""

from __future__ import annotations

import numpy as np
import pytest

from gateway.protocol.audio import ENGINE_RATE
from gateway.session.double_talk import (
    ECHO_SHARE,
    MAX_DELAY,
    Coupling,
    answer_said,
    echo_share,
)
from gateway.session.input_processing import PERSON_EXCESS_DB
from tests.helpers import espeak
from tests.test_input_processing import OTHER, processed, recording, room

HALF_S = ENGINE_RATE // 2


def clip_and_far(mic: np.ndarray, far: np.ndarray, at: int, length: int) -> tuple:
    """`mic[at:at+length]` and the far end from MAX_DELAY before it, as the module keeps."""
    padded = np.concatenate([np.zeros(MAX_DELAY, np.float32), far])
    return mic[at : at + length], padded[at : at + length + MAX_DELAY]


@pytest.mark.parametrize(("delay_ms", "gain_db"), [(20, -4), (120, -10), (300, -20)])
def test_the_echo_alone_is_the_far_ends(delay_ms: int, gain_db: float) -> None:
    far = np.tile(recording(), 3)
    echo = room(far, delay_ms=delay_ms, gain_db=gain_db)
    noise = 1e-4 * np.random.default_rng(0).standard_normal(len(echo)).astype(np.float32)
    for at in (ENGINE_RATE // 2, ENGINE_RATE, 2 * ENGINE_RATE):
        share = echo_share(*clip_and_far(echo + noise, far, at, HALF_S))
        assert share >= ECHO_SHARE, (at, share)


@pytest.mark.parametrize(("delay_ms", "gain_db"), [(20, -4), (120, -10), (300, -20)])
def test_a_person_over_the_echo_is_not(delay_ms: int, gain_db: float) -> None:
    far = np.tile(recording(), 3)
    person = recording(OTHER)
    mic = room(far, delay_ms=delay_ms, gain_db=gain_db)
    at = ENGINE_RATE
    mic[at : at + len(person)] += person
    talking = at + np.argmax(np.abs(person) > 0.02)  # the person's first sound
    assert echo_share(*clip_and_far(mic, far, talking, HALF_S)) < ECHO_SHARE


def test_nothing_played_explains_nothing() -> None:
    person = recording(OTHER)[:HALF_S]
    silence = np.zeros(HALF_S + MAX_DELAY, np.float32)
    assert echo_share(person, silence) == 0.0


def test_the_far_end_must_cover_the_delay() -> None:
    with pytest.raises(ValueError, match="MAX_DELAY"):
        echo_share(np.zeros(HALF_S, np.float32), np.zeros(HALF_S, np.float32))


ANSWER_SPOKEN = (
    "Once upon a time there was a brave little dog named Max who lived by the sea "
    "and every morning he ran along the beach looking for shells and crabs"
)


def answer_audio() -> np.ndarray:
    """An answer's far end: continuous speech, as a voice reads a story."""
    return espeak(ANSWER_SPOKEN, ENGINE_RATE, "-v", "en-us")


@pytest.mark.parametrize(("delay_ms", "gain_db"), [(20, -4), (120, -10), (300, -20)])
def test_a_rooms_echo_stays_as_loud_as_it_was_learnt(delay_ms: int, gain_db: float) -> None:
    far = answer_audio()
    echo = room(far, delay_ms=delay_ms, gain_db=gain_db)
    second = ENGINE_RATE
    coupling = Coupling.learn(*clip_and_far(echo, far, second // 2, 2 * second))
    assert coupling is not None
    # Within a couple of dB as the words change (this room's reverberation holds four
    # times the direct path's energy): never as loud as a person (`PERSON_EXCESS_DB`).
    for at in range(second, len(far) - second, second // 2):
        excess = coupling.excess_db(*clip_and_far(echo, far, at, second))
        assert abs(excess) < 2.5 < PERSON_EXCESS_DB, (at, excess)


@pytest.mark.parametrize(("delay_ms", "gain_db"), [(20, -4), (120, -10), (300, -20)])
def test_a_person_is_louder_than_the_rooms_echo(delay_ms: int, gain_db: float) -> None:
    far = answer_audio()
    second = ENGINE_RATE
    mic = room(far, delay_ms=delay_ms, gain_db=gain_db)
    coupling = Coupling.learn(*clip_and_far(mic, far, second // 2, 2 * second))
    assert coupling is not None
    person = recording(OTHER)  # at about the echo's level at -4 dB, above it otherwise
    mic[3 * second : 3 * second + len(person)] += person
    assert coupling.excess_db(*clip_and_far(mic, far, 3 * second, second)) >= PERSON_EXCESS_DB


def test_no_coupling_is_learnt_from_a_person_or_across_a_pause() -> None:
    far = answer_audio()
    second = ENGINE_RATE
    echo = room(far, delay_ms=120, gain_db=-10)
    person = echo.copy()
    person[second : second + len(recording(OTHER))] += recording(OTHER)
    assert Coupling.learn(*clip_and_far(person, far, second // 2, 2 * second)) is None
    # The far end's sound stops half a second before the clip ends: its last stretch
    # of sound is too short to learn from (what came before the pause is not used).
    paused = far.copy()
    paused[2 * second :] = 0.0
    echo = room(paused, delay_ms=120, gain_db=-10)
    assert Coupling.learn(*clip_and_far(echo, paused, second // 2, 2 * second)) is None


def test_a_person_6_db_over_a_speakerphones_echo_interrupts() -> None:
    # The canceller takes a lot off (AEC3's suppressor takes the person down with the
    # echo) and the far end explains a third of what the microphone heard: weak signs
    # of an echo that agree (`is_echo`). The room's learnt loudness says a person.
    far = answer_audio()
    second = ENGINE_RATE
    noise = 1e-4 * np.random.default_rng(0).standard_normal(len(far)).astype(np.float32)
    mic = room(far, delay_ms=120, gain_db=-10) + noise
    person = recording(OTHER)
    voiced = person[np.abs(person) > 1e-3]
    level = np.sqrt(np.mean(mic[3 * second : 4 * second] ** 2) / np.mean(voiced**2))
    mic[4 * second : 4 * second + len(person)] += person * level * 10 ** (6 / 20)
    _, processing = processed(mic[: 5 * second], far)
    assert processing.heard_echo(3900, 5000) is False
    _, processing = processed(
        room(far, delay_ms=120, gain_db=-10)[: 5 * second] + noise[: 5 * second], far
    )
    assert processing.heard_echo(3900, 5000) is True


ANSWER = (
    "Once upon a time there was a brave little dog named Max. One day he followed "
    "the river up the mountain, and he told a story to an old man at the top."
)


@pytest.mark.parametrize(
    ("heard", "said"),
    [
        ("One day.", True),  # the echo's residue, as Whisper heard it
        ("and the mountain", True),
        ("Follow.", True),  # close to "followed"
        ("Once on the air.", True),  # half of it garbled
        ("Hold on.", False),  # a person over the answer, though it said "old" and "told"
        ("Stop.", False),  # though it said "top"
        ("Wait, stop the story!", False),  # most of the words their own
        ("and the", False),  # nothing that tells
        ("", False),
    ],
)
def test_the_answers_own_words_are_told_from_a_persons(heard: str, said: bool) -> None:
    assert answer_said(heard, ANSWER) is said


def test_question_words_tell_nothing() -> None:
    assert not answer_said("Stop. What is the", "What a bright day it was, he said.")
