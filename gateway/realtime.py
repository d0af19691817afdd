"""A sans-I/O OpenAI Realtime session: client events in, server events and engine actions out.

Rule 1: nothing here does I/O or reads a clock. The shell (`gateway.connection`) feeds
client frames (`receive_text`), VAD decisions (`speech_started` / `speech_stopped`) and
engine outputs (`response_*`), then drains `events_to_send()` and `actions()`.
Rule 2: a response finishes exactly once. After its `response.done` every engine output
still addressed to it is dropped here, so no stale audio can reach the client whatever
the engine does afterwards.
Rule 3: all `*_ms` values count audio appended to this session (one clock), in ms.
"""

from __future__ import annotations

import base64
import json
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from pydantic import ValidationError

from gateway.audio import (
    ENGINE_RATE,
    AudioFormat,
    AudioFormatError,
    StreamResampler,
    decode_base64,
    resample,
)
from gateway.config import GatewayConfig
from gateway.conversation import Conversation, Item
from gateway.protocol import CLIENT_EVENTS, new_id, to_beta
from gateway.responses import ResponseOptions, parse_response_options
from gateway.session_config import SessionSettings, SettingError, apply_update

__all__ = [
    "CancelResponse",
    "ClientError",
    "CloseSession",
    "ConfigureVad",
    "DiscardPrepared",
    "FeedVad",
    "PrepareResponse",
    "RealtimeSession",
    "StartResponse",
    "TranscribeItem",
]

MIN_COMMIT_MS = 100
# Clients (the openai SDK among them) refuse messages over 1 MiB by default.
MAX_SERVER_EVENT_BYTES = 768 * 1024
# Without speech, server VAD keeps only this much audio before the newest. The VAD runs
# behind the appends (a client may send seconds of audio at once), and the engine's VAD
# stage refuses to fall more than 30 s behind, so 30 s always covers the speech start.
VAD_KEEP_MS = 30_000


@dataclass(frozen=True)
class StartResponse:
    """Run one turn in the engine: `prompt` is the DuplexAppendPlan prompt."""

    response_id: str
    prompt: dict[str, Any]
    entry_stage_id: int
    final_stage_id: int
    out_of_band: bool


@dataclass(frozen=True)
class TranscribeItem:
    """Transcribe a committed user audio item that no response is answering yet; the
    job's outputs come back under `job_id` as a response's would."""

    job_id: str
    audio: np.ndarray  # float32 at ENGINE_RATE


@dataclass(frozen=True)
class PrepareResponse:
    """Start work on the response a pause in speech would get if it became a stop.

    The engine holds its outputs back; the `StartResponse` of the same turn (an equal
    prompt) takes the work over, and anything else discards it.
    """

    prompt: dict[str, Any]
    entry_stage_id: int
    final_stage_id: int


@dataclass(frozen=True)
class DiscardPrepared:
    """The prepared response will not be asked for: stop its work."""


@dataclass(frozen=True)
class CancelResponse:
    """Stop a response's engine work; `reason` "turn_detected" is a barge-in."""

    response_id: str
    reason: str


@dataclass(frozen=True)
class FeedVad:
    samples: np.ndarray  # float32 at ENGINE_RATE


@dataclass(frozen=True)
class ConfigureVad:
    """(Re)start server VAD from session time `start_ms`, or stop it (`settings` None)."""

    settings: Any
    start_ms: float
    pause_after_ms: int | None = None


@dataclass(frozen=True)
class CloseSession:
    code: int
    reason: str


class ClientError(Exception):
    """A client event the session refuses; becomes one `error` event."""

    def __init__(
        self, message: str, code: str, param: str | None = None, kind: str = "invalid_request_error"
    ) -> None:
        super().__init__(message)
        self.code = code
        self.param = param
        self.kind = kind


@dataclass
class Response:
    id: str
    options: ResponseOptions
    input_item_id: str | None
    status: str = "in_progress"
    item: Item | None = None
    resampler: StreamResampler | None = None
    text: str = ""
    audio_ms: float = 0.0
    usage: dict[str, Any] | None = None
    output_tokens: int = 0
    status_details: dict[str, Any] | None = None
    pending: bytearray = field(default_factory=bytearray)


