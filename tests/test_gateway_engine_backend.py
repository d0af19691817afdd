"""The gateway's engine backend over the real duplex session manager and a scripted port."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from duplex.contracts import (
    DuplexStageRequestContext,
    DuplexStageSubmission,
    DuplexStageSubmissionResult,
)
from duplex.manager import DuplexSessionManager
from duplex.outputs import DuplexStageOutput, DuplexStreamingStagePort
from gateway.backend import TurnOutput
from gateway.engine_backend import EngineBackendSession, realtime_usage
from gateway.realtime import StartResponse


class ScriptedPort(DuplexStreamingStagePort):
    """Answers each final-stage request with "hi", then finishes it; a turn whose text is
    "hold" gets no answer (it stays active until cancelled)."""

    def __init__(self) -> None:
        self.sink: Callable[[DuplexStageOutput], None] | None = None
        self.aborted: list[str] = []

    @property
    def stage_count(self) -> int:
        return 3

    def sampling_defaults(self) -> tuple[object, ...]:
        return (None, None, None)

    def attach_output_sink(self, sink: Callable[[DuplexStageOutput], None]) -> None:
        self.sink = sink

    def ensure_request(self, context: DuplexStageRequestContext) -> None:
        pass

    async def submit(self, submission: DuplexStageSubmission) -> DuplexStageSubmissionResult:
        ctx = submission.context
        if ctx.stage_id == ctx.final_stage_id and submission.prompt.get("text") != "hold":
            asyncio.get_running_loop().call_soon(self._answer, ctx)
        return DuplexStageSubmissionResult(
            request_id=ctx.request_id, stage_id=ctx.stage_id, replica_id=0
        )

    def _answer(self, ctx: DuplexStageRequestContext) -> None:
        assert self.sink is not None
        rid, stage = ctx.request_id, ctx.stage_id
        self.sink(DuplexStageOutput(rid, stage, "text", text="hi"))
        usage = {"prompt_tokens": 7, "completion_tokens": 1, "total_tokens": 8}
        self.sink(DuplexStageOutput(rid, stage, "done", finished=True, metadata={"usage": usage}))

    async def abort_requests(self, request_ids: list[str]) -> None:
        self.aborted += request_ids

    async def cleanup(self, request_ids: list[str], *, abort: bool = False) -> None:
        pass


def text_turn(response_id: str, out_of_band: bool = False, text: str = "hello") -> StartResponse:
    prompt = {
        "text": text,
        "messages": [],
        "output_modalities": ["text"],
        "max_output_tokens": None,
        "voice": None,
        "speed": None,
        "cache_key": None if out_of_band else "s",
    }
    return StartResponse(response_id, prompt, 1, 1, out_of_band)


async def collect(session: EngineBackendSession, count: int) -> list[TurnOutput]:
    outputs = []
    async with asyncio.timeout(5):
        async for out in session.outputs():
            outputs.append(out)
            if len(outputs) == count:
                return outputs
    return outputs


def test_usage_in_realtime_shape() -> None:
    usage = realtime_usage({"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5})
    assert usage is not None
    assert (usage["input_tokens"], usage["output_tokens"], usage["total_tokens"]) == (3, 2, 5)
    assert realtime_usage({}) is None


async def test_turns_map_to_responses_and_barge_in_drops_the_old_turn() -> None:
    port = ScriptedPort()
    manager = DuplexSessionManager(port, max_sessions=4)
    session = EngineBackendSession(manager, "sess_a")
    session.start(text_turn("resp_1"))
    first = await collect(session, 2)
    assert [(o.response_id, o.kind, o.text) for o in first] == [
        ("resp_1", "text", "hi"),
        ("resp_1", "done", ""),
    ]
    assert first[1].usage is not None and first[1].usage["input_tokens"] == 7
    session.start(text_turn("resp_2", text="hold"))
    session.cancel("resp_2", barge_in=True)
    session.start(text_turn("resp_3"))
    outputs = await collect(session, 2)
    assert [(o.response_id, o.kind) for o in outputs] == [("resp_3", "text"), ("resp_3", "done")]
    assert port.aborted  # the barged-in turn's requests were aborted
    await session.close()
    assert len(manager) == 0


async def test_out_of_band_response_runs_in_its_own_session() -> None:
    port = ScriptedPort()
    manager = DuplexSessionManager(port, max_sessions=4)
    session = EngineBackendSession(manager, "sess_b")
    session.start(text_turn("resp_main", text="hold"))
    session.start(text_turn("resp_side", out_of_band=True))
    outputs = await collect(session, 2)
    assert [(o.response_id, o.kind) for o in outputs] == [
        ("resp_side", "text"),
        ("resp_side", "done"),
    ]
    await session.close()
    assert len(manager) == 0
