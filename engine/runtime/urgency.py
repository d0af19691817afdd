"""Requests the yielding lanes give way to: the words that may confirm an interruption.

Speech over a running answer becomes an interruption once its words say so
(`engine.listening.speech_detection`). On a busy CPU that transcription waited behind
the answer's own LLM and TTS steps, the very work the interruption may cancel: in the
live gateway it took 170 to 490 ms against about 110 ms on an idle engine. A request
whose inputs say `urgent` therefore holds the yielding lanes (`engine.runtime.lanes`)
between their steps while it runs. The answer is made ahead of its playback, so a short
hold costs no audio, and two bounds keep any stream from starving:

- a hold lasts at most `max_hold_s` after its urgent request arrived;
- after a hold, the held lanes run at least as long as they waited before the next one
  can begin (speech that keeps coming, such as the answer's own echo, holds them at
  most half the time).

A step already under way when a hold begins goes on, and shares the cores with the
urgent request. Most steps are short, but on a CPU a prefill forward of a large model
(the quality profile's 1.5B: a 64-token slice in about 1.5 s) and a voice's render (a
Kokoro clause in 1 to 3 s, a Piper chunk in a few hundred ms) are not, so those pause
within themselves too, between their layers, blocks or tiles (`pause`).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

__all__ = ["Urgency", "is_urgent"]


def is_urgent(inputs: object) -> bool:
    """Whether a request's inputs ask the yielding lanes to wait for it."""
    return getattr(inputs, "urgent", False) is True


class Urgency:
    """The urgent requests live on the small lanes, and how long the yielding lanes wait."""

    def __init__(self, max_hold_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self._max_hold_s = max_hold_s
        self._clock = clock
        self._lock = threading.Lock()
        self._released = threading.Condition(self._lock)
        self._holding: dict[tuple[str, str], float] = {}  # urgent request -> hold's end
        self._began: float | None = None  # when the hold under way began
        self._next_hold = 0.0  # no hold begins before this (monotonic seconds)
        self._wakes: list[Callable[[], None]] = []

    def on_release(self, wake: Callable[[], None]) -> None:
        """Call `wake()` (from any thread) whenever an urgent request ends."""
        self._wakes.append(wake)

    def begin(self, stage: str, request_id: str) -> None:
        now = self._clock()
        with self._lock:
            if now < self._next_hold:
                return
            self._holding[(stage, request_id)] = now + self._max_hold_s
            if self._began is None:
                self._began = now

    def end(self, stage: str, request_id: str) -> None:
        now = self._clock()
        with self._lock:
            if self._holding.pop((stage, request_id), None) is None:
                return
            if not self._holding and self._began is not None:
                self._next_hold = now + (now - self._began)
                self._began = None
            self._released.notify_all()
        for wake in self._wakes:
            wake()

    def hold_s(self) -> float:
        """Seconds the yielding lanes should still wait before their next step (0: none)."""
        with self._lock:
            return self._remaining_s()

    def pause(self) -> None:
        """Wait, on the calling thread, while a hold is under way: what a long step of a
        yielding lane calls between its pieces, each evaluated, so that no work of its
        own is left queued for the cores meanwhile."""
        with self._released:
            while (held := self._remaining_s()) > 0:
                self._released.wait(held)

    def _remaining_s(self) -> float:
        now = self._clock()
        return max([0.0, *(until - now for until in self._holding.values())])
