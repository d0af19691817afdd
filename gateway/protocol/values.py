"""The rules client-event values are held to, as pydantic validators: text is valid
Unicode, a number is never a boolean and always finite, response metadata is bounded,
and every refusal states the rule it broke. `gateway.protocol.events`'s models use them.
"""

from __future__ import annotations

import math
import re
from typing import Annotated, Literal

from pydantic import AfterValidator, BaseModel, BeforeValidator, ConfigDict, field_validator
from pydantic_core import PydanticCustomError

__all__ = [
    "METADATA_MAX_KEYS",
    "METADATA_MAX_KEY_CHARS",
    "METADATA_MAX_VALUE_CHARS",
    "Metadata",
    "StrictModel",
    "TokenLimit",
    "integer",
    "number",
]


_LONE_SURROGATE = re.compile("[\ud800-\udfff]")


def _holds_lone_surrogate(value: object) -> bool:
    """Whether a string anywhere in a JSON value holds a lone surrogate (JSON's `\\ud800`
    escapes decode to one): such text has no UTF-8 form, so nothing below could use it."""
    pending = [value]
    while pending:  # a loop, not recursion: the value may nest as deep as JSON allows
        item = pending.pop()
        if isinstance(item, str):
            if not item.isascii() and _LONE_SURROGATE.search(item):
                return True
        elif isinstance(item, dict):
            pending.extend(item.keys())
            pending.extend(item.values())
        elif isinstance(item, list):
            pending.extend(item)
    return False


class StrictModel(BaseModel):
    """A client-event model: unknown fields and text that is not valid Unicode are refused."""

    model_config = ConfigDict(extra="forbid")

    @field_validator("*", mode="before")
    @classmethod
    def _valid_unicode(cls, value: object) -> object:
        if _holds_lone_surrogate(value):
            raise PydanticCustomError(
                "value_error", "must be valid Unicode text (a lone surrogate is not)"
            )
        return value


# -- numbers: never booleans, always finite, refused with the rule they broke ----------


def _rule_error(rule: str) -> PydanticCustomError:
    return PydanticCustomError("value_error", "must be {rule}", {"rule": rule})


def _span(low: float | None, high: float | None, *, low_open: bool = False) -> str:
    if low is None and high is None:
        return ""
    if high is None:
        return f" of at least {low}"
    opening = "(" if low_open else "["
    return f" in {opening}{low}, {high}]"


def integer(low: int | None = None, high: int | None = None) -> BeforeValidator:
    """An integer in [low, high]: not a boolean, not a float, not a string."""
    rule = "an integer" + _span(low, high)

    def check(value: object) -> object:
        if value is None:
            return value  # whether None is allowed is the field's type's business
        if not isinstance(value, int) or isinstance(value, bool):
            raise _rule_error(rule)
        if (low is not None and value < low) or (high is not None and value > high):
            raise _rule_error(rule)
        return value

    return BeforeValidator(check)


def number(
    low: float | None = None, high: float | None = None, *, low_open: bool = False
) -> BeforeValidator:
    """A finite number (integer or float, never a boolean) in [low, high] or (low, high]."""
    rule = "a finite number" + _span(low, high, low_open=low_open)

    def above_low(value: float) -> bool:
        return low is None or (value > low if low_open else value >= low)

    def check(value: object) -> object:
        if value is None:
            return value
        if not isinstance(value, int | float) or isinstance(value, bool):
            raise _rule_error(rule)
        # An integer is finite however long (and too long for math.isfinite).
        finite = isinstance(value, int) or math.isfinite(value)
        if not finite or not above_low(value):
            raise _rule_error(rule)
        if high is not None and value > high:
            raise _rule_error(rule)
        return value

    return BeforeValidator(check)


def _token_limit(value: object) -> object:
    if value == "inf" or value is None:
        return value
    if isinstance(value, int) and not isinstance(value, bool) and 1 <= value <= 4096:
        return value
    raise _rule_error("an integer in [1, 4096] or 'inf'")


# Output tokens per response: 1..4096, or "inf" for the model's own limit.
TokenLimit = Annotated[int | Literal["inf"] | None, BeforeValidator(_token_limit)]

# Response metadata, as OpenAI documents it: up to 16 string pairs, short keys.
METADATA_MAX_KEYS = 16
METADATA_MAX_KEY_CHARS = 64
METADATA_MAX_VALUE_CHARS = 512


def _metadata(value: dict[str, str] | None) -> dict[str, str] | None:
    if value is None:
        return None
    too_long = any(
        len(k) > METADATA_MAX_KEY_CHARS or len(v) > METADATA_MAX_VALUE_CHARS
        for k, v in value.items()
    )
    if len(value) > METADATA_MAX_KEYS or too_long:
        raise PydanticCustomError(
            "value_error",
            f"must have at most {METADATA_MAX_KEYS} keys, each of at most "
            f"{METADATA_MAX_KEY_CHARS} characters, with string values of at most "
            f"{METADATA_MAX_VALUE_CHARS} characters",
        )
    return value


Metadata = Annotated[dict[str, str] | None, AfterValidator(_metadata)]
