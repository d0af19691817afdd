"""What one turn may put in front of the local LLM, counted in tokens, before prefill.

A turn's chat messages are checked and fitted here, on the engine thread, so that a
client cannot make the shared model prefill more than the profile allows:

1. The system message (the session's instructions) and the user message (or function
   result) being answered must each fit their own limit, or the turn is refused with the
   limit's name in the error. A message refused so stays in the conversation's history,
   where rule 2 drops it.
2. The whole templated prompt must fit `max_context_tokens`. With truncation on, the
   oldest history messages are dropped until it does (the instructions and the message
   being answered always stay); with truncation off, or when those two alone are too
   long, the turn is refused. Retention-ratio truncation may set a lower limit of its
   own on the tokens after the system message, and once over a limit drops history
   until only `retention_ratio` of what the limit allows after the system message is
   used: the following turns then grow from the same first message, and the cached
   prompt holds, until the limit is reached again.

Counting a huge text would itself stall the engine, so texts with more bytes than the
limit times the longest token can hold are over it without being tokenized.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from engine.runtime.stage import RequestRefused

__all__ = ["ContextLimitError", "ContextLimits", "ContextFitter"]

Message = dict[str, Any]


@dataclass(frozen=True)
class ContextLimits:
    max_instructions_tokens: int = 4096
    max_user_message_tokens: int = 4096
    max_context_tokens: int = 6144


class ContextLimitError(RequestRefused):
    """A turn over one of the limits; `code` names it for the client's `error` event."""


CountPrompt = Callable[[list[Message]], int]


class ContextFitter:
    """Checks and fits chat messages for one tokenizer.

    `count_text` counts a text's tokens; `max_token_bytes` is the longest token's length
    in bytes.
    """

    def __init__(
        self,
        limits: ContextLimits,
        *,
        count_text: Callable[[str], int],
        max_token_bytes: int,
    ) -> None:
        self.limits = limits
        self._count_text = count_text
        self._max_token_bytes = max(1, max_token_bytes)

    def fit(
        self,
        messages: Sequence[Message],
        *,
        truncate: bool,
        count_prompt: CountPrompt,
        retention_ratio: float | None = None,
        post_instructions_tokens: int | None = None,
    ) -> list[Message]:
        """`messages` checked (rule 1) and fitted (rule 2); raises ContextLimitError.
        `count_prompt` counts the tokens of the whole prompt these messages make (with
        whatever the template adds, such as the tools a reply may call)."""
        messages = list(messages)
        if messages[0].get("role") == "system":
            self._check_message(messages[0])
        if messages[-1].get("role") in ("user", "tool"):
            self._check_message(messages[-1])
        limit = self.limits.max_context_tokens
        if retention_ratio is not None and truncate:
            return self._retain(messages, count_prompt, retention_ratio, post_instructions_tokens)
        if self._fits(messages, count_prompt):
            return messages
        if not truncate:
            raise ContextLimitError(
                "context_length_exceeded",
                f"the conversation is over max_context_tokens ({limit} tokens) and the "
                "session's truncation is disabled",
            )
        keep_first = 1 if messages[0].get("role") == "system" else 0
        head, history, last = messages[:keep_first], messages[keep_first:-1], messages[-1:]
        dropped = self._fewest_to_drop(head, history, last, count_prompt)
        if dropped is None:
            raise ContextLimitError(
                "context_length_exceeded",
                f"the instructions and the last message alone are over max_context_tokens "
                f"({limit} tokens)",
            )
        return head + history[dropped:] + last

    def _retain(
        self,
        messages: list[Message],
        count_prompt: CountPrompt,
        ratio: float,
        post_instructions: int | None,
    ) -> list[Message]:
        keep_first = 1 if messages[0].get("role") == "system" else 0
        head, history, last = messages[:keep_first], messages[keep_first:-1], messages[-1:]
        limit = self.limits.max_context_tokens
        instructions = count_prompt(head) if head else 0
        if post_instructions is not None:
            limit = min(limit, instructions + post_instructions)
        if self._fits(messages, count_prompt, limit):
            return messages
        if not self._fits(head + last, count_prompt, limit):
            raise ContextLimitError(
                "context_length_exceeded",
                f"the instructions and the last message alone are over the context limit "
                f"({limit} tokens)",
            )
        target = max(instructions + int((limit - instructions) * ratio), count_prompt(head + last))
        dropped = self._fewest_to_drop(head, history, last, count_prompt, target)
        assert dropped is not None  # head + last alone fit the target
        return head + history[dropped:] + last

    def _fewest_to_drop(
        self,
        head: list[Message],
        history: list[Message],
        last: list[Message],
        count_prompt: CountPrompt,
        limit: int | None = None,
    ) -> int | None:
        # Fewer messages never make a longer prompt, so the count is found by bisection.
        def fits(dropped: int) -> bool:
            return self._fits(head + history[dropped:] + last, count_prompt, limit)

        if not fits(len(history)):
            return None
        low, high = 0, len(history)  # fits(high) holds; fits(low) does not
        while high - low > 1:
            middle = (low + high) // 2
            if fits(middle):
                high = middle
            else:
                low = middle
        return high

    def _fits(
        self, messages: list[Message], count_prompt: CountPrompt, limit: int | None = None
    ) -> bool:
        limit = self.limits.max_context_tokens if limit is None else limit
        size = sum(_bytes(m.get("content")) for m in messages)
        return size <= limit * self._max_token_bytes and count_prompt(messages) <= limit

    def _check_message(self, message: Message) -> None:
        role, content = message.get("role"), message.get("content")
        if not isinstance(content, str):
            return
        if role == "system":
            name, code = "max_instructions_tokens", "instructions_too_long"
            limit, what = self.limits.max_instructions_tokens, "the instructions"
        elif role in ("user", "tool"):  # a function's result is the client's input too
            name, code = "max_user_message_tokens", "user_message_too_long"
            limit, what = self.limits.max_user_message_tokens, f"a {role} message"
        else:
            return
        if _bytes(content) > limit * self._max_token_bytes:
            raise ContextLimitError(code, f"{what} is over {name} ({limit} tokens)")
        tokens = self._count_text(content)
        if tokens > limit:
            raise ContextLimitError(code, f"{what} has {tokens} tokens; {name} is {limit}")


def _bytes(content: object) -> int:
    return len(content.encode("utf-8", "surrogatepass")) if isinstance(content, str) else 0
