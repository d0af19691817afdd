"""Simulated rooms for a speakerphone client: what its microphone picks up of what its
loudspeaker plays, with the delay, level and reverberation of a room, and a playback
clock that drifts and jitters against the microphone's, as a real device's does.

Everything is PCM float32 at 24 kHz (the realtime API's PCM16 rate) on the client's
microphone clock: sample n of the microphone is at n / 24 kHz.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from numpy.typing import NDArray

__all__ = ["RATE", "ROOMS", "Room", "Speakerphone"]

RATE = 24000
Audio = NDArray[np.float32]


@dataclass(frozen=True)
class Room:
    """`echo_db`: how far the echo's level lies below the user's voice at the microphone;
    `delay_ms`: loudspeaker to microphone (device buffers and the air); `rt60_s`: the
    reverberation's decay to -60 dB; `drr_db`: the direct path's energy against the
    reverberation's (a loudspeaker beside the microphone is well above 0 dB);
    `drift_ppm`: the playback clock against the microphone's; `jitter_ms`: how far the
    playback position wanders around it."""

    name: str
    echo_db: float
    delay_ms: float
    rt60_s: float
    drr_db: float
    drift_ppm: float
    jitter_ms: float
    seed: int

    def impulse_response(self) -> Audio:
        """Unit-energy response: the direct path, a few early reflections and an
        exponentially decaying diffuse tail."""
        rng = np.random.default_rng(self.seed)
        delay = int(self.delay_ms * RATE / 1000)
        length = int(min(self.rt60_s, 0.8) * RATE)
        response = np.zeros(delay + length, np.float64)
        response[delay] = 1.0
        for _ in range(4):
            at = delay + int(rng.uniform(0.002, 0.03) * RATE)
            response[at] += rng.uniform(-0.6, 0.6)
        t = np.arange(length) / RATE
        tail = rng.standard_normal(length) * np.exp(-6.9 * t / self.rt60_s) * (t > 0.005)
        direct = np.sum(response**2)
        tail *= np.sqrt(direct / np.sum(tail**2) * 10 ** (-self.drr_db / 10))
        response[delay:] += tail
        return (response / np.sqrt(np.sum(response**2))).astype(np.float32)


# Echo 4 to 20 dB below the voice, 20 to 300 ms of delay, and reverberation from a car
# to a hall whose tail outweighs the direct path; clocks off by up to 300 ppm with a few
# ms of jitter.
ROOMS = (
    Room(
        "kitchen", echo_db=4, delay_ms=60, rt60_s=0.4, drr_db=3, drift_ppm=120, jitter_ms=2, seed=1
    ),
    Room(
        "laptop", echo_db=8, delay_ms=20, rt60_s=0.25, drr_db=10, drift_ppm=-80, jitter_ms=1, seed=2
    ),
    Room(
        "phone", echo_db=6, delay_ms=150, rt60_s=0.3, drr_db=12, drift_ppm=200, jitter_ms=4, seed=3
    ),
    Room(
        "kiosk", echo_db=12, delay_ms=300, rt60_s=0.6, drr_db=0, drift_ppm=-250, jitter_ms=3, seed=4
    ),
    Room("car", echo_db=5, delay_ms=100, rt60_s=0.15, drr_db=8, drift_ppm=300, jitter_ms=2, seed=5),
    Room(
        "hall", echo_db=10, delay_ms=220, rt60_s=0.8, drr_db=-3, drift_ppm=50, jitter_ms=5, seed=6
    ),
    Room(
        "office",
        echo_db=16,
        delay_ms=40,
        rt60_s=0.35,
        drr_db=6,
        drift_ppm=-150,
        jitter_ms=2,
        seed=7,
    ),
    Room(
        "tablet", echo_db=20, delay_ms=180, rt60_s=0.5, drr_db=8, drift_ppm=100, jitter_ms=3, seed=8
    ),
)


class Speakerphone:
    """A client's loudspeaker and microphone in `room`.

    `play(audio, at_s)` queues received audio: it starts `latency_s` after it arrives,
    or when the audio queued before it ends. `microphone(n)` is the next `n` samples of
    the echo at the microphone. The playback device runs on its own clock: its
    position at microphone time t is t(1 + drift) + jitter(t).
    """

    def __init__(self, room: Room, echo_gain: float, latency_s: float = 0.04) -> None:
        self.room = room
        self._gain = echo_gain  # scales the unit-energy response to the room's echo level
        self._latency = latency_s
        self._response = room.impulse_response()
        taps = len(self._response)
        self._fft = 1 << int(np.ceil(np.log2(taps + 8 * RATE // 10)))
        self._spectrum = np.fft.rfft(self._response, self._fft)
        self._device = np.zeros(0, np.float32)  # played audio on the device's clock...
        self._base = 0  # ...from this device sample on (what has played is let go)
        self._speaker = np.zeros(taps, np.float32)  # loudspeaker output, microphone clock
        self._mic_at = 0  # the next microphone sample
        rng = np.random.default_rng(room.seed + 100)
        # The jitter: a smooth random walk, within +-jitter_ms, one value per 10 ms.
        walk = np.cumsum(rng.standard_normal(60_000)) * 0.15
        walk = np.convolve(walk, np.ones(20) / 20, mode="same")
        self._jitter = np.clip(walk, -room.jitter_ms, room.jitter_ms).astype(np.float64)
        # item -> (device position of its first sample, samples of it received)
        self._items: dict[str, tuple[int, int]] = {}

    def _device_at(self, mic_samples: NDArray[np.float64]) -> NDArray[np.float64]:
        """The device's position (in its samples) at microphone sample times."""
        t_ms = mic_samples * 1000 / RATE
        jitter = np.interp(t_ms / 10, np.arange(len(self._jitter)), self._jitter)
        return mic_samples * (1 + self.room.drift_ppm * 1e-6) + jitter * RATE / 1000

    def play(self, item_id: str, audio: Audio) -> None:
        """`audio` arrived now (the microphone's current time)."""
        now = float(self._device_at(np.array([float(self._mic_at)]))[0])
        end = self._base + len(self._device)
        start = max(int(now + self._latency * RATE), end)
        pad = np.zeros(start - end, np.float32)
        self._device = np.concatenate([self._device, pad, audio])
        first, count = self._items.get(item_id, (start, 0))
        self._items[item_id] = (first, count + len(audio))

    def stop(self, item_id: str) -> float:
        """The client stops playback now; how many ms of `item_id` it played (gaps where
        it ran dry count as played: at most all it received)."""
        now = int(self._device_at(np.array([float(self._mic_at)]))[0])
        self._device = self._device[: max(now - self._base, 0)]
        first, count = self._items.get(item_id, (now, 0))
        return max(0, min(now - first, count)) * 1000 / RATE

    def _interpolate(self, positions: NDArray[np.float64]) -> NDArray[np.float64]:
        """The device's audio at fractional positions; silence outside it. What lies
        before the first position is let go: it has played."""
        lo = np.floor(positions).astype(np.int64) - self._base
        frac = positions - np.floor(positions)
        size = len(self._device)
        ok = (lo >= 0) & (lo < size - 1)
        safe = np.where(ok, lo, 0)
        values = np.where(
            ok,
            self._device[safe] * (1 - frac) + self._device[np.minimum(safe + 1, size - 1)] * frac
            if size
            else 0.0,
            0.0,
        )
        drop = min(max(int(lo[0]) - 2, 0), size) if len(lo) else 0
        self._device = self._device[drop:]
        self._base += drop
        return np.asarray(values, np.float64)

    def playing_until_s(self) -> float:
        """Microphone time at which the queued audio ends playing."""
        return (self._base + len(self._device)) / (1 + self.room.drift_ppm * 1e-6) / RATE

    def microphone(self, count: int) -> Audio:
        """The echo in the next `count` microphone samples."""
        times = np.arange(self._mic_at, self._mic_at + count, dtype=np.float64)
        self._mic_at += count
        speaker = self._interpolate(self._device_at(times))
        self._speaker = np.concatenate([self._speaker, speaker.astype(np.float32)])
        window = self._speaker[-(len(self._response) - 1 + count) :]
        echo = np.fft.irfft(np.fft.rfft(window, self._fft) * self._spectrum, self._fft)
        self._speaker = self._speaker[-len(self._response) :]
        start = len(self._response) - 1
        return (self._gain * echo[start : start + count]).astype(np.float32)
