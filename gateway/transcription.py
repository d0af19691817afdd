"""Transcription of committed user audio that no response answers yet.

An item committed while no response takes it (a manual commit, or server VAD with
`create_response: false`) is transcribed at once by a job: a turn of the session that
ends at speech-to-text (`StartResponse(job_id, TurnRequest(final=Stage.ASR, ...),
conversation=False)`), running beside any response. Its words join the conversation, so
several commits before one `response.create` all count.

A response that answers the item transcribes it itself: it supersedes the job, which is
cancelled. A job, like a response, is known until its `ResponseDone` arrives.
"""

from __future__ import annotations

from gateway.actions import CancelResponse, StartResponse
from gateway.backend import ResponseDone, ResponseOutput
from gateway.conversation import Conversation, Item
from gateway.outbox import Outbox
from gateway.protocol import new_id
from gateway.turns import transcription_turn

__all__ = ["TranscriptionJobs", "report_transcript"]


class TranscriptionJobs:
    def __init__(self, outbox: Outbox, conversation: Conversation) -> None:
        self._out = outbox
        self._conversation = conversation
        self._items: dict[str, str] = {}  # job id -> the item it transcribes
        self._cancelled: set[str] = set()

    def __contains__(self, job_id: str) -> bool:
        return job_id in self._items

    def start(self, item: Item) -> None:
        """Start transcribing `item` now, if it has audio not transcribed yet."""
        if item.pending_audio is None:
            return
        job_id = new_id("transcription")
        self._items[job_id] = item.id
        self._out.act(StartResponse(job_id, transcription_turn(item), conversation=False))

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
                report_transcript(self._out, item, event.text, report=report)
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


def report_transcript(outbox: Outbox, item: Item, text: str, *, report: bool) -> None:
    """`item`'s audio said `text`: its words join the conversation, and with `report`
    (the session's `transcription` is set) the client gets the transcription events."""
    item.set_transcript(text)
    if not report:
        return
    outbox.emit(
        "conversation.item.input_audio_transcription.delta",
        item_id=item.id,
        content_index=0,
        delta=text,
    )
    outbox.emit(
        "conversation.item.input_audio_transcription.completed",
        item_id=item.id,
        content_index=0,
        transcript=text,
        usage={"type": "duration", "seconds": round(item.audio_ms / 1000, 3)},
    )
