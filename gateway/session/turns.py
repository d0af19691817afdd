"""The turns a realtime session asks the speech pipeline for, built in one place.

A response's turn answers the last item of its context when that is a user item: its
audio not transcribed yet (the turn enters at speech-to-text) or else its words; with no
user item last, the reply follows the history alone, and with no history at all the
instructions alone (the assistant speaks first, as the service does). The turn ends in
speech when the response's output modalities include audio, else in text. Everything
before the answered item is the history, led by the instructions as a system message.

The response's tools and tool choice travel with the turn; the calls and results in the
history are messages of their own (an assistant message carrying the calls, a `tool`
message per result), and calls made one after another are one assistant message.

Because a prepared turn and the response that takes it over are both built here from
the same items and settings, equal inputs give equal turns, as adoption requires.

A turn that transcribes an item's audio names the item as its `utterance` (server VAD
transcribed it live under that id, if the session listened) and carries the session's
transcription prompt and logprobs request.
"""

from __future__ import annotations

from collections.abc import Sequence

from duplex.turn import Message, Stage, TurnRequest
from gateway.config import GatewayConfig
from gateway.protocol.session_config import LiveTranscription, SessionSettings
from gateway.session.conversation import Item
from gateway.session.responses import ResponseOptions

__all__ = ["answered_item", "response_turn", "transcription_turn"]


def answered_item(context: Sequence[Item]) -> Item | None:
    """The user item a response to `context` answers, if the context ends with one."""
    return context[-1] if context and context[-1].role == "user" else None


def response_turn(
    options: ResponseOptions,
    context: Sequence[Item],
    settings: SessionSettings,
    *,
    config: GatewayConfig,
) -> TurnRequest:
    """The turn of a response to `context` under `options`; the voice asked for is
    spoken by the profile voice `config` maps it to."""
    answered = answered_item(context)
    history = context[:-1] if answered is not None else context
    audio = answered.pending_audio if answered is not None else None
    text = answered.text() if answered is not None and audio is None else None
    spoken = "audio" in options.output_modalities
    live = settings.live_transcription() or LiveTranscription()
    messages = _merge_calls([m for m in (item.message() for item in history) if m is not None])
    if settings.truncates:
        messages = messages[-_kept_messages(settings, len(messages), config) :]
    if options.system_text:
        messages.insert(0, Message("system", options.system_text))
    return TurnRequest(
        final=Stage.TTS if spoken else Stage.LLM,
        audio=audio,
        text=text,
        messages=tuple(messages),
        max_output_tokens=options.max_output_tokens,
        voice=config.speaker(options.voice) if spoken else None,
        speed=settings.speed if spoken else None,
        # The conversation's prompt cache; an out-of-band reply shares none of it.
        cache_key=None if options.out_of_band else settings.id,
        truncate=settings.truncates,
        retention_ratio=settings.retention_ratio,
        post_instructions_tokens=settings.post_instructions_tokens,
        temperature=options.temperature,
        parallel_tool_calls=options.parallel_tool_calls,
        tools=options.tools,
        tool_choice=options.tool_choice,
        utterance=answered.id if answered is not None and audio is not None else None,
        transcription_prompt=live.prompt if audio is not None else "",
        logprobs=live.logprobs and audio is not None,
    )


def _kept_messages(settings: SessionSettings, count: int, config: GatewayConfig) -> int:
    """How many of the newest history messages a turn keeps: at most the limit. Over it,
    retention-ratio truncation drops the oldest in blocks of the limit's share it gives
    up, so that it keeps `retention_ratio` of the limit and the following turns start
    from the same first message (their cached prompt holds) until the limit is reached
    again."""
    limit = config.limits.max_context_messages
    ratio = settings.retention_ratio
    if count <= limit or ratio is None:
        return limit
    block = max(1, limit - max(1, int(limit * ratio)))
    dropped = -(-(count - limit) // block) * block  # whole blocks, enough to fit
    return count - dropped


def _merge_calls(messages: list[Message]) -> list[Message]:
    """Calls made one after another as one assistant message carrying them all."""
    merged: list[Message] = []
    for message in messages:
        previous = merged[-1] if merged else None
        if message.tool_calls and previous is not None and previous.tool_calls:
            calls = previous.tool_calls + message.tool_calls
            merged[-1] = Message("assistant", previous.content, tool_calls=calls)
        else:
            merged.append(message)
    return merged


def transcription_turn(item: Item, live: LiveTranscription | None) -> TurnRequest:
    """The turn that only transcribes `item`'s pending audio, with `live`'s options."""
    options = live or LiveTranscription()
    return TurnRequest(
        final=Stage.ASR,
        audio=item.pending_audio,
        utterance=item.id,
        transcription_prompt=options.prompt,
        logprobs=options.logprobs,
    )
