"""Conversation items of a realtime session, and what each contributes to the LLM context.

Rules of this module:

1. A spoken assistant item keeps a `PlaybackLedger` of the audio chunks it sent, each
   with the words it speaks, so truncating at `audio_end_ms` keeps exactly the words
   the client played (`PlaybackLedger.heard_text`).
2. A user audio item not transcribed yet keeps its audio in the turn's format
   (`pending_audio`: float32 little-endian at 16 kHz), converted once when the item is
   made; a turn answering it carries those bytes as they are.
3. Function calls are items too: a `function_call` (the assistant's call: `call_id`,
   `name`, `arguments`) and a `function_call_output` (the client's result for a
   `call_id`). In the LLM context a call is an assistant message carrying the call, and
   an output a `tool` message answering it.
4. The user audio the items hold is bounded (`max_audio_ms`): an item that would go past
   the bound first makes room by dropping the audio of the oldest transcribed user
   items (their words stay); audio not transcribed yet is never dropped, so if that is
   not enough the item is refused (`AudioLimitError`) and nothing changes.
"""

from __future__ import annotations

import base64
from dataclasses import dataclass
from typing import Any, Literal

from duplex.playback import PlaybackLedger
from duplex.turn import Message, ToolCall
from gateway.protocol.audio import (
    ENGINE_RATE,
    AudioFormat,
    AudioFormatError,
    Samples,
    decode_base64,
    resample,
)
from gateway.protocol.events import ItemIn, new_id
from gateway.session.input_buffer import Clip

__all__ = ["AudioLimitError", "Conversation", "Item", "Role"]

Role = Literal["user", "assistant", "system", "tool"]
ItemType = Literal["message", "function_call", "function_call_output"]