class RealtimeSession:
    def __init__(self, *, config: GatewayConfig, model: str, beta: bool) -> None:
        self.config = config
        self.limits = config.limits
        self.beta = beta
        self.settings = SessionSettings(
            id=new_id("sess"),
            model=model,
            voice=config.voices[0],
            instructions=config.default_instructions,
        )
        self.conversation = Conversation(max_items=self.limits.max_items)
        self.responses: dict[str, Response] = {}
        self.active_id: str | None = None  # the one response on the default conversation
        self.voice_locked = False
        self.audio_ms = 0.0
        self._buffer = bytearray()
        self._buffer_start_ms = 0.0
        self._speech_item_id: str | None = None
        self._speech_start_ms = 0.0
        # The speech bytes and 16 kHz samples of the response the engine holds prepared.
        self._prepared_audio: tuple[bytes, np.ndarray] | None = None
        self._transcriptions: dict[str, str] = {}  # transcription job id -> item id
        self._idle_since_ms = 0.0
        self._vad_resampler: StreamResampler | None = None
        self._events: list[dict[str, Any]] = []
        self._actions: list[Any] = []
        self._emit("session.created", session=self._session_object())
        self._configure_vad()

    # -- outputs -----------------------------------------------------------------------

    def events_to_send(self) -> list[dict[str, Any]]:
        events, self._events = self._events, []
        return events

    def actions(self) -> list[Any]:
        actions, self._actions = self._actions, []
        return actions

    def _emit(self, kind: str, **fields: Any) -> None:
        event = {"type": kind, "event_id": new_id("event"), **fields}
        if self.beta:
            event = to_beta(event)
            if event is None:
                return
        self._events.append(event)

    def _error(self, exc: ClientError, event_id: str | None) -> None:
        self._emit(
            "error",
            error={
                "type": exc.kind,
                "code": exc.code,
                "message": str(exc),
                "param": exc.param,
                "event_id": event_id,
            },
        )

    def _session_object(self) -> dict[str, Any]:
        return self.settings.beta_object() if self.beta else self.settings.ga_object()

    def reject_model(self, requested: str, served: str) -> None:
        """The connection asked for a model this gateway does not serve: error, then close."""
        self._events.clear()
        self._actions = [a for a in self._actions if not isinstance(a, ConfigureVad)]
        self._error(
            ClientError(
                f"The model {requested!r} is not served here; use {served!r}",
                "invalid_model",
                "model",
            ),
            None,
        )
        self._actions.append(CloseSession(1008, "invalid model"))

    # -- client frames -----------------------------------------------------------------

    def receive_binary(self, size: int) -> None:
        self._error(
            ClientError(
                f"binary frames are not accepted ({size} bytes); send JSON text events",
                "invalid_event",
            ),
            None,
        )

    def receive_text(self, data: str) -> None:
        event_id = None
        try:
            if len(data) > self.limits.max_event_bytes:
                raise ClientError(
                    f"the event is {len(data)} bytes; the limit is "
                    f"{self.limits.max_event_bytes} bytes",
                    "event_too_large",
                )
            payload = self._parse(data)
            event_id = payload.get("event_id") if isinstance(payload.get("event_id"), str) else None
            self._dispatch(payload)
        except ClientError as exc:
            self._error(exc, event_id)

    def _parse(self, data: str) -> dict[str, Any]:
        try:
            payload = json.loads(data)
        except (json.JSONDecodeError, RecursionError) as exc:
            raise ClientError(f"the frame is not valid JSON: {exc}", "invalid_json") from None
        if not isinstance(payload, dict):
            raise ClientError("an event is a JSON object", "invalid_json")
        return payload

    def _dispatch(self, payload: dict[str, Any]) -> None:
        kind = payload.get("type")
        model = CLIENT_EVENTS.get(kind) if isinstance(kind, str) else None
        if model is None:
            raise ClientError(f"invalid event type {kind!r}", "invalid_value", "type")
        if kind == "transcription_session.update" and not self.beta:
            raise ClientError(
                "transcription_session.update is a beta event; use session.update",
                "invalid_value",
                "type",
            )
        try:
            event = model.model_validate(payload)
        except ValidationError as exc:
            raise _validation_error(exc) from None
        handler = getattr(self, "_on_" + kind.replace(".", "_"))
        handler(event)

    # -- session -----------------------------------------------------------------------

    def _on_session_update(self, event: Any) -> None:
        try:
            new = apply_update(
                self.settings,
                event.session,
                beta=self.beta,
                config=self.config,
                voice_locked=self.voice_locked,
            )
        except SettingError as exc:
            raise ClientError(str(exc), exc.code, exc.param) from None
        except ValidationError as exc:
            raise _validation_error(exc, prefix="session.") from None
        old = self.settings
        self.settings = new
        if new.input_format != old.input_format and self._buffer:
            # Buffered bytes are in the old format; they cannot be reinterpreted.
            self._buffer.clear()
        if new.turn_detection != old.turn_detection or new.input_format != old.input_format:
            self._configure_vad()
        self._emit("session.updated", session=self._session_object())

    def _on_transcription_session_update(self, event: Any) -> None:
        self._on_session_update(event)

    def _configure_vad(self) -> None:
        detection = self.settings.turn_detection
        self._speech_item_id = None
        self._idle_since_ms = self.audio_ms
        fmt = self.settings.input_format
        self._vad_resampler = None if detection is None else StreamResampler(fmt.rate, ENGINE_RATE)
        self._discard_prepared()
        pause = self.config.prepare_after_silence_ms if detection is not None else None
        self._actions.append(ConfigureVad(detection, self.audio_ms, pause))

    # -- input audio -------------------------------------------------------------------

    def _on_input_audio_buffer_append(self, event: Any) -> None:
        fmt = self.settings.input_format
        try:
            data = decode_base64(event.audio)
            samples = fmt.decode(data)
        except AudioFormatError as exc:
            raise ClientError(str(exc), "invalid_value", "audio") from None
        if self.settings.turn_detection is None:
            buffered = fmt.duration_ms(len(self._buffer) + len(data))
            if buffered > self.limits.max_input_buffer_ms:
                raise ClientError(
                    f"the input audio buffer is full ({self.limits.max_input_buffer_ms} ms); "
                    "commit or clear it",
                    "input_audio_buffer_full",
                    "audio",
                )
        if not self._buffer:
            self._buffer_start_ms = self.audio_ms
        self._buffer.extend(data)
        self.audio_ms += fmt.duration_ms(len(data))
        if self._vad_resampler is not None:
            self._actions.append(FeedVad(self._vad_resampler.push(samples)))
            self._trim_idle_buffer()
            self._check_idle_timeout()

    def _trim_idle_buffer(self) -> None:
        if self._speech_item_id is not None:
            return
        fmt = self.settings.input_format
        keep = int(VAD_KEEP_MS * fmt.bytes_per_ms) // fmt.sample_bytes * fmt.sample_bytes
        excess = len(self._buffer) - keep
        if excess > 0:
            del self._buffer[:excess]
            self._buffer_start_ms += fmt.duration_ms(excess)

    def _check_idle_timeout(self) -> None:
        detection = self.settings.turn_detection
        if detection is None or detection.idle_timeout_ms is None:
            return
        if self._speech_item_id is not None or self.active_id is not None:
            self._idle_since_ms = self.audio_ms
            return
        if self.audio_ms - self._idle_since_ms < detection.idle_timeout_ms:
            return
        item_id = new_id("item")
        self._emit(
            "input_audio_buffer.timeout_triggered",
            audio_start_ms=int(self._buffer_start_ms),
            audio_end_ms=int(self.audio_ms),
            item_id=item_id,
        )
        self._idle_since_ms = self.audio_ms
        self._commit(item_id, self._buffer_start_ms, self.audio_ms)
        self._create_default_response(ResponseOptions.from_session(self.settings), None)

    def _on_input_audio_buffer_commit(self, event: Any) -> None:
        if self._speech_item_id is not None:
            # A manual commit in the middle of detected speech ends that speech turn.
            self._speech_item_id = None
            self._discard_prepared()
        item = self._commit(new_id("item"), self._buffer_start_ms, self.audio_ms)
        self._transcribe(item)

    def _on_input_audio_buffer_clear(self, event: Any) -> None:
        self._discard_prepared()
        self._buffer.clear()
        self._buffer_start_ms = self.audio_ms
        self._speech_item_id = None
        self._emit("input_audio_buffer.cleared")

    def _on_output_audio_buffer_clear(self, event: Any) -> None:
        raise ClientError(
            "output_audio_buffer.clear applies to WebRTC/SIP sessions; over WebSocket stop "
            "playback locally and send conversation.item.truncate",
            "invalid_value",
            "type",
        )

    def _buffer_span(self, start_ms: float, end_ms: float) -> tuple[int, int]:
        """Byte offsets of [start_ms, end_ms) in the buffer, on whole samples."""
        fmt = self.settings.input_format
        step = fmt.sample_bytes
        lo = max(0, int((start_ms - self._buffer_start_ms) * fmt.bytes_per_ms) // step * step)
        hi = max(lo, int((end_ms - self._buffer_start_ms) * fmt.bytes_per_ms) // step * step)
        return lo, hi

    def _take_buffer(self, start_ms: float, end_ms: float) -> bytes:
        """Remove and return buffered audio in [start_ms, end_ms); later audio stays."""
        lo, hi = self._buffer_span(start_ms, end_ms)
        data = bytes(self._buffer[lo:hi])
        del self._buffer[:hi]
        self._buffer_start_ms += self.settings.input_format.duration_ms(hi)
        return data

    def _commit(self, item_id: str, start_ms: float, end_ms: float) -> Item:
        fmt = self.settings.input_format
        span_ms = min(end_ms, self.audio_ms) - max(start_ms, self._buffer_start_ms)
        if not self._buffer or span_ms < MIN_COMMIT_MS:
            raise ClientError(
                "Error committing input audio buffer: buffer too small. Expected at least "
                f"{MIN_COMMIT_MS}ms of audio, but buffer only has "
                f"{max(span_ms, 0):.2f}ms of audio.",
                "input_audio_buffer_commit_empty",
            )
        data = self._take_buffer(start_ms, end_ms)
        previous = self.conversation.last_id()
        prepared = self._prepared_audio
        if prepared is not None and prepared[0] == data:
            samples = prepared[1]  # resampled already when the response was prepared
        else:
            samples = resample(fmt.decode(data), fmt.rate, ENGINE_RATE)
        item = Item.user_audio(item_id, data, fmt, samples)
        self._emit("input_audio_buffer.committed", previous_item_id=previous, item_id=item_id)
        self._add_item(item, previous)
        return item

    # -- server VAD ---------------------------------------------------------------------

    def speech_started(self, audio_start_ms: float) -> None:
        """VAD heard speech begin at session time `audio_start_ms`."""
        detection = self.settings.turn_detection
        if detection is None or self._speech_item_id is not None:
            return
        self._speech_item_id = new_id("item")
        self._speech_start_ms = max(audio_start_ms, self._buffer_start_ms)
        self._emit(
            "input_audio_buffer.speech_started",
            audio_start_ms=int(audio_start_ms),
            item_id=self._speech_item_id,
        )
        if detection.interrupt_response and self.active_id is not None:
            self._cancel(self.responses[self.active_id], "turn_detected")

    def speech_paused(self, audio_end_ms: float) -> None:
        """VAD heard a silence begin at `audio_end_ms` that may become the stop: prepare
        the response the stop would create, so its work runs while the silence does."""
        detection = self.settings.turn_detection
        item_id = self._speech_item_id
        if detection is None or item_id is None or self.config.prepare_after_silence_ms is None:
            return
        if not detection.create_response or self.active_id is not None:
            return  # the stop would not create a response
        lo, hi = self._buffer_span(self._speech_start_ms, audio_end_ms)
        fmt = self.settings.input_format
        if fmt.duration_ms(hi - lo) < MIN_COMMIT_MS:
            return
        data = bytes(self._buffer[lo:hi])
        # The bytes the commit will take; it reuses these samples, so the prompts match.
        samples = resample(fmt.decode(data), fmt.rate, ENGINE_RATE)
        item = Item.user_audio(item_id, data, fmt, samples)
        options = ResponseOptions.from_session(self.settings)
        prompt, entry, final = self._turn_prompt(
            options, [*self.conversation.items(), item], out_of_band=False
        )
        self._discard_prepared()
        self._prepared_audio = (data, samples)
        self._actions.append(PrepareResponse(prompt, entry, final))

    def speech_resumed(self) -> None:
        """The paused speech went on: the prepared response is not wanted."""
        self._discard_prepared()

    def _discard_prepared(self) -> None:
        if self._prepared_audio is not None:
            self._prepared_audio = None
            self._actions.append(DiscardPrepared())

    def speech_stopped(self, audio_end_ms: float) -> None:
        """VAD heard speech end at session time `audio_end_ms`: commit and maybe respond."""
        detection = self.settings.turn_detection
        item_id, self._speech_item_id = self._speech_item_id, None
        if detection is None or item_id is None:
            self._discard_prepared()
            return
        self._idle_since_ms = self.audio_ms
        self._emit(
            "input_audio_buffer.speech_stopped", audio_end_ms=int(audio_end_ms), item_id=item_id
        )
        try:
            item = self._commit(item_id, self._speech_start_ms, audio_end_ms)
        except ClientError as exc:
            self._discard_prepared()
            self._error(exc, None)
            return
        if detection.create_response and self.active_id is None:
            # An equal prompt takes over the prepared work; anything else discards it.
            self._prepared_audio = None
            self._create_default_response(ResponseOptions.from_session(self.settings), None)
        else:
            self._transcribe(item)
        self._discard_prepared()

    # -- transcription of items no response answers yet --------------------------------

    def _transcribe(self, item: Item) -> None:
        """Start transcribing `item` now: its words enter the conversation (and the
        transcription events go out) without waiting for a response."""
        if item.pending_audio is None:
            return
        job_id = new_id("transcription")
        self._transcriptions[job_id] = item.id
        self._actions.append(TranscribeItem(job_id, item.pending_audio))

    def _stop_transcription(self, item_id: str) -> None:
        for job_id, target in list(self._transcriptions.items()):
            if target == item_id:
                del self._transcriptions[job_id]
                self._actions.append(CancelResponse(job_id, "superseded"))

    def _transcription_output(self, job_id: str, kind: str, text: str = "") -> None:
        item_id = self._transcriptions.get(job_id)
        item = self.conversation.get(item_id) if item_id else None
        if kind == "transcript" and item is not None:
            self._item_transcript(item, text)
        elif kind == "failed":
            self._transcriptions.pop(job_id, None)
            if item is not None and self.settings.transcription is not None:
                error = {"type": "server_error", "code": "engine_error", "message": text}
                self._emit(
                    "conversation.item.input_audio_transcription.failed",
                    item_id=item.id,
                    content_index=0,
                    error={**error, "param": None},
                )
        elif kind == "done":
            self._transcriptions.pop(job_id, None)

    # -- conversation items ------------------------------------------------------------

    def _add_item(self, item: Item, previous_item_id: str | None) -> None:
        try:
            self.conversation.insert(item, previous_item_id)
        except (KeyError, ValueError) as exc:
            raise ClientError(str(exc.args[0]), "invalid_value", "previous_item_id") from None
        previous = self.conversation.previous_id(item.id)
        self._emit("conversation.item.added", previous_item_id=previous, item=item.public())
        self._emit("conversation.item.done", previous_item_id=previous, item=item.public())

    def _on_conversation_item_create(self, event: Any) -> None:
        try:
            item = Item.from_client(event.item, self.settings.input_format)
        except (ValueError, ValidationError) as exc:
            raise _item_error(exc) from None
        if item.id in self.conversation:
            raise ClientError(f"item id {item.id!r} already exists", "invalid_value", "item.id")
        self._add_item(item, event.previous_item_id or self.conversation.last_id())

    def _on_conversation_item_retrieve(self, event: Any) -> None:
        item = self._item(event.item_id)
        public = item.public(with_audio=True)
        if len(json.dumps(public)) > MAX_SERVER_EVENT_BYTES:
            raise ClientError(
                "the item's audio is too large to send in one event", "item_too_large", "item_id"
            )
        self._emit("conversation.item.retrieved", item=public)

    def _on_conversation_item_delete(self, event: Any) -> None:
        self._item(event.item_id)
        active = self.responses[self.active_id] if self.active_id else None
        if active is not None and active.item is not None and active.item.id == event.item_id:
            raise ClientError(
                "the item belongs to the active response; cancel it first",
                "invalid_value",
                "item_id",
            )
        self._stop_transcription(event.item_id)
        self.conversation.delete(event.item_id)
        self._emit("conversation.item.deleted", item_id=event.item_id)

    def _on_conversation_item_truncate(self, event: Any) -> None:
        item = self._item(event.item_id)
        if item.role != "assistant" or not item.has_audio:
            raise ClientError(
                "only assistant messages with audio can be truncated", "invalid_value", "item_id"
            )
        if event.content_index != 0:
            raise ClientError("content_index must be 0", "invalid_value", "content_index")
        if event.audio_end_ms > item.audio_ms + 1:
            raise ClientError(
                f"audio_end_ms {event.audio_end_ms} is beyond the item's audio "
                f"({int(item.audio_ms)} ms)",
                "invalid_value",
                "audio_end_ms",
            )
        item.truncate(event.audio_end_ms)
        self._emit(
            "conversation.item.truncated",
            item_id=item.id,
            content_index=0,
            audio_end_ms=event.audio_end_ms,
        )

    def _item(self, item_id: str) -> Item:
        item = self.conversation.get(item_id)
        if item is None:
            raise ClientError(f"item {item_id!r} does not exist", "item_not_found", "item_id")
        return item

    # -- responses ---------------------------------------------------------------------

    def _on_response_create(self, event: Any) -> None:
        try:
            options = parse_response_options(
                event.response or {}, self.settings, beta=self.beta, config=self.config
            )
        except SettingError as exc:
            raise ClientError(str(exc), exc.code, exc.param) from None
        except ValidationError as exc:
            raise _validation_error(exc, prefix="response.") from None
        if options.out_of_band:
            self._start_response(options, self._context(options), out_of_band=True)
            return
        if self.active_id is not None:
            raise ClientError(
                f"Conversation already has an active response in progress: {self.active_id}. "
                "Wait until the response is finished before creating a new one.",
                "conversation_already_has_active_response",
            )
        self._create_default_response(options, None)

    def _create_default_response(self, options: ResponseOptions, _: Any) -> None:
        response = self._start_response(options, self._context(options), out_of_band=False)
        self.active_id = response.id

    def _context(self, options: ResponseOptions) -> list[Item]:
        if options.input is None:
            return self.conversation.items()
        items = []
        for entry in options.input:
            if isinstance(entry, str):
                items.append(self._item(entry))
            else:
                items.append(entry)
        return items

    def _start_response(
        self, options: ResponseOptions, context: list[Item], *, out_of_band: bool
    ) -> Response:
        prompt, entry, final = self._turn_prompt(options, context, out_of_band=out_of_band)
        turn = context[-1] if context and context[-1].role == "user" else None
        if turn is not None and entry == 0:
            # This response transcribes the item itself (and reports it).
            self._stop_transcription(turn.id)
        response = Response(
            id=new_id("resp"),
            options=options,
            input_item_id=turn.id if turn is not None and entry == 0 else None,
        )
        self.responses[response.id] = response
        self._emit("response.created", response=self._response_object(response))
        self._actions.append(StartResponse(response.id, prompt, entry, final, out_of_band))
        return response

    def _turn_prompt(
        self, options: ResponseOptions, context: list[Item], *, out_of_band: bool
    ) -> tuple[dict[str, Any], int, int]:
        """The engine prompt, entry stage and final stage of a response to `context`."""
        turn = context[-1] if context and context[-1].role == "user" else None
        history = context[:-1] if turn is not None else context
        prompt: dict[str, Any] = {
            "messages": self._messages(options.instructions, history),
            "output_modalities": list(options.output_modalities),
            "max_output_tokens": options.max_output_tokens,
            "voice": options.voice if "audio" in options.output_modalities else None,
            "speed": self.settings.speed if "audio" in options.output_modalities else None,
            "cache_key": None if out_of_band else self.settings.id,
        }
        entry = 1
        if turn is not None and turn.pending_audio is not None:
            prompt["audio"] = turn.pending_audio
            entry = 0
        elif turn is not None:
            prompt["text"] = turn.text()
        final = 2 if "audio" in options.output_modalities else 1
        return prompt, entry, final

    def _messages(self, instructions: str, history: list[Item]) -> list[dict[str, str]]:
        messages = [m for m in (item.message() for item in history) if m is not None]
        if self.settings.truncation == "auto":
            messages = messages[-self.limits.max_context_messages :]
        if instructions:
            messages.insert(0, {"role": "system", "content": instructions})
        return messages

    def _response_object(self, response: Response) -> dict[str, Any]:
        options = response.options
        output = [response.item.public()] if response.item is not None else []
        return {
            "object": "realtime.response",
            "id": response.id,
            "status": response.status,
            "status_details": response.status_details,
            "output": output,
            "conversation_id": None if options.out_of_band else "conv_" + self.settings.id[5:],
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

    def _on_response_cancel(self, event: Any) -> None:
        target = event.response_id or self.active_id
        response = self.responses.get(target) if target else None
        if response is None:
            raise ClientError(
                "Cancellation failed: no active response found", "response_cancel_not_active"
            )
        self._cancel(response, "client_cancelled")

    def _cancel(self, response: Response, reason: str) -> None:
        self._actions.append(CancelResponse(response.id, reason))
        self._finish(response, "cancelled", {"type": "cancelled", "reason": reason})

    # -- engine outputs ----------------------------------------------------------------

    def _live(self, response_id: str) -> Response | None:
        return self.responses.get(response_id)

    def response_transcript(self, response_id: str, text: str) -> None:
        """The ASR transcript of the user audio a response answers."""
        if response_id in self._transcriptions:
            self._transcription_output(response_id, "transcript", text)
            return
        response = self._live(response_id)
        item_id = response.input_item_id if response else None
        item = self.conversation.get(item_id) if item_id else None
        if item is not None:
            self._item_transcript(item, text)

    def _item_transcript(self, item: Item, text: str) -> None:
        item.set_transcript(text)
        if self.settings.transcription is None:
            return
        self._emit(
            "conversation.item.input_audio_transcription.delta",
            item_id=item.id,
            content_index=0,
            delta=text,
        )
        self._emit(
            "conversation.item.input_audio_transcription.completed",
            item_id=item.id,
            content_index=0,
            transcript=text,
            usage={"type": "duration", "seconds": round(item.audio_ms / 1000, 3)},
        )

    def response_text(self, response_id: str, delta: str) -> None:
        response = self._live(response_id)
        if response is None or not delta:
            return
        response.output_tokens += 1
        if "audio" in response.options.output_modalities:
            return  # spoken responses report text as the transcript of each audio chunk
        item = self._open_item(response)
        response.text += delta
        item.text_value = response.text
        self._emit("response.output_text.delta", **self._ids(response), delta=delta)

    def response_audio(self, response_id: str, pcm16: bytes, sample_rate: int, text: str) -> None:
        response = self._live(response_id)
        if response is None or "audio" not in response.options.output_modalities:
            return
        item = self._open_item(response)
        fmt = response.options.output_format
        if response.resampler is None or response.resampler.in_rate != sample_rate:
            response.resampler = StreamResampler(sample_rate, fmt.rate)
        samples = np.frombuffer(pcm16, dtype="<i2").astype(np.float32) / 32768.0
        encoded = fmt.encode(response.resampler.push(samples))
        if text:
            spoken = _join_spoken(response.text, text)
            response.text += spoken
            self._emit(
                "response.output_audio_transcript.delta", **self._ids(response), delta=spoken
            )
        start_ms = response.audio_ms
        self._send_audio(response, fmt, encoded)
        item.add_audio(encoded, start_ms, response.audio_ms, text)

    def _flush_audio(self, response: Response) -> None:
        """Send the resampler's held-back tail when the engine's audio is complete."""
        if response.resampler is None or response.item is None:
            return
        fmt = response.options.output_format
        tail = fmt.encode(response.resampler.push(np.zeros(0, np.float32), last=True))
        start_ms = response.audio_ms
        self._send_audio(response, fmt, tail)
        response.item.add_audio(tail, start_ms, response.audio_ms, "")

    def _send_audio(self, response: Response, fmt: AudioFormat, encoded: bytes) -> None:
        chunk = int(self.limits.output_chunk_ms * fmt.bytes_per_ms) // fmt.sample_bytes
        chunk *= fmt.sample_bytes
        for start in range(0, len(encoded), chunk):
            piece = encoded[start : start + chunk]
            response.audio_ms += fmt.duration_ms(len(piece))
            self._emit(
                "response.output_audio.delta",
                **self._ids(response),
                delta=base64.b64encode(piece).decode("ascii"),
            )

    def response_done(self, response_id: str, usage: dict[str, Any] | None, finish: str) -> None:
        """The engine finished the response; `finish` "length" means max tokens hit."""
        if response_id in self._transcriptions:
            self._transcription_output(response_id, "done")
            return
        response = self._live(response_id)
        if response is None:
            return
        response.usage = usage
        self._flush_audio(response)
        if finish == "length":
            self._finish(
                response, "incomplete", {"type": "incomplete", "reason": "max_output_tokens"}
            )
        else:
            self._finish(response, "completed", None)

    def response_failed(self, response_id: str, message: str) -> None:
        if response_id in self._transcriptions:
            self._transcription_output(response_id, "failed", message)
            return
        response = self._live(response_id)
        if response is None:
            return
        error = {"type": "server_error", "code": "engine_error", "message": message}
        self._emit("error", error={**error, "param": None, "event_id": None})
        self._finish(response, "failed", {"type": "failed", "error": error})

    def _open_item(self, response: Response) -> Item:
        if response.item is not None:
            return response.item
        item = Item.assistant(new_id("item"), response.options.output_modalities)
        item.set_output_format(response.options.output_format)
        response.item = item
        self.voice_locked = self.voice_locked or "audio" in response.options.output_modalities
        out_of_band = response.options.out_of_band
        self._emit(
            "response.output_item.added",
            response_id=response.id,
            output_index=0,
            item=item.public(),
        )
        if not out_of_band:
            previous = self.conversation.last_id()
            try:
                self.conversation.insert(item, previous)
            except ValueError:
                # A full conversation still streams the answer; it is just not kept.
                out_of_band = True
            else:
                self._emit("conversation.item.added", previous_item_id=previous, item=item.public())
        self._emit(
            "response.content_part.added",
            **self._ids(response),
            part=item.part(),
        )
        return item

    def _ids(self, response: Response) -> dict[str, Any]:
        assert response.item is not None
        return {
            "response_id": response.id,
            "item_id": response.item.id,
            "output_index": 0,
            "content_index": 0,
        }

    def _finish(self, response: Response, status: str, details: dict[str, Any] | None) -> None:
        """Close every open part, then `response.done`; the response is then forgotten."""
        del self.responses[response.id]
        if self.active_id == response.id:
            self.active_id = None
            self._idle_since_ms = self.audio_ms
        response.status = status
        response.status_details = details
        item = response.item
        if item is not None:
            item.status = "completed" if status == "completed" else "incomplete"
            ids = self._ids(response)
            if "audio" in response.options.output_modalities:
                self._emit("response.output_audio.done", **ids)
                self._emit("response.output_audio_transcript.done", **ids, transcript=response.text)
            else:
                self._emit("response.output_text.done", **ids, text=response.text)
            self._emit("response.content_part.done", **ids, part=item.part())
            if item.id in self.conversation:
                previous = self.conversation.previous_id(item.id)
                self._emit("conversation.item.done", previous_item_id=previous, item=item.public())
            self._emit(
                "response.output_item.done",
                response_id=response.id,
                output_index=0,
                item=item.public(),
            )
        if response.usage is None:
            response.usage = _usage(0, response.output_tokens)
        self._emit("response.done", response=self._response_object(response))

    def close(self) -> None:
        """The connection is going away: stop every response's engine work."""
        for response_id in [*self.responses, *self._transcriptions]:
            self._actions.append(CancelResponse(response_id, "client_cancelled"))
        self.responses.clear()
        self._transcriptions.clear()
        self.active_id = None


def _usage(input_tokens: int, output_tokens: int) -> dict[str, Any]:
    return {
        "total_tokens": input_tokens + output_tokens,
        "input_tokens": input_tokens,
        "output_tokens": output_tokens,
        "input_token_details": {
            "text_tokens": input_tokens,
            "audio_tokens": 0,
            "image_tokens": 0,
            "cached_tokens": 0,
        },
        "output_token_details": {"text_tokens": output_tokens, "audio_tokens": 0},
    }


def _join_spoken(before: str, text: str) -> str:
    if before and not before[-1].isspace() and not text[:1].isspace():
        return " " + text
    return text


def _validation_error(exc: ValidationError, prefix: str = "") -> ClientError:
    first = exc.errors()[0]
    param = prefix + ".".join(str(p) for p in first["loc"])
    if first["type"] == "missing":
        return ClientError(
            f"missing required parameter '{param}'", "missing_required_parameter", param
        )
    if first["type"] == "extra_forbidden":
        return ClientError(f"unknown parameter '{param}'", "unknown_parameter", param)
    return ClientError(f"invalid value for '{param}': {first['msg']}", "invalid_value", param)


def _item_error(exc: Exception) -> ClientError:
    if isinstance(exc, ValidationError):
        return _validation_error(exc, prefix="item.")
    param = exc.args[1] if len(exc.args) > 1 else "item"
    return ClientError(str(exc.args[0]), "invalid_value", param)
