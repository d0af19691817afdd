"""The event loop before the models: every other thread of the process runs at a lower
CPU priority, so that a busy engine cannot keep the loop from reading frames, answering
pings and sending audio.

On two cores the engine's lanes, their BLAS and MLX workers and the loop all want the
CPU at once; at equal priority the loop waits its turn behind a matrix product. A
higher nice value (Linux, per thread) makes the scheduler run the loop as soon as it
wakes. Threads started later by a lowered thread inherit its priority; the loop's own
helper threads started later (`asyncio.to_thread`) do not, and need not: they wait on
I/O or on the engine. A compute thread the loop starts later (the echo canceller's
warm-up) lowers itself as far (`lower_this_thread`).
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
from pathlib import Path

__all__ = ["lower_other_threads", "lower_this_thread"]

logger = logging.getLogger(__name__)

TASKS = Path("/proc/self/task")
_lowered_by = [0]  # what `lower_other_threads` lowered the threads by, for later ones


def lower_other_threads(by: int) -> int:
    """Raise the nice value of every thread of this process but the caller's by `by`
    (the loop's priority is unchanged). Returns how many threads were lowered; 0 where
    threads have no priority of their own (not Linux)."""
    if by <= 0 or not TASKS.is_dir():
        return 0
    _lowered_by[0] = by
    own = threading.get_native_id()
    lowered = 0
    for task in TASKS.iterdir():
        tid = int(task.name)
        if tid == own:
            continue
        with contextlib.suppress(ProcessLookupError):  # a thread that just ended
            _lower(tid, by)
            lowered += 1
    logger.info("%d compute threads run %d nice levels below the event loop", lowered, by)
    return lowered


def lower_this_thread() -> None:
    """The caller, a compute thread the loop started after `lower_other_threads` ran,
    runs as far below the loop as the others (nothing if they were not lowered)."""
    if _lowered_by[0] and TASKS.is_dir():
        _lower(threading.get_native_id(), _lowered_by[0])


def _lower(tid: int, by: int) -> None:
    nice = os.getpriority(os.PRIO_PROCESS, tid)
    os.setpriority(os.PRIO_PROCESS, tid, min(nice + by, 19))
