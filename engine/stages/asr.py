"""Speech to text: Whisper transcription with an utterance-length encoder, and the ASR stage.

The encoder runs on the utterance plus a short pad instead of Whisper's fixed 30 s window.
Naively trimmed windows make greedy decoding loop or stop early, because the decoder was
trained to see the whole window, mostly silence after the speech. So the decoder is given a
full window anyway: the trimmed encoder output followed by the encoder output of a silent
window (computed once at load), which is what the full window's tail looks like.

Safeguards, since trimming changes what the decoder sees: a token cap from the duration,
repeated n-gram detection, and a fall-back to a longer, then the full, window when a
transcript looks broken. Audio over 30 s is split at quiet points and transcribed in parts.
The first window is never shorter than `MIN_WINDOW_S`: on a clip of about a second, a
window of utterance + 1 s misheard the last word where the full window did not.

An `AsrRequest` can force the start of the transcript (`prefix`, run through the decoder
in the same pass as the start tokens), give Whisper the previous text (`prompt`), ask for
each token's log-probability, and mark itself `partial` (live, speculative work run only
when no final transcript waits, in one try) or `greedy` (never a beam search).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING

import mlx.core as mx
import numpy as np
from tokenizers import Tokenizer

from engine.llm.decoding_loops import collapse_loop, repeated_tail
from engine.models import whisper
from engine.native import gemv_forward
from engine.runtime.stage import StageOutput
from engine.stages.asr_beam import log_softmax, run_beam_search
from engine.stages.asr_request import (
    NOT_SCORED,
    AsrRequest,
    Transcription,
    check_audio,
    merge_parts,
    split_long_audio,
)

if TYPE_CHECKING:
    from engine.listening.live_transcript import LiveTranscript

__all__ = [
    "NOT_SCORED",
    "AsrRequest",
    "AsrStage",
    "Transcriber",
    "Transcription",
    "load_transcriber",
    "split_long_audio",
]

SAMPLE_RATE = whisper.SAMPLE_RATE
MIN_SECONDS = 0.1  # shorter audio holds no word: answer "" without running the model
WINDOW_BUCKET_FRAMES = 50  # round windows up so requests in a batch share encoder calls
TOKENS_PER_SECOND_CAP = 8.0  # fast speech is ~5 tokens/s with punctuation
MIN_TOKENS_PER_SECOND = 0.5  # fewer on a long utterance means decoding stopped early
EARLY_STOP_MIN_SECONDS = 4.0
MIN_WINDOW_S = 4.0  # the first window of a short clip: the decoder needs room after it
PARTIAL_PAD_S = 0.5  # pad of a partial request's window
PREFIX_SLACK_TOKENS = 8  # a forced prefix may use up the duration's cap: still decode a few


@dataclass
class _Job:
    audio: np.ndarray
    duration_s: float
    context: list[int]  # the decoder's start: previous text, then the start tokens
    prefix: list[int] = field(default_factory=list)
    logprobs: bool = False
    partial: bool = False
    greedy: bool = False  # whatever `beam_size` (partials, quick checks)
    attempts: int = 0
    tokens: list[int] = field(default_factory=list)
    scores: list[float] = field(default_factory=list)
    frames: int = 0
    broken: str | None = None


@dataclass
class _Decoded:
    tokens: list[int]  # the forced prefix, then the decoded tokens
    scores: list[float]  # their log-probabilities when asked, else empty
    broken: str | None  # why decoding stopped short, or None


class Transcriber:
    """Whisper transcription of 16 kHz mono float32 audio: greedy, or with `beam_size` > 1
    a beam search for final transcripts not marked greedy (`engine.stages.asr_beam`)."""

    def __init__(
        self,
        model: whisper.Model,
        tokenizer: Tokenizer,
        config: dict,
        *,
        pad_s: float = 1.0,
        fallback_pad_s: float = 5.0,
        silence_tail: bool = True,
        min_window_s: float = MIN_WINDOW_S,
        beam_size: int = 1,
    ):
        if pad_s < 0 or fallback_pad_s < pad_s or beam_size < 1:
            raise ValueError("need 0 <= pad_s <= fallback_pad_s and beam_size >= 1")
        self.beam_size = beam_size
        self.model = model
        self.tokenizer = tokenizer
        self.eot = config["eot_id"]
        # Conversions older than the multilingual start tokens name only these two.
        self.prompt = config.get("start_ids", [config["sot_id"], config["no_timestamps_id"]])
        self.start_of_prev = tokenizer.token_to_id("<|startofprev|>")
        self.max_tokens = model.args.n_text_ctx // 2 - len(self.prompt)
        # Whisper's own limit on previous text: the other half of the text context.
        self.max_prompt_tokens = model.args.n_text_ctx // 2 - 1
        suppress = np.zeros(model.args.n_vocab, np.float32)
        suppress[config["suppress_ids"]] = -np.inf
        self.suppress = suppress
        self.suppress_first = suppress.copy()
        self.suppress_first[config["suppress_ids_begin"]] = -np.inf
        self._embedding = model.decoder.token_embedding.weight
        self.pads = (pad_s, fallback_pad_s)
        self.min_window_s = min_window_s
        self._silence_kv = self._encode_silence() if silence_tail else None

    # --- public API ---

    def transcribe(self, audio: np.ndarray) -> str:
        return self.transcribe_detailed(audio).text

    def transcribe_detailed(self, audio: np.ndarray) -> Transcription:
        return self.transcribe_batch([audio])[0]

    def transcribe_batch(self, audios: list[np.ndarray]) -> list[Transcription]:
        """Transcribe several utterances, sharing encoder and decoder passes."""
        return self.transcribe_requests([AsrRequest(audio) for audio in audios])

    def transcribe_requests(self, requests: list[AsrRequest]) -> list[Transcription]:
        """Transcribe several requests in shared passes. Audio over 30 s is split: the
        prefix starts the first part, the prompt goes before every part."""
        jobs_per_request = [self._jobs(r) for r in requests]
        flat = [job for jobs in jobs_per_request for job in jobs]
        done = self._transcribe_parts(flat)
        results, i = [], 0
        for jobs in jobs_per_request:
            duration = sum(job.duration_s for job in jobs)
            results.append(merge_parts(done[i : i + len(jobs)], duration))
            i += len(jobs)
        return results

    def decode(self, tokens: Sequence[int]) -> str:
        """The text of `tokens`, as is: leading space and partial characters included."""
        return self.tokenizer.decode(list(tokens))

    def check(self, request: AsrRequest) -> AsrRequest:
        """The request with checked audio; ValueError for what cannot be transcribed."""
        if any(not 0 <= t < self.eot for t in request.prefix):
            raise ValueError("ASR prefix tokens must be text tokens of the model")
        if len(request.prefix) > self.max_tokens - PREFIX_SLACK_TOKENS:
            raise ValueError(f"ASR prefix is longer than {self.max_tokens} tokens")
        if not isinstance(request.prompt, str):
            raise ValueError("ASR prompt must be a string")
        return replace(request, audio=check_audio(request.audio))

    # --- attempts ---

    def _jobs(self, request: AsrRequest) -> list[_Job]:
        request = self.check(request)
        context = self._context(request.prompt)
        parts = split_long_audio(request.audio)
        return [
            _Job(
                audio=part,
                duration_s=len(part) / SAMPLE_RATE,
                context=context,
                prefix=list(request.prefix) if i == 0 else [],
                logprobs=request.logprobs,
                partial=request.partial,
                greedy=request.partial or request.greedy,
            )
            for i, part in enumerate(parts)
        ]

    def _context(self, prompt: str) -> list[int]:
        if not prompt.strip():
            return list(self.prompt)
        ids = self.tokenizer.encode(" " + prompt.strip(), add_special_tokens=False).ids
        return [self.start_of_prev, *ids[-self.max_prompt_tokens :], *self.prompt]

    def _transcribe_parts(self, jobs: list[_Job]) -> list[Transcription]:
        pending = [j for j in jobs if j.duration_s >= MIN_SECONDS]
        for window in self._ladder():
            # A rung that would not widen a job's window cannot fix it: skip to the next.
            wider = [j for j in pending if window(j) > j.frames]
            if wider:
                self._attempt(wider, window)
            # A partial transcript is live guesswork: it gets one try, never a wider one.
            pending = [j for j in pending if j.broken is not None and not j.partial]
        return [self._result(j) for j in jobs]

    def _ladder(self) -> list[Callable[[_Job], int]]:
        # Window size in mel frames per attempt: utterance + pad (at least the minimum
        # window), + fallback pad, full.
        first, fallback = self.pads

        def first_rung(job: _Job) -> int:
            # A partial transcript is re-made many times while the utterance grows: its
            # encoder pass, the bulk of its cost, gets a shorter pad. Not a shorter
            # minimum: its words are committed, and a short window mishears the first
            # ones ("for me then" for "The meeting").
            pad = PARTIAL_PAD_S if job.partial else first
            return _bucket(max(job.duration_s + pad, self.min_window_s))

        return [
            first_rung,
            lambda job: _bucket(job.duration_s + fallback),
            lambda job: whisper.N_FRAMES,
        ]

    def _attempt(self, jobs: list[_Job], window: Callable[[_Job], int]) -> None:
        frames = [window(j) for j in jobs]
        cross_kv = self._cross_kv(jobs, frames)
        # The full window is the last resort: there, loops are cut rather than retried.
        finals = [n == whisper.N_FRAMES or j.partial for j, n in zip(jobs, frames, strict=True)]
        outs = self._search(cross_kv, jobs, stop_on_loop=[not f for f in finals])
        for job, n, final, out in zip(jobs, frames, finals, outs, strict=True):
            job.attempts += 1
            job.frames = n
            tokens, reason = out.tokens, out.broken
            if final and reason is not None:
                tokens, reason = collapse_loop(tokens, keep=len(job.prefix)), None
            if reason is None and self._stopped_early(job, tokens) and not final:
                reason = "too few tokens"
            job.tokens, job.scores, job.broken = tokens, out.scores[: len(tokens)], reason

    def _token_cap(self, duration_s: float, prefix: int = 0) -> int:
        cap = max(int(10 + TOKENS_PER_SECOND_CAP * duration_s), prefix + PREFIX_SLACK_TOKENS)
        return min(self.max_tokens, cap)

    @staticmethod
    def _stopped_early(job: _Job, tokens: list[int]) -> bool:
        if job.duration_s < EARLY_STOP_MIN_SECONDS:
            return False
        return len(tokens) < MIN_TOKENS_PER_SECOND * job.duration_s

    def _result(self, job: _Job) -> Transcription:
        if not job.attempts:  # too short to hold a word: the forced prefix
            job.tokens = list(job.prefix)
            job.scores = [NOT_SCORED] * len(job.tokens) if job.logprobs else []
        text = self.decode(job.tokens).strip()
        return Transcription(text, job.tokens, job.frames, job.attempts, job.duration_s, job.scores)

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

    def _search(
        self, cross_kv: list[tuple[mx.array, mx.array]], jobs: list[_Job], stop_on_loop: list[bool]
    ) -> list[_Decoded]:
        """Greedy in one batch (`_Job.greedy`, or all at `beam_size` 1); the rest by beams."""
        beams = [i for i, j in enumerate(jobs) if self.beam_size > 1 and not j.greedy]
        greedy = [i for i in range(len(jobs)) if i not in beams]
        outs: list[_Decoded | None] = [None] * len(jobs)
        if len(greedy) == len(jobs):
            return self._decode(cross_kv, jobs, stop_on_loop)
        if greedy:
            sel = mx.array(greedy, dtype=mx.int32)
            kv = [(k[sel], v[sel]) for k, v in cross_kv]
            done = self._decode(kv, [jobs[i] for i in greedy], [stop_on_loop[i] for i in greedy])
            for i, out in zip(greedy, done, strict=True):
                outs[i] = out
        for i in beams:
            outs[i] = self._beam(
                [(k[i : i + 1], v[i : i + 1]) for k, v in cross_kv], jobs[i], stop_on_loop[i]
            )
        return [out for out in outs if out is not None]

    def _beam(
        self, cross_kv: list[tuple[mx.array, mx.array]], job: _Job, stop_on_loop: bool
    ) -> _Decoded:
        best = run_beam_search(
            self.model.decoder,
            self._embedding,
            cross_kv,
            job.context,
            job.prefix,
            suppress=(self.suppress if job.prefix else self.suppress_first, self.suppress),
            beam_size=self.beam_size,
            eot=self.eot,
            cap=self._token_cap(job.duration_s, len(job.prefix)),
            stop_on_loop=stop_on_loop,
        )
        scores = [NOT_SCORED] * len(job.prefix) + best.logprobs if job.logprobs else []
        return _Decoded(best.tokens, scores, best.broken)

    def _decode(
        self, cross_kv: list[tuple[mx.array, mx.array]], jobs: list[_Job], stop_on_loop: list[bool]
    ) -> list[_Decoded]:
        """Batched greedy decoding after each job's context and forced prefix."""
        starts = [job.context + job.prefix for job in jobs]
        longest = max(len(s) for s in starts)
        pads_list = [longest - len(s) for s in starts]
        # Rows of different lengths are left-padded: their last tokens line up.
        x = mx.array([[0] * pad + s for pad, s in zip(pads_list, starts, strict=True)])
        pads = mx.array(pads_list) if any(pads_list) else None
        caps = [self._token_cap(job.duration_s, len(job.prefix)) for job in jobs]
        # Forced tokens were not chosen: scoring them would cost a vocabulary-wide
        # product per token, for numbers a live transcript already has.
        outs = [
            _Decoded(list(job.prefix), [NOT_SCORED] * len(job.prefix) if job.logprobs else [], None)
            for job in jobs
        ]
        cache = self.model.decoder.make_cache()
        last = self.model.decoder.hidden(x, cross_kv, cache, pads)[:, -1]
        suppress = np.stack([self.suppress if j.prefix else self.suppress_first for j in jobs])
        active = list(range(len(jobs)))
        while active:
            # One row per step: `engine.native.gemv_forward` streams the weights once for it.
            logits = np.array(last @ self._embedding.T) + suppress
            next_tokens = logits.argmax(axis=-1).tolist()
            scores = (
                _chosen_logprobs(logits, next_tokens)
                if any(jobs[i].logprobs for i in active)
                else None
            )
            keep = []
            for row, (i, t) in enumerate(zip(active, next_tokens, strict=True)):
                if t == self.eot:
                    continue
                out = outs[i]
                out.tokens.append(t)
                if scores is not None and jobs[i].logprobs:
                    out.scores.append(scores[row])
                if stop_on_loop[i] and repeated_tail(out.tokens):
                    out.broken = "repetition"
                elif len(out.tokens) >= caps[i]:
                    out.broken = "token cap"
                else:
                    keep.append(row)
            if not keep:
                break
            if len(keep) < len(active):
                sel = mx.array(keep, dtype=mx.int32)
                cross_kv = [(k[sel], v[sel]) for k, v in cross_kv]
                cache = [[k[sel], v[sel]] for k, v in cache]
                pads = pads[sel] if pads is not None else None
            active = [active[r] for r in keep]
            suppress = self.suppress
            x = mx.array([[outs[i].tokens[-1]] for i in active])
            last = self.model.decoder.hidden(x, cross_kv, cache, pads)[:, -1]
        return outs


