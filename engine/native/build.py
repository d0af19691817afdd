"""Compile the engine's C sources once per CPU into the engine cache.

A library's file name carries a hash of its source and of this CPU's instruction set:
checkouts of different versions share one cache and each finds its own build there, and
a cache moved to another machine rebuilds. A build is written under a temporary name and
renamed into place, so a process never loads a partial one. Without a compiler, or when
the build fails, `library` returns None and the caller keeps its portable path.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import time
import uuid
from pathlib import Path

from engine.weights.paths import cache_dir

__all__ = ["PRUNE_AFTER_S", "library"]

log = logging.getLogger(__name__)

# Builds not loaded for this long are deleted from the cache (30 days).
PRUNE_AFTER_S = 30 * 24 * 3600


def library(source: Path, stem: str, fallback: str) -> Path | None:
    """The compiled library of `source` in the cache, named `stem-<hash>.so`, built now
    if needed; None without a compiler or when the build fails, after a warning that
    ends with `fallback` (what runs instead)."""
    code = source.read_bytes()
    key = hashlib.sha256(code + platform.machine().encode() + _cpu_flags()).hexdigest()[:16]
    target = cache_dir() / "native" / f"{stem}-{key}.so"
    if target.exists():
        with contextlib.suppress(OSError):
            os.utime(target)  # in use: not pruned (`_prune`)
        return target
    compiler = shutil.which(os.environ.get("CC", "cc")) or shutil.which("gcc")
    if compiler is None:
        log.warning("no C compiler: %s", fallback)
        return None
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(f".{target.name}.{uuid.uuid4().hex[:8]}")
    cmd = [compiler, "-O3", "-march=native", "-Wno-psabi", "-shared", "-fPIC", "-pthread"]
    cmd += ["-o", str(tmp), str(source), "-ldl"]
    try:
        subprocess.run(cmd, check=True, capture_output=True, text=True, timeout=120)
    except (OSError, subprocess.SubprocessError) as exc:
        detail = getattr(exc, "stderr", "") or exc
        log.warning("building %s failed (%s); %s", source.name, detail, fallback)
        tmp.unlink(missing_ok=True)
        return None
    os.replace(tmp, target)  # atomic: another process may be building the same file
    _prune(target.parent, stem)
    return target


def _prune(folder: Path, stem: str) -> None:
    """Drop builds of `stem` no process has loaded for `PRUNE_AFTER_S`, so upgrades do
    not pile them up. A build in use is refreshed each time it is loaded, and a process
    that still has one mapped keeps its mapping."""
    cutoff = time.time() - PRUNE_AFTER_S
    # The hidden ones are what builds that were stopped half-way left behind.
    for old in [*folder.glob(f"{stem}-*.so"), *folder.glob(f".{stem}-*.so.*")]:
        with contextlib.suppress(OSError):  # another process pruned it first
            if old.stat().st_mtime < cutoff:
                old.unlink()


def _cpu_flags() -> bytes:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return b""
    return next((line for line in text.splitlines() if line.startswith("flags")), "").encode()
