"""The LLM stage served by an OpenAI-compatible chat-completions endpoint.

vLLM, vllm-mlx and `mlx_lm.server` all stream `/v1/chat/completions` as server-sent
events. This client keeps the local LLM stage's streaming contract (`StageOutput`s whose
payload is a `RequestOutput` delta, the last one `finished` with usage), so the
orchestrator cannot tell the two apart: streamed `tool_calls` deltas become the
payload's `tool_calls` (`ToolCallDelta`, the function's name on every piece), and the
request's tools and tool choice are forwarded as they are. It is network I/O, not model
code, so it runs on the event loop; abort cancels the reading task, which closes the
HTTP stream and lets the server stop generating.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import httpx

from engine.config import RemoteLlmConfig
from engine.runtime.request import RequestOutput, ToolCallDelta
from engine.runtime.stage import StageOutput
from engine.runtime.streams import OutputStreams

if TYPE_CHECKING:  # the local stage's module loads MLX; only its input type is needed
    from engine.llm.stage import LlmInput

__all__ = ["RemoteLlm"]


@dataclass
class _Progress:
    text: str = ""
    completion_tokens: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    finish_reason: str | None = None
    usage_seen: bool = False
    call_names: dict[int, str] = field(default_factory=dict)  # tool call index -> name


class RemoteLlm:
    """Streams chat completions from one remote server; one HTTP stream per request."""

    def __init__(
        self, config: RemoteLlmConfig, *, transport: httpx.AsyncBaseTransport | None = None
    ) -> None:
        self.config = config
        headers = {"Authorization": f"Bearer {config.api_key}"} if config.api_key else {}
        self._client = httpx.AsyncClient(
            base_url=config.base_url.rstrip("/") + "/",
            headers=headers,
            timeout=httpx.Timeout(config.timeout_s),
            transport=transport,
        )
        # The task reading each request's HTTP stream, until it has queued its last output.
        self._tasks: dict[str, asyncio.Task[None]] = {}
        self._streams: OutputStreams[str] = OutputStreams(self._cancel)

    def stream(self, request_id: str, inputs: LlmInput) -> AsyncIterator[StageOutput]:
        """Start the request now; iterate its outputs. Leaving early aborts it."""
        if request_id in self._streams:
            raise ValueError(f"request {request_id!r} is already streaming")
        body = chat_body(self.config.model, inputs)
        outputs = self._streams.open(request_id)
        self._tasks[request_id] = asyncio.create_task(self._fetch(request_id, body))
        return outputs

    def abort(self, request_id: str) -> None:
        """Close the request's HTTP stream; its iterator ends with no further output."""
        self._streams.close(request_id)
        self._cancel(request_id)

    def forget(self, cache_key: str) -> None:
        """Nothing to free here: the server keeps (and evicts) its own prompt cache."""

    def pending(self) -> int:
        return len(self._streams)

    async def aclose(self) -> None:
        for request_id in list(self._tasks):
            self.abort(request_id)
        await self._client.aclose()

    def _cancel(self, request_id: str) -> None:
        task = self._tasks.pop(request_id, None)
        if task is not None:
            task.cancel()

    async def _fetch(self, request_id: str, body: dict[str, Any]) -> None:
        try:
            await self._read(request_id, body)
        finally:
            if self._tasks.get(request_id) is asyncio.current_task():
                del self._tasks[request_id]

    async def _read(self, request_id: str, body: dict[str, Any]) -> None:
        progress = _Progress()
        put = self._streams.put  # drops outputs once the request is aborted
        try:
            async with self._client.stream("POST", "chat/completions", json=body) as resp:
                if resp.status_code != 200:
                    detail = (await resp.aread()).decode("utf-8", "replace")[:300]
                    raise RemoteLlmError(f"HTTP {resp.status_code}: {detail}")
                async for line in resp.aiter_lines():
                    if not line.startswith("data:"):
                        continue  # SSE comments, keep-alives and blank separators
                    data = line[len("data:") :].strip()
                    if data == "[DONE]":
                        break
                    chunk = json.loads(data)
                    if not isinstance(chunk, dict):
                        raise RemoteLlmError(f"a stream chunk is not a JSON object: {data[:100]}")
                    delta, calls = _apply_chunk(progress, chunk)
                    if delta or calls:
                        put(request_id, _delta_output(request_id, progress, delta, calls))
            put(request_id, _final_output(request_id, progress))
        except asyncio.CancelledError:
            raise
        except (httpx.HTTPError, RemoteLlmError, ValueError, KeyError, TypeError) as exc:
            error = f"remote LLM at {self.config.base_url}: {type(exc).__name__}: {exc}"
            put(request_id, StageOutput(request_id, None, finished=True, error=error))


