"""`FakeStagePort`: a stage port that runs no model, for tests and benchmarks.

It records every call the duplex core makes, in order, and emits only the outputs a
test pushes. Scripted behaviour covers what a real engine does wrong or slowly:

    port = FakeStagePort()
    manager = DuplexSessionManager(port, max_sessions=4)
    handle = manager.open("s")
    handle.start_turn(TurnRequest(final=Stage.TTS, audio=samples))
    await handle.settled()
    asr, llm, tts = port.ids("s")
    port.push(asr, "transcript", "hello", finished=True)
    assert port.kinds() == ["ensure", "ensure", "ensure", "submit", "submitted"]
"""

from __future__ import annotations

import asyncio
import struct
from collections.abc import Callable, Sequence

from duplex.contracts import (
    DuplexStageRequestContext,
    DuplexStageSubmission,
    DuplexStageSubmissionResult,
    duplex_session_id_from_request_id,
)
from duplex.outputs import (
    DuplexPreparedTurn,
    DuplexStageOutput,
    DuplexStreamingStagePort,
    stage_id_from_request_id,
)

__all__ = ["AUDIO_RATE", "FakeStagePort", "float32_audio"]

AUDIO_RATE = 24_000


def float32_audio(ms: float, *, rate: int = AUDIO_RATE, sample: float = 0.5) -> bytes:
    """`ms` milliseconds of one constant float32 little-endian sample (0.5 by default)."""
    return struct.pack("<f", sample) * round(rate * ms / 1000)


