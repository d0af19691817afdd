"""Where the engine keeps what it makes once: converted models, built native helpers."""

from __future__ import annotations

import fcntl
import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

__all__ = ["CACHE_ENV", "cache_dir", "cache_lock"]

CACHE_ENV = "DUPLEX_GATEWAY_CACHE"


def cache_dir() -> Path:
    """`$DUPLEX_GATEWAY_CACHE`, else `~/.cache/duplex-gateway`."""
    env = os.environ.get(CACHE_ENV)
    return Path(env).expanduser() if env else Path.home() / ".cache" / "duplex-gateway"


@contextmanager
def cache_lock(name: str) -> Iterator[None]:
    """Hold the cache's file lock `name`: one process at a time writes what it guards."""
    locks = cache_dir() / ".locks"
    locks.mkdir(parents=True, exist_ok=True)
    with open(locks / f"{name}.lock", "a") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)
