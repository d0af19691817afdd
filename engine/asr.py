"""Speech to text: Whisper transcription with an utterance-length encoder, and the ASR stage.

The encoder runs on the utterance plus a short pad instead of Whisper's fixed 30 s window.
Naively trimmed windows make greedy decoding loop or stop early, because the decoder was
trained to see the whole window, mostly silence after the speech. So the decoder is given a
full window anyway: the trimmed encoder output followed by the encoder output of a silent
window (computed once at load), which is what the full window's tail looks like.

Safeguards, since trimming changes what the decoder sees: a token cap from the duration,
repeated n-gram detection, and a fall-back to a longer, then the full, window when a
transcript looks broken. Audio over 30 s is split at quiet points and transcribed in parts.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import mlx.core as mx
import numpy as np
from tokenizers import Tokenizer

from engine.models import whisper
from engine.stage import StageOutput

__all__ = [
    "AsrStage",
    "Transcriber",
    "Transcription",
    "load_transcriber",
    "split_long_audio",
]

SAMPLE_RATE = whisper.SAMPLE_RATE
MIN_SECONDS = 0.1  # shorter audio holds no word: answer "" without running the model
CHUNK_MAX_SECONDS = 28.0  # parts of long audio leave room for the pad inside 30 s
WINDOW_BUCKET_FRAMES = 50  # round windows up so requests in a batch share encoder calls
TOKENS_PER_SECOND_CAP = 8.0  # fast speech is ~5 tokens/s with punctuation
MIN_TOKENS_PER_SECOND = 0.5  # fewer on a long utterance means decoding stopped early
EARLY_STOP_MIN_SECONDS = 4.0


@dataclass
class Transcription:
    text: str
    tokens: list[int]
    window_frames: int  # mel frames the encoder saw in the accepted attempt
    attempts: int  # 1 = the first (shortest) window was accepted
    duration_s: float


@dataclass
class _Job:
    audio: np.ndarray
    duration_s: float
    attempts: int = 0
    tokens: list[int] = field(default_factory=list)
    frames: int = 0
    broken: str | None = None


def repeated_tail(tokens: list[int], max_period: int = 16) -> int:
    """Length of the block the sequence ends by repeating in a loop, or 0.

    A block of 2+ tokens repeated 3 times, or one token repeated 5 times, counts.
    """
    n = len(tokens)
    for p in range(1, min(max_period, n // 3) + 1):
        need = 5 if p == 1 else 3
        if n < p * need:
            continue
        block = tokens[n - p :]
        if all(tokens[n - (k + 1) * p : n - k * p] == block for k in range(1, need)):
            return p
    return 0


def _collapse_loop(tokens: list[int]) -> list[int]:
    # Keep one copy of a block the decoder kept repeating until the cap.
    p = repeated_tail(tokens)
    while p:
        block = tokens[-p:]
        while tokens[-2 * p : -p] == block:
            tokens = tokens[:-p]
        p = repeated_tail(tokens)
    return tokens


def split_long_audio(audio: np.ndarray, max_s: float = CHUNK_MAX_SECONDS) -> list[np.ndarray]:
    """Split audio into parts of at most `max_s`, cutting at the quietest 20 ms frame of
    each part's last quarter so words are not cut in two."""
    max_len, hop = int(max_s * SAMPLE_RATE), SAMPLE_RATE // 50
    parts, start = [], 0
    while len(audio) - start > max_len:
        lo, hi = start + max_len * 3 // 4, start + max_len
        frames = audio[lo:hi][: (hi - lo) // hop * hop].reshape(-1, hop)
        cut = lo + int(np.argmin((frames**2).mean(axis=1))) * hop + hop // 2
        parts.append(audio[start:cut])
        start = cut
    parts.append(audio[start:])
    return parts


class Transcriber:
    """Greedy Whisper transcription of 16 kHz mono float32 audio."""

    def __init__(
        self,
        model: whisper.Model,
        tokenizer: Tokenizer,
        config: dict,
        *,
        pad_s: float = 1.0,
        fallback_pad_s: float = 5.0,
        silence_tail: bool = True,
    ):
        if pad_s < 0 or fallback_pad_s < pad_s:
            raise ValueError("need 0 <= pad_s <= fallback_pad_s")
        self.model = model
        self.tokenizer = tokenizer
        self.eot = config["eot_id"]
        self.prompt = [config["sot_id"], config["no_timestamps_id"]]
        self.max_tokens = model.args.n_text_ctx // 2 - len(self.prompt)
        suppress = np.zeros(model.args.n_vocab, np.float32)
        suppress[config["suppress_ids"]] = -np.inf
        self.suppress = suppress
        self.suppress_first = suppress.copy()
        self.suppress_first[config["suppress_ids_begin"]] = -np.inf
        self._embedding = model.decoder.token_embedding.weight
        self.pads = (pad_s, fallback_pad_s)
        self._silence_kv = self._encode_silence() if silence_tail else None

    # --- public API ---

    def transcribe(self, audio: np.ndarray) -> str:
        return self.transcribe_detailed(audio).text

    def transcribe_detailed(self, audio: np.ndarray) -> Transcription:
        return self.transcribe_batch([audio])[0]

    def transcribe_batch(self, audios: list[np.ndarray]) -> list[Transcription]:
        """Transcribe several utterances, sharing encoder and decoder passes."""
        audios = [_check_audio(a) for a in audios]
        parts = [split_long_audio(a) for a in audios]
        flat = [p for ps in parts for p in ps]
        done = self._transcribe_parts(flat)
        results, i = [], 0
        for audio, ps in zip(audios, parts, strict=True):
            results.append(_merge(done[i : i + len(ps)], len(audio) / SAMPLE_RATE))
            i += len(ps)
        return results

    # --- attempts ---

    def _transcribe_parts(self, audios: list[np.ndarray]) -> list[Transcription]:
        jobs = [self._job(a) for a in audios]
        pending = [j for j in jobs if j.duration_s >= MIN_SECONDS]
        for window in self._ladder():
            # A rung that would not widen a job's window cannot fix it: skip to the next.
            wider = [j for j in pending if window(j) > j.frames]
            if wider:
                self._attempt(wider, window)
            pending = [j for j in pending if j.broken is not None]
        return [self._result(j) for j in jobs]

    def _ladder(self) -> list[Callable[[_Job], int]]:
        # Window size in mel frames per attempt: utterance + pad, + fallback pad, full.
        def sized(pad: float) -> Callable[[_Job], int]:
            return lambda job: _bucket(job.duration_s + pad)

        return [sized(self.pads[0]), sized(self.pads[1]), lambda job: whisper.N_FRAMES]

    def _job(self, audio: np.ndarray) -> _Job:
        return _Job(audio=audio, duration_s=len(audio) / SAMPLE_RATE)

    def _attempt(self, jobs: list[_Job], window: Callable[[_Job], int]) -> None:
        frames = [window(j) for j in jobs]
        cross_kv = self._cross_kv(jobs, frames)
        caps = [self._token_cap(j.duration_s) for j in jobs]
        # The full window is the last resort: there, loops are cut rather than retried.
        finals = [n == whisper.N_FRAMES for n in frames]
        outs = self._decode(cross_kv, caps, stop_on_loop=[not f for f in finals])
        for job, n, final, (tokens, reason) in zip(jobs, frames, finals, outs, strict=True):
            job.attempts += 1
            job.frames = n
            if final and reason is not None:
                tokens, reason = _collapse_loop(tokens), None
            if reason is None and self._stopped_early(job, tokens) and not final:
                reason = "too few tokens"
            job.tokens, job.broken = tokens, reason

    def _token_cap(self, duration_s: float) -> int:
        return min(self.max_tokens, int(10 + TOKENS_PER_SECOND_CAP * duration_s))

    @staticmethod
    def _stopped_early(job: _Job, tokens: list[int]) -> bool:
        if job.duration_s < EARLY_STOP_MIN_SECONDS:
            return False
        return len(tokens) < MIN_TOKENS_PER_SECOND * job.duration_s

    def _result(self, job: _Job) -> Transcription:
        text = self.tokenizer.decode(job.tokens).strip() if job.tokens else ""
        return Transcription(text, job.tokens, job.frames, job.attempts, job.duration_s)

    # --- encoder ---

    def _encode_silence(self) -> list[tuple[mx.array, mx.array]]:
        mel = whisper.log_mel_spectrogram(np.zeros(0, np.float32), n_frames=whisper.N_FRAMES)
        features = self.model.encoder(mx.array(mel[None]))
        kv = self.model.decoder.cross_kv(features)
        mx.eval(kv)
        return kv

    def _cross_kv(self, jobs: list[_Job], frames: list[int]) -> list[tuple[mx.array, mx.array]]:
        """Per-layer cross-attention (keys, values) for the batch, each a full window."""
        per_job: list = [None] * len(jobs)
        for n in sorted(set(frames)):
            idx = [i for i, f in enumerate(frames) if f == n]
            mel = np.stack([whisper.log_mel_spectrogram(jobs[i].audio, n_frames=n) for i in idx])
            kv = self.model.decoder.cross_kv(self.model.encoder(mx.array(mel)))
            if self._silence_kv is not None and n < whisper.N_FRAMES:
                kv = _with_silence(kv, self._silence_kv)
            for row, i in enumerate(idx):
                per_job[i] = [(k[row : row + 1], v[row : row + 1]) for k, v in kv]
        layers = zip(*per_job, strict=True)
        return [
            (mx.concatenate([k for k, _ in lkv]), mx.concatenate([v for _, v in lkv]))
            for lkv in layers
        ]

    # --- decoder ---

    def _decode(
        self,
        cross_kv: list[tuple[mx.array, mx.array]],
        caps: list[int],
        stop_on_loop: list[bool],
    ) -> list[tuple[list[int], str | None]]:
        """Batched greedy decoding; returns (tokens, broken reason or None) per row."""
        B = len(caps)
        outs: list[list[int]] = [[] for _ in range(B)]
        reasons: list[str | None] = [None] * B
        active = list(range(B))
        cache = self.model.decoder.make_cache()
        x = mx.array([self.prompt] * B)
        suppress = self.suppress_first
        while active:
            # One row per step: `engine.gemv_forward` streams the weights once for it.
            logits = np.array(
                self.model.decoder.hidden(x, cross_kv, cache)[:, -1] @ self._embedding.T
            )
            logits += suppress
            suppress = self.suppress
            next_tokens = logits.argmax(axis=-1).tolist()
            keep = []
            for row, (i, t) in enumerate(zip(active, next_tokens, strict=True)):
                if t == self.eot:
                    continue
                outs[i].append(t)
                if stop_on_loop[i] and repeated_tail(outs[i]):
                    reasons[i] = "repetition"
                elif len(outs[i]) >= caps[i]:
                    reasons[i] = "token cap"
                else:
                    keep.append(row)
            if not keep:
                break
            if len(keep) < len(active):
                sel = mx.array(keep, dtype=mx.int32)
                cross_kv = [(k[sel], v[sel]) for k, v in cross_kv]
                cache = [[k[sel], v[sel]] for k, v in cache]
            active = [active[r] for r in keep]
            x = mx.array([[outs[i][-1]] for i in active])
        return list(zip(outs, reasons, strict=True))


def _bucket(seconds: float) -> int:
    frames = int(np.ceil(seconds * whisper.FRAMES_PER_SECOND / WINDOW_BUCKET_FRAMES))
    return min(whisper.N_FRAMES, frames * WINDOW_BUCKET_FRAMES)


def _check_audio(audio: np.ndarray) -> np.ndarray:
    audio = np.asarray(audio)
    if audio.ndim != 1:
        raise ValueError(f"audio must be mono (1-D), got shape {audio.shape}")
    if not np.issubdtype(audio.dtype, np.floating):
        raise ValueError(f"audio must be float samples in [-1, 1], got {audio.dtype}")
    audio = audio.astype(np.float32, copy=False)
    if not np.isfinite(audio).all():
        raise ValueError("audio contains NaN or infinite samples")
    return audio


def _merge(parts: list[Transcription], duration_s: float) -> Transcription:
    if len(parts) == 1:
        return parts[0]
    text = " ".join(p.text for p in parts if p.text)
    tokens = [t for p in parts for t in p.tokens]
    frames = max(p.window_frames for p in parts)
    return Transcription(text, tokens, frames, max(p.attempts for p in parts), duration_s)


class AsrStage:
    """The engine's ASR stage: one request = one utterance, one finished transcript.

    `add(request_id, audio)` takes float32 mono 16 kHz samples; each `step` transcribes up
    to `max_batch` waiting requests in shared encoder/decoder passes, oldest first.
    """

    name = "asr"

    def __init__(self, transcriber: Transcriber, *, max_batch: int = 4):
        if max_batch < 1:
            raise ValueError("max_batch must be at least 1")
        self.transcriber = transcriber
        self.max_batch = max_batch
        self._waiting: dict[str, np.ndarray] = {}

    def add(self, request_id: str, inputs: np.ndarray) -> None:
        if request_id in self._waiting:
            raise ValueError(f"ASR request {request_id!r} is already waiting")
        if not isinstance(inputs, np.ndarray):
            raise ValueError(f"ASR input must be a numpy array, got {type(inputs).__name__}")
        self._waiting[request_id] = _check_audio(inputs)

    def abort(self, request_id: str) -> None:
        self._waiting.pop(request_id, None)

    def has_work(self) -> bool:
        return bool(self._waiting)

    def step(self) -> list[StageOutput]:
        ids = list(self._waiting)[: self.max_batch]
        audios = [self._waiting.pop(i) for i in ids]
        if not ids:
            return []
        start = time.perf_counter()
        try:
            results = self.transcriber.transcribe_batch(audios)
        except Exception as exc:  # a failed batch fails its requests, not the engine
            error = f"{type(exc).__name__}: {exc}"
            return [StageOutput(i, "", finished=True, error=error) for i in ids]
        asr_ms = (time.perf_counter() - start) * 1000
        return [
            StageOutput(
                i,
                r.text,
                finished=True,
                metrics={"asr_ms": asr_ms, "audio_s": r.duration_s, "attempts": r.attempts},
            )
            for i, r in zip(ids, results, strict=True)
        ]


def load_transcriber(model_dir: Path, **options) -> Transcriber:
    """Load a converted Whisper directory (see `engine.models.whisper_ct2.convert`)."""
    model, config = whisper.load_model(Path(model_dir))
    tokenizer = Tokenizer.from_file(str(Path(model_dir) / "tokenizer.json"))
    return Transcriber(model, tokenizer, config, **options)


def _with_silence(
    kv: list[tuple[mx.array, mx.array]], silence: list[tuple[mx.array, mx.array]]
) -> list[tuple[mx.array, mx.array]]:
    """Each layer's keys/values continued with the silent window's from the same frame on."""
    out = []
    for (k, v), (sk, sv) in zip(kv, silence, strict=True):
        B, H, n, D = k.shape
        tail_k = mx.broadcast_to(sk[:, :, n:], (B, H, sk.shape[2] - n, D))
        tail_v = mx.broadcast_to(sv[:, :, n:], (B, H, sv.shape[2] - n, D))
        out.append((mx.concatenate([k, tail_k], 2), mx.concatenate([v, tail_v], 2)))
    return out
