"""The offline parts of `bench/echo.py`: each candidate replayed on what the live
clients recorded, and the simulated rooms through each candidate with no gateway."""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any, Protocol

import numpy as np
from _clips import (
    FRAME,
    NOISE_DBFS,
    PERSON,
    PERSON_AFTER_S,
    VOICE_DBFS,
    Recording,
    active_rms,
    erle_db,
    espeak,
    pct,
    person_kept_db,
    to_engine,
    wer,
)
from _rooms import RATE, ROOMS, Speakerphone
from _speex import SpeexCanceller

from gateway.protocol.audio import ENGINE_RATE
from gateway.session.far_end import FarEnd
from gateway.session.input_processing import InputProcessing


class Replayable(Protocol):
    """A live session's trial: what it recorded, in which room, when the person spoke."""

    room: str
    person_at: int
    record: Recording | None


def replay(record: Recording, speex: bool) -> tuple[np.ndarray, float, float]:
    """The microphone through the canceller as the gateway fed it: output at 16 kHz,
    CPU seconds, and seconds of audio the canceller worked on."""
    mic = to_engine(np.concatenate(record.mic))
    clock = [0.0]
    far_end = FarEnd(lambda: clock[0])
    processing = InputProcessing(
        far_end, echo_cancellation=True, noise_reduction=None, start_ms=0.0
    )
    canceller = SpeexCanceller() if speex else None
    played = sorted(record.played, key=lambda p: p[0])
    truncated = sorted(record.truncated, key=lambda t: t[0])
    out: list[np.ndarray] = []
    cpu = 0.0
    step = ENGINE_RATE * 40 // 1000
    for lo in range(0, len(mic), step):
        mic_sample = lo * RATE // ENGINE_RATE
        while played and played[0][0] <= mic_sample:
            _, item, audio = played.pop(0)
            far_end.play(item, audio, RATE)
        while truncated and truncated[0][0] <= mic_sample:
            _, item, ms = truncated.pop(0)
            far_end.truncate(item, ms)
        chunk = mic[lo : lo + step]
        clock[0] += len(chunk) * 1000 / ENGINE_RATE
        begin = time.process_time()
        if canceller is None:
            out.append(processing.push(chunk))
        else:
            frames = []
            for f in range(0, len(chunk) - canceller.frame + 1, canceller.frame):
                at = lo + f
                frames.append(
                    canceller.process(
                        chunk[f : f + canceller.frame], far_end.read(at, canceller.frame)
                    )
                )
            far_end.forget_before(lo)
            out.append(np.concatenate(frames) if frames else np.zeros(0, np.float32))
        cpu += time.process_time() - begin
    worked_s = processing.frames_processed / 100 if canceller is None else len(mic) / ENGINE_RATE
    result = np.concatenate(out)
    return np.pad(result, (0, max(0, len(mic) - len(result))))[: len(mic)], cpu, worked_s


def offline(trials: Sequence[Replayable], person_len: dict[str, int]) -> dict[str, Any]:
    """Each candidate replayed on every recorded session: ERLE where only echo plays,
    the person's level while they talk over it, CPU per second of audio worked on."""
    result: dict[str, Any] = {}
    trials = [t for t in trials if t.record is not None]
    for name, speex in (("aec3", False), ("speexdsp", True)):
        erles, kept, cpu, worked = [], [], 0.0, 0.0
        for trial in trials:
            assert trial.record is not None
            out, seconds, audio_s = replay(trial.record, speex)
            echo = to_engine(np.concatenate(trial.record.echo))
            near = to_engine(np.concatenate(trial.record.near))
            erles.append(erle_db(echo, out, near))
            kept.append(person_kept_db(near, out, trial.person_at, person_len[trial.room]))
            cpu, worked = cpu + seconds, worked + audio_s
        result[name] = {
            # A room whose answer was cut within the first second has no echo-only frames.
            "erle_db_median": pct([e for e in erles if not np.isnan(e)], 50),
            "erle_db": [round(e, 1) for e in erles],
            "double_talk_person_kept_db_median": pct(kept, 50),
            "cpu_ms_per_audio_s": round(1000 * cpu / max(worked, 1e-9), 1),
        }
    raw = []
    for trial in trials:
        assert trial.record is not None
        near = to_engine(np.concatenate(trial.record.near))
        mic = to_engine(np.concatenate(trial.record.mic))
        raw.append(person_kept_db(near, mic, trial.person_at, person_len[trial.room]))
    result["none"] = {"double_talk_person_kept_db_median": pct(raw, 50)}
    return result


