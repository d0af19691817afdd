"""The paced track of a call's assistant audio, without a network: what it reports, what
a cut says was played, and the bound on what waits."""

from __future__ import annotations

import numpy as np

from gateway.webrtc.call_audio import FRAME_SAMPLES, Cut, PacedAudioTrack

RATE = 48000


class Late:
    """A clock always past every frame's due time: `recv` never waits."""

    def __init__(self) -> None:
        self.calls = 0

    def __call__(self) -> float:
        self.calls += 1
        return 0.0 if self.calls == 1 else 1e9


def pcm(ms: int, value: int = 1000) -> bytes:
    return np.full(RATE * ms // 1000, value, "<i2").tobytes()


async def frames(track: PacedAudioTrack, n: int) -> list[np.ndarray]:
    out = []
    for _ in range(n):
        frame = await track.recv()
        out.append(frame.to_ndarray().reshape(-1))
    return out


async def test_started_and_stopped_frame_a_response_and_silence_follows() -> None:
    reports: list[tuple[str, str]] = []
    track = PacedAudioTrack(lambda kind, rid: reports.append((kind, rid)), clock=Late())
    track.push("resp_a", "item_a", pcm(30))
    track.done("resp_a")
    first, second, third = await frames(track, 3)
    assert len(first) == FRAME_SAMPLES and (first == 1000).all()
    assert (second[: FRAME_SAMPLES // 2] == 1000).all() and (
        second[FRAME_SAMPLES // 2 :] == 0
    ).all()
    assert (third == 0).all()
    assert reports == [
        ("output_audio_buffer.started", "resp_a"),
        ("output_audio_buffer.stopped", "resp_a"),
    ]
    assert not track.playing


async def test_a_cut_reports_what_each_item_had_played() -> None:
    reports: list[tuple[str, str]] = []
    track = PacedAudioTrack(lambda kind, rid: reports.append((kind, rid)), clock=Late())
    track.push("resp_a", "item_a", pcm(100))
    track.push("resp_b", "item_b", pcm(100))
    await frames(track, 2)
    assert track.playing
    assert track.cut() == [Cut("resp_a", "item_a", 40), Cut("resp_b", "item_b", 0)]
    assert not track.playing
    (after,) = await frames(track, 1)
    assert (after == 0).all()
    # A cut is reported by the call as `cleared`, never as `stopped` here.
    assert reports == [("output_audio_buffer.started", "resp_a")]


async def test_a_new_response_stops_the_one_before() -> None:
    reports: list[tuple[str, str]] = []
    track = PacedAudioTrack(lambda kind, rid: reports.append((kind, rid)), clock=Late())
    track.push("resp_a", "item_a", pcm(10))
    track.push("resp_b", "item_b", pcm(10))
    await frames(track, 1)
    assert reports == [
        ("output_audio_buffer.started", "resp_a"),
        ("output_audio_buffer.stopped", "resp_a"),
        ("output_audio_buffer.started", "resp_b"),
    ]


async def test_what_waits_is_bounded() -> None:
    from gateway.webrtc import call_audio

    track = PacedAudioTrack(lambda kind, rid: None, clock=Late())
    chunk = np.zeros(RATE * 60, "<i2").tobytes()
    for _ in range(call_audio.MAX_QUEUED_S // 60 + 2):
        track.push("resp_a", "item_a", chunk)
    assert track.queued_s == call_audio.MAX_QUEUED_S
