"""Context limits (`engine.llm.context`) with a word-counting tokenizer: refusals name their
limit, truncation drops the oldest history first and keeps the instructions and the
message being answered, and over-long texts are refused without being counted."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from engine.llm.context import ContextFitter, ContextLimitError, ContextLimits

Message = dict[str, Any]


def words(text: str) -> int:
    return len(text.split())


class Fitter:
    """A fitter with its prompt counter, as the LLM stage calls it."""

    def __init__(self, fitter: ContextFitter, count_prompt: Callable[[list[Message]], int]):
        self._fitter, self._count_prompt = fitter, count_prompt

    def fit(self, messages: list[Message], *, truncate: bool) -> list[Message]:
        return self._fitter.fit(messages, truncate=truncate, count_prompt=self._count_prompt)


def fitter(counted: list[str] | None = None, **limits: int) -> Fitter:
    def count_text(text: str) -> int:
        if counted is not None:
            counted.append(text)
        return words(text)

    def count_prompt(messages: list[Message]) -> int:
        # One token of template per message, as a chat template adds its role markers.
        return sum(count_text(m["content"]) + 1 for m in messages)

    return Fitter(
        ContextFitter(ContextLimits(**limits), count_text=count_text, max_token_bytes=8),
        count_prompt,
    )


def msg(role: str, n: int, tag: str = "w") -> Message:
    return {"role": role, "content": " ".join(f"{tag}{i}" for i in range(n))}


def test_messages_within_every_limit_pass_unchanged() -> None:
    messages = [msg("system", 3), msg("user", 4), msg("assistant", 4), msg("user", 2)]
    assert fitter(max_context_tokens=100).fit(messages, truncate=True) == messages


@pytest.mark.parametrize(
    ("role", "code", "name"),
    [
        ("user", "user_message_too_long", "max_user_message_tokens"),
        ("system", "instructions_too_long", "max_instructions_tokens"),
    ],
)
def test_a_long_message_is_refused_naming_its_limit(role: str, code: str, name: str) -> None:
    limits = {name: 5}
    with pytest.raises(ContextLimitError) as err:
        fitter(**limits).fit([msg(role, 6)], truncate=True)
    assert err.value.code == code
    assert name in str(err.value) and "6 tokens" in str(err.value)


def test_a_long_user_message_in_the_history_is_dropped_by_truncation() -> None:
    counted: list[str] = []
    huge = {"role": "user", "content": "x " * 1000}
    messages = [huge, msg("assistant", 2), msg("user", 1)]
    fitted = fitter(counted, max_user_message_tokens=8, max_context_tokens=20).fit(
        messages, truncate=True
    )
    assert fitted == messages[1:]
    assert huge["content"] not in counted  # over by its size alone


def test_assistant_messages_have_no_limit_of_their_own() -> None:
    messages = [msg("assistant", 50), msg("user", 1)]
    assert fitter(max_user_message_tokens=8).fit(messages, truncate=True) == messages


def test_a_huge_text_is_refused_without_being_counted() -> None:
    counted: list[str] = []
    huge = {"role": "user", "content": "x" * (5 * 8 + 1)}  # more bytes than 5 tokens hold
    with pytest.raises(ContextLimitError) as err:
        fitter(counted, max_user_message_tokens=5).fit([huge], truncate=True)
    assert err.value.code == "user_message_too_long"
    assert counted == []


def test_truncation_drops_the_oldest_history_first() -> None:
    system, last = msg("system", 4, "s"), msg("user", 3, "q")
    history = [msg("user", 5, "a"), msg("assistant", 5, "b"), msg("user", 5, "c")]
    # 5 + 4 (system) + 4 (last) + 6 per history message: two of three fit in 22.
    fitted = fitter(max_context_tokens=21).fit([system, *history, last], truncate=True)
    assert fitted == [system, *history[1:], last]
    fitted = fitter(max_context_tokens=20).fit([system, *history, last], truncate=True)
    assert fitted == [system, history[2], last]


def test_truncation_keeps_what_is_answered_without_a_system_message() -> None:
    history = [msg("user", 5, "a"), msg("assistant", 5, "b")]
    last = msg("user", 3, "q")
    assert fitter(max_context_tokens=10).fit([*history, last], truncate=True) == [
        history[1],
        last,
    ]


def test_without_truncation_an_over_long_conversation_is_refused() -> None:
    messages = [msg("user", 5), msg("assistant", 5), msg("user", 5)]
    with pytest.raises(ContextLimitError) as err:
        fitter(max_context_tokens=16).fit(messages, truncate=False)
    assert err.value.code == "context_length_exceeded"
    assert "truncation is disabled" in str(err.value)


def test_instructions_and_last_message_over_the_context_are_refused() -> None:
    messages = [msg("system", 10), msg("assistant", 1), msg("user", 10)]
    with pytest.raises(ContextLimitError) as err:
        fitter(max_context_tokens=16).fit(messages, truncate=True)
    assert err.value.code == "context_length_exceeded"
    assert "alone" in str(err.value)


def test_retention_ratio_cuts_to_its_share_of_the_limit() -> None:
    wrapper = fitter(max_context_tokens=60)
    history = [msg("user" if i % 2 else "assistant", 4, f"m{i}-") for i in range(10)]
    messages = [msg("system", 9), *history, msg("user", 4)]  # 10 + 10x5 + 5 = 65 tokens
    fit = wrapper._fitter.fit
    count = wrapper._count_prompt
    # Plain truncation drops just enough to fit 60 tokens...
    assert count(fit(messages, truncate=True, count_prompt=count)) == 60
    # ...retention 0.5 keeps half of what the limit allows after the instructions.
    kept = fit(messages, truncate=True, count_prompt=count, retention_ratio=0.5)
    assert kept[0] == messages[0] and kept[-1] == messages[-1]
    assert count(kept) <= 10 + 25 and count(kept) > 10 + 25 - 5
    # Its own post-instructions limit applies below the engine's.
    short = fit(
        messages,
        truncate=True,
        count_prompt=count,
        retention_ratio=1.0,
        post_instructions_tokens=20,
    )
    assert count(short) <= 10 + 20
    # Within the limit nothing is dropped.
    assert (
        fit(messages[:3] + messages[-1:], truncate=True, count_prompt=count, retention_ratio=0.5)
        == messages[:3] + messages[-1:]
    )