@dataclass
class Item:
    id: str
    role: Role
    status: str = "completed"
    text_value: str | None = None  # input_text / output_text / system text
    transcript: str | None = None  # of input or output audio
    audio: bytearray | None = None  # wire bytes in `audio_format`
    audio_format: AudioFormat | None = None
    pending_audio: bytes | None = None  # user audio not yet transcribed (rule 2)
    ledger: PlaybackLedger | None = None  # what a spoken assistant item said when (rule 1)
    audio_dropped: bool = False  # its audio went to make room for newer audio (rule 4)
    type: ItemType = "message"
    call_id: str | None = None  # function_call and function_call_output (rule 3)
    name: str | None = None  # function_call
    arguments: str = ""  # function_call, as JSON text
    output: str | None = None  # function_call_output

    @classmethod
    def user_audio(cls, item_id: str, clip: Clip) -> Item:
        audio, pending = bytearray(clip.data), _turn_audio(clip.samples)
        return cls(item_id, "user", audio=audio, audio_format=clip.fmt, pending_audio=pending)

    @classmethod
    def assistant(cls, item_id: str, modalities: tuple[str, ...]) -> Item:
        spoken = "audio" in modalities
        return cls(
            item_id,
            "assistant",
            status="in_progress",
            text_value=None if spoken else "",
            transcript="" if spoken else None,
            audio=bytearray() if spoken else None,
            ledger=PlaybackLedger() if spoken else None,
        )

    @classmethod
    def function_call(cls, item_id: str, call_id: str, name: str) -> Item:
        """The assistant's call as a response starts streaming it."""
        return cls(
            item_id,
            "assistant",
            status="in_progress",
            type="function_call",
            call_id=call_id,
            name=name,
        )

    @classmethod
    def from_client(cls, raw: dict[str, Any], input_format: AudioFormat) -> Item:
        """An item from `conversation.item.create` or `response.input`; raises ValueError."""
        spec = ItemIn.model_validate(raw)
        if spec.type != "message":
            return cls._function_item(spec)
        if spec.role is None:
            raise ValueError("a message item needs a role", "item.role")
        item = cls(spec.id or new_id("item"), spec.role, status="completed")
        texts: list[str] = []
        for index, part in enumerate(spec.content or []):
            param = f"item.content.{index}"
            allowed = _ALLOWED_CONTENT[spec.role]
            if part.type not in allowed:
                raise ValueError(
                    f"{spec.role} messages take content of type {', '.join(sorted(allowed))}, "
                    f"not {part.type!r}",
                    f"{param}.type",
                )
            if part.type == "input_audio":
                item._attach_audio(part.audio, part.transcript, input_format, param)
            elif part.text is None:
                raise ValueError(f"content of type {part.type!r} needs text", f"{param}.text")
            else:
                texts.append(part.text)
        if texts:
            item.text_value = "".join(texts)
        if item.text_value is None and item.audio is None:
            raise ValueError("a message needs text or audio content", "item.content")
        return item

    @classmethod
    def _function_item(cls, spec: ItemIn) -> Item:
        if spec.role is not None or spec.content is not None:
            raise ValueError(f"a {spec.type} item takes no role or content", "item.type")
        if not spec.call_id:
            raise ValueError(f"a {spec.type} item needs a call_id", "item.call_id")
        item_id = spec.id or new_id("item")
        if spec.type == "function_call_output":
            if spec.output is None:
                raise ValueError("a function_call_output item needs an output", "item.output")
            if spec.name is not None or spec.arguments is not None:
                raise ValueError("a function_call_output takes call_id and output", "item.type")
            return cls(
                item_id,
                "tool",
                type="function_call_output",
                call_id=spec.call_id,
                output=spec.output,
            )
        if not spec.name:
            raise ValueError("a function_call item needs a name", "item.name")
        if spec.output is not None:
            raise ValueError("a function_call item takes no output", "item.output")
        return cls(
            item_id,
            "assistant",
            type="function_call",
            call_id=spec.call_id,
            name=spec.name,
            arguments=spec.arguments or "",
        )

    def _attach_audio(
        self, b64: str | None, transcript: str | None, fmt: AudioFormat, param: str
    ) -> None:
        if b64 is None:
            raise ValueError("input_audio content needs audio", f"{param}.audio")
        try:
            data = decode_base64(b64)
            samples = fmt.decode(data)
        except AudioFormatError as exc:
            raise ValueError(str(exc), f"{param}.audio") from None
        self.audio, self.audio_format = bytearray(data), fmt
        if transcript:
            self.transcript = transcript
        else:
            self.pending_audio = _turn_audio(resample(samples, fmt.rate, ENGINE_RATE))

    @property
    def has_audio(self) -> bool:
        return self.audio is not None

    @property
    def audio_ms(self) -> float:
        if self.audio is None or self.audio_format is None:
            return 0.0
        return self.audio_format.duration_ms(len(self.audio))

    @property
    def held_audio_ms(self) -> float:
        """User audio this item holds, as counted against the conversation's bound."""
        return self.audio_ms if self.role == "user" else 0.0

    @property
    def transcribed(self) -> bool:
        return self.pending_audio is None

    def drop_audio(self) -> None:
        """Let the transcribed audio go; the content part and its transcript stay."""
        assert self.transcribed
        self.audio, self.audio_dropped = bytearray(), True

    def text(self) -> str:
        return self.text_value if self.text_value is not None else (self.transcript or "")

    @property
    def spoken(self) -> bool:
        """An assistant item answering with audio."""
        return self.ledger is not None

    def message(self) -> Message | None:
        """This item as one LLM chat message, or None if it holds no words."""
        if self.type == "function_call":
            if self.status != "completed":
                return None  # a cut-off call's arguments are not JSON the model should see
            assert self.call_id is not None and self.name is not None
            call = ToolCall(self.call_id, self.name, self.arguments)
            return Message("assistant", "", tool_calls=(call,))
        if self.type == "function_call_output":
            return Message("tool", self.output or "", tool_call_id=self.call_id)
        content = self.text()
        return Message(self.role, content) if content else None

    def set_transcript(self, text: str) -> None:
        self.transcript = text
        self.pending_audio = None

    def add_audio(self, data: bytes, text: str) -> None:
        """Append a chunk of spoken audio (wire bytes) and the words it speaks."""
        assert self.audio is not None and self.audio_format is not None
        assert self.ledger is not None
        self.audio.extend(data)
        self.ledger.add(self.audio_format.duration_ms(len(data)), text)
        self.transcript = self.ledger.text.strip()

    def set_output_format(self, fmt: AudioFormat) -> None:
        self.audio_format = fmt

    def truncate(self, audio_end_ms: int) -> None:
        """Keep the audio and the words heard up to `audio_end_ms`."""
        assert self.audio is not None and self.audio_format is not None
        assert self.ledger is not None
        keep = int(audio_end_ms * self.audio_format.bytes_per_ms)
        keep -= keep % self.audio_format.sample_bytes
        del self.audio[keep:]
        heard = self.ledger.heard_text(audio_end_ms)
        # What is left is one chunk: the audio kept, speaking the words heard.
        self.ledger = PlaybackLedger()
        self.ledger.add(self.audio_format.duration_ms(len(self.audio)), heard)
        self.transcript = heard.strip()

    def part(self) -> dict[str, Any]:
        """The content part as `response.content_part.*` carries it."""
        if self.spoken:
            return {"type": "audio", "transcript": self.transcript or ""}
        return {"type": "text", "text": self.text_value or ""}

    def public(self, with_audio: bool = False) -> dict[str, Any]:
        if self.type == "function_call":
            return {
                "id": self.id,
                "object": "realtime.item",
                "type": "function_call",
                "status": self.status,
                "call_id": self.call_id,
                "name": self.name,
                "arguments": self.arguments,
            }
        if self.type == "function_call_output":
            return {
                "id": self.id,
                "object": "realtime.item",
                "type": "function_call_output",
                "call_id": self.call_id,
                "output": self.output,
            }
        return {
            "id": self.id,
            "object": "realtime.item",
            "type": "message",
            "status": self.status,
            "role": self.role,
            "content": self._content(with_audio),
        }

    def _content(self, with_audio: bool) -> list[dict[str, Any]]:
        parts: list[dict[str, Any]] = []
        if self.role == "assistant":
            if self.spoken:
                parts.append({"type": "output_audio", "transcript": self.transcript})
            elif self.text_value:
                parts.append({"type": "output_text", "text": self.text_value})
        elif self.text_value is not None:
            parts.append({"type": "input_text", "text": self.text_value})
        if self.role == "user" and self.audio is not None:
            parts.append({"type": "input_audio", "transcript": self.transcript})
        if with_audio and self.audio is not None and not self.audio_dropped:
            audio_part = parts[-1]
            audio_part["audio"] = base64.b64encode(bytes(self.audio)).decode("ascii")
        return parts


