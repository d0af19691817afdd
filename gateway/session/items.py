"""The client's edits of the conversation: create, retrieve, delete, truncate items.

Every change to the conversation's items is announced here (`conversation.item.*`), so
the client's copy of the conversation follows the session's exactly.
"""

from __future__ import annotations

import json

from gateway.protocol.errors import ClientError, item_error
from gateway.protocol.events import ItemCreateIn, ItemIdIn, TruncateIn
from gateway.protocol.session_config import SessionSettings
from gateway.session.conversation import AudioLimitError, Conversation, Item
from gateway.session.outbox import Outbox
from gateway.session.response_stream import ResponseStream
from gateway.session.transcription import TranscriptionJobs

__all__ = ["ItemEditor", "MAX_SERVER_EVENT_BYTES"]

# Clients (the openai SDK among them) refuse messages over 1 MiB by default.
MAX_SERVER_EVENT_BYTES = 768 * 1024


class ItemEditor:
    def __init__(
        self,
        outbox: Outbox,
        conversation: Conversation,
        responses: ResponseStream,
        jobs: TranscriptionJobs,
    ) -> None:
        self._out = outbox
        self._conversation = conversation
        self._responses = responses
        self._jobs = jobs

    def get(self, item_id: str) -> Item:
        item = self._conversation.get(item_id)
        if item is None:
            raise ClientError(f"item {item_id!r} does not exist", "item_not_found", "item_id")
        return item

    def add(self, item: Item, previous_item_id: str | None) -> None:
        """Insert `item` after `previous_item_id` (None: at the end; "root": first)."""
        try:
            self._conversation.insert(item, previous_item_id)
        except AudioLimitError as exc:
            raise ClientError(str(exc), "invalid_value", "item.content") from None
        except (KeyError, ValueError) as exc:
            raise ClientError(str(exc.args[0]), "invalid_value", "previous_item_id") from None
        previous = self._conversation.previous_id(item.id)
        self._out.emit("conversation.item.added", previous_item_id=previous, item=item.public())
        self._out.emit("conversation.item.done", previous_item_id=previous, item=item.public())

    def create(self, event: ItemCreateIn, settings: SessionSettings) -> None:
        try:
            item = Item.from_client(event.item, settings.input_format)
        except ValueError as exc:
            raise item_error(exc) from None
        if item.id in self._conversation:
            raise ClientError(f"item id {item.id!r} already exists", "invalid_value", "item.id")
        self._check_call_output(item)
        self.add(item, event.previous_item_id or self._conversation.last_id())

    def _check_call_output(self, item: Item) -> None:
        """A function result must answer a call the conversation holds."""
        if item.type != "function_call_output" or item.call_id is None:
            return
        if not self._conversation.has_call(item.call_id):
            raise ClientError(
                f"no function_call with call_id {item.call_id!r} is in the conversation; "
                "a function_call_output answers a call the assistant made",
                "invalid_value",
                "item.call_id",
            )

    def retrieve(self, event: ItemIdIn) -> None:
        public = self.get(event.item_id).public(with_audio=True)
        if len(json.dumps(public)) > MAX_SERVER_EVENT_BYTES:
            raise ClientError(
                "the item's audio is too large to send in one event", "item_too_large", "item_id"
            )
        self._out.emit("conversation.item.retrieved", item=public)

    def delete(self, event: ItemIdIn) -> None:
        self.get(event.item_id)
        if self._responses.active_item_id() == event.item_id:
            raise ClientError(
                "the item belongs to the active response; cancel it first",
                "invalid_value",
                "item_id",
            )
        self._jobs.stop(event.item_id)
        self._conversation.delete(event.item_id)
        self._out.emit("conversation.item.deleted", item_id=event.item_id)

    def truncate(self, event: TruncateIn) -> None:
        item = self.get(event.item_id)
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
        self._out.emit(
            "conversation.item.truncated",
            item_id=item.id,
            content_index=0,
            audio_end_ms=event.audio_end_ms,
        )
