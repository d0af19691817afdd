"""Speed of the Silero VAD on MLX, single stream and batched, beside onnxruntime.

    python bench/vad.py [--json] [--sessions 64] [--seconds 10] [--ablation]

The audio is the alsa-utils recordings resampled to 16 kHz and looped. "Per core"
figures divide audio time by the process's CPU time, and BLAS is pinned to one thread,
so they do not depend on how many cores the machine has or how busy it is.

- `rtf_single`: wall time / audio time for one stream fed 32 ms at a time.
- `streams_per_core_batched`: real-time streams one core sustains with `--sessions`
  streams fed 32 ms at a time and stepped through `VadStage` (one batched pass per step).
- `streams_per_core_behind`: the same, but every stream stays `--behind` seconds behind:
  its audio waits unheard in the stage, and each step hears one chunk per stream, as
  when the engine thread is busy elsewhere and the VAD never catches up.
- `onnxruntime_*`: the same ONNX file run by onnxruntime (one thread), batched the same way.
- `--ablation`: the largest single-chunk difference from onnxruntime when the MLX model
  is fed the way earlier ports fed it (no 64-sample context, other STFT padding).
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import sys
import time
from pathlib import Path

# One BLAS thread, so CPU time is one core's time; must be set before the BLAS loads.
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import engine  # noqa: E402

engine.setup()  # first: the BLAS for MLX; NumPy's own then sleeps between products too

import numpy as np  # noqa: E402
import soundfile as sf  # noqa: E402
import soxr  # noqa: E402

from engine.models import silero_onnx  # noqa: E402
from engine.stages.vad import SileroVad, VadStage  # noqa: E402
from engine.weights import registry  # noqa: E402

RATE = 16000
CHUNK = 512
CHUNK_S = CHUNK / RATE


def load_audio(seconds: float) -> np.ndarray:
    parts = []
    for path in sorted(glob.glob("/usr/share/sounds/alsa/*.wav")):
        audio, rate = sf.read(path, dtype="float32")
        audio = audio.mean(axis=1) if audio.ndim > 1 else audio
        parts.append(soxr.resample(audio, rate, RATE).astype(np.float32))
    if not parts:
        raise SystemExit("no recordings in /usr/share/sounds/alsa (apt-get install alsa-utils)")
    audio = np.concatenate(parts)
    reps = int(np.ceil(seconds * RATE / len(audio)))
    return np.tile(audio, reps)[: int(seconds * RATE) // CHUNK * CHUNK]


class Clock:
    def __enter__(self) -> Clock:
        self.wall, self.cpu = time.perf_counter(), time.process_time()
        return self

    def __exit__(self, *exc: object) -> None:
        self.wall = time.perf_counter() - self.wall
        self.cpu = time.process_time() - self.cpu


def bench_mlx_single(vad: SileroVad, audio: np.ndarray) -> Clock:
    stream = vad.stream()
    stream.feed(audio[: 4 * CHUNK])  # warm-up
    stream = vad.stream()
    with Clock() as clock:
        for i in range(0, len(audio), CHUNK):
            stream.feed(audio[i : i + CHUNK])
    return clock


def _streams(audio: np.ndarray, sessions: int) -> list[np.ndarray]:
    """Every session says something else: the audio from another offset."""
    return [np.roll(audio, -((k * 7919 * CHUNK) % len(audio))) for k in range(sessions)]


def bench_mlx_batched(vad: SileroVad, audio: np.ndarray, sessions: int) -> Clock:
    stage = VadStage(vad)
    streams = _streams(audio, sessions)
    for k in range(sessions):
        stage.add(f"s{k}", None)
    stage.feed("s0", audio[:CHUNK])
    stage.step()  # warm-up
    return _stream_through(stage, streams)


def bench_mlx_behind(vad: SileroVad, audio: np.ndarray, sessions: int, behind_s: float) -> Clock:
    stage = VadStage(vad, max_chunks_per_step=1)
    streams = _streams(audio, sessions)
    for k, samples in enumerate(streams):
        stage.add(f"s{k}", None)
        backlog = np.roll(samples, len(samples) // 2)  # other words than what follows
        for i in range(0, int(behind_s * RATE) // CHUNK * CHUNK, CHUNK):
            j = i % len(backlog)
            stage.feed(f"s{k}", backlog[j : j + CHUNK])  # came 32 ms at a time, unheard
    return _stream_through(stage, streams)


def _stream_through(stage: VadStage, streams: list[np.ndarray]) -> Clock:
    """Stream s{k} gets `streams[k]` 32 ms at a time, one stage step after each round."""
    with Clock() as clock:
        for i in range(0, len(streams[0]), CHUNK):
            for k, samples in enumerate(streams):
                stage.feed(f"s{k}", samples[i : i + CHUNK])
            stage.step()
    return clock


def onnx_session(package_dir: Path):  # noqa: ANN201 - onnxruntime is a test/bench dependency
    import onnxruntime as ort

    opts = ort.SessionOptions()
    opts.intra_op_num_threads = 1
    opts.inter_op_num_threads = 1
    path = str(silero_onnx.find_onnx(package_dir))
    return ort.InferenceSession(path, opts, providers=["CPUExecutionProvider"])


def bench_onnx(session, audio: np.ndarray, sessions: int) -> Clock:  # noqa: ANN001
    rate = np.array(RATE, dtype=np.int64)
    state = np.zeros((2, sessions, 128), np.float32)
    context = np.zeros((sessions, 64), np.float32)
    streams = np.stack([np.roll(audio, -(k * 7919 * CHUNK) % len(audio)) for k in range(sessions)])
    with Clock() as clock:
        for i in range(0, len(audio), CHUNK):
            chunks = streams[:, i : i + CHUNK]
            x = np.concatenate([context, chunks], axis=1)
            _, state = session.run(None, {"input": x, "state": state, "sr": rate})
            context = chunks[:, -64:]
    return clock


def ablation(vad: SileroVad, session, audio: np.ndarray) -> dict[str, float]:  # noqa: ANN001
    """Max |p_mlx - p_onnx| per chunk when the MLX model is fed the way other ports feed it."""
    import mlx.core as mx

    model = vad.model
    weight = model.stft.weight

    def spectrum(x: mx.array, padding: str) -> mx.array:
        """(1, samples) to the model's (blocks, rows, frames, bins): one block of one row."""
        if padding == "reflect-right":
            return model.stft(x[None])
        right = mx.zeros((x.shape[0], 64)) if padding == "zero-right" else x[:, -65:-1][:, ::-1]
        left = x[:, 1:65][:, ::-1] if padding == "reflect-both" else x[:, :0]
        spec = mx.conv1d(mx.concatenate([left, x, right], axis=1)[..., None], weight, stride=128)
        re, im = mx.split(spec, 2, axis=-1)
        return mx.sqrt(re * re + im * im)[None]

    def run(context: bool, padding: str) -> np.ndarray:
        h, c = mx.zeros((1, 1, 128)), mx.zeros((1, 1, 128))
        tail, probs = np.zeros(64, np.float32), []
        for i in range(0, len(audio), CHUNK):
            chunk = audio[i : i + CHUNK]
            x = np.concatenate([tail, chunk]) if context else chunk
            y = spectrum(mx.array(x[None]), padding)
            for encoder in model.encoder:
                y = encoder(y)
            p, h, c = model.decoder(y[:, :, -1, :], h, c)
            probs.append(p.item())
            tail = chunk[-64:]
        return np.array(probs)

    rate = np.array(RATE, dtype=np.int64)
    state, tail, ref = np.zeros((2, 1, 128), np.float32), np.zeros(64, np.float32), []
    for i in range(0, len(audio), CHUNK):
        chunk = audio[i : i + CHUNK]
        p, state = session.run(
            None, {"input": np.concatenate([tail, chunk])[None], "state": state, "sr": rate}
        )
        ref.append(float(p[0, 0]))
        tail = chunk[-64:]
    ref_np = np.array(ref)
    variants = {
        "as_shipped": (True, "reflect-right"),
        "no_context": (False, "reflect-right"),
        "zero_padded_stft": (True, "zero-right"),
        "symmetric_reflect_stft": (True, "reflect-both"),
        "symmetric_reflect_stft_no_context": (False, "reflect-both"),
    }
    out = {}
    for name, (context, padding) in variants.items():
        probs = run(context, padding)
        out[f"{name}_max_diff"] = round(float(np.abs(probs - ref_np).max()), 6)
        out[f"{name}_flipped"] = int(np.sum((probs >= 0.5) != (ref_np >= 0.5)))
    out["chunks"] = len(ref_np)
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--sessions", type=int, default=64)
    parser.add_argument("--seconds", type=float, default=10.0, help="audio per stream")
    parser.add_argument("--behind", type=float, default=10.0, help="backlog per stream, s")
    parser.add_argument("--ablation", action="store_true")
    args = parser.parse_args()
    if args.sessions < 1 or args.seconds < 1:
        parser.error("--sessions and --seconds must be at least 1")

    model_dir = registry.prepare("silero-vad", progress=not args.json)
    package_dir, _ = registry.resolve_source(registry.get_spec("silero-vad").source)
    vad = SileroVad(model_dir)
    audio = load_audio(args.seconds)
    seconds = len(audio) / RATE

    single = bench_mlx_single(vad, audio)
    batched = bench_mlx_batched(vad, audio, args.sessions)
    behind = bench_mlx_behind(vad, audio, args.sessions, args.behind)
    session = onnx_session(package_dir)
    ort_single = bench_onnx(session, audio, 1)
    ort_batched = bench_onnx(session, audio, args.sessions)
    result: dict[str, object] = {
        "rtf_single": round(single.wall / seconds, 5),
        "rtf_single_cpu": round(single.cpu / seconds, 5),
        "streams_per_core_batched": round(args.sessions * seconds / batched.cpu, 1),
        "streams_realtime_batched_wall": round(args.sessions * seconds / batched.wall, 1),
        "streams_per_core_behind": round(args.sessions * seconds / behind.cpu, 1),
        "behind_seconds": args.behind,
        "batched_step_ms": round(1000 * batched.wall / (len(audio) // CHUNK), 3),
        "onnxruntime_rtf_single": round(ort_single.wall / seconds, 5),
        "onnxruntime_streams_per_core_batched": round(args.sessions * seconds / ort_batched.cpu, 1),
        "sessions": args.sessions,
        "audio_seconds_per_stream": round(seconds, 2),
        "block_size": vad.block_size,
    }
    if args.ablation:
        result["ablation"] = ablation(vad, session, audio[: int(min(seconds, 15) * RATE)])
    if args.json:
        print(json.dumps(result))
    else:
        for key, value in result.items():
            print(f"{key:40} {value}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
