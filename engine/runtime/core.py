"""The engine thread that owns MLX, and the asyncio facade the layers above use.

Rule: only the engine thread touches a stage. Other threads (and the event loop) put
aborts, adds and calls on queues guarded by one condition; the thread drains them in
that order (aborts first, so a barge-in never waits behind new work), then steps every
busy stage once, then hands that step's outputs out. It sleeps on the condition when no
stage has work, so an idle engine burns no CPU. A stage whose work can wait says so with
an optional `deferrable() -> bool` (the LLM when every row is ahead of its speech): it is
stepped only in iterations where no other stage has work, i.e. in slack. A stage that
holds work back until a moment comes (the TTS while another request runs short) says when
with an optional `wake_in() -> float | None` (seconds from now; None: nothing held): the
thread's sleep ends then even if nothing new arrives.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import os
import sys
import threading
import traceback
from collections import deque
from collections.abc import AsyncIterator, Callable, Mapping
from dataclasses import dataclass
from typing import Any, NoReturn, Protocol, TypeVar

import mlx.core as mx

from engine.runtime.stage import RequestRefused, Stage, StageOutput
from engine.runtime.streams import DEFAULT_MAX_QUEUED_OUTPUTS, OutputStreams
from engine.runtime.urgency import Urgency, is_urgent

__all__ = [
    "AsyncEngine",
    "DEFAULT_MAX_QUEUED_OUTPUTS",
    "EngineCore",
    "EngineThreads",
    "exit_after",
    "exit_process",
]

logger = logging.getLogger(__name__)

OutputCallback = Callable[[str, list[StageOutput]], None]
T = TypeVar("T")


@dataclass
class _Add:
    stage: str
    request_id: str
    inputs: Any


@dataclass
class _Call:
    stage: str
    fn: Callable[[Any], Any]  # called with the stage
    future: concurrent.futures.Future


class EngineCore:
    """Runs every stage on one thread; thread-safe `add`/`abort`/`call` from anywhere."""

    def __init__(
        self,
        stages: Mapping[str, Stage],
        *,
        yields: int = 0,
        reports_urgent: Urgency | None = None,
        waits_for_urgent: Urgency | None = None,
    ) -> None:
        """`yields`: nice levels this thread (and the MLX stream thread it starts) runs
        below the engine's other threads (Linux), so that they get the CPU first.
        `reports_urgent`: where this thread's urgent requests are told while they run;
        `waits_for_urgent`: what holds this thread's steps."""
        self._stages = dict(stages)
        self._yields = yields
        self._reports = reports_urgent
        self._waits_for = waits_for_urgent
        self._cond = threading.Condition()
        self._aborts: list[tuple[str, str]] = []
        self._ops: deque[_Add | _Call] = deque()
        self._live: dict[str, set[str]] = {name: set() for name in self._stages}
        self._callback: OutputCallback | None = None
        self._thread: threading.Thread | None = None
        self._running = False
        if waits_for_urgent is not None:
            waits_for_urgent.on_release(self._wake)

    def start(self) -> None:
        if self._thread is not None:
            raise RuntimeError("EngineCore already started")
        self._running = True
        self._thread = threading.Thread(target=self._run, name="engine-core", daemon=True)
        self._thread.start()

    def shutdown(self, timeout: float = 5.0) -> None:
        with self._cond:
            self._running = False
            self._cond.notify_all()
        if self._thread is not None:
            self._thread.join(timeout)
        self._fail_pending_calls()

    def add(self, stage: str, request_id: str, inputs: Any) -> None:
        self._check_stage(stage)
        with self._cond:
            self._ops.append(_Add(stage, request_id, inputs))
            self._cond.notify()

    def abort(self, stage: str, request_id: str) -> None:
        self._check_stage(stage)
        with self._cond:
            # An add still queued is simply withdrawn; the stage never sees it.
            self._ops = deque(
                op
                for op in self._ops
                if not (isinstance(op, _Add) and (op.stage, op.request_id) == (stage, request_id))
            )
            self._aborts.append((stage, request_id))
            self._cond.notify()

    def call(self, stage: str, fn: Callable[[Any], T]) -> concurrent.futures.Future[T]:
        """Run `fn(stage)` on the engine thread, in order with adds; its result or error
        comes in the future (`engine.runtime.clients` gives `fn` the stage's type)."""
        self._check_stage(stage)
        future: concurrent.futures.Future[T] = concurrent.futures.Future()
        with self._cond:
            self._ops.append(_Call(stage, fn, future))
            self._cond.notify()
        return future

    def call_on_each_thread(self, fn: Callable[[], object]) -> None:
        """Run `fn()` on this core's thread once what is queued there is done; its result
        and any error are dropped."""
        self.call(next(iter(self._stages)), lambda _: fn())

    def set_output_callback(self, cb: OutputCallback) -> None:
        self._callback = cb

    def pending(self) -> dict[str, int]:
        with self._cond:
            return {name: len(ids) for name, ids in self._live.items()}

    def _wake(self) -> None:
        with self._cond:
            self._cond.notify()

    def _check_stage(self, stage: str) -> None:
        if stage not in self._stages:
            raise KeyError(f"unknown stage {stage!r}; known: {sorted(self._stages)}")

    # --- engine thread -------------------------------------------------------------

    def _run(self) -> None:
        if self._yields and sys.platform == "linux":
            # Before this thread's first MLX op: the stream thread it starts inherits it.
            tid = threading.get_native_id()
            os.setpriority(
                os.PRIO_PROCESS, tid, min(os.getpriority(os.PRIO_PROCESS, tid) + self._yields, 19)
            )
        try:
            self._loop()
        finally:
            # MLX work still in flight when this thread ends can abort the process at
            # interpreter exit ("terminate called without an active exception").
            mx.synchronize()

    def _loop(self) -> None:
        while True:
            with self._cond:
                while self._running and not self._aborts and not self._ops:
                    held = self._held_s()
                    if not held and self._busy():
                        break
                    self._cond.wait(_soonest(held or None, self._next_wake()))
                if not self._running:
                    return
                aborts, self._aborts = self._aborts, []
                ops, self._ops = self._ops, deque()
            self._process_aborts(aborts)
            self._process_ops(ops)
            if not self._held_s():
                self._step_stages()

    def _held_s(self) -> float:
        return self._waits_for.hold_s() if self._waits_for is not None else 0.0

    def _busy(self) -> bool:
        return any(self._stage_has_work(name) for name in self._stages)

    def _next_wake(self) -> float | None:
        """Seconds until a stage has work though nothing new arrives (the soonest of
        their `wake_in`), or None."""
        times = []
        for name, stage in self._stages.items():
            wake_in = getattr(stage, "wake_in", None)
            try:
                seconds = wake_in() if wake_in is not None else None
            except Exception:
                logger.exception("stage %s: wake_in failed", name)
                continue
            if seconds is not None:
                times.append(seconds)
        return max(0.0, min(times)) if times else None

    def _deferrable(self, name: str) -> bool:
        deferrable = getattr(self._stages[name], "deferrable", None)
        try:
            return bool(deferrable()) if deferrable is not None else False
        except Exception:
            logger.exception("stage %s: deferrable failed", name)
            return False

    def _stage_has_work(self, name: str) -> bool:
        try:
            return bool(self._stages[name].has_work())
        except Exception:
            logger.exception("stage %s: has_work failed", name)
            return bool(self._live[name])

    def _process_aborts(self, aborts: list[tuple[str, str]]) -> None:
        for stage, request_id in aborts:
            with self._cond:
                was_live = request_id in self._live[stage]
                self._live[stage].discard(request_id)
            if not was_live:
                continue
            if self._reports is not None:
                self._reports.end(stage, request_id)
            try:
                self._stages[stage].abort(request_id)
            except Exception:
                logger.exception("stage %s: abort of %s failed", stage, request_id)

    def _process_ops(self, ops: deque[_Add | _Call]) -> None:
        for op in ops:
            if isinstance(op, _Add):
                self._process_add(op)
            else:
                self._process_call(op)

    def _process_add(self, op: _Add) -> None:
        try:
            self._stages[op.stage].add(op.request_id, op.inputs)
        except RequestRefused as exc:
            refusal = StageOutput(op.request_id, None, True, str(exc), error_code=exc.code)
            self._emit(op.stage, [refusal])
            return
        except Exception as exc:
            error = f"{type(exc).__name__}: {exc}"
            self._emit(op.stage, [StageOutput(op.request_id, None, finished=True, error=error)])
            return
        with self._cond:
            self._live[op.stage].add(op.request_id)
        if self._reports is not None and is_urgent(op.inputs):
            self._reports.begin(op.stage, op.request_id)

    def _process_call(self, op: _Call) -> None:
        if not op.future.set_running_or_notify_cancel():
            return
        try:
            result = op.fn(self._stages[op.stage])
        except BaseException as exc:
            op.future.set_exception(exc)
        else:
            op.future.set_result(result)

    def _step_stages(self) -> None:
        busy = [name for name in self._stages if self._stage_has_work(name)]
        urgent = [name for name in busy if not self._deferrable(name)]
        for name in urgent or busy:
            stage = self._stages[name]
            try:
                outputs = stage.step()
            except Exception as exc:
                logger.exception("stage %s: step failed", name)
                outputs = self._fail_stage_requests(name, exc)
            self._emit(name, outputs)

    def _fail_stage_requests(self, name: str, exc: Exception) -> list[StageOutput]:
        # The step's requests cannot be told apart from the exception, so every live
        # request of this stage fails; other stages and the thread go on.
        with self._cond:
            failed, self._live[name] = sorted(self._live[name]), set()
        error = f"{type(exc).__name__}: {exc}"
        for request_id in failed:
            try:
                self._stages[name].abort(request_id)
            except Exception:
                logger.exception("stage %s: abort of %s failed", name, request_id)
        return [StageOutput(rid, None, finished=True, error=error) for rid in failed]

    def _emit(self, stage: str, outputs: list[StageOutput]) -> None:
        if not outputs:
            return
        finished = [out.request_id for out in outputs if out.finished]
        with self._cond:
            self._live[stage].difference_update(finished)
        if self._reports is not None:
            for request_id in finished:
                self._reports.end(stage, request_id)
        if self._callback is not None:
            try:
                self._callback(stage, outputs)
            except Exception:
                logger.exception("output callback failed")

    def _fail_pending_calls(self) -> None:
        with self._cond:
            ops, self._ops = self._ops, deque()
        for op in ops:
            if isinstance(op, _Call) and op.future.set_running_or_notify_cancel():
                op.future.set_exception(RuntimeError("engine shut down"))


