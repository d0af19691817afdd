"""Token usage in the Realtime `response.usage` shape, from the engine's counts.

The engine reports chat-completions usage (`prompt_tokens`, `completion_tokens`,
`cached_tokens`); the Realtime protocol splits the same numbers by direction and by
modality. Every token here is a text token: the engine's speech stages are not billed
in tokens.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

__all__ = ["realtime_usage"]


def realtime_usage(usage: Mapping[str, int]) -> dict[str, Any]:
    """`usage` (the engine's counts; missing ones are 0) in the `response.usage` shape."""
    prompt = int(usage.get("prompt_tokens", 0))
    completion = int(usage.get("completion_tokens", 0))
    return {
        "total_tokens": prompt + completion,
        "input_tokens": prompt,
        "output_tokens": completion,
        "input_token_details": {
            "text_tokens": prompt,
            "audio_tokens": 0,
            "image_tokens": 0,
            "cached_tokens": int(usage.get("cached_tokens", 0)),
        },
        "output_token_details": {"text_tokens": completion, "audio_tokens": 0},
    }