# ---- offline rooms: no gateway, the same rooms, what the VAD hears ---------------------

STORY = (
    "Once upon a time there was a brave little dog named Max. He lived on a farm with "
    "his family and loved to run in the fields every morning. One day he found a lost "
    "kitten near the river, and he carried it home in the rain."
)


def vad_runs(vad: Any, audio: np.ndarray) -> tuple[int, float | None]:
    """Silero (the gateway's VAD) over 16 kHz `audio`: the longest run of chunks at or
    above server VAD's default threshold, in ms, and the first such chunk, in s."""
    states: list[Any] = [None]
    size = vad.chunk_size
    probs = []
    for lo in range(0, len(audio) - size + 1, size):
        p, states = vad.speech_probability(audio[None, lo : lo + size], states)
        probs.append(float(p[0]))
    longest = run = 0
    first = None
    for n, p in enumerate(probs):
        run = run + 1 if p >= 0.5 else 0
        longest = max(longest, run)
        if p >= 0.5 and first is None:
            first = n * size / ENGINE_RATE
    return longest * size * 1000 // ENGINE_RATE, first


def process(
    mic: np.ndarray, far: np.ndarray, how: str, echo_heard: bool = False
) -> tuple[np.ndarray, float]:
    """`mic` (16 kHz) through a candidate with `far` playing from time 0; CPU seconds.
    `echo_heard`: AEC3's output from the start, as once a session's echo was heard."""
    clock = [0.0]
    far_end = FarEnd(lambda: clock[0])
    far_end.play("item", far, ENGINE_RATE)
    far_end.flush()
    processing = InputProcessing(
        far_end, echo_cancellation=how == "aec3", noise_reduction=None, start_ms=0.0
    )
    processing.echo_heard = echo_heard
    canceller = SpeexCanceller() if how == "speexdsp" else None
    out, cpu, step = [], 0.0, ENGINE_RATE * 40 // 1000
    for lo in range(0, len(mic) - step + 1, step):
        clock[0] += 40
        begin = time.process_time()
        if canceller is None:
            out.append(processing.push(mic[lo : lo + step]))
        else:
            size = canceller.frame
            for f in range(lo, lo + step, size):
                out.append(canceller.process(mic[f : f + size], far_end.read(f, size)))
        cpu += time.process_time() - begin
    return np.concatenate(out), cpu