_ALLOWED_CONTENT = {
    "user": {"input_text", "input_audio"},
    "assistant": {"output_text", "text"},
    "system": {"input_text"},
}


def _turn_audio(samples: Samples) -> bytes | None:
    """16 kHz samples as a turn carries them; None for no audio (nothing to transcribe)."""
    return samples.astype("<f4").tobytes() if samples.size else None


class AudioLimitError(ValueError):
    """An item's audio does not fit under the conversation's bound (rule 4)."""


class Conversation:
    """Ordered items with O(1) lookup; `previous_item_id` "root" means the start."""

    def __init__(self, max_items: int, max_audio_ms: float) -> None:
        self.max_items = max_items
        self.max_audio_ms = max_audio_ms
        self._items: list[Item] = []
        self._by_id: dict[str, Item] = {}

    def __contains__(self, item_id: str) -> bool:
        return item_id in self._by_id

    def get(self, item_id: str) -> Item | None:
        return self._by_id.get(item_id)

    def items(self) -> list[Item]:
        return list(self._items)

    def has_call(self, call_id: str) -> bool:
        """Whether a function_call item with this `call_id` is in the conversation."""
        return any(i.type == "function_call" and i.call_id == call_id for i in self._items)

    def last_id(self) -> str | None:
        return self._items[-1].id if self._items else None

    def previous_id(self, item_id: str) -> str | None:
        index = self._index(item_id)
        return self._items[index - 1].id if index > 0 else None

    def held_audio_ms(self) -> float:
        return sum(item.held_audio_ms for item in self._items)

    def check_audio_room(self, audio_ms: float) -> None:
        """Raise AudioLimitError unless `audio_ms` more user audio can be held once the
        transcribed audio is dropped."""
        untranscribed_ms = sum(i.held_audio_ms for i in self._items if not i.transcribed)
        if untranscribed_ms + audio_ms > self.max_audio_ms:
            limit_s = self.max_audio_ms / 1000
            raise AudioLimitError(
                f"the conversation may hold {limit_s:g} s of user audio (limit "
                f"max_committed_audio_s); this adds {audio_ms / 1000:.1f} s to "
                f"{untranscribed_ms / 1000:.1f} s not transcribed yet; wait for the "
                "transcription, delete items or send shorter audio"
            )

    def _make_audio_room(self, audio_ms: float) -> None:
        """Drop the audio of the oldest transcribed user items until `audio_ms` fits."""
        self.check_audio_room(audio_ms)
        held_ms = self.held_audio_ms()
        for item in self._items:
            if held_ms + audio_ms <= self.max_audio_ms:
                return
            if item.held_audio_ms and item.transcribed:
                held_ms -= item.held_audio_ms
                item.drop_audio()

    def insert(self, item: Item, previous_item_id: str | None) -> None:
        if len(self._items) >= self.max_items:
            raise ValueError(
                f"the conversation holds the maximum of {self.max_items} items; delete some"
            )
        if previous_item_id not in (None, "root") and previous_item_id not in self._by_id:
            raise KeyError(f"previous_item_id {previous_item_id!r} does not exist")
        self._make_audio_room(item.held_audio_ms)
        if previous_item_id is None:
            position = len(self._items)
        elif previous_item_id == "root":
            position = 0
        else:
            position = self._index(previous_item_id) + 1
        self._items.insert(position, item)
        self._by_id[item.id] = item

    def delete(self, item_id: str) -> None:
        self._items.pop(self._index(item_id))
        del self._by_id[item_id]

    def _index(self, item_id: str) -> int:
        return next(i for i, item in enumerate(self._items) if item.id == item_id)
