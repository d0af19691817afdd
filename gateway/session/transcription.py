"""Transcription of committed user audio that no response answers yet.

An item committed while no response takes it (a manual commit, or server VAD with
`create_response: false`) is transcribed at once by a job: a turn of the session that
ends at speech-to-text (`StartResponse(job_id, TurnRequest(final=Stage.ASR, ...),
conversation=False)`), running beside any response. Its words join the conversation, so
several commits before one `response.create` all count.

A response that answers the item transcribes it itself: it supersedes the job, which is
cancelled. A job, like a response, is known until its `ResponseDone` arrives.

Live captions: while the user speaks, the backend's `TranscriptDelta`s for the speech's
item id go out at once as `conversation.item.input_audio_transcription.delta`. When the
item's final transcript comes (it begins with every word sent live), only the rest
follows as one more delta, then `.completed` with the whole transcript.
"""

from __future__ import annotations

import collections
from typing import Any

from gateway.protocol.events import new_id
from gateway.protocol.session_config import LiveTranscription
from gateway.session.actions import CancelResponse, StartResponse
from gateway.session.backend import ResponseDone, ResponseOutput, TokenLogprob, TranscriptDelta
from gateway.session.conversation import Conversation, Item
from gateway.session.outbox import Outbox
from gateway.session.turns import transcription_turn

__all__ = ["LiveCaptions", "TranscriptionJobs", "report_transcript"]

# Utterances whose live text is remembered until their transcript completes; one that
# never does (its speech was dropped) is forgotten once this many newer ones came.
_LIVE_REMEMBERED = 64


class LiveCaptions:
    """What was sent live of each utterance (the item id speech_started named)."""

    def __init__(self, outbox: Outbox) -> None:
        self._out = outbox
        self._sent: collections.OrderedDict[str, str] = collections.OrderedDict()

    def delta(self, event: TranscriptDelta, *, report: bool) -> None:
        if not report or not event.text:
            return
        self._sent[event.utterance_id] = self._sent.get(event.utterance_id, "") + event.text
        self._sent.move_to_end(event.utterance_id)
        while len(self._sent) > _LIVE_REMEMBERED:
            self._sent.popitem(last=False)
        self._send_delta(event.utterance_id, event.text, event.logprobs)

    def complete(self, item: Item, text: str, logprobs: tuple[TokenLogprob, ...]) -> None:
        """The item's final transcript: the rest of it as a delta, then `.completed`."""
        sent = self._sent.pop(item.id, "")
        rest = text[len(sent) :] if text.startswith(sent) else text
        if rest or not sent:
            self._send_delta(item.id, rest, _rest_logprobs(logprobs, len(sent)))
        extra: dict[str, Any] = {"logprobs": _wire(logprobs)} if logprobs else {}
        self._out.emit(
            "conversation.item.input_audio_transcription.completed",
            item_id=item.id,
            content_index=0,
            transcript=text,
            usage={"type": "duration", "seconds": round(item.audio_ms / 1000, 3)},
            **extra,
        )

    def _send_delta(self, item_id: str, text: str, logprobs: tuple[TokenLogprob, ...]) -> None:
        extra: dict[str, Any] = {"logprobs": _wire(logprobs)} if logprobs else {}
        self._out.emit(
            "conversation.item.input_audio_transcription.delta",
            item_id=item_id,
            content_index=0,
            delta=text,
            **extra,
        )


def _wire(logprobs: tuple[TokenLogprob, ...]) -> list[dict[str, Any]]:
    return [{"token": t.token, "logprob": t.logprob, "bytes": list(t.bytes)} for t in logprobs]


def _rest_logprobs(logprobs: tuple[TokenLogprob, ...], sent_chars: int) -> tuple[TokenLogprob, ...]:
    """The tokens after the first `sent_chars` characters of the transcript."""
    count = 0
    for index, token in enumerate(logprobs):
        if count >= sent_chars:
            return logprobs[index:]
        count += len(token.token)
    return ()


class TranscriptionJobs:
    def __init__(self, outbox: Outbox, conversation: Conversation) -> None:
        self._out = outbox
        self._conversation = conversation
        self.captions = LiveCaptions(outbox)
        self._items: dict[str, str] = {}  # job id -> the item it transcribes
        self._cancelled: set[str] = set()

    def __contains__(self, job_id: str) -> bool:
        return job_id in self._items

    def start(self, item: Item, live: LiveTranscription | None) -> None:
        """Start transcribing `item` now, if it has audio not transcribed yet."""
        if item.pending_audio is None:
            return
        job_id = new_id("transcription")
        self._items[job_id] = item.id
        turn = transcription_turn(item, live)
        self._out.act(StartResponse(job_id, turn, conversation=False))

    def stop(self, item_id: str) -> None:
        """Cancel the jobs transcribing `item_id` (a response took it over, or it went)."""
        for job_id, target in self._items.items():
            if target == item_id and job_id not in self._cancelled:
                self._cancelled.add(job_id)
                self._out.act(CancelResponse(job_id, "superseded"))

    def close(self) -> None:
        for job_id in self._items:
            if job_id not in self._cancelled:
                self._out.act(CancelResponse(job_id, "client_cancelled"))
        self._items.clear()
        self._cancelled.clear()

    def receive(self, event: ResponseOutput | ResponseDone, *, report: bool) -> None:
        """A job's transcript or its done event; `report` sends the transcription events."""
        item = self._conversation.get(self._items[event.response_id])
        if isinstance(event, ResponseDone):
            del self._items[event.response_id]
            self._cancelled.discard(event.response_id)
            if event.status == "failed" and item is not None and report:
                self._failed(item, event.error or "transcription failed")
        elif event.kind == "transcript":
            if item is not None:
                report_transcript(self.captions, item, event, report=report)
        else:
            raise RuntimeError(f"transcription job {event.response_id} output {event.kind!r}")

    def _failed(self, item: Item, message: str) -> None:
        error = {"type": "server_error", "code": "engine_error", "message": message}
        self._out.emit(
            "conversation.item.input_audio_transcription.failed",
            item_id=item.id,
            content_index=0,
            error={**error, "param": None},
        )


def report_transcript(
    captions: LiveCaptions, item: Item, transcript: ResponseOutput, *, report: bool
) -> None:
    """`item`'s audio said `transcript.text`: its words join the conversation, and with
    `report` (the session's `transcription` is set) the client gets the transcription
    events: what was not sent live yet, then `.completed`."""
    item.set_transcript(transcript.text)
    if report:
        captions.complete(item, transcript.text, transcript.logprobs)
