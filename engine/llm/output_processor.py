"""The LLM stage's output processor: each sampled token becomes the request's next
`RequestOutput` delta (its text, its tool calls, whether it finished and why), or a
failed `StageOutput` when the request's logits processor raised."""

from __future__ import annotations

from engine.llm.sequence import LlmSequence
from engine.runtime.request import Request, RequestOutput, RequestStatus, ToolCallDelta
from engine.runtime.stage import StageOutput

__all__ = ["OutputProcessor"]


class OutputProcessor:
    """Detokenizes sampled tokens and checks each request's stop conditions."""

    def __init__(self, eos: set[int]) -> None:
        self._eos = eos

    def output(
        self, seq: LlmSequence, token: int, now: float, error: Exception | None
    ) -> StageOutput:
        """`token` was sampled for `seq` (`error`: what its logits processor raised)."""
        if error is not None:
            return self._fail(seq, error)
        out = self._advance(seq, token, now)
        metrics = self._metrics(seq.req, now) if out.finished else {}
        return StageOutput(seq.req.request_id, out, out.finished, metrics=metrics)

    @staticmethod
    def _fail(seq: LlmSequence, exc: Exception) -> StageOutput:
        # Only this request failed (its logits processor raised); the batch goes on.
        seq.req.set_finished(RequestStatus.FINISHED_ABORTED, "error")
        error = f"logits processor failed: {type(exc).__name__}: {exc}"
        return StageOutput(seq.req.request_id, None, finished=True, error=error)

    @staticmethod
    def _metrics(req: Request, now: float) -> dict[str, float]:
        first = req.first_token_time or now
        return {
            "ttft_s": first - req.arrival_time,
            "e2e_s": now - req.arrival_time,
            "decode_tok_s": (req.num_output_tokens - 1) / max(now - first, 1e-9),
        }

    def _advance(self, seq: LlmSequence, token: int, now: float) -> RequestOutput:
        req, params = seq.req, seq.req.sampling_params
        req.append_output_token(token)
        seq.tokens.append(token)
        if req.first_token_time is None:
            req.first_token_time = now
        status = None
        if token in self._eos or token in params.stop_token_ids:
            status = RequestStatus.FINISHED_STOPPED
            delta = seq.detok.finish()
        else:
            delta = seq.detok.push([token])
            if seq.detok.stopped:
                status = RequestStatus.FINISHED_STOPPED
            elif req.num_output_tokens >= params.max_tokens:
                status = RequestStatus.FINISHED_LENGTH_CAPPED
                delta += seq.detok.finish()
        req.output_text = seq.detok.text
        calls: list[ToolCallDelta] = []
        reason = None
        if seq.calls is not None:
            delta, calls = seq.calls.push(delta)
            if status is not None:
                rest, last = seq.calls.finish()
                delta, calls = delta + rest, calls + last
                reason = "tool_calls" if seq.calls.called else None
        if status is not None:
            req.set_finished(status, reason)
        return RequestOutput(
            request_id=req.request_id,
            new_token_ids=[token],
            new_text=delta,
            tool_calls=calls,
            output_token_ids=list(req.output_token_ids),
            output_text=req.output_text,
            finished=status is not None,
            finish_reason=req.get_finish_reason() if status is not None else None,
            prompt_tokens=req.num_prompt_tokens,
            completion_tokens=req.num_output_tokens,
            cached_tokens=req.cached_tokens,
        )