def offline_rooms(rooms: int) -> dict[str, Any]:
    from engine.stages.vad import SileroVad

    vad = SileroVad.from_registry()
    far24 = espeak(STORY)
    far24 = (far24 * 10 ** (-20 / 20) / active_rms(far24)).astype(np.float32)
    far = to_engine(far24)
    person = to_engine(espeak(PERSON[0], "en-us+m3"))
    onset = int(PERSON_AFTER_S * ENGINE_RATE)
    result: dict[str, Any] = {}
    for how in ("off", "aec3", "speexdsp"):
        rows: list[dict[str, Any]] = []
        cpu = 0.0
        for room in [ROOMS[i % len(ROOMS)] for i in range(rooms)]:
            phone = Speakerphone(room, 10 ** ((VOICE_DBFS - room.echo_db) / 20) / 0.1)
            phone.play("item", far24)
            echo = to_engine(
                np.concatenate([phone.microphone(FRAME) for _ in range(len(far24) // FRAME)])
            )
            noise = np.random.default_rng(room.seed).standard_normal(len(echo)) * 10 ** (
                NOISE_DBFS / 20
            )
            mic = (echo + noise).astype(np.float32)
            out, seconds = process(mic, far[: len(mic)], how)
            cpu += seconds
            longest, _ = vad_runs(vad, out)
            # The same room, a person talking over the echo 1.5 s in.
            talk = mic.copy()
            talk[onset : onset + len(person)] += person[: len(talk) - onset]
            talk_out, _ = process(talk, far[: len(mic)], how)
            _, first = vad_runs(vad, talk_out[onset:])
            near = np.zeros_like(talk)
            near[onset : onset + len(person)] = person[: len(talk) - onset]
            # Headphones: the answer plays, no echo, the user talks 1.5 s in.
            clean = noise.astype(np.float32) + near
            clean_out, _ = process(clean, far[: len(mic)], how)
            span = slice(onset, onset + len(person))
            rows.append(
                {
                    "room": room.name,
                    "echo_vad_longest_ms": longest,
                    "erle_db": round(erle_db(echo, out, np.zeros_like(echo)), 1),
                    "person_vad_after_ms": None if first is None else round(first * 1000),
                    "person_kept_db": round(
                        person_kept_db(
                            near,
                            talk_out,
                            onset * RATE // ENGINE_RATE,
                            len(person) * RATE // ENGINE_RATE,
                        ),
                        1,
                    ),
                    "headset_speech_kept_db": round(
                        float(
                            10 * np.log10(np.sum(clean_out[span] ** 2) / np.sum(clean[span] ** 2))
                        ),
                        1,
                    ),
                }
            )
        audio_s = rooms * len(far) / ENGINE_RATE
        result[how] = {
            "rooms_where_echo_reads_as_speech_200ms": sum(
                r["echo_vad_longest_ms"] >= 200 for r in rows
            ),
            "echo_vad_longest_ms_max": max(r["echo_vad_longest_ms"] for r in rows),
            "erle_db_median": pct([r["erle_db"] for r in rows], 50),
            "person_vad_after_ms_p95": pct(
                [r["person_vad_after_ms"] for r in rows if r["person_vad_after_ms"] is not None], 95
            ),
            "person_heard": sum(r["person_vad_after_ms"] is not None for r in rows),
            "person_kept_db_median": pct([r["person_kept_db"] for r in rows], 50),
            "headset_speech_kept_db_min": min(r["headset_speech_kept_db"] for r in rows),
            "cpu_ms_per_audio_s": round(1000 * cpu / audio_s, 1),
            "per_room": rows,
        }
    return result


# ---- offline headset: what the canceller costs Whisper where there is no echo ----------


def headset_wer(texts: Sequence[str]) -> dict[str, Any]:
    """Each text (eSpeak NG at the user's level) spoken 1.5 s into a playing answer on a
    headset (no echo), transcribed by the engine's Whisper: as the microphone heard it,
    as AEC3 made it, and as the detectors hear it (`InputProcessing`'s output)."""
    from engine.stages.asr import load_transcriber
    from engine.weights import registry

    transcriber = load_transcriber(registry.prepare("whisper-tiny.en", progress=False))
    far24 = espeak(STORY)
    far = to_engine((far24 * 10 ** (-20 / 20) / active_rms(far24)).astype(np.float32))
    onset = int(PERSON_AFTER_S * ENGINE_RATE)
    margin = ENGINE_RATE // 5
    hyps: dict[str, list[str]] = {"microphone": [], "aec3_output": [], "heard": []}
    for n, text in enumerate(texts):
        clip = to_engine(espeak(text))
        clip *= 10 ** (VOICE_DBFS / 20) / active_rms(clip)
        total = onset + len(clip) + ENGINE_RATE // 2
        noise = np.random.default_rng(n).standard_normal(total) * 10 ** (NOISE_DBFS / 20)
        mic = noise.astype(np.float32)
        mic[onset : onset + len(clip)] += clip
        span = slice(onset - margin, onset + len(clip) + margin)
        hyps["microphone"].append(transcriber.transcribe(mic[span]))
        # AEC3's own output: the processing told the echo was heard from the start.
        hyps["aec3_output"].append(transcriber.transcribe(process(mic, far, "aec3", True)[0][span]))
        hyps["heard"].append(transcriber.transcribe(process(mic, far, "aec3")[0][span]))
    return {
        **{f"headset_wer_{name}": round(wer(list(texts), h), 4) for name, h in hyps.items()},
        "headset_transcripts": hyps,
    }
