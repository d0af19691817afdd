"""Remote LLM stage: request mapping, SSE parsing, errors, and a real mlx_lm.server."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from duplex.contracts import (
    DuplexFence,
    DuplexStageRequestContext,
    DuplexStageSubmission,
    duplex_ephemeral_stage_request_id,
)
from duplex.outputs import DuplexStageOutput
from duplex.turn import Stage, TurnRequest
from engine.config import RemoteLlmConfig, parse_config
from engine.llm.remote_llm import RemoteLlm, chat_body
from engine.llm.stage import LlmInput
from engine.pipeline.orchestrator import DuplexOrchestrator
from engine.runtime.core import AsyncEngine, EngineCore
from engine.runtime.request import SamplingParams
from engine.runtime.stage import StageOutput
from tests.helpers import free_port, wait_until, wait_until_serving

ROOT = Path(__file__).resolve().parent.parent
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


def chat_inputs(**fields: Any) -> LlmInput:
    """What the local LLM stage takes; the question as messages unless told otherwise."""
    return LlmInput(**{"messages": [dict(m) for m in QUESTION], **fields})


def _config(base_url: str = "http://server.test/v1", **extra: Any) -> RemoteLlmConfig:
    return RemoteLlmConfig(base_url=base_url, model="served", **extra)


def test_every_sampling_field_reaches_the_body() -> None:
    params = SamplingParams(
        max_tokens=12,
        temperature=0.3,
        top_p=0.8,
        top_k=20,
        min_p=0.05,
        presence_penalty=0.4,
        repetition_penalty=1.2,
        stop=["\n\n"],
        seed=7,
    )
    body = chat_body("served", chat_inputs(sampling_params=params, cache_key="sess-1"))
    assert body == {
        "model": "served",
        "messages": QUESTION,
        "stream": True,
        "stream_options": {"include_usage": True},
        "max_tokens": 12,
        "temperature": 0.3,
        "top_p": 0.8,
        "presence_penalty": 0.4,
        "top_k": 20,
        "min_p": 0.05,
        "repetition_penalty": 1.2,
        "stop": ["\n\n"],
        "seed": 7,
        "prompt_cache_key": "sess-1",
    }


def test_tools_go_with_parallel_tool_calls_when_given() -> None:
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    body = chat_body("m", chat_inputs(tools=[tool], parallel_tool_calls=False))
    assert body["tools"] == [tool] and body["parallel_tool_calls"] is False
    assert "parallel_tool_calls" not in chat_body("m", chat_inputs(tools=[tool]))


def test_what_a_server_cannot_take_is_rejected() -> None:
    with pytest.raises(ValueError, match="not prompt token ids"):
        chat_body("m", chat_inputs(messages=None, prompt_token_ids=[1, 2]))
    with pytest.raises(ValueError, match="stop_token_ids"):
        chat_body("m", chat_inputs(sampling_params=SamplingParams(stop_token_ids=[2])))


def _sse(*chunks: dict[str, Any]) -> bytes:
    lines = [f"data: {json.dumps(c)}\n\n" for c in chunks] + ["data: [DONE]\n\n"]
    return (": keep-alive\n\n" + "".join(lines)).encode()


def _choice(content: str | None, finish: str | None = None) -> dict[str, Any]:
    return {"choices": [{"index": 0, "delta": {"content": content}, "finish_reason": finish}]}


async def _collect(llm: RemoteLlm, request_id: str = "r1", **kw: Any) -> list[StageOutput]:
    return [out async for out in llm.stream(request_id, chat_inputs(**kw))]


async def test_stream_is_parsed_into_request_outputs() -> None:
    seen: list[httpx.Request] = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        usage = {"prompt_tokens": 9, "completion_tokens": 3, "total_tokens": 12}
        body = _sse(
            _choice("Paris"),
            _choice(" is"),
            _choice(" it.", "stop"),
            {"choices": [], "usage": usage},
        )
        return httpx.Response(200, content=body, headers={"content-type": "text/event-stream"})

    llm = RemoteLlm(_config(api_key="secret"), transport=httpx.MockTransport(handler))
    outs = await _collect(llm)
    await llm.aclose()
    assert [o.payload.new_text for o in outs[:-1]] == ["Paris", " is", " it."]
    final = outs[-1]
    assert final.finished and final.error is None
    assert final.payload.output_text == "Paris is it."
    assert final.payload.finish_reason == "stop"
    assert final.payload.usage() == {"prompt_tokens": 9, "completion_tokens": 3, "total_tokens": 12}
    assert seen[0].url == "http://server.test/v1/chat/completions"
    assert seen[0].headers["authorization"] == "Bearer secret"
    assert llm.pending() == 0


async def test_http_error_becomes_an_error_output() -> None:
    transport = httpx.MockTransport(lambda r: httpx.Response(503, text="overloaded"))
    llm = RemoteLlm(_config(), transport=transport)
    outs = await _collect(llm)
    await llm.aclose()
    assert len(outs) == 1 and outs[0].finished
    assert (
        outs[0].error is not None and "HTTP 503" in outs[0].error and "overloaded" in outs[0].error
    )


async def test_unreachable_server_becomes_an_error_output() -> None:
    llm = RemoteLlm(_config(f"http://127.0.0.1:{free_port()}/v1", timeout_s=2.0))
    outs = await _collect(llm)
    await llm.aclose()
    assert outs[-1].finished and outs[-1].error is not None and "ConnectError" in outs[-1].error


async def test_a_request_id_streams_once() -> None:
    llm = RemoteLlm(_config(), transport=httpx.MockTransport(lambda r: httpx.Response(200)))
    stream = llm.stream("dup", chat_inputs())
    with pytest.raises(ValueError, match="already streaming"):
        llm.stream("dup", chat_inputs())
    assert [o.finished async for o in stream] == [True]
    await llm.aclose()


# ---- against a real mlx_lm.server serving the embedded SmolLM2 -----------------------


@pytest.fixture(scope="module")
def mlx_server() -> Iterator[str]:
    from engine.weights.registry import prepare

    model_dir = prepare("smollm2-135m-instruct", precision="fp32", progress=False)
    port = free_port()
    # Import the engine package first so the server's MLX uses the fast BLAS too.
    code = "import engine, sys; engine.setup(); from mlx_lm.server import main; sys.exit(main())"
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    proc = subprocess.Popen(
        [sys.executable, "-c", code, "--model", str(model_dir), "--host", "127.0.0.1"]
        + ["--port", str(port)],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    base = f"http://127.0.0.1:{port}"
    try:
        wait_until_serving(
            proc,
            base + "/v1/models",
            120,
            lambda: proc.stderr.read().decode() if proc.stderr else "",
        )
        yield base + "/v1"
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@pytest.mark.models
async def test_real_server_answers_the_question(mlx_server: str) -> None:
    llm = RemoteLlm(RemoteLlmConfig(base_url=mlx_server, model="default_model"))
    params = SamplingParams(max_tokens=24, temperature=0.0)
    outs = await _collect(llm, sampling_params=params)
    await llm.aclose()
    final = outs[-1]
    assert final.finished and final.error is None
    deltas = "".join(o.payload.new_text for o in outs[:-1])
    assert deltas == final.payload.output_text
    assert "Paris" in deltas
    assert final.payload.prompt_tokens > 5
    assert 0 < final.payload.completion_tokens <= 24
    assert final.payload.finish_reason in ("stop", "length")


@pytest.mark.models
async def test_real_server_abort_mid_stream(mlx_server: str) -> None:
    llm = RemoteLlm(RemoteLlmConfig(base_url=mlx_server, model="default_model"))
    counting = [{"role": "user", "content": "Count from one to two hundred in words."}]
    params = SamplingParams(max_tokens=200, temperature=0.0)
    stream = llm.stream("long", chat_inputs(messages=counting, sampling_params=params))
    got: list[StageOutput] = []
    async for out in stream:
        got.append(out)
        if len(got) == 3:
            llm.abort("long")
    assert len(got) == 3 and not any(o.finished for o in got)
    assert llm.pending() == 0
    # The server is free again: a new request completes normally.
    outs = await _collect(llm, "next", sampling_params=SamplingParams(max_tokens=8, temperature=0))
    await llm.aclose()
    assert outs[-1].finished and outs[-1].error is None


@pytest.mark.models
async def test_real_server_behind_the_stage_port(mlx_server: str) -> None:
    """A text turn through the orchestrator whose LLM stage is the remote server."""
    remote = RemoteLlm(RemoteLlmConfig(base_url=mlx_server, model="default_model"))
    config = parse_config({})
    orch = DuplexOrchestrator(AsyncEngine(EngineCore({})), config, llm=remote)
    outputs: list[DuplexStageOutput] = []
    orch.attach_output_sink(outputs.append)
    defaults = orch.sampling_defaults()
    greedy = (defaults[0], SamplingParams(max_tokens=24, temperature=0.0), defaults[2])

    async def text_turn(turn: int, text: str) -> str:
        fence = DuplexFence("remote", 0, turn)
        ctx = DuplexStageRequestContext(
            request_id=duplex_ephemeral_stage_request_id(fence, stage_id=1),
            session_id="remote",
            fence=fence,
            stage_id=1,
            final_stage_id=1,
            config_generation=0,
            sampling_params=greedy,
        )
        orch.ensure_request(ctx)
        prompt = TurnRequest(final=Stage.LLM, text=text).plan().prompt
        await orch.submit(DuplexStageSubmission(ctx, prompt, False, False))
        return ctx.request_id

    rid = await text_turn(0, "What is the capital of France?")
    await wait_until(lambda: any(o.finished for o in outputs), 120, "the answer")
    assert "Paris" in "".join(o.text for o in outputs if o.kind == "text")
    assert outputs[-1].kind == "done" and outputs[-1].metadata["usage"]["completion_tokens"] > 0
    await orch.cleanup([rid])
    # Barge-in mid-stream: abort closes the HTTP stream and nothing more is emitted.
    outputs.clear()
    rid = await text_turn(1, "Count from one to two hundred in words.")
    await wait_until(lambda: any(o.kind == "text" for o in outputs), 120, "the first words")
    await orch.abort_requests([rid])
    count = len(outputs)

    def drained() -> bool:
        # With its HTTP stream closed and no turn running, nothing is left to output.
        return remote.pending() == 0 and orch.running_turns() == 0

    await wait_until(drained, 5, "the aborted turn to drain")
    assert len(outputs) == count and not any(o.finished for o in outputs)
    await orch.cleanup([rid])
    await remote.aclose()