def _soonest(*seconds: float | None) -> float | None:
    """The shortest of some waits (None: wait for nothing)."""
    return min((s for s in seconds if s is not None), default=None)


class EngineThreads(Protocol):
    """What `AsyncEngine` drives: one `EngineCore`, or `engine.runtime.lanes.EngineLanes` (several
    cores, each stage on one of them). Every method is safe to call from any thread."""

    def add(self, stage: str, request_id: str, inputs: Any) -> None: ...

    def abort(self, stage: str, request_id: str) -> None: ...

    def call(self, stage: str, fn: Callable[[Any], T]) -> concurrent.futures.Future[T]: ...

    def call_on_each_thread(self, fn: Callable[[], object]) -> None:
        """`fn()` once on every engine thread, after what is queued there (not waited for)."""

    def set_output_callback(self, cb: OutputCallback) -> None: ...

    def pending(self) -> dict[str, int]: ...


class AsyncEngine:
    """Asyncio facade over `EngineThreads`: the event loop never runs or waits on a model.

    Outputs of a step cross threads in one `call_soon_threadsafe`; while the loop has
    not yet run it, later steps join the same hand-over instead of scheduling more.
    """

    def __init__(
        self,
        core: EngineThreads,
        loop: asyncio.AbstractEventLoop | None = None,
        max_queued_outputs: int = DEFAULT_MAX_QUEUED_OUTPUTS,
    ) -> None:
        self._core = core
        self._loop = loop
        # A stream whose consumer falls this far behind is failed, not buffered on.
        self._streams: OutputStreams[tuple[str, str]] = OutputStreams(
            self._abort_in_core, max_queued_outputs
        )
        self._inbox: list[tuple[str, list[StageOutput]]] = []
        self._inbox_lock = threading.Lock()
        self._scheduled = False
        core.set_output_callback(self._on_outputs)

    def stream(self, stage: str, request_id: str, inputs: Any) -> AsyncIterator[StageOutput]:
        """Add a request now and return an iterator over its outputs.

        The iterator ends after the finished output. Leaving it early aborts the request.
        """
        self._bind_loop()
        key = (stage, request_id)
        if key in self._streams:
            raise ValueError(f"request {request_id!r} is already streaming on {stage!r}")
        self._core.add(stage, request_id, inputs)
        # Opened after the add, in the same loop turn: no output can be delivered before.
        return self._streams.open(key)

    async def run(self, stage: str, fn: Callable[[Any], T]) -> T:
        """`fn(stage)` on the engine thread; typed through `engine.runtime.clients`."""
        self._bind_loop()
        return await asyncio.wrap_future(self._core.call(stage, fn))

    def notify(self, stage: str, fn: Callable[[Any], object]) -> None:
        """`fn(stage)` on the engine thread, not waited for; its result and any error are
        dropped (for hints such as the LLM's `set_runway`)."""
        self._core.call(stage, fn)

    def notify_each_thread(self, fn: Callable[[], object]) -> None:
        """`fn()` once on every engine thread, after what is queued there, not waited for
        (for work on state all threads share, such as MLX's buffer cache)."""
        self._core.call_on_each_thread(fn)

    def abort(self, stage: str, request_id: str) -> None:
        self._streams.close((stage, request_id))
        self._core.abort(stage, request_id)

    def pending(self) -> dict[str, int]:
        return self._core.pending()

    def _bind_loop(self) -> None:
        if self._loop is None:
            self._loop = asyncio.get_running_loop()

    def _abort_in_core(self, key: tuple[str, str]) -> None:
        self._core.abort(*key)

    # --- engine thread -> loop -----------------------------------------------------

    def _on_outputs(self, stage: str, outputs: list[StageOutput]) -> None:
        with self._inbox_lock:
            self._inbox.append((stage, outputs))
            if self._scheduled or self._loop is None:
                return
            self._scheduled = True
        try:
            self._loop.call_soon_threadsafe(self._deliver)
        except RuntimeError:
            logger.warning("event loop closed; dropping engine outputs")

    def _deliver(self) -> None:
        with self._inbox_lock:
            batches, self._inbox = self._inbox, []
            self._scheduled = False
        for stage, outputs in batches:
            for out in outputs:
                # Outputs of aborted requests, or of none streamed here, are dropped.
                self._streams.put((stage, out.request_id), out)


def exit_process(code: int) -> NoReturn:
    """End a process whose engine threads have been shut down, skipping C++ teardown.

    MLX's static destructors at interpreter exit can abort ("terminate called without an
    active exception") once MLX has run on a thread other than the main one. By the time
    this is called every engine thread has been joined and every stream closed, so
    nothing is lost by leaving without them: flush what Python buffered and exit.
    """
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def exit_after(main: Callable[[], int | None]) -> NoReturn:
    """Run `main` and leave through `exit_process` however it ends: a process that ran
    MLX on a worker thread must skip C++ teardown on an error or `sys.exit` too, or the
    teardown can turn the failure (or a clean exit) into an abort."""
    code: int | str | None
    try:
        code = main()
    except SystemExit as exc:
        code = exc.code
    except BaseException:
        traceback.print_exc()
        code = 1
    if isinstance(code, str):  # sys.exit("message") prints the message and exits 1
        print(code, file=sys.stderr)
        code = 1
    exit_process(code or 0)