class RemoteLlmError(RuntimeError):
    """The server answered, but not with a chat-completions stream."""


def chat_body(model: str, inputs: LlmInput) -> dict[str, Any]:
    """The request body for `inputs`; raises ValueError for what a server cannot take."""
    if inputs.prompt_token_ids is not None or not inputs.messages:
        raise ValueError("the remote LLM takes chat messages, not prompt token ids")
    params = inputs.sampling_params
    if params.stop_token_ids or params.logits_processors:
        raise ValueError("the remote LLM supports neither stop_token_ids nor logits_processors")
    body: dict[str, Any] = {
        "model": model,
        "messages": [dict(m) for m in inputs.messages],
        "stream": True,
        "stream_options": {"include_usage": True},
        "max_tokens": params.max_tokens,
        "temperature": params.temperature,
        "top_p": params.top_p,
        "presence_penalty": params.presence_penalty,
        # Not in OpenAI's schema, but vLLM, vllm-mlx and mlx_lm.server honour them.
        "top_k": params.top_k,
        "min_p": params.min_p,
        "repetition_penalty": params.repetition_penalty,
    }
    if params.stop:
        body["stop"] = list(params.stop)
    if params.seed is not None:
        body["seed"] = params.seed
    if inputs.cache_key:
        body["prompt_cache_key"] = inputs.cache_key
    if inputs.tools:
        body["tools"] = inputs.tools
        body["tool_choice"] = inputs.tool_choice
        if inputs.parallel_tool_calls is not None:
            body["parallel_tool_calls"] = inputs.parallel_tool_calls
    return body


def _apply_chunk(progress: _Progress, chunk: Mapping[str, Any]) -> tuple[str, list[ToolCallDelta]]:
    """Fold one SSE chunk into `progress`; return its new text and call deltas."""
    usage = chunk.get("usage")
    if usage:
        progress.usage_seen = True
        progress.prompt_tokens = int(usage.get("prompt_tokens", 0))
        progress.completion_tokens = int(usage.get("completion_tokens", 0))
        details = usage.get("prompt_tokens_details") or {}
        progress.cached_tokens = int(details.get("cached_tokens") or 0)
    text = ""
    calls: list[ToolCallDelta] = []
    for choice in chunk.get("choices") or ():
        delta = choice.get("delta") or {}
        text += delta.get("content") or ""
        calls += [_call_delta(progress, call) for call in delta.get("tool_calls") or ()]
        if choice.get("finish_reason"):
            progress.finish_reason = choice["finish_reason"]
    progress.text += text
    if (text or calls) and not progress.usage_seen:
        # Servers stream about one token per chunk; exact usage replaces this count.
        progress.completion_tokens += 1
    return text, calls


def _call_delta(progress: _Progress, call: Mapping[str, Any]) -> ToolCallDelta:
    """One streamed `tool_calls` entry: the name comes with a call's first piece only."""
    index = int(call.get("index", 0))
    function = call.get("function") or {}
    if function.get("name"):
        progress.call_names[index] = function["name"]
    name = progress.call_names.get(index)
    if name is None:
        raise RemoteLlmError(f"tool call {index} streamed arguments before its name")
    return ToolCallDelta(index=index, name=name, arguments=function.get("arguments") or "")


def _delta_output(
    request_id: str, progress: _Progress, delta: str, calls: list[ToolCallDelta]
) -> StageOutput:
    out = RequestOutput(
        request_id=request_id,
        new_text=delta,
        output_text=progress.text,
        completion_tokens=progress.completion_tokens,
        tool_calls=calls,
    )
    return StageOutput(request_id, out)


def _final_output(request_id: str, progress: _Progress) -> StageOutput:
    out = RequestOutput(
        request_id=request_id,
        output_text=progress.text,
        finished=True,
        finish_reason=progress.finish_reason or "stop",
        prompt_tokens=progress.prompt_tokens,
        completion_tokens=progress.completion_tokens,
        cached_tokens=progress.cached_tokens,
    )
    return StageOutput(request_id, out, finished=True)
