"""Giving freed memory back to the system once the last session has ended.

Two allocators keep what the engine frees. MLX keeps freed buffers in its own cache for
the next array of the same size. glibc's malloc keeps freed heap pages in each of its
arenas (one per thread that allocated, up to eight per core), and after a large block
is freed it raises its mmap threshold, so later blocks of that size come from an arena
too. Both are right while sessions run; once every session has ended they only hold
resident memory that no one will use soon, so `release_free_memory` hands it back.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
from collections.abc import Callable

import mlx.core as mx

__all__ = ["release_free_memory"]

log = logging.getLogger(__name__)


def _find_malloc_trim() -> Callable[[int], int] | None:
    name = ctypes.util.find_library("c")
    try:
        trim = ctypes.CDLL(name).malloc_trim  # glibc only; musl and macOS have none
    except (OSError, AttributeError, TypeError):
        return None
    trim.argtypes, trim.restype = [ctypes.c_size_t], ctypes.c_int
    return trim  # type: ignore[no-any-return]


_malloc_trim = _find_malloc_trim()


def release_free_memory() -> int:
    """Empty MLX's buffer cache and return the C heap's free pages to the system (run it
    on engine threads, never the event loop: trimming a large heap takes milliseconds).
    Returns the bytes MLX's cache held."""
    cached = int(mx.get_cache_memory())
    mx.clear_cache()
    if _malloc_trim is not None:
        _malloc_trim(0)
    log.debug("released %d bytes of MLX's buffer cache and the heap's free pages", cached)
    return cached