class FakeStagePort(DuplexStreamingStagePort):
    """A recording stage port (see the module docstring).

    Records, in call order (all empty with `record=False`, which benchmarks use so the
    port holds nothing):

    - `calls`: `(name, id)` pairs: `("ensure", rid)`, `("submit", rid)` when a submit
      begins, `("submitted", rid)` when it returns, `("abort", rid)`, `("cleanup", rid)`
      (one pair per request id), `("prepare", session_id)`, `("discard", session_id)`;
    - `ensured`, `submitted`: the contexts and submissions accepted;
    - `abort_calls`, `cleanup_calls`: the id lists of each call;
    - `prepared`, `discarded`: prepared turns and the session ids discarded.

    Scripting (set the attributes any time):

    - `fail_ensure` / `fail_submit`: raise this exception instead of accepting;
    - `submit_gate`: each submit waits for this event before answering (a slow engine);
      `submit_waiting` is set while one waits on it;
    - `wrong_result`: submit answers with the wrong stage id;
    - `on_submit`: called with each accepted submission, e.g. to answer it;
    - `appends_now`: take a resident request's later appends at once (`append_now`,
      noted as `"append_now"`), as the engine does; by default every append is submitted.
    """

    def __init__(
        self,
        stage_count: int = 3,
        *,
        sampling: Sequence[object] | None = None,
        record: bool = True,
    ) -> None:
        self._stage_count = stage_count
        self._sampling = (
            tuple(f"defaults-{n}" for n in range(stage_count))
            if sampling is None
            else tuple(sampling)
        )
        self._record = record
        self.sink: Callable[[DuplexStageOutput], None] | None = None
        self.calls: list[tuple[str, str]] = []
        self.ensured: list[DuplexStageRequestContext] = []
        self.submitted: list[DuplexStageSubmission] = []
        self.abort_calls: list[list[str]] = []
        self.cleanup_calls: list[list[str]] = []
        self.prepared: list[DuplexPreparedTurn] = []
        self.discarded: list[str] = []
        self.fail_ensure: Exception | None = None
        self.fail_submit: Exception | None = None
        self.submit_gate: asyncio.Event | None = None
        self.submit_waiting = asyncio.Event()
        self.wrong_result = False
        self.on_submit: Callable[[DuplexStageSubmission], None] | None = None
        self.appends_now = False

    # -- the port ---------------------------------------------------------------------

    @property
    def stage_count(self) -> int:
        return self._stage_count

    def sampling_defaults(self) -> tuple[object, ...]:
        return self._sampling

    def attach_output_sink(self, sink: Callable[[DuplexStageOutput], None]) -> None:
        self.sink = sink

    def ensure_request(self, context: DuplexStageRequestContext) -> None:
        if self.fail_ensure is not None:
            raise self.fail_ensure
        if self._record:
            self.ensured.append(context)
        self._note("ensure", context.request_id)

    async def submit(self, submission: DuplexStageSubmission) -> DuplexStageSubmissionResult:
        rid = submission.context.request_id
        self._note("submit", rid)
        if self.submit_gate is not None:
            self.submit_waiting.set()
            await self.submit_gate.wait()
            self.submit_waiting.clear()
        if self.fail_submit is not None:
            raise self.fail_submit
        if self._record:
            self.submitted.append(submission)
        self._note("submitted", rid)
        if self.on_submit is not None:
            self.on_submit(submission)
        stage = submission.context.stage_id + (1 if self.wrong_result else 0)
        return DuplexStageSubmissionResult(request_id=rid, stage_id=stage, replica_id=0)

    def append_now(self, submission: DuplexStageSubmission) -> bool:
        if not self.appends_now:
            return False
        if self.fail_submit is not None:
            raise self.fail_submit
        if self._record:
            self.submitted.append(submission)
        self._note("append_now", submission.context.request_id)
        return True

    async def abort_requests(self, request_ids: list[str]) -> None:
        if self._record:
            self.abort_calls.append(list(request_ids))
            self.calls.extend(("abort", r) for r in request_ids)

    async def cleanup(self, request_ids: list[str], *, abort: bool = False) -> None:
        assert abort is False, "the session core aborts explicitly, exactly once"
        if self._record:
            self.cleanup_calls.append(list(request_ids))
            self.calls.extend(("cleanup", r) for r in request_ids)

    def prepare_turn(self, turn: DuplexPreparedTurn) -> None:
        if self._record:
            self.prepared.append(turn)
        self._note("prepare", turn.session_id)

    def discard_prepared(self, session_id: str) -> None:
        if self._record:
            self.discarded.append(session_id)
        self._note("discard", session_id)

    # -- views ------------------------------------------------------------------------

    def kinds(self) -> list[str]:
        """The names of the calls so far, in order."""
        return [name for name, _ in self.calls]

    def ids(self, session_id: str) -> list[str]:
        """Every request id `session_id` reserved, in order."""
        return [c.request_id for c in self.ensured if c.session_id == session_id]

    @property
    def aborted(self) -> list[str]:
        return [r for call in self.abort_calls for r in call]

    @property
    def cleaned(self) -> list[str]:
        return [r for call in self.cleanup_calls for r in call]

    @property
    def reserved(self) -> list[str]:
        """Request ids reserved and not yet cleaned up: empty once the port is drained."""
        cleaned = set(self.cleaned)
        return [c.request_id for c in self.ensured if c.request_id not in cleaned]

    # -- outputs ----------------------------------------------------------------------

    def output(
        self,
        request_id: str,
        kind: str,
        text: str = "",
        *,
        finished: bool = False,
        audio_ms: float = 20,
        session_id: str | None = None,
        **metadata: object,
    ) -> DuplexStageOutput:
        """An output of `request_id` as the engine would send it: the session and stage
        are those the id names (pass `session_id` to mislabel it); an `"audio"` output
        carries `audio_ms` of float32 audio."""
        stage = stage_id_from_request_id(request_id)
        owner = session_id or duplex_session_id_from_request_id(request_id)
        if stage is None or owner is None:
            raise ValueError(f"{request_id!r} is no duplex stage request id")
        audio = float32_audio(audio_ms) if kind == "audio" else b""
        return DuplexStageOutput(
            owner,
            request_id,
            stage,
            kind,
            text=text,
            audio=audio,
            sample_rate=AUDIO_RATE if audio else 0,
            finished=finished,
            metadata=metadata,
        )

    def emit(self, out: DuplexStageOutput) -> None:
        """Hand `out` to the sink at once, as the engine does on the loop thread."""
        if self.sink is None:
            raise RuntimeError("no output sink attached: open a DuplexSessionManager first")
        self.sink(out)

    def push(
        self,
        request_id: str,
        kind: str,
        text: str = "",
        *,
        finished: bool = False,
        audio_ms: float = 20,
        session_id: str | None = None,
        **metadata: object,
    ) -> DuplexStageOutput:
        """Build an output (see `output`), emit it and return it."""
        out = self.output(
            request_id,
            kind,
            text,
            finished=finished,
            audio_ms=audio_ms,
            session_id=session_id,
            **metadata,
        )
        self.emit(out)
        return out

    def _note(self, name: str, request_or_session_id: str) -> None:
        if self._record:
            self.calls.append((name, request_or_session_id))
