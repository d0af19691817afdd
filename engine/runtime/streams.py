"""The event-loop side of streamed requests: one bounded queue and one iterator each.

Both the engine thread's facade (`engine.runtime.core.AsyncEngine`) and the remote LLM client
(`engine.llm.remote_llm.RemoteLlm`) hand a request's `StageOutput`s to whoever awaits them.
`OutputStreams` holds those open streams by key. Its rules:

- `open` returns an async iterator that ends after the request's finished output, or
  at once (with no further output) when `close` is called for the key.
- A consumer that leaves the iterator early stops the request upstream (`abort`).
- A consumer that falls `limit` outputs behind gets one error output instead of an
  ever longer queue: for voice, growing latency is worse than a clear error.

Everything here runs on the event loop; nothing is thread-safe.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import AsyncIterator, Callable, Hashable
from typing import Generic, TypeVar

from engine.runtime.stage import StageOutput

__all__ = ["DEFAULT_MAX_QUEUED_OUTPUTS", "OutputStreams"]

DEFAULT_MAX_QUEUED_OUTPUTS = 4096

K = TypeVar("K", bound=Hashable)


class _End:
    """Queued after the last output of a stream that was closed."""


_END = _End()


class _Queue:
    """One stream's outputs waiting for its consumer, and a wake-up event."""

    def __init__(self) -> None:
        self.items: deque[StageOutput | _End] = deque()
        self.ready = asyncio.Event()

    def put(self, item: StageOutput | _End) -> None:
        self.items.append(item)
        self.ready.set()

    def replace(self, item: StageOutput | _End) -> None:
        """Drop whatever is queued; `item` is the next and last thing read."""
        self.items.clear()
        self.put(item)

    async def get(self) -> StageOutput | _End:
        while not self.items:
            self.ready.clear()
            await self.ready.wait()
        return self.items.popleft()


class OutputStreams(Generic[K]):
    """Open output streams by key; `abort(key)` stops a request upstream."""

    def __init__(self, abort: Callable[[K], None], limit: int = DEFAULT_MAX_QUEUED_OUTPUTS) -> None:
        self._abort = abort
        self.limit = limit
        self._open: dict[K, _Queue] = {}

    def __contains__(self, key: K) -> bool:
        return key in self._open

    def __len__(self) -> int:
        return len(self._open)

    def open(self, key: K) -> AsyncIterator[StageOutput]:
        if key in self._open:
            raise ValueError(f"{key!r} is already streaming")
        queue = _Queue()
        self._open[key] = queue
        return self._iterate(key, queue)

    def put(self, key: K, out: StageOutput) -> None:
        """Queue `out` for the stream of `key`; dropped if that stream is not open."""
        queue = self._open.get(key)
        if queue is None:
            return  # closed, aborted or never opened here: dropped on purpose
        if out.finished:
            del self._open[key]
        if len(queue.items) < self.limit:
            queue.put(out)
            return
        self._open.pop(key, None)
        self._abort(key)
        error = f"output queue overflow: consumer fell {self.limit} outputs behind"
        queue.replace(StageOutput(out.request_id, None, finished=True, error=error))

    def close(self, key: K) -> None:
        """End the stream of `key` now: its iterator yields nothing more. The request
        upstream is the caller's to stop."""
        queue = self._open.pop(key, None)
        if queue is not None:
            queue.replace(_END)

    async def _iterate(self, key: K, queue: _Queue) -> AsyncIterator[StageOutput]:
        try:
            while True:
                item = await queue.get()
                if isinstance(item, _End):
                    return
                yield item
                if item.finished:
                    return
        finally:
            if self._open.get(key) is queue:  # the consumer left before the end
                self.close(key)
                self._abort(key)
