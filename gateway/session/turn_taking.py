"""The user's side of a realtime session: input audio, commits and server VAD's decisions.

Rules of this module:

1. The input buffer keeps the session's clock (`now_ms`); server VAD reports its
   decisions on that clock, and the VAD is fed each appended sample once, in order.
2. A turn ends with a commit: the client's `input_audio_buffer.commit` (manual), VAD's
   speech stop, or the idle timeout. The committed span becomes a user item; a response
   answers it when the settings say so, otherwise a transcription job transcribes it.
3. Speech heard while a response is running is a candidate interruption: nothing is sent
   and nothing cancelled until it is confirmed (by its length or its words, see
   `GatewayConfig.turns`), and then `speech_started` carries its true start. With echo
   cancellation, speech while the answer's echo may still arrive (its audio still
   playing, or just played) is a candidate too, even once the response is done; and a
   confirmation counts only if the speech was not the answer's own echo
   (`InputProcessing.heard_echo`); if it was, it is confirmed afresh. A candidate
   that stops unconfirmed (a backchannel, a cough) is no turn: no event, no item; the
   response goes on, and it stays no turn if the response ended meanwhile.
4. While a silence may still become the stop, the turn that the stop would start is
   prepared (`PrepareResponse`); the stop starts an equal turn, which takes that work
   over, and anything else discards it (`DiscardPrepared`). Both read the same stored
   samples of the same span, so the two turns are equal values.
5. The backend hears every 16 kHz sample once, in order (`Hear`: the samples server VAD
   gets, and those it skips when it starts over), so its clock is the session's. The
   speech under way is an utterance named by its item id (`StartUtterance` once it is
   a turn, after any barge-in it causes; `EndUtterance` once it is committed, after the
   turn that names it, or dropped), transcribed live while the session's settings ask
   for transcription (`Listen`).
"""

from __future__ import annotations

from collections.abc import Callable

from gateway.config import GatewayConfig
from gateway.protocol.audio import ENGINE_RATE, AudioFormat, AudioFormatError, decode_base64
from gateway.protocol.errors import ClientError
from gateway.protocol.events import AppendIn, EmptyIn, new_id
from gateway.protocol.session_config import SessionSettings
from gateway.session.actions import (
    ConfigureVad,
    DiscardPrepared,
    EndUtterance,
    Hear,
    Listen,
    PrepareResponse,
    StartUtterance,
    WatchWords,
)
from gateway.session.conversation import AudioLimitError, Conversation, Item
from gateway.session.double_talk import answer_said
from gateway.session.far_end import FarEnd
from gateway.session.input_buffer import BufferFullError, InputBuffer
from gateway.session.input_processing import ECHO_TAIL_MS, InputProcessing
from gateway.session.items import ItemEditor
from gateway.session.outbox import Outbox
from gateway.session.response_stream import ResponseStream
from gateway.session.responses import ResponseOptions
from gateway.session.transcription import TranscriptionJobs
from gateway.session.turns import response_turn, transcription_turn

__all__ = ["MIN_COMMIT_MS", "TurnTaking", "VAD_KEEP_MS"]

MIN_COMMIT_MS = 100
# Without speech, server VAD keeps the newest append whole and this much audio before it.
# The VAD hears an append after it arrives, however long it is (the feeder hands it over
# in bounded pieces), so its decisions about that append find the audio still kept; the
# margin covers a VAD still hearing earlier appends and the prefix padding.
VAD_KEEP_MS = 30_000
# The input buffer's rings are made this large (a silent session's steady state and room
# for the appends on top of it), so that they do not grow while it lasts.
HELD_MS = VAD_KEEP_MS + 2_000


