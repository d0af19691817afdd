"""Each session's input processing off the event loop: an ordered lane of jobs per
session on one pool of threads shared by all sessions, below the loop's priority.

Rules of this module:

1. The event loop never runs the module's work (`gateway.input_processing`, rule 6): a
   session's jobs run on `pool(nice)`, whose threads lower themselves by the engine's
   `engine_nice` as they start, so they yield to the loop as the engine's threads do.
   livekit's own threads are started by the first job that creates its module, so they
   inherit that priority.
2. A session's jobs run one after another in the order submitted (the module is a
   stream), while other sessions' jobs run on the pool's other threads.
3. Bounded: at most `MAX_JOBS` jobs wait or run per session; `room()` waits below that,
   and the connection's reader waits on it before it reads the next client frame. The
   bound is seconds of audio, not a few frames: while the reader waits, the session
   clock stops, and the far end sent meanwhile is laid on the clock too early for
   the echo that comes back (`gateway.far_end`, rule 1). A lane thread starved by a
   busy machine catches up on the canceller's warm-up (90 ms of CPU at once) and on a
   burst of appends without stopping the clock.
4. Each finished job is announced on the loop (`notify`), which collects its output.
5. `aclose()` cancels the jobs not started and waits for the one running: nothing of a
   session runs after its connection is released.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from functools import cache

from gateway.audio import Samples
from gateway.input_processing import Job
from gateway.priority import lower_this_thread

__all__ = ["MAX_JOBS", "InputLane", "pool"]

MAX_JOBS = 100  # a session's jobs waiting or running: 4 s of 40 ms appends (rule 3)
_THREADS = 2


@cache
def pool(nice: int) -> ThreadPoolExecutor:
    """The process's threads for input processing, `nice` levels below the loop (rule 1)."""
    return ThreadPoolExecutor(
        _THREADS,
        thread_name_prefix="input-processing",
        initializer=lower_this_thread,
        initargs=(nice,),
    )


class InputLane:
    """One session's jobs, in order, on `executor` (rule 2)."""

    def __init__(self, executor: ThreadPoolExecutor, notify: Callable[[], None]) -> None:
        self._executor = executor
        self._notify = notify
        self._lock = threading.Lock()  # guards _waiting and _draining across threads
        self._waiting: deque[tuple[Job, Future[Samples]]] = deque()
        self._draining: Future[None] | None = None  # the pool task running this lane
        self._loop: asyncio.AbstractEventLoop | None = None
        self._unfinished = 0  # jobs submitted and not yet announced on the loop
        self._room = asyncio.Event()
        self._room.set()
        self._closed = False

    def submit(self, job: Job) -> Future[Samples]:
        """Queue `job` behind this session's others; called on the loop."""
        if self._closed:
            raise RuntimeError("the input lane is closed")
        self._loop = asyncio.get_running_loop()
        future: Future[Samples] = Future()
        with self._lock:
            self._waiting.append((job, future))
            if self._draining is None:
                self._draining = self._executor.submit(self._drain)
        self._unfinished += 1
        if self._unfinished >= MAX_JOBS:
            self._room.clear()
        future.add_done_callback(self._finished)
        return future

    async def room(self) -> None:
        """Return once fewer than `MAX_JOBS` jobs wait or run (rule 3)."""
        await self._room.wait()

    async def aclose(self) -> None:
        """Cancel the jobs not started; wait for the one running (rule 5)."""
        self._closed = True
        with self._lock:
            waiting, self._waiting = self._waiting, deque()
            draining = self._draining
        for _, future in waiting:
            future.cancel()
        if draining is not None:
            await asyncio.wrap_future(draining)

    def _drain(self) -> None:
        """On a pool thread: run the lane's jobs until none waits (rule 2)."""
        while True:
            with self._lock:
                if not self._waiting:
                    self._draining = None
                    return
                job, future = self._waiting.popleft()
            if not future.set_running_or_notify_cancel():
                continue
            try:
                future.set_result(job())
            except Exception as exc:  # the loop re-raises it where it collects the output
                future.set_exception(exc)

    def _finished(self, future: Future[Samples]) -> None:
        """On the thread that finished the job: announce it on the loop (rule 4)."""
        if future.cancelled() or self._loop is None:
            return
        with contextlib.suppress(RuntimeError):  # the loop is closed: nobody listens
            self._loop.call_soon_threadsafe(self._announce)

    def _announce(self) -> None:
        self._unfinished -= 1
        if self._unfinished < MAX_JOBS:
            self._room.set()
        if not self._closed:
            self._notify()