def _chosen_logprobs(logits: np.ndarray, chosen: list[int]) -> list[float]:
    """log-softmax of each row at its chosen token."""
    picked = log_softmax(logits)[np.arange(len(chosen)), chosen]
    return picked.astype(float).tolist()


def _bucket(seconds: float) -> int:
    frames = int(np.ceil(seconds * whisper.FRAMES_PER_SECOND / WINDOW_BUCKET_FRAMES))
    return min(whisper.N_FRAMES, frames * WINDOW_BUCKET_FRAMES)


class AsrStage:
    """The engine's ASR stage: one request = one utterance, one finished transcript.

    `add(request_id, inputs)` takes float32 mono 16 kHz samples (the payload is then the
    transcript text) or an `AsrRequest` (the payload is then a `Transcription`). Each
    `step` transcribes one batch in shared encoder/decoder passes, oldest first: up to
    `max_batch` final requests while any waits, else up to `max_partial_batch` partial
    ones, so that live guesses never delay a finished turn by more than one step.
    """

    name = "asr"

    def __init__(self, transcriber: Transcriber, *, max_batch: int = 4, max_partial_batch: int = 4):
        if max_batch < 1 or max_partial_batch < 1:
            raise ValueError("max_batch and max_partial_batch must be at least 1")
        self.transcriber = transcriber
        self.max_batch = max_batch
        self.max_partial_batch = max_partial_batch
        self._finals: dict[str, AsrRequest] = {}
        self._partials: dict[str, AsrRequest] = {}
        self._plain: set[str] = set()  # requests given as bare audio: their payload is text

    def add(self, request_id: str, inputs: np.ndarray | AsrRequest) -> None:
        if request_id in self._finals or request_id in self._partials:
            raise ValueError(f"ASR request {request_id!r} is already waiting")
        if isinstance(inputs, np.ndarray):
            request = self.transcriber.check(AsrRequest(inputs))
            self._plain.add(request_id)
        elif isinstance(inputs, AsrRequest):
            request = self.transcriber.check(inputs)
        else:
            raise ValueError(
                f"ASR input must be a numpy array or an AsrRequest, got {type(inputs).__name__}"
            )
        (self._partials if request.partial else self._finals)[request_id] = request

    def abort(self, request_id: str) -> None:
        self._finals.pop(request_id, None)
        self._partials.pop(request_id, None)
        self._plain.discard(request_id)

    def has_work(self) -> bool:
        return bool(self._finals or self._partials)

    def new_live_transcript(self, prompt: str = "", logprobs: bool = False) -> LiveTranscript:
        """The policy for one utterance transcribed while it is spoken (runs anywhere:
        it only needs this stage's tokenizer)."""
        from engine.listening.live_transcript import (
            LiveTranscript,  # it builds this module's requests
        )

        return LiveTranscript(self.transcriber.decode, prompt=prompt, logprobs=logprobs)

    def step(self) -> list[StageOutput]:
        queue, size = (
            (self._finals, self.max_batch)
            if self._finals
            else (self._partials, self.max_partial_batch)
        )
        ids = list(queue)[:size]
        if not ids:
            return []
        requests = [queue.pop(i) for i in ids]
        plain = {i for i in ids if i in self._plain}
        self._plain -= plain
        start = time.perf_counter()
        try:
            results = self.transcriber.transcribe_requests(requests)
        except Exception as exc:  # a failed batch fails its requests, not the engine
            error = f"{type(exc).__name__}: {exc}"
            return [StageOutput(i, "", finished=True, error=error) for i in ids]
        asr_ms = (time.perf_counter() - start) * 1000
        return [
            StageOutput(
                i,
                r.text if i in plain else r,
                finished=True,
                metrics={"asr_ms": asr_ms, "audio_s": r.duration_s, "attempts": r.attempts},
            )
            for i, r in zip(ids, results, strict=True)
        ]


def load_transcriber(model_dir: Path, **options) -> Transcriber:
    """Load a converted Whisper directory (see `engine.models.whisper_ct2.convert`)."""
    model, config = whisper.load_model(Path(model_dir))
    # The decoder's products take one row a token: its float16 weights, held as fp32,
    # are read at half the bytes from 16-bit twins (the encoder's take hundreds of rows
    # and go to the BLAS whatever their weights).
    gemv_forward.compress(model.decoder)
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
