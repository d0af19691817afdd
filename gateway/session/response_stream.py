"""The responses of a realtime session, from `response.created` to `response.done`.

Rules of this module:

1. A response finishes exactly once, on the `ResponseDone` the backend reports for it
   (every started turn gets exactly one): its open parts get their `.done` events, then
   `response.done`. After that its id is unknown here.
2. A cancel does not finish a response. It sends `CancelResponse` down and frees the
   conversation's slot at once (`active_id` None), so the next response can start; the
   actions are carried out in order, so the cancel reaches the engine before that start.
   The layer below ends the turn, drops whatever the turn produces after the cancel (the
   duplex fence is the one stale-output filter; nothing here filters) and reports
   `ResponseDone(status="cancelled")`, on which the response finishes as cancelled.
3. Output audio arrives as float32 at the voice's rate. Each response resamples it with
   one streaming resampler to the output format's rate and encodes it once, then cuts it
   into deltas of at most `output_chunk_ms`; the resampler's held-back tail goes out when
   the response completes. What goes out is also played into the session's far end
   (`gateway.session.far_end`), the echo canceller's reference.
4. An event for a response id not known here is a bug below, not client input: it raises.
5. A response's output items are numbered (`output_index`) in the order they open: the
   message (text or audio) and each function call, which opens on its first arguments
   delta and closes, with `function_call_arguments.done`, when the response finishes.
   A call carries no content part and is never spoken.
"""

from __future__ import annotations

import base64
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from duplex.turn import TurnRequest
from gateway.protocol.audio import AudioFormat, StreamResampler
from gateway.protocol.events import new_id
from gateway.protocol.usage import realtime_usage
from gateway.session.actions import CancelResponse, StartResponse
from gateway.session.backend import ResponseDone, ResponseOutput
from gateway.session.conversation import Conversation, Item
from gateway.session.far_end import FarEnd
from gateway.session.outbox import Outbox
from gateway.session.responses import ResponseOptions

__all__ = ["Response", "ResponseStream"]

# Error codes of turns refused for the server's sake, not for what they asked.
_SERVER_SIDE = {"server_busy": "server_error"}


@dataclass
class Response:
    id: str
    options: ResponseOptions
    input_item_id: str | None  # the user item whose audio this response transcribes
    status: str = "in_progress"
    cancel_reason: str | None = None  # set once a cancel went down (rule 2)
    item: Item | None = None  # the message (text or audio) item
    calls: dict[int, Item] = field(default_factory=dict)  # call index -> function_call item
    outputs: list[Item] = field(default_factory=list)  # every output item, in order (rule 5)
    resampler: StreamResampler | None = None
    text: str = ""
    audio_ms: float = 0.0
    output_tokens: int = 0  # text deltas, the usage reported when the engine gives none
    usage: dict[str, Any] | None = None
    status_details: dict[str, Any] | None = None

    @property
    def spoken(self) -> bool:
        return "audio" in self.options.output_modalities


