"""speexdsp's echo canceller and preprocessor (Debian's libspeexdsp1) through ctypes: the
candidate `bench/echo.py` measures against WebRTC's AEC3 on the same signals.

The far end is fed frame by frame beside the near end, already placed on the session
clock (as `gateway.session.far_end` places it); speex's adaptive filter must cover the rest of
the delay, so its length is the longest delay the rooms have plus their reverberation.
"""

from __future__ import annotations

import ctypes
import ctypes.util

import numpy as np
from numpy.typing import NDArray

__all__ = ["SpeexCanceller"]

_SET_SAMPLING_RATE = 24  # SPEEX_ECHO_SET_SAMPLING_RATE
_SET_ECHO_STATE = 24  # SPEEX_PREPROCESS_SET_ECHO_STATE


def _library() -> ctypes.CDLL:
    name = ctypes.util.find_library("speexdsp") or "libspeexdsp.so.1"
    lib = ctypes.CDLL(name)
    lib.speex_echo_state_init.restype = ctypes.c_void_p
    lib.speex_echo_state_init.argtypes = [ctypes.c_int, ctypes.c_int]
    lib.speex_echo_ctl.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p]
    lib.speex_echo_cancellation.argtypes = [ctypes.c_void_p] + [ctypes.c_void_p] * 3
    lib.speex_echo_state_destroy.argtypes = [ctypes.c_void_p]
    lib.speex_preprocess_state_init.restype = ctypes.c_void_p
    lib.speex_preprocess_state_init.argtypes = [ctypes.c_int, ctypes.c_int]
    lib.speex_preprocess_ctl.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p]
    lib.speex_preprocess_run.argtypes = [ctypes.c_void_p, ctypes.c_void_p]
    lib.speex_preprocess_state_destroy.argtypes = [ctypes.c_void_p]
    return lib


class SpeexCanceller:
    """16 kHz, 10 ms frames: `process(near, far)` returns the near end cleaned."""

    def __init__(self, filter_ms: int = 600, rate: int = 16000) -> None:
        self._lib = _library()
        self.frame = rate // 100
        self._echo = self._lib.speex_echo_state_init(self.frame, rate * filter_ms // 1000)
        value = ctypes.c_int(rate)
        self._lib.speex_echo_ctl(self._echo, _SET_SAMPLING_RATE, ctypes.byref(value))
        self._pre = self._lib.speex_preprocess_state_init(self.frame, rate)
        self._lib.speex_preprocess_ctl(self._pre, _SET_ECHO_STATE, ctypes.c_void_p(self._echo))

    def process(self, near: NDArray[np.float32], far: NDArray[np.float32]) -> NDArray[np.float32]:
        rec = _int16(near)
        play = _int16(far)
        out = np.zeros(self.frame, np.int16)
        self._lib.speex_echo_cancellation(
            self._echo, rec.ctypes.data, play.ctypes.data, out.ctypes.data
        )
        self._lib.speex_preprocess_run(self._pre, out.ctypes.data)
        return (out / np.float32(32767)).astype(np.float32)

    def close(self) -> None:
        self._lib.speex_preprocess_state_destroy(self._pre)
        self._lib.speex_echo_state_destroy(self._echo)


def _int16(samples: NDArray[np.float32]) -> NDArray[np.int16]:
    return np.ascontiguousarray((np.clip(samples, -1, 1) * 32767).astype(np.int16))
