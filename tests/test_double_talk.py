"""The double-talk measure on real speech through synthetic rooms: the echo alone is
explained by the far end, a person talking over it is not."""

from __future__ import annotations

import numpy as np
import pytest

from gateway.protocol.audio import ENGINE_RATE
from gateway.session.double_talk import ECHO_SHARE, MAX_DELAY, answer_said, echo_share
from tests.test_input_processing import OTHER, recording, room

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