class ResponseStream:
    """Every response not yet done; `active_id` is the default conversation's one."""

    def __init__(
        self,
        outbox: Outbox,
        conversation: Conversation,
        *,
        session_id: str,
        chunk_ms: int,
        far_end: FarEnd,
        media_format: AudioFormat | None = None,
    ) -> None:
        self._out = outbox
        # A WebRTC call speaks on its RTP track in this format, whatever the response's
        # output format says: its deltas go to the track, not to the client (rule 3).
        self._media_format = media_format
        self._far_end = far_end
        self._conversation = conversation
        self.conversation_id = "conv_" + session_id.removeprefix("sess_")
        self._chunk_ms = chunk_ms
        self._responses: dict[str, Response] = {}
        self.active_id: str | None = None
        self.voice_locked = False  # the assistant has spoken: the voice cannot change

    def __contains__(self, response_id: str) -> bool:
        return response_id in self._responses

    def is_running(self, response_id: str) -> bool:
        """Known and not cancelled yet: a response the client can still cancel."""
        response = self._responses.get(response_id)
        return response is not None and response.cancel_reason is None

    def input_item_id(self, response_id: str) -> str | None:
        return self._responses[response_id].input_item_id

    def active_item_id(self) -> str | None:
        active = self._responses[self.active_id] if self.active_id else None
        return active.item.id if active is not None and active.item is not None else None

    def start(self, options: ResponseOptions, turn: TurnRequest, input_item_id: str | None) -> str:
        response = Response(new_id("resp"), options, input_item_id)
        self._responses[response.id] = response
        if not options.out_of_band:
            self.active_id = response.id
        if response.spoken:
            self._far_end.expected = True
        self._out.emit("response.created", response=self._response_object(response))
        self._out.act(StartResponse(response.id, turn, conversation=not options.out_of_band))
        return response.id

    def cancel(self, response_id: str, reason: str) -> None:
        """Stop the response's turn; it finishes on its `ResponseDone` (rule 2)."""
        response = self._responses[response_id]
        response.cancel_reason = reason
        self._out.act(CancelResponse(response_id, reason))
        if self.active_id == response_id:
            self.active_id = None

    def close(self) -> None:
        """The connection is going away: stop every turn still running, forget them all."""
        for response in self._responses.values():
            if response.cancel_reason is None:
                self._out.act(CancelResponse(response.id, "client_cancelled"))
        self._responses.clear()
        self.active_id = None

    # -- engine events ------------------------------------------------------------------

    def receive(self, event: ResponseOutput | ResponseDone) -> None:
        """A text or audio output of a known response, or its done event."""
        response = self._responses.get(event.response_id)
        if response is None:
            raise RuntimeError(f"an engine event for unknown response {event.response_id!r}")
        if isinstance(event, ResponseDone):
            self._done(response, event)
        elif event.kind == "text":
            self._text(response, event.text)
        elif event.kind == "audio":
            self._audio(response, event)
        elif event.kind == "tool_call":
            self._tool_call(response, event)
        else:
            raise RuntimeError(f"{event.kind!r} output is not a response output")

    def _text(self, response: Response, delta: str) -> None:
        if not delta:
            return
        response.output_tokens += 1
        if response.spoken:
            return  # spoken responses report text as the transcript of each audio chunk
        item = self._open_item(response)
        response.text += delta
        item.text_value = response.text
        self._out.emit("response.output_text.delta", **self._ids(response), delta=delta)

    def _audio(self, response: Response, out: ResponseOutput) -> None:
        if not response.spoken:
            return
        item = self._open_item(response)
        fmt = self._output_format(response)
        if response.resampler is None:
            response.resampler = StreamResampler(out.sample_rate, fmt.rate)
        elif response.resampler.in_rate != out.sample_rate:
            raise RuntimeError(
                f"response {response.id}: audio at {out.sample_rate} Hz after "
                f"{response.resampler.in_rate} Hz; one response speaks with one voice"
            )
        resampled = response.resampler.push(np.frombuffer(out.audio, dtype="<f4"))
        encoded = fmt.encode(resampled)
        spoken = _join_spoken(response.text, out.text) if out.text else ""
        if spoken:
            response.text += spoken
            self._out.emit(
                "response.output_audio_transcript.delta", **self._ids(response), delta=spoken
            )
        self._send_audio(response, fmt, encoded)
        self._far_end.play(item.id, resampled, fmt.rate, spoken)
        item.add_audio(encoded, spoken)

    def _tool_call(self, response: Response, out: ResponseOutput) -> None:
        item = response.calls.get(out.call_index)
        if item is None:
            item = Item.function_call(new_id("item"), new_id("call"), out.name)
            response.calls[out.call_index] = item
            self._add_output(response, item)
        response.output_tokens += 1
        if not out.text:
            return
        item.arguments += out.text
        self._out.emit(
            "response.function_call_arguments.delta",
            response_id=response.id,
            item_id=item.id,
            output_index=response.outputs.index(item),
            call_id=item.call_id,
            delta=out.text,
        )

    def _flush_audio(self, response: Response) -> None:
        """Send the resampler's held-back tail: the engine's audio is complete."""
        if response.resampler is None or response.item is None:
            return
        fmt = self._output_format(response)
        resampled = response.resampler.push(np.zeros(0, np.float32), last=True)
        tail = fmt.encode(resampled)
        self._send_audio(response, fmt, tail)
        self._far_end.play(response.item.id, resampled, fmt.rate)
        self._far_end.flush()
        response.item.add_audio(tail, "")

    def _output_format(self, response: Response) -> AudioFormat:
        return self._media_format or response.options.output_format

    def _send_audio(self, response: Response, fmt: AudioFormat, encoded: bytes) -> None:
        chunk = int(self._chunk_ms * fmt.bytes_per_ms) // fmt.sample_bytes * fmt.sample_bytes
        for start in range(0, len(encoded), chunk):
            piece = encoded[start : start + chunk]
            response.audio_ms += fmt.duration_ms(len(piece))
            self._out.emit(
                "response.output_audio.delta",
                **self._ids(response),
                delta=base64.b64encode(piece).decode("ascii"),
            )

    def _done(self, response: Response, done: ResponseDone) -> None:
        if done.usage:
            response.usage = realtime_usage(done.usage)
        if done.status == "completed":
            self._flush_audio(response)
            self._finish(response, "completed", None)
        elif done.status == "incomplete":
            self._flush_audio(response)
            reason = done.reason or "max_output_tokens"
            self._finish(response, "incomplete", {"type": "incomplete", "reason": reason})
        elif done.status == "cancelled":
            reason = done.reason or response.cancel_reason or "client_cancelled"
            self._finish(response, "cancelled", {"type": "cancelled", "reason": reason})
        else:
            message = done.error or "the engine failed"
            error = {"type": "server_error", "code": "engine_error", "message": message}
            if done.error_code is not None:
                # Refused for what it asked (the client's to fix), or for capacity.
                kind = _SERVER_SIDE.get(done.error_code, "invalid_request_error")
                error = {"type": kind, "code": done.error_code, "message": message}
            self._out.emit("error", error={**error, "param": None, "event_id": None})
            self._finish(response, "failed", {"type": "failed", "error": error})

    # -- output item and response.done --------------------------------------------------

    def _open_item(self, response: Response) -> Item:
        if response.item is not None:
            return response.item
        item = Item.assistant(new_id("item"), response.options.output_modalities)
        item.set_output_format(self._output_format(response))
        response.item = item
        self.voice_locked = self.voice_locked or response.spoken
        self._add_output(response, item)
        self._out.emit("response.content_part.added", **self._ids(response), part=item.part())
        return item

    def _add_output(self, response: Response, item: Item) -> None:
        """Announce a new output item of `response` and add it to the conversation."""
        response.outputs.append(item)
        self._out.emit(
            "response.output_item.added",
            response_id=response.id,
            output_index=len(response.outputs) - 1,
            item=item.public(),
        )
        if not response.options.out_of_band:
            previous = self._conversation.last_id()
            try:
                self._conversation.insert(item, previous)
            except ValueError:
                pass  # a full conversation still streams the answer; it is just not kept
            else:
                self._out.emit(
                    "conversation.item.added", previous_item_id=previous, item=item.public()
                )

    def _ids(self, response: Response) -> dict[str, Any]:
        assert response.item is not None
        return {
            "response_id": response.id,
            "item_id": response.item.id,
            "output_index": response.outputs.index(response.item),
            "content_index": 0,
        }

    def _finish(self, response: Response, status: str, details: dict[str, Any] | None) -> None:
        """Close every open part, then `response.done`; the response is then forgotten."""
        del self._responses[response.id]
        if self.active_id == response.id:
            self.active_id = None
        response.status = status
        response.status_details = details
        for item in response.outputs:
            item.status = "completed" if status == "completed" else "incomplete"
            if item is response.item:
                self._close_message(response, item)
            else:
                self._close_call(response, item)
        if response.usage is None:
            response.usage = realtime_usage({"completion_tokens": response.output_tokens})
        self._out.emit("response.done", response=self._response_object(response))

    def _close_message(self, response: Response, item: Item) -> None:
        ids = self._ids(response)
        if response.spoken:
            self._out.emit("response.output_audio.done", **ids)
            self._out.emit("response.output_audio_transcript.done", **ids, transcript=response.text)
        else:
            self._out.emit("response.output_text.done", **ids, text=response.text)
        self._out.emit("response.content_part.done", **ids, part=item.part())
        self._close_output(response, item)

    def _close_call(self, response: Response, item: Item) -> None:
        self._out.emit(
            "response.function_call_arguments.done",
            response_id=response.id,
            item_id=item.id,
            output_index=response.outputs.index(item),
            call_id=item.call_id,
            name=item.name,
            arguments=item.arguments,
        )
        self._close_output(response, item)

    def _close_output(self, response: Response, item: Item) -> None:
        if item.id in self._conversation:
            previous = self._conversation.previous_id(item.id)
            self._out.emit("conversation.item.done", previous_item_id=previous, item=item.public())
        self._out.emit(
            "response.output_item.done",
            response_id=response.id,
            output_index=response.outputs.index(item),
            item=item.public(),
        )

    def _response_object(self, response: Response) -> dict[str, Any]:
        options = response.options
        return {
            "object": "realtime.response",
            "id": response.id,
            "status": response.status,
            "status_details": response.status_details,
            "output": [item.public() for item in response.outputs],
            "conversation_id": None if options.out_of_band else self.conversation_id,
            "output_modalities": list(options.output_modalities),
            "max_output_tokens": "inf"
            if options.max_output_tokens is None
            else options.max_output_tokens,
            "audio": {
                "output": {"format": options.output_format.ga_shape(), "voice": options.voice}
            },
            "usage": response.usage,
            "metadata": options.metadata,
        }


def _join_spoken(before: str, text: str) -> str:
    """`text` as it continues the transcript `before`: chunks are separate clauses."""
    if before and not before[-1].isspace() and not text[:1].isspace():
        return " " + text
    return text
