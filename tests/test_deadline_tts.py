"""The TTS stage's schedule: earliest deadline first, bounded steps, no racing ahead.

A fake voice (two latent frames per character, silent audio) and a hand-set clock make
the order exact; the real voice's timing is measured in bench/load.py, not here.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import pytest

from engine.runtime.stage import StageOutput
from engine.stages.tts import (
    AHEAD_S,
    FIRST_CHUNK_FRAMES,
    MAX_CHUNK_FRAMES,
    STEP_WINDOW_FRAMES,
    Scales,
    TtsRequest,
    TtsStage,
)

HOP = 100
RATE = 10_000  # 100 latent frames per second of audio
CONTEXT = 10
FRAMES_PER_CHAR = 2


class FakeVoice:
    """What `TtsStage` uses of a `Voice`; records the spans of every render."""

    sample_rate = RATE
    whole_segments = False

    def __init__(self) -> None:
        self.renders: list[list[int]] = []  # span widths per step

    def scales(self, request: TtsRequest) -> Scales:
        return Scales(0.0, 1.0, 0.0)

    def context_frames(self) -> int:
        return CONTEXT

    def id_pieces(self, text: str) -> list[list[int]]:
        return [[1] * len(text)]

    def latents(self, batch: Sequence[list[int]], scales: Sequence[Scales]) -> list[np.ndarray]:
        return [np.zeros((1, FRAMES_PER_CHAR * len(ids), 1), np.float32) for ids in batch]

    def render(self, spans: Sequence[tuple[np.ndarray, int, int]]) -> list[np.ndarray]:
        self.renders.append([stop - start for _, start, stop in spans])
        return [np.zeros((stop - start) * HOP, np.float32) for _, start, stop in spans]


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def stage(max_batch: int = 8) -> tuple[TtsStage, FakeVoice, Clock]:
    voice, clock = FakeVoice(), Clock()
    return TtsStage(voice, max_batch=max_batch, clock=clock), voice, clock  # type: ignore[arg-type]


def ids(outputs: list[StageOutput]) -> list[str]:
    return [o.request_id for o in outputs if o.payload is not None and o.payload.samples.size]


def test_a_voice_that_renders_whole_pieces_gets_each_piece_in_one_chunk() -> None:
    tts, voice, _ = stage()
    voice.whole_segments = True
    tts.add("a", TtsRequest())
    tts.feed("a", "x" * 200 + ". " + "y" * 60 + ".", final=True)
    while tts.has_work():
        tts.step()
    assert voice.renders == [[402], [122]]


def test_a_new_request_goes_before_requests_already_playing() -> None:
    tts, _, clock = stage(max_batch=1)
    for rid in ("a", "b"):
        tts.add(rid, TtsRequest())
        tts.feed(rid, "x" * 200)
    assert ids(tts.step()) == ["a"]  # both unheard: the one that came first
    assert ids(tts.step()) == ["b"]  # a has audio in hand, b has none
    clock.now += 0.1
    tts.add("c", TtsRequest())
    tts.feed("c", "x" * 200)
    assert ids(tts.step()) == ["c"]


def test_the_request_closest_to_running_dry_goes_first() -> None:
    tts, _, clock = stage(max_batch=1)
    for rid in ("a", "b"):
        tts.add(rid, TtsRequest())
        tts.feed(rid, "x" * 400)
    tts.step(), tts.step()  # first chunks: 0.32 s of audio each
    for _ in range(3):
        tts.step()
    runway = {rid: tts.runway(rid) for rid in ("a", "b")}
    assert all(r is not None for r in runway.values())
    order = ids(tts.step())
    assert order == [min(runway, key=lambda rid: runway[rid] or 0.0)]
    clock.now += 0.05
    # Every step serves whichever has less in hand, so the two stay within one chunk.
    for _ in range(6):
        tts.step()
    a, b = tts.runway("a"), tts.runway("b")
    assert a is not None and b is not None
    assert abs(a - b) <= MAX_CHUNK_FRAMES * HOP / RATE


def render_far_ahead(tts: TtsStage, rid: str) -> None:
    """A request with more than AHEAD_S of audio in hand and more text to speak."""
    tts.add(rid, TtsRequest())
    tts.feed(rid, "x" * 2000)
    while (tts.runway(rid) or 0.0) <= AHEAD_S:
        tts.step()


def test_a_request_far_ahead_waits_while_another_runs_short() -> None:
    tts, _, clock = stage()
    render_far_ahead(tts, "long")
    tts.add("short", TtsRequest())
    tts.feed("short", "x" * 300)
    for _ in range(4):
        assert ids(tts.step()) == ["short"]
        clock.now += 0.01
    # Once "long" is closer to running dry than "short", it is served again.
    clock.now += (tts.runway("long") or 0.0) - AHEAD_S + 0.5
    assert "long" in ids(tts.step())


def test_a_step_never_renders_more_than_its_window_budget() -> None:
    tts, voice, clock = stage()
    for i in range(8):
        tts.add(f"r{i}", TtsRequest())
        tts.feed(f"r{i}", "x" * 600, final=True)
    while tts.has_work():
        tts.step()
        clock.now += 0.02
    assert voice.renders
    for widths in voice.renders:
        assert len(widths) * (max(widths) + 2 * CONTEXT) <= STEP_WINDOW_FRAMES or len(widths) == 1
        assert max(widths) <= MAX_CHUNK_FRAMES + FIRST_CHUNK_FRAMES


def test_a_short_clause_never_waits_behind_a_long_chunk() -> None:
    # "long" has been playing for a while and renders wide chunks; "short" arrives: its
    # first chunk goes out in a step no wider than a first chunk.
    tts, voice, clock = stage()
    tts.add("long", TtsRequest())
    tts.feed("long", "x" * 2000)
    for _ in range(4):
        tts.step()
        clock.now += 1.0  # playback eats what was rendered
    tts.add("short", TtsRequest())
    tts.feed("short", "Yes.", final=True)
    assert "short" in ids(tts.step())
    assert max(voice.renders[-1]) <= FIRST_CHUNK_FRAMES


def test_every_request_finishes_with_all_its_audio() -> None:
    tts, _, clock = stage(max_batch=3)
    texts = {f"r{i}": "x" * (50 + 90 * i) for i in range(5)}
    for rid, text in texts.items():
        tts.add(rid, TtsRequest())
        tts.feed(rid, text, final=True)
    frames = dict.fromkeys(texts, 0)
    finished = []
    while tts.has_work():
        for out in tts.step():
            frames[out.request_id] += out.payload.samples.size // HOP
            if out.finished:
                finished.append(out.request_id)
        clock.now += 0.05
    assert sorted(finished) == sorted(texts)
    assert frames == {rid: FRAMES_PER_CHAR * len(t) for rid, t in texts.items()}


def test_a_request_far_ahead_waits_while_another_waits_for_its_text() -> None:
    tts, voice, clock = stage()
    render_far_ahead(tts, "long")
    assert tts.wake_in() is None  # nobody is short: nothing is held
    tts.add("short", TtsRequest())  # its first text is still being written
    renders = len(voice.renders)
    assert not tts.has_work() and tts.step() == []
    assert len(voice.renders) == renders
    runway = tts.runway("long")
    assert runway is not None and tts.wake_in() == pytest.approx(runway - AHEAD_S)
    tts.feed("short", "Yes.")  # a first clause; the next is still being written
    assert ids(tts.step()) == ["short"]
    assert not tts.has_work()
    # With no new text from "short", "long" is rendered once it is down to AHEAD_S.
    clock.now += tts.wake_in() or 0.0
    assert tts.has_work() and ids(tts.step()) == ["long"]