class TurnTaking:
    def __init__(
        self,
        settings: SessionSettings,
        config: GatewayConfig,
        *,
        outbox: Outbox,
        conversation: Conversation,
        items: ItemEditor,
        responses: ResponseStream,
        jobs: TranscriptionJobs,
        respond: Callable[[ResponseOptions], None],
        far_end: FarEnd,
        media_format: AudioFormat | None = None,
    ) -> None:
        self.settings = settings
        # A WebRTC call's input comes decoded from its RTP track in this format, whatever
        # the session's input format says; None: the client appends in that format.
        self._media_format = media_format
        self._config = config
        self._out = outbox
        self._conversation = conversation
        self._items = items
        self._responses = responses
        self._jobs = jobs
        self._respond = respond  # creates the default conversation's response
        self._far_end = far_end
        self._processing = InputProcessing(
            far_end,
            echo_cancellation=_cancels_echo(settings),
            noise_reduction=settings.noise_reduction,
            start_ms=0.0,
        )
        self.input = InputBuffer(
            self._wire_format(settings), processing=self._processing, held_ms=HELD_MS
        )
        self._speech_item_id: str | None = None  # the user item of the speech under way
        self._speech_start_ms = 0.0
        # The start of speech heard over a running response, not yet confirmed (rule 3).
        self._candidate_ms: float | None = None
        self._prepared = False  # a PrepareResponse is out, not yet taken or discarded
        self._idle_since_ms = 0.0
        self._configure_vad()
        if settings.live_transcription() is not None:
            self._out.act(Listen(settings.live_transcription()))

    @property
    def now_ms(self) -> float:
        return self.input.now_ms

    def update(self, new: SessionSettings) -> None:
        """The session's settings changed (a valid `session.update`)."""
        old, self.settings = self.settings, new
        new_format = self._wire_format(new)
        format_changed = new_format != self._wire_format(old)
        if format_changed:
            # Buffered audio is in the old format; it cannot be reinterpreted.
            self._processing.restart(self.now_ms)
            self.input = InputBuffer(new_format, self.now_ms, self._processing, HELD_MS)
        self._processing.configure(
            echo_cancellation=_cancels_echo(new), noise_reduction=new.noise_reduction
        )
        if new.turn_detection != old.turn_detection or format_changed:
            self._configure_vad()
        if new.live_transcription() != old.live_transcription():
            self._out.act(Listen(new.live_transcription()))

    def busy(self) -> None:
        """The session is busy as of now (a response starts): idle time counts from here."""
        self._idle_since_ms = self.now_ms

    def _configure_vad(self) -> None:
        detection = self.settings.turn_detection
        self._end_utterance()
        self._candidate_ms = None
        self.busy()
        # The VAD starts over at the clock's now; what the resampler still holds is audio
        # from before, so it goes into the buffer (and is heard) without being fed.
        self.input.settle()
        fresh = self.input.take_fresh()
        if fresh.size:
            self._out.act(Hear(fresh))
        self._discard_prepared()
        pause = self._config.prepare_after_silence_ms if detection is not None else None
        if detection is not None and detection.semantic:
            # The answer is prepared where the detector asks for the words it scores with.
            pause = self._config.turns.semantic_words_after_ms
        self._out.act(ConfigureVad(detection, self.now_ms, pause))

    # -- client events ------------------------------------------------------------------

    def _wire_format(self, settings: SessionSettings) -> AudioFormat:
        return self._media_format or settings.input_format

    def append(self, event: AppendIn) -> None:
        if self._media_format is not None:
            raise ClientError(
                "a WebRTC call's input audio comes on its audio track; "
                "input_audio_buffer.append is not taken on the data channel",
                "invalid_value",
                "type",
            )
        try:
            data = decode_base64(event.audio)
        except AudioFormatError as exc:
            raise ClientError(str(exc), "invalid_value", "audio") from None
        self.append_audio(data)

    def append_audio(self, data: bytes) -> None:
        """Audio in the buffer's wire format: an append's, or a call's decoded track."""
        manual = self.settings.turn_detection is None
        limit = self._config.limits.max_input_buffer_ms
        appended_from_ms = self.now_ms
        try:
            self.input.append(data, limit_ms=limit if manual else None)
        except BufferFullError:
            raise ClientError(
                f"the input audio buffer is full ({limit} ms); commit or clear it",
                "input_audio_buffer_full",
                "audio",
            ) from None
        except AudioFormatError as exc:
            raise ClientError(str(exc), "invalid_value", "audio") from None
        self._feed_vad()
        if not manual:
            if self._speech_item_id is None:
                self.input.trim(self.now_ms - appended_from_ms + VAD_KEEP_MS)
            self._check_idle_timeout()

    def commit(self, event: EmptyIn) -> None:
        if self._speech_item_id is not None:
            # A manual commit in the middle of detected speech ends that speech turn.
            self._end_utterance()
            self._discard_prepared()
        item = self._commit(new_id("item"), self.input.start_ms, self.now_ms)
        self._jobs.start(item, self.settings.live_transcription())

    def clear(self, event: EmptyIn) -> None:
        self._discard_prepared()
        self.input.clear()
        self._end_utterance()
        self._candidate_ms = None
        self._out.emit("input_audio_buffer.cleared")

    def _feed_vad(self) -> None:
        """Hand the backend and server VAD the 16 kHz samples made since (rule 5)."""
        fresh = self.input.take_fresh()
        if not fresh.size:
            return
        self._out.act(Hear(fresh))

    def _end_utterance(self) -> None:
        """The speech under way is no turn any more (rule 5)."""
        if self._speech_item_id is not None:
            self._out.act(EndUtterance(self._speech_item_id))
            self._speech_item_id = None

    def _check_idle_timeout(self) -> None:
        detection = self.settings.turn_detection
        if detection is None or detection.idle_timeout_ms is None:
            return
        if self._speech_item_id is not None or self._responses.active_id is not None:
            self.busy()
            return
        if self.now_ms - self._idle_since_ms < detection.idle_timeout_ms:
            return
        item_id = new_id("item")
        self._out.emit(
            "input_audio_buffer.timeout_triggered",
            audio_start_ms=int(self.input.start_ms),
            audio_end_ms=int(self.now_ms),
            item_id=item_id,
        )
        self.busy()
        self._commit(item_id, self.input.start_ms, self.now_ms)
        self._respond(ResponseOptions.from_session(self.settings))

    def _commit(self, item_id: str, start_ms: float, end_ms: float) -> Item:
        """Take [start_ms, end_ms) of the buffer as a new user item of the conversation."""
        span_ms = self.input.span_ms(start_ms, end_ms)
        if self.input.empty or span_ms < MIN_COMMIT_MS:
            raise ClientError(
                "Error committing input audio buffer: buffer too small. Expected at least "
                f"{MIN_COMMIT_MS}ms of audio, but buffer only has "
                f"{max(span_ms, 0):.2f}ms of audio.",
                "input_audio_buffer_commit_empty",
            )
        try:
            # Before taking the span: a refused commit leaves the buffer as it was.
            self._conversation.check_audio_room(span_ms)
        except AudioLimitError as exc:
            raise ClientError(str(exc), "input_audio_buffer_commit_too_large") from None
        item = Item.user_audio(item_id, self.input.take(start_ms, end_ms))
        self._feed_vad()  # taking the span may have flushed the resampler
        previous = self._conversation.last_id()
        self._out.emit("input_audio_buffer.committed", previous_item_id=previous, item_id=item_id)
        self._items.add(item, previous)
        return item

    # -- server VAD decisions -----------------------------------------------------------

    def speech_started(self, audio_start_ms: float) -> None:
        detection = self.settings.turn_detection
        if detection is None or self._speech_item_id is not None:
            return
        needs_confirming = self._config.turns.min_interruption_ms > 0
        over_answer = self._responses.active_id is not None
        # A finished answer's audio may still be playing, and its echo still arriving.
        over_echo = self._processing.echo_may_arrive(audio_start_ms)
        if needs_confirming and (over_answer or over_echo):
            self._candidate_ms = audio_start_ms  # rule 3: not yet an interruption
            self._out.act(WatchWords())
            return
        self._begin_speech(audio_start_ms)

    def speech_confirmed(self, audio_start_ms: float, words: str | None = None) -> None:
        if self._candidate_ms is None:
            return
        said = words is not None and answer_said(words, self._answer_text(audio_start_ms))
        if self._processing.heard_echo(audio_start_ms, self.now_ms, said):
            # Rule 3: what the canceller let through of the answer's echo; that is no
            # interruption, but a person may still join in.
            self._out.act(WatchWords(again=True))
            return
        self._candidate_ms = None
        self._begin_speech(audio_start_ms)

    def _answer_text(self, since_ms: float) -> str:
        """What the client played that the microphone may have heard from `since_ms` on:
        the echo comes up to `ECHO_TAIL_MS` after the audio it repeats."""
        since = round((since_ms - ECHO_TAIL_MS) * ENGINE_RATE / 1000)
        return self._far_end.said_between(since, round(self.now_ms * ENGINE_RATE / 1000))

    def _begin_speech(self, audio_start_ms: float) -> None:
        detection = self.settings.turn_detection
        assert detection is not None
        self._speech_item_id = new_id("item")
        self._speech_start_ms = max(audio_start_ms, self.input.start_ms)
        self._out.emit(
            "input_audio_buffer.speech_started",
            audio_start_ms=int(audio_start_ms),
            item_id=self._speech_item_id,
        )
        active = self._responses.active_id
        if detection.interrupt_response and active is not None:
            self._responses.cancel(active, "turn_detected")
        # After the barge-in: the utterance belongs to the epoch that follows it.
        self._out.act(StartUtterance(self._speech_item_id, self._speech_start_ms))

    def speech_paused(self, audio_end_ms: float) -> None:
        detection = self.settings.turn_detection
        item_id = self._speech_item_id
        if detection is None or item_id is None or self._config.prepare_after_silence_ms is None:
            return
        answers = detection.create_response and self._responses.active_id is None
        live = self.settings.live_transcription()
        if not answers and live is None:
            return  # the stop would neither create a response nor transcribe
        clip = self.input.peek(self._speech_start_ms, audio_end_ms)
        self._feed_vad()  # peeking may have flushed the resampler
        if clip.duration_ms < MIN_COMMIT_MS:
            return
        # The item the stop will commit: the same span, so the same stored samples.
        item = Item.user_audio(item_id, clip)
        if answers:
            turn = response_turn(
                ResponseOptions.from_session(self.settings),
                [*self._conversation.items(), item],
                self.settings,
                config=self._config,
            )
        else:
            # The stop starts a transcription job: its final transcript is worked out in
            # the silence, and the job takes it over.
            turn = transcription_turn(item, live)
        self._discard_prepared()
        self._prepared = True
        self._out.act(PrepareResponse(turn))

    def speech_resumed(self) -> None:
        self._discard_prepared()

    def speech_stopped(self, audio_end_ms: float) -> None:
        detection = self.settings.turn_detection
        if self._candidate_ms is not None:
            # Rule 3: unconfirmed speech that began over a response is no turn, even if
            # the response has ended since (its audio was most likely still playing).
            self._candidate_ms = None
            return
        item_id, self._speech_item_id = self._speech_item_id, None
        if detection is None or item_id is None:
            self._discard_prepared()
            return
        self.busy()
        self._out.emit(
            "input_audio_buffer.speech_stopped", audio_end_ms=int(audio_end_ms), item_id=item_id
        )
        try:
            self._check_still_kept(audio_end_ms)
            item = self._commit(item_id, self._speech_start_ms, audio_end_ms)
        except ClientError as exc:
            self._discard_prepared()
            self._out.act(EndUtterance(item_id))
            self._out.error(exc, None)
            return
        if detection.create_response and self._responses.active_id is None:
            # An equal turn takes the prepared work over; a different one replaces it.
            self._prepared = False
            self._respond(ResponseOptions.from_session(self.settings))
        else:
            if item.pending_audio is not None:
                # The job takes over an equal prepared turn; a different one replaces it.
                self._prepared = False
            self._jobs.start(item, self.settings.live_transcription())
            self._discard_prepared()
        # After the turn that names it, which finishes its live transcript.
        self._out.act(EndUtterance(item_id))

    def _check_still_kept(self, audio_end_ms: float) -> None:
        """Speech the VAD heard only after its audio was let go is an error, not a loss
        that passes unseen: the client sent audio faster than the VAD could hear it."""
        if audio_end_ms <= self.input.start_ms:
            raise ClientError(
                f"speech ended at {int(audio_end_ms)} ms, before the oldest audio still kept "
                f"({int(self.input.start_ms)} ms): without speech the buffer keeps the newest "
                f"append and {VAD_KEEP_MS} ms before it, and server VAD fell further behind",
                "input_audio_buffer_commit_empty",
            )

    def _discard_prepared(self) -> None:
        if self._prepared:
            self._prepared = False
            self._out.act(DiscardPrepared())


def _cancels_echo(settings: SessionSettings) -> bool:
    """The echo canceller runs in sessions that speak, unless they turned it off."""
    return settings.echo_cancellation and not settings.transcription_only
