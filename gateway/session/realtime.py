"""A sans-I/O OpenAI Realtime session: client events in, server events and actions out.

Rule 1: nothing here does I/O or reads a clock. The shell (`gateway.server.connection`) feeds
client frames (`receive_text`, `receive_binary`), VAD decisions (`speech_started`,
`speech_paused`, `speech_resumed`, `speech_stopped`) and the backend's events
(`receive_response_event`), then drains `events_to_send()` and `actions()` and carries
the actions out in order.
Rule 2: every `*_ms` value counts audio appended to this session (one clock, kept by the
input buffer), in ms.
Rule 3: one name per turn: a response's id (or a transcription job's) goes down in
`StartResponse` and comes back on each of its outputs and on its one `ResponseDone`. An
event for an id this session never started, or has already finished, is a bug below
and raises, except after `close()`, when every event is ignored.

This module is the facade: it parses client events, routes each to its typed handler
through one table, and ties the parts together: `turn_taking` (input audio, commits,
server VAD; its `input_buffer` keeps the clock), `items` (the client's edits of the
`conversation`), `turns` (the turn requests), `response_stream` (each response from
created to done) and `transcription` (jobs for items no response answers yet).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any, TypeVar

from pydantic import BaseModel, ValidationError

from gateway.config import GatewayConfig
from gateway.protocol.audio import AudioFormat
from gateway.protocol.errors import ClientError, validation_error
from gateway.protocol.events import (
    AppendIn,
    EmptyIn,
    ItemCreateIn,
    ItemIdIn,
    ResponseCancelIn,
    ResponseCreateIn,
    SessionUpdateIn,
    TruncateIn,
    new_id,
)
from gateway.protocol.session_config import SessionSettings, SettingError, transcription_session
from gateway.protocol.session_object import beta_session_object, ga_session_object
from gateway.protocol.session_update import apply_update
from gateway.session.actions import Action, ClearOutputAudio, CloseSession
from gateway.session.backend import ResponseEvent, ResponseOutput, TranscriptDelta
from gateway.session.conversation import Conversation, Item
from gateway.session.far_end import FarEnd
from gateway.session.items import ItemEditor
from gateway.session.outbox import Outbox, ServerEvent
from gateway.session.response_stream import ResponseStream
from gateway.session.responses import ResponseOptions, parse_response_options
from gateway.session.transcription import TranscriptionJobs, report_transcript
from gateway.session.turn_taking import TurnTaking
from gateway.session.turns import answered_item, response_turn

__all__ = ["ClientError", "RealtimeSession"]

EventT = TypeVar("EventT", bound=BaseModel)
_Handler = Callable[[dict[str, Any]], None]


def _route(model: type[EventT], handle: Callable[[EventT], None]) -> _Handler:
    """A table entry: validate the payload as `model`, then hand it to `handle`."""

    def run(payload: dict[str, Any]) -> None:
        try:
            event = model.model_validate(payload)
        except ValidationError as exc:
            raise validation_error(exc) from None
        handle(event)

    return run


class RealtimeSession:
    def __init__(
        self,
        *,
        config: GatewayConfig,
        model: str,
        beta: bool,
        media_format: AudioFormat | None = None,
    ) -> None:
        """`media_format`: the session is a WebRTC call's, whose audio comes and goes on
        RTP tracks in that format (`gateway.webrtc.call`); None: audio travels in events."""
        self.config = config
        self.media_format = media_format
        self.limits = config.limits
        self.beta = beta
        self.settings = SessionSettings(
            id=new_id("sess"),
            model=model,
            voice=config.voices[0],
            instructions=config.default_instructions,
            echo_cancellation=config.echo_cancellation,
        )
        self.conversation = Conversation(
            max_items=self.limits.max_items,
            max_audio_ms=self.limits.max_committed_audio_s * 1000,
        )
        self._out = Outbox(beta=beta)
        # What the client plays, on the session clock: the echo canceller's reference.
        self._far_end = FarEnd(clock=lambda: self._turns.now_ms)
        self._responses = ResponseStream(
            self._out,
            self.conversation,
            session_id=self.settings.id,
            chunk_ms=self.limits.output_chunk_ms,
            far_end=self._far_end,
            media_format=media_format,
        )
        self._jobs = TranscriptionJobs(self._out, self.conversation)
        self._items = ItemEditor(self._out, self.conversation, self._responses, self._jobs)
        self._greet()
        self._turns = TurnTaking(
            self.settings,
            config,
            outbox=self._out,
            conversation=self.conversation,
            items=self._items,
            responses=self._responses,
            jobs=self._jobs,
            respond=self._create_default_response,
            far_end=self._far_end,
            media_format=media_format,
        )
        self._closed = False
        turns, items = self._turns, self._items
        self._handlers: dict[str, _Handler] = {
            "session.update": _route(SessionUpdateIn, self._on_session_update),
            "transcription_session.update": _route(
                SessionUpdateIn, self._on_transcription_session_update
            ),
            "input_audio_buffer.append": _route(AppendIn, turns.append),
            "input_audio_buffer.commit": _route(EmptyIn, turns.commit),
            "input_audio_buffer.clear": _route(EmptyIn, turns.clear),
            "output_audio_buffer.clear": _route(EmptyIn, self._on_output_audio_clear),
            "conversation.item.create": _route(ItemCreateIn, self._on_item_create),
            "conversation.item.retrieve": _route(ItemIdIn, items.retrieve),
            "conversation.item.delete": _route(ItemIdIn, items.delete),
            "conversation.item.truncate": _route(TruncateIn, self._on_item_truncate),
            "response.create": _route(ResponseCreateIn, self._on_response_create),
            "response.cancel": _route(ResponseCancelIn, self._on_response_cancel),
        }

    # -- state the shell reads ----------------------------------------------------------

    @property
    def active_id(self) -> str | None:
        """The default conversation's running response; None once it is cancelled."""
        return self._responses.active_id

    @property
    def audio_ms(self) -> float:
        """The session clock: audio appended so far, in ms."""
        return self._turns.now_ms

    # -- server VAD decisions, on the session clock -------------------------------------

    def speech_started(self, audio_start_ms: float) -> None:
        """VAD heard speech begin; with `interrupt_response` it cancels the active response."""
        self._turns.speech_started(audio_start_ms)

    def speech_confirmed(self, audio_start_ms: float, words: str | None = None) -> None:
        """The speech that began at `audio_start_ms` lasted long enough to interrupt, or
        said enough: `words`, what the engine heard of it then (None: its length)."""
        self._turns.speech_confirmed(audio_start_ms, words)

    def speech_paused(self, audio_end_ms: float) -> None:
        """VAD heard a silence begin that may become the stop: the turn the stop would
        start is prepared, so its work runs while the silence does (with the words the
        engine's speech detection heard, where it transcribed them: they stay below)."""
        self._turns.speech_paused(audio_end_ms)

    def speech_resumed(self) -> None:
        """The paused speech went on: the prepared turn is not wanted."""
        self._turns.speech_resumed()

    def speech_stopped(self, audio_end_ms: float) -> None:
        """VAD heard speech end: the speech is committed and maybe answered."""
        self._turns.speech_stopped(audio_end_ms)

    # -- the shell's side ---------------------------------------------------------------

    def events_to_send(self) -> list[ServerEvent]:
        return self._out.take_events()

    def actions(self) -> list[Action]:
        return self._out.take_actions()

    def reject_model(self, requested: str, served: str) -> None:
        """The connection asked for a model this gateway does not serve: error, then close."""
        self._out.retract_greeting()
        message = f"The model {requested!r} is not served here; use {served!r}"
        self._out.error(ClientError(message, "invalid_model", "model"), None)
        self._out.act(CloseSession(1008, "invalid model"))

    def open_as_transcription(self) -> None:
        """The connection asked for a transcription session (`?intent=transcription`):
        it is greeted as one, and it never creates responses. Called before anything of
        the session was sent."""
        self._out.take_events()  # the realtime greeting, replaced
        self._apply_settings(transcription_session(self.settings))
        self._greet()

    def close(self) -> None:
        """The connection is going away: stop every turn; later engine events are ignored."""
        if self._closed:
            return
        self._closed = True
        self._responses.close()
        self._jobs.close()

    def start_with(self, session: dict[str, Any]) -> None:
        """A call made with a session config (a client secret's, or the unified form's):
        the session starts with it applied, and is greeted as such. Called before
        anything of the session was sent; raises ClientError for a config it refuses."""
        try:
            new = apply_update(
                self.settings, session, beta=self.beta, config=self.config, voice_locked=False
            )
        except SettingError as exc:
            raise ClientError(str(exc), exc.code, exc.param) from None
        except ValidationError as exc:
            raise validation_error(exc, prefix="session.") from None
        self._out.take_events()  # the greeting, replaced
        self._apply_settings(new)
        self._greet()

    def receive_audio(self, data: bytes) -> None:
        """A WebRTC call's input audio, decoded from its track in `media_format`: the
        same input path as an `input_audio_buffer.append`."""
        try:
            self._turns.append_audio(data)
        except ClientError as exc:
            self._out.error(exc, None)

    def truncate_played(self, item_id: str, audio_end_ms: int) -> None:
        """A WebRTC call's track stopped playing `item_id` at `audio_end_ms` (a barge-in,
        `output_audio_buffer.clear`): as a client's `conversation.item.truncate`."""
        if self.conversation.get(item_id) is None:
            return  # deleted meanwhile: nothing to truncate
        event = TruncateIn(
            type="conversation.item.truncate",
            item_id=item_id,
            content_index=0,
            audio_end_ms=audio_end_ms,
        )
        self._on_item_truncate(event)

    def emit(self, kind: str, **fields: Any) -> None:
        """A server event the shell decides (a call's `output_audio_buffer.*`)."""
        self._out.emit(kind, **fields)

    # -- client frames ------------------------------------------------------------------

    def receive_binary(self, size: int) -> None:
        message = f"binary frames are not accepted ({size} bytes); send JSON text events"
        self._out.error(ClientError(message, "invalid_event"), None)

    def receive_text(self, data: str) -> None:
        event_id = None
        try:
            if len(data) > self.limits.max_event_bytes:
                raise ClientError(
                    f"the event is {len(data)} bytes; the limit is "
                    f"{self.limits.max_event_bytes} bytes",
                    "event_too_large",
                )
            payload = _parse(data)
            if isinstance(payload.get("event_id"), str):
                event_id = payload["event_id"]
            self._dispatch(payload)
        except ClientError as exc:
            self._out.error(exc, event_id)

    def _dispatch(self, payload: dict[str, Any]) -> None:
        kind = payload.get("type")
        handler = self._handlers.get(kind) if isinstance(kind, str) else None
        if handler is None:
            raise ClientError(f"invalid event type {kind!r}", "invalid_value", "type")
        if kind == "transcription_session.update" and not self.beta:
            raise ClientError(
                "transcription_session.update is a beta event; use session.update",
                "invalid_value",
                "type",
            )
        handler(payload)

    # -- session ------------------------------------------------------------------------

    def _on_session_update(self, event: SessionUpdateIn) -> None:
        if self.beta and self.settings.transcription_only:
            raise ClientError(
                "this is a transcription session: update it with transcription_session.update",
                "invalid_value",
                "type",
            )
        self._update_session(event)

    def _on_transcription_session_update(self, event: SessionUpdateIn) -> None:
        if not self.settings.transcription_only:
            raise ClientError(
                "transcription_session.update applies to transcription sessions: connect "
                "with ?intent=transcription for one; update this session with session.update",
                "invalid_value",
                "type",
            )
        self._update_session(event)

    def _update_session(self, event: SessionUpdateIn) -> None:
        try:
            new = apply_update(
                self.settings,
                event.session,
                beta=self.beta,
                config=self.config,
                voice_locked=self._responses.voice_locked,
            )
        except SettingError as exc:
            raise ClientError(str(exc), exc.code, exc.param) from None
        except ValidationError as exc:
            raise validation_error(exc, prefix="session.") from None
        self._apply_settings(new)
        self._out.emit(self._session_event("updated"), session=self._session_object())

    def _apply_settings(self, new: SessionSettings) -> None:
        """Every change of the session's settings (an update, or the session type)."""
        self.settings = new
        self._turns.update(new)

    def _greet(self) -> None:
        self._out.emit(self._session_event("created"), session=self._session_object())
        if self.beta and not self.settings.transcription_only:
            # Beta announces the session's one conversation, as the service does.
            conversation = {
                "id": self._responses.conversation_id,
                "object": "realtime.conversation",
            }
            self._out.emit("conversation.created", conversation=conversation)

    def _session_event(self, what: str) -> str:
        # Beta names a transcription session's events apart; GA tells by session.type.
        beta_transcription = self.beta and self.settings.transcription_only
        return f"transcription_session.{what}" if beta_transcription else f"session.{what}"

    def _session_object(self) -> dict[str, Any]:
        return beta_session_object(self.settings) if self.beta else ga_session_object(self.settings)

    def _on_output_audio_clear(self, event: EmptyIn) -> None:
        if self.media_format is not None:
            self._out.act(ClearOutputAudio())
            return
        raise ClientError(
            "output_audio_buffer.clear applies to WebRTC/SIP sessions; over WebSocket stop "
            "playback locally and send conversation.item.truncate",
            "invalid_value",
            "type",
        )

    def _on_item_create(self, event: ItemCreateIn) -> None:
        self._items.create(event, self.settings)

    def _on_item_truncate(self, event: TruncateIn) -> None:
        self._items.truncate(event)
        # The client stopped playing there: the echo canceller's reference stops too.
        self._far_end.truncate(event.item_id, event.audio_end_ms)

    # -- responses ----------------------------------------------------------------------

    def _on_response_create(self, event: ResponseCreateIn) -> None:
        if self.settings.transcription_only:
            raise ClientError(
                "response.create is not available in a transcription session: it only "
                "transcribes input audio; connect without ?intent=transcription to get answers",
                "invalid_value",
                "type",
            )
        try:
            options = parse_response_options(
                event.response or {}, self.settings, beta=self.beta, config=self.config
            )
        except SettingError as exc:
            raise ClientError(str(exc), exc.code, exc.param) from None
        except ValidationError as exc:
            raise validation_error(exc, prefix="response.") from None
        if options.out_of_band:
            self._start_response(options, self._context(options))
            return
        if self.active_id is not None:
            raise ClientError(
                f"Conversation already has an active response in progress: {self.active_id}. "
                "Wait until the response is finished before creating a new one.",
                "conversation_already_has_active_response",
            )
        self._create_default_response(options)

    def _on_response_cancel(self, event: ResponseCancelIn) -> None:
        target = event.response_id or self.active_id
        if target is None or not self._responses.is_running(target):
            raise ClientError(
                "Cancellation failed: no active response found", "response_cancel_not_active"
            )
        self._responses.cancel(target, "client_cancelled")

    def _create_default_response(self, options: ResponseOptions) -> None:
        self._turns.busy()
        self._start_response(options, self._context(options))

    def _context(self, options: ResponseOptions) -> list[Item]:
        if options.input is None:
            return self.conversation.items()
        return [self._items.get(e) if isinstance(e, str) else e for e in options.input]

    def _start_response(self, options: ResponseOptions, context: list[Item]) -> None:
        turn = response_turn(options, context, self.settings, config=self.config)
        answered = answered_item(context)
        transcribed = answered if answered is not None and turn.audio is not None else None
        if transcribed is not None:
            # This response transcribes the item itself (and reports it).
            self._jobs.stop(transcribed.id)
        self._responses.start(options, turn, transcribed.id if transcribed else None)

    # -- backend events -----------------------------------------------------------------

    def receive_response_event(self, event: ResponseEvent | TranscriptDelta) -> None:
        """An output or the done event of a turn this session started (rule 3), or live
        words of the speech under way."""
        if self._closed:
            return
        report = self.settings.transcription is not None
        if isinstance(event, TranscriptDelta):
            self._jobs.captions.delta(event, report=report)
            return
        turn_id = event.response_id
        if turn_id in self._jobs:
            self._jobs.receive(event, report=report)
        elif turn_id not in self._responses:
            raise RuntimeError(f"an engine event for unknown response {turn_id!r}")
        elif isinstance(event, ResponseOutput) and event.kind == "transcript":
            item_id = self._responses.input_item_id(turn_id)
            item = self.conversation.get(item_id) if item_id else None
            if item is not None:
                report_transcript(self._jobs.captions, item, event, report=report)
        else:
            self._responses.receive(event)


def _parse(data: str) -> dict[str, Any]:
    try:
        payload = json.loads(data)
    except (ValueError, RecursionError) as exc:  # ValueError: also over-long integers
        raise ClientError(f"the frame is not valid JSON: {exc}", "invalid_json") from None
    if not isinstance(payload, dict):
        raise ClientError("an event is a JSON object", "invalid_json")
    return payload
