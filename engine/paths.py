"""Where the engine keeps what it makes once: converted models, built native helpers."""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["CACHE_ENV", "cache_dir"]

CACHE_ENV = "DUPLEX_GATEWAY_CACHE"


def cache_dir() -> Path:
    """`$DUPLEX_GATEWAY_CACHE`, else `~/.cache/duplex-gateway`."""
    env = os.environ.get(CACHE_ENV)
    return Path(env).expanduser() if env else Path.home() / ".cache" / "duplex-gateway"
