"""Several engine threads behind the one `EngineCore` interface.

Voice activity detection must answer within a few tens of milliseconds, but one step of
the TTS or LLM stage can take hundreds. Putting the VAD stage on a thread of its own (a
"lane") keeps speech-start latency independent of whatever the heavy stages are doing;
inside each lane the `EngineCore` rules still hold (one thread per stage, aborts first).
A lane may yield the CPU to the others (`yielding`): on a busy machine the heavy lane's
steps wait, not the small lanes' answers; and with `urgency` it also pauses between its
steps while an urgent request of another lane runs (`engine.runtime.urgency`).
`AsyncEngine` takes either: both are `engine.runtime.core.EngineThreads`.
"""

from __future__ import annotations

import concurrent.futures
from collections.abc import Callable, Mapping
from typing import Any, TypeVar

from engine.runtime.core import EngineCore, OutputCallback
from engine.runtime.stage import Stage
from engine.runtime.urgency import Urgency

__all__ = ["EngineLanes"]

T = TypeVar("T")


class EngineLanes:
    """Routes each call to the lane (its own `EngineCore` thread) that owns the stage."""

    def __init__(
        self,
        lanes: Mapping[str, Mapping[str, Stage]],
        *,
        yielding: Mapping[str, int] | None = None,
        urgency: Urgency | None = None,
    ) -> None:
        """`yielding`: lanes whose thread runs that many nice levels below the others;
        with `urgency`, they also wait for the others' urgent requests."""
        yields = yielding or {}
        self._cores = {
            lane: EngineCore(
                stages,
                yields=yields.get(lane, 0),
                reports_urgent=None if lane in yields else urgency,
                waits_for_urgent=urgency if lane in yields else None,
            )
            for lane, stages in lanes.items()
        }
        self._owner: dict[str, EngineCore] = {}
        for core, stages in zip(self._cores.values(), lanes.values(), strict=True):
            for stage in stages:
                if stage in self._owner:
                    raise ValueError(f"stage {stage!r} is in more than one lane")
                self._owner[stage] = core

    def start(self) -> None:
        for core in self._cores.values():
            core.start()

    def shutdown(self, timeout: float = 5.0) -> None:
        for core in self._cores.values():
            core.shutdown(timeout)

    def add(self, stage: str, request_id: str, inputs: Any) -> None:
        self._core(stage).add(stage, request_id, inputs)

    def abort(self, stage: str, request_id: str) -> None:
        self._core(stage).abort(stage, request_id)

    def call(self, stage: str, fn: Callable[[Any], T]) -> concurrent.futures.Future[T]:
        return self._core(stage).call(stage, fn)

    def call_on_each_thread(self, fn: Callable[[], object]) -> None:
        for core in self._cores.values():
            core.call_on_each_thread(fn)

    def set_output_callback(self, cb: OutputCallback) -> None:
        for core in self._cores.values():
            core.set_output_callback(cb)

    def pending(self) -> dict[str, int]:
        merged: dict[str, int] = {}
        for core in self._cores.values():
            merged.update(core.pending())
        return merged

    def _core(self, stage: str) -> EngineCore:
        try:
            return self._owner[stage]
        except KeyError:
            raise KeyError(f"unknown stage {stage!r}; known: {sorted(self._owner)}") from None
