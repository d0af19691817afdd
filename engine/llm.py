"""The LLM stage: a scheduler and continuous-batching decode over mlx-lm models (llama
models load with the engine's own model file, `engine.models.llama`).

Rules of this file:
1. A request is in exactly one of `_waiting` (a heap ordered by `Request.__lt__`),
   `_prefilling` (its own per-layer KV cache, filled a chunk at a time) or `_running`
   (a row of the shared batched KV cache). `_seqs` holds every live request.
2. Every running row has one pending decode input in `_pending`. Either it is the row's
   last recorded token (`unread` false: the row just joined, its KV covers
   `tokens[:-1]`), or it was drawn by the decode step still in flight and the host has
   not read it yet (`unread` true: the KV covers all of `tokens`). The next step feeds
   `_pending` to the model and launches that forward before it reads the old tokens,
   so the CPU computes while the host detokenizes, checks stops and hands outputs out.
3. Prefill's last chunk ends with the last prompt token and samples the next one from
   its logits, so a request's first token costs no forward of its own. Requests whose
   last chunk falls in the same step share one padded forward. New, cached and
   preempted requests all enter the batch the same way, which is why a resumed
   request continues exactly where it stopped.
5. A request with tools (`LlmInput.tools`) sees them in its prompt, and its reply goes
   through a `CallReader`: a call comes out as `tool_calls` deltas, never as text. Its
   `CallMask` logits processor (`engine.grammar`) keeps the call valid; it is one more
   per-row processor, so constrained and free rows share the batch.
6. Speech pacing (`set_runway`): the orchestrator tells the stage how many seconds of
   speech each request already has queued for its listener. While every running row has
   more than AHEAD_S queued and no prompt waits, the stage's work is `deferrable`: the
   engine thread steps it only when no other stage of its lane has work, so text no one
   can speak yet never delays audio someone is about to need.
4. Abort, finish and preemption free the KV at once and drop the row's pending token
   unread, so nothing drawn past a finish or an abort is ever emitted; a preempted row
   also gets its random key back, so its resumed draw repeats the dropped one. A
   session-keyed request hands its KV to the prompt cache instead, recorded with
   exactly the tokens that KV covers.
"""

from __future__ import annotations

import dataclasses
import heapq
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

import mlx.core as mx
from mlx_lm.models.cache import BatchKVCache, KVCache, make_prompt_cache

from engine import gemv_forward
from engine.context import ContextFitter, ContextLimits
from engine.detokenizer import StreamingDetokenizer
from engine.prompt_cache import PromptCache, common_prefix_length
from engine.request import Request, RequestOutput, RequestStatus, SamplingParams, ToolCallDelta
from engine.sampling import RowSampler, new_key, sample_batch
from engine.stage import StageOutput
from engine.tool_calls import CallReader, template_messages

__all__ = ["AHEAD_S", "PREFILL_AGEING_TOKENS_PER_S", "LlmInput", "LlmStage", "SHARED_PREFIX_KEY"]

log = logging.getLogger(__name__)

# The prompt-cache key of the system-prompt prefix every new session copies; the NUL
# keeps it apart from any session key.
SHARED_PREFIX_KEY = "\x00shared-prefix"
# The KV depth at which a long prompt's prefill slice is half its full size (`_slice_at`).
SLICE_HALVING_DEPTH = 512
# A row whose listener has more than this much speech queued (seconds) is not decoded
# further while no row is short of it (rule 6): text it could not speak yet. Generous:
# once due, a row's next clause takes tens of decode steps, each behind a TTS step, so a
# small margin (6 s was measured) lets a lone speaker's audio run dry on a loaded CPU.
AHEAD_S = 20.0
# Prefill ageing: each second a prompt has waited counts as this many fewer tokens left to
# prefill, so a long prompt is eventually first even under a steady stream of short ones.
PREFILL_AGEING_TOKENS_PER_S = 64


@dataclass
class LlmInput:
    """One generation request: a token prompt or chat messages, and how to sample.

    `cache_key` names the conversation whose KV is reused between turns (None: no
    reuse). `priority`: lower is admitted first, as in `Request.__lt__`. `truncate`:
    messages over the stage's context limit lose their oldest history instead of
    failing the request (`engine.context`); with `retention_ratio` they lose enough to
    use that share of the limit (or of `post_instructions_tokens` after the system
    message, when given).
    `messages`, `tools` and `tool_choice` are in the chat-completions shape: messages may
    carry `tool_calls` or be `tool` results; `tools` are `function` tools, and
    `tool_choice` is "auto", "none", "required" or `{"type": "function", "function":
    {"name": ...}}`. `parallel_tool_calls` goes to a remote server as it is; the local
    model writes at most one call per reply whatever it says.
    """

    prompt_token_ids: list[int] | None = None
    messages: list[dict[str, Any]] | None = None
    sampling_params: SamplingParams = field(default_factory=SamplingParams)
    cache_key: str | None = None
    priority: int = 0
    truncate: bool = True
    retention_ratio: float | None = None
    post_instructions_tokens: int | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] = "auto"
    parallel_tool_calls: bool | None = None

    @property
    def offered_tools(self) -> list[dict[str, Any]]:
        """The tools the model may call: none with "none", the named one when forced."""
        if not self.tools or self.tool_choice == "none":
            return []
        if isinstance(self.tool_choice, dict):
            name = self.tool_choice["function"]["name"]
            return [t for t in self.tools if t["function"]["name"] == name]
        return list(self.tools)

    @property
    def forces_call(self) -> bool:
        return self.tool_choice == "required" or isinstance(self.tool_choice, dict)


@dataclass(eq=False)
class _Seq:
    req: Request
    tokens: list[int]  # prompt + output so far
    sampler: RowSampler
    detok: StreamingDetokenizer
    cache_key: str | None
    calls: CallReader | None = None  # with tools: reads calls out of the reply (rule 5)
    layers: list[Any] = field(default_factory=list)  # per-layer KV while prefilling
    unread: bool = False  # its `_pending` token was drawn but not yet recorded
    rewind_key: mx.array | None = None  # its sampler key before that draw
    added_at: float = 0.0  # stage clock at `add`
    speech_until: float | None = None  # stage clock when its queued speech runs out (rule 6)

    @property
    def kv_tokens(self) -> int:
        return self.req.num_computed_tokens


class LlmStage:
    """Continuous-batching text generation; payloads are `RequestOutput` deltas."""

    name = "llm"

    def __init__(
        self,
        model: Any,
        tokenizer: Any,
        *,
        max_running_sequences: int = 8,
        max_tokens_per_step: int = 2048,
        prefill_chunk_tokens: int = 512,
        prefill_slice_tokens: int = 64,
        max_kv_tokens: int | None = None,
        prompt_cache_bytes: int = 256 * 1024 * 1024,
        context_limits: ContextLimits | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if min(max_running_sequences, prefill_chunk_tokens, prefill_slice_tokens) < 1:
            raise ValueError(
                "max_running_sequences, prefill_chunk_tokens and prefill_slice_tokens must be >= 1"
            )
        if max_tokens_per_step <= max_running_sequences:
            raise ValueError("max_tokens_per_step must exceed max_running_sequences")
        self.model = model
        self.tokenizer = tokenizer
        self.max_running_sequences = max_running_sequences
        self.max_tokens_per_step = max_tokens_per_step
        self.prefill_chunk_tokens = prefill_chunk_tokens
        self.prefill_slice_tokens = min(prefill_slice_tokens, prefill_chunk_tokens)
        self.max_kv_tokens = max_kv_tokens
        self._clock = clock
        self.prompt_cache = PromptCache(prompt_cache_bytes)
        self._context = None if context_limits is None else self._fitter(context_limits)
        self._eos = set(getattr(tokenizer, "eos_token_ids", None) or ())
        self._check_plain_kv()
        self._seqs: dict[str, _Seq] = {}
        self._waiting: list[Request] = []
        self._prefilling: list[_Seq] = []
        self._running: list[_Seq] = []
        self._batch: list[BatchKVCache] | None = None
        self._pending: mx.array | None = None  # (running,) next decode inputs
        self._call_grammar: Any = None  # engine.grammar.CallGrammar, built on first use
        self.num_preemptions = 0
        # Tokens computed so far (read by /metrics from another thread: values only change).
        self.token_counts = {"prefill": 0, "decode": 0}

    @classmethod
    def from_path(cls, path: str | Path, **limits: Any) -> LlmStage:
        from engine.models.llama import load

        model, tokenizer = load(path)
        # Weights dequantized from 4- and 8-bit blocks (the embedded model's) get their
        # compact twins: decode steps read a fraction of the bytes, with equal results.
        compact = gemv_forward.compress(model)
        if compact:
            log.info("LLM weights with compact twins: %s", compact)
        return cls(model, tokenizer, **limits)

    def _fitter(self, limits: ContextLimits) -> ContextFitter:
        tokenizer = self.tokenizer
        return ContextFitter(
            limits,
            count_text=lambda text: len(tokenizer.encode(text, add_special_tokens=False)),
            max_token_bytes=max(len(t.encode()) for t in tokenizer.get_vocab()),
        )

    def _check_plain_kv(self) -> None:
        if not all(type(c) is KVCache for c in make_prompt_cache(self.model)):
            raise ValueError("LlmStage supports models whose every layer uses a plain KVCache")

    # --- Stage interface -----------------------------------------------------------

    def add(self, request_id: str, inputs: LlmInput) -> None:
        if request_id in self._seqs:
            raise ValueError(f"request {request_id!r} is already live")
        if not isinstance(inputs, LlmInput):
            raise ValueError(f"LlmStage takes LlmInput, got {type(inputs).__name__}")
        prompt = self._prompt_ids(inputs)
        params = inputs.sampling_params
        self._check_fits(prompt, params)
        tools = inputs.offered_tools
        if tools:
            mask = self._grammar().mask(tools, len(prompt), forced=inputs.forces_call)
            processors = [*(params.logits_processors or []), mask]
            params = dataclasses.replace(params, logits_processors=processors)
        req = Request(request_id, prompt, params, priority=inputs.priority)
        sampler = RowSampler(params, prompt, req.output_token_ids, new_key(params.seed))
        detok = StreamingDetokenizer(self.tokenizer.decode, params.stop)
        seq = _Seq(req, list(prompt), sampler, detok, inputs.cache_key, added_at=self._clock())
        seq.calls = CallReader() if tools else None
        self._seqs[request_id] = seq
        heapq.heappush(self._waiting, req)

    def _grammar(self) -> Any:
        if self._call_grammar is None:
            from engine.grammar import CallGrammar

            hf = getattr(self.tokenizer, "_tokenizer", self.tokenizer)
            self._call_grammar = CallGrammar(hf, sorted(self._eos))
        return self._call_grammar

    def abort(self, request_id: str) -> None:
        seq = self._seqs.get(request_id)
        if seq is None:
            return
        if seq in self._running:
            self._drop_rows([self._running.index(seq)])
        elif seq in self._prefilling:
            self._prefilling.remove(seq)
            self._release(seq, seq.layers)
        else:
            self._waiting.remove(seq.req)
            heapq.heapify(self._waiting)
        seq.req.set_finished(RequestStatus.FINISHED_ABORTED)
        del self._seqs[request_id]

    def has_work(self) -> bool:
        return bool(self._seqs)

    def step(self) -> list[StageOutput]:
        self._admit()
        outputs = self._prefill(self.max_tokens_per_step - len(self._running))
        if not self._running:
            return outputs
        self._make_room()
        if not self._running:
            return outputs
        return outputs + self._decode()

    def set_runway(self, request_id: str, seconds: float) -> None:
        """Rule 6: `request_id`'s listener has `seconds` of speech queued (audio not yet
        played and text not yet spoken). Unknown ids (finished a moment ago) are ignored."""
        seq = self._seqs.get(request_id)
        if seq is not None:
            seq.speech_until = self._clock() + seconds

    def deferrable(self) -> bool:
        """Rule 6: only rows with speech enough queued, and no prompt waiting."""
        if self._waiting or self._prefilling or not self._running:
            return False
        return not self._decode_due()

    def _decode_due(self) -> bool:
        """Whether some running row is short of speech (rows without a runway always are)."""
        now = self._clock()
        return any(self._ahead_by(seq, now) <= 0 for seq in self._running)

    @staticmethod
    def _ahead_by(seq: _Seq, now: float) -> float:
        if seq.speech_until is None:
            return 0.0
        return seq.speech_until - now - AHEAD_S

    def stats(self) -> dict[str, int]:
        return {
            "waiting": len(self._waiting),
            "prefilling": len(self._prefilling),
            "running": len(self._running),
            "kv_tokens": self._kv_in_use(),
            "prompt_cache_entries": len(self.prompt_cache),
            "prompt_cache_bytes": self.prompt_cache.nbytes,
            "preemptions": self.num_preemptions,
        }

    def cache_stats(self) -> dict[str, tuple[int | None, int]]:
        """(entries, bytes) of the stage's KV: the prompt cache between turns, and the
        live requests' KV (read by /metrics from another thread: no lock, a snapshot)."""
        batch = self._batch
        live = sum(layer.nbytes for layer in batch or ())
        for seq in list(self._prefilling):
            live += sum(layer.nbytes for layer in list(seq.layers))
        return {
            "llm_prompt_cache": (len(self.prompt_cache), self.prompt_cache.nbytes),
            "llm_live_kv": (len(self._seqs), live),
        }

    def request(self, request_id: str) -> Request | None:
        seq = self._seqs.get(request_id)
        return seq.req if seq else None

    def cache_shared_prefix(self, system_prompt: str) -> int:
        """Prefill the tokens every conversation under `system_prompt` starts with and
        keep their KV in the prompt cache, so a new session's first turn only prefills
        its own message. Returns the prefix length in tokens."""
        probes = [
            self._prompt_ids(LlmInput(messages=[{"role": "system", "content": system_prompt}, m]))
            for m in ({"role": "user", "content": "a"}, {"role": "user", "content": "b"})
        ]
        # Where two different user messages part is where the shared template ends.
        tokens = probes[0][: common_prefix_length(*probes)]
        if not tokens:
            return 0
        layers = make_prompt_cache(self.model)
        for start in range(0, len(tokens), self.prefill_chunk_tokens):
            self._forward_layers(layers, tokens[start : start + self.prefill_chunk_tokens])
        self.prompt_cache.put(SHARED_PREFIX_KEY, tokens, layers, pinned=True)
        return len(tokens)

    def forget(self, cache_key: str) -> None:
        """The conversation under `cache_key` is over: drop its cached KV, and keep none
        of a request of it that is still live (its abort may be processed later)."""
        if cache_key == SHARED_PREFIX_KEY:
            return
        for seq in self._seqs.values():
            if seq.cache_key == cache_key:
                seq.cache_key = None
        self.prompt_cache.discard(cache_key)

    # --- admission -----------------------------------------------------------------

    def _prompt_ids(self, inputs: LlmInput) -> list[int]:
        if (inputs.prompt_token_ids is None) == (inputs.messages is None):
            raise ValueError("LlmInput needs exactly one of prompt_token_ids or messages")
        if inputs.messages is not None:
            tools = inputs.offered_tools
            messages = inputs.messages
            if self._context is not None:
                messages = self._context.fit(
                    messages,
                    truncate=inputs.truncate,
                    count_prompt=lambda fitted: len(self._templated(fitted, tools)),
                    retention_ratio=inputs.retention_ratio,
                    post_instructions_tokens=inputs.post_instructions_tokens,
                )
            ids = self._templated(messages, tools)
        else:
            ids = [int(t) for t in inputs.prompt_token_ids or ()]
        vocab = self.model.args.vocab_size if hasattr(self.model, "args") else None
        if not ids:
            raise ValueError("prompt is empty")
        if vocab is not None and not all(0 <= t < vocab for t in ids):
            raise ValueError(f"prompt token ids must be in [0, {vocab})")
        return ids

    def _templated(
        self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None
    ) -> list[int]:
        template = self.tokenizer.apply_chat_template
        shown = template_messages(messages, tools or [])
        return [int(t) for t in template(shown, add_generation_prompt=True, tokenize=True)]

    def _check_fits(self, prompt: Sequence[int], params: SamplingParams) -> None:
        need = len(prompt) + params.max_tokens
        if self.max_kv_tokens is not None and need > self.max_kv_tokens:
            raise ValueError(
                f"prompt ({len(prompt)}) + max_tokens ({params.max_tokens}) exceeds the "
                f"KV budget of {self.max_kv_tokens} tokens"
            )

    def _admit(self) -> None:
        while self._waiting and self._live_slots() < self.max_running_sequences:
            seq = self._seqs[self._waiting[0].request_id]
            if not self._kv_fits(len(seq.tokens)):
                return
            heapq.heappop(self._waiting)
            self._start_prefill(seq)

    def _start_prefill(self, seq: _Seq) -> None:
        req = seq.req
        req.status = RequestStatus.RUNNING
        hit = None
        if seq.cache_key is not None:
            hit = self.prompt_cache.take(seq.cache_key, seq.tokens)
        if hit is not None:
            seq.layers = hit.layers
            req.num_computed_tokens = hit.num_tokens
            req.cache_hit_type = hit.hit_type
        else:
            seq.layers = make_prompt_cache(self.model)
            req.num_computed_tokens = 0
            req.cache_hit_type = "miss" if seq.cache_key is not None else None
        if not req.output_token_ids:  # a resumed request keeps its first-turn count
            req.cached_tokens = req.num_computed_tokens
        req.prompt_cache = seq.layers
        self._prefilling.append(seq)

    def _live_slots(self) -> int:
        return len(self._prefilling) + len(self._running)

    def _kv_in_use(self) -> int:
        return sum(s.kv_tokens for s in self._prefilling) + sum(s.kv_tokens for s in self._running)

    def _kv_fits(self, extra: int) -> bool:
        return self.max_kv_tokens is None or self._kv_in_use() + extra <= self.max_kv_tokens

    # --- prefill -------------------------------------------------------------------

    def _prefill(self, budget: int) -> list[StageOutput]:
        """Fair prefill: one session's long prompt must not hold up everyone else.

        A forward cannot be interrupted, so a request that arrives mid-step waits for
        the whole step. Measured on the embedded SmolLM2 on the CPU (bench/fairness.py):
        a 512-token chunk of a 2,000-token prompt took up to 3.7 s, a short turn's whole
        prefill about 0.15 s. Hence:
        - No forward prefills more than `prefill_slice_tokens` of one request (64), and
          fewer as its KV grows (`_slice_at`): attention over a longer cache makes each
          token dearer, so a short turn arriving deep into a long prefill would otherwise
          wait for a slice several times dearer than one near its start
          (`bench/fairness.py --arrive-after 1500` measures that wait).
        - Shortest remaining prefill first: requests whose rest fits in a slice finish
          first, sharing padded forwards up to one chunk in all (a burst of short
          turns still starts in one step); otherwise the shortest one advances a slice.
          A new short turn's first token thus waits for at most the slice in flight
          when it arrived, and a long prompt gets every step in which nothing shorter
          waits.
        - Ageing: every second a request has waited counts as PREFILL_AGEING_TOKENS_PER_S
          fewer tokens left, so even a steady stream of short turns cannot hold a long
          prompt back for ever: once aged past them it advances a slice per step.
        """
        budget = min(budget, self.prefill_chunk_tokens)
        if budget <= 0 or not self._prefilling:
            return []
        now = self._clock()

        def aged_rest(seq: _Seq) -> float:
            waited = now - seq.added_at
            return len(seq.tokens) - seq.kv_tokens - PREFILL_AGEING_TOKENS_PER_S * waited

        shortest_first = sorted(self._prefilling, key=aged_rest)
        last: list[_Seq] = []
        for seq in shortest_first:
            todo = len(seq.tokens) - seq.kv_tokens
            if todo > min(budget, self.prefill_slice_tokens):
                break
            last.append(seq)
            budget -= todo
        if not last:
            seq = shortest_first[0]
            size = min(budget, self._slice_at(seq.kv_tokens))
            self._forward_layers(seq.layers, seq.tokens[seq.kv_tokens : seq.kv_tokens + size])
            self._computed(seq, size)
        outputs: list[StageOutput] = []
        for group in self._padded_groups(last):
            outputs += self._prefill_last(group)
        return outputs

    def _slice_at(self, depth: int) -> int:
        """The most one forward prefills of a prompt whose KV holds `depth` tokens: the
        full slice up front, half of it at SLICE_HALVING_DEPTH, never below a quarter."""
        scaled = self.prefill_slice_tokens * SLICE_HALVING_DEPTH // (SLICE_HALVING_DEPTH + depth)
        return max(self.prefill_slice_tokens // 4, scaled, 1)

    def _padded_groups(self, seqs: list[_Seq]) -> list[list[_Seq]]:
        """Split last chunks into groups whose padded size (rows x longest chunk) stays
        within one chunk, so a long chunk never makes short ones pay for its length."""
        groups: list[list[_Seq]] = []
        width = 0
        for seq in sorted(seqs, key=lambda s: s.kv_tokens - len(s.tokens)):
            n = len(seq.tokens) - seq.kv_tokens
            if groups and (len(groups[-1]) + 1) * width <= self.prefill_chunk_tokens:
                groups[-1].append(seq)
            else:
                groups.append([seq])
                width = n
        return groups

    def _computed(self, seq: _Seq, n: int) -> None:
        self.token_counts["prefill"] += n
        seq.req.num_computed_tokens += n
        seq.req.remaining_tokens = seq.tokens[seq.kv_tokens : len(seq.tokens) - 1]

    def _prefill_last(self, group: list[_Seq]) -> list[StageOutput]:
        """Prefill the last chunks of `group` in one forward, sample each sequence's
        next token from its last position, and move the survivors into the batch."""
        chunks = [seq.tokens[seq.kv_tokens :] for seq in group]
        per_layer = zip(*(seq.layers for seq in group), strict=True)
        cache = [BatchKVCache.merge(list(layer)) for layer in per_layer]
        logits = self._last_logits(cache, chunks)
        samplers = [seq.sampler for seq in group]
        tokens = sample_batch(logits, samplers)
        mx.eval(tokens, [s.key for s in samplers], [c.state for c in cache])
        now = time.time()
        outputs = []
        for seq, chunk, token in zip(group, chunks, _ints(tokens), strict=True):
            self._prefilling.remove(seq)
            seq.layers = []
            self._computed(seq, len(chunk))
            outputs.append(self._output(seq, token, now, seq.sampler.error))
        self._join_batch(group, cache)
        return outputs

    def _last_logits(self, cache: list[BatchKVCache], chunks: list[list[int]]) -> mx.array:
        """Forward `chunks` (one per row of `cache`) and return each row's logits at its
        last token. Rows of unequal length are padded so that the mask hides the pads."""
        lengths = [len(c) for c in chunks]
        width = max(lengths)
        pads = [width - n for n in lengths]
        if cache[0].empty():
            # No KV yet: pad before the prompts, so every row ends at the same position.
            for c in cache:
                c.prepare(left_padding=pads)
            tokens = [[0] * p + c for c, p in zip(chunks, pads, strict=True)]
            last = [width - 1] * len(chunks)
        else:
            # Pad after each row's tokens, right behind its own KV; finalize() then rolls
            # the pads' KV to the left, where the mask hides it.
            for c in cache:
                c.prepare(right_padding=pads)
            tokens = [c + [0] * p for c, p in zip(chunks, pads, strict=True)]
            last = [n - 1 for n in lengths]
        logits = self._logits_at(mx.array(tokens), cache, mx.array(last)[:, None, None])
        for c in cache:
            c.finalize()
        return logits

    def _logits_at(self, tokens: mx.array, cache: list[Any], positions: mx.array) -> mx.array:
        """Logits (B, V) at one position per row; the LM head runs on those rows only."""
        body = getattr(self.model, "model", None)
        args = getattr(self.model, "args", None)
        if body is None or args is None:
            logits = self.model(tokens, cache=cache)
            return mx.take_along_axis(logits, positions, axis=1)[:, 0, :]
        hidden = mx.take_along_axis(body(tokens, cache=cache), positions, axis=1)
        if getattr(args, "tie_word_embeddings", False):
            return body.embed_tokens.as_linear(hidden)[:, 0, :]
        return self.model.lm_head(hidden)[:, 0, :]

    def _forward_layers(self, layers: list[Any], chunk: list[int]) -> None:
        body = getattr(self.model, "model", self.model)  # skip the LM head: no logits needed
        hidden = body(mx.array([chunk]), cache=layers)
        mx.eval(hidden, [c.state for c in layers])

    def _join_batch(self, group: list[_Seq], cache: list[BatchKVCache]) -> None:
        """Move `group`'s rows of `cache` into the running batch; the rows of requests
        that already finished hand their KV to the prompt cache instead."""
        keep = []
        for row, seq in enumerate(group):
            if seq.req.is_finished():
                self._release(seq, [c.extract(row) for c in cache])
                del self._seqs[seq.req.request_id]
            else:
                keep.append(row)
        if not keep:
            return
        if len(keep) < len(group):
            for c in cache:
                c.filter(keep)
        joined = [group[row] for row in keep]
        inputs = mx.array([seq.tokens[-1] for seq in joined], dtype=mx.uint32)
        if self._batch is None or self._pending is None:
            self._batch, self._pending = cache, inputs
        else:
            for batch, rows in zip(self._batch, cache, strict=True):
                batch.extend(rows)
            self._pending = mx.concatenate([self._pending, inputs])
        for seq in joined:
            seq.req.prompt_cache = None
            seq.req.remaining_tokens = []
            seq.unread = False
            self._running.append(seq)

    # --- decode --------------------------------------------------------------------

    def _make_room(self) -> None:
        # Each running row grows by one token this step; preempt the live request that
        # sorts last (lowest priority, latest arrival) until the budget holds.
        while self._live_slots() > 1 and not self._kv_fits(len(self._running)):
            self._preempt(max(self._running + self._prefilling, key=lambda s: s.req))

    def _preempt(self, seq: _Seq) -> None:
        if seq in self._running:
            self._drop_rows([self._running.index(seq)], keep_kv=False)
            if seq.unread:  # its draw is dropped; resuming draws it again, identically
                assert seq.rewind_key is not None  # saved before every draw
                seq.sampler.key = seq.rewind_key
                seq.unread = False
        else:
            self._prefilling.remove(seq)
            seq.layers = []
        seq.req.status = RequestStatus.PREEMPTED
        seq.req.num_computed_tokens = 0
        seq.req.prompt_cache = None
        heapq.heappush(self._waiting, seq.req)
        self.num_preemptions += 1

    def _decode(self) -> list[StageOutput]:
        """Launch the forward of the pending inputs, then record the inputs that were
        drawn by the previous step (reading them waits for that step only)."""
        assert self._pending is not None and self._batch is not None
        running, inputs = list(self._running), self._pending
        unread = [seq.unread for seq in running]
        errors = [seq.sampler.error for seq in running]  # before this step's processors
        for seq in running:
            seq.rewind_key = seq.sampler.key
        pending = [inputs[i : i + 1] if u else None for i, u in enumerate(unread)]
        logits = self.model(inputs[:, None], cache=self._batch)[:, -1, :]
        self.token_counts["decode"] += len(running)
        drawn = sample_batch(logits, [seq.sampler for seq in running], pending)
        mx.async_eval(drawn, [seq.sampler.key for seq in running])
        tokens = _ints(inputs) if any(unread) else []
        self._pending = drawn
        now = time.time()
        outputs, done = [], []
        for row, seq in enumerate(running):
            seq.unread = True
            if not unread[row]:
                continue  # its input is the token prefill already emitted
            outputs.append(self._output(seq, tokens[row], now, errors[row]))
            if seq.req.is_finished():
                done.append(row)
        if done:
            self._drop_rows(done)
        return outputs

    def _output(self, seq: _Seq, token: int, now: float, error: Exception | None) -> StageOutput:
        if error is not None:
            return self._fail(seq, error)
        out = self._advance(seq, token, now)
        metrics = self._metrics(seq.req, now) if out.finished else {}
        return StageOutput(seq.req.request_id, out, out.finished, metrics=metrics)

    def _fail(self, seq: _Seq, exc: Exception) -> StageOutput:
        # Only this request failed (its logits processor raised); the batch goes on.
        seq.req.set_finished(RequestStatus.FINISHED_ABORTED, "error")
        error = f"logits processor failed: {type(exc).__name__}: {exc}"
        return StageOutput(seq.req.request_id, None, finished=True, error=error)

    @staticmethod
    def _metrics(req: Request, now: float) -> dict[str, float]:
        first = req.first_token_time or now
        return {
            "ttft_s": first - req.arrival_time,
            "e2e_s": now - req.arrival_time,
            "decode_tok_s": (req.num_output_tokens - 1) / max(now - first, 1e-9),
        }

    def _advance(self, seq: _Seq, token: int, now: float) -> RequestOutput:
        req, params = seq.req, seq.req.sampling_params
        req.append_output_token(token)
        seq.tokens.append(token)
        if req.first_token_time is None:
            req.first_token_time = now
        status = None
        if token in self._eos or token in params.stop_token_ids:
            status = RequestStatus.FINISHED_STOPPED
            delta = seq.detok.finish()
        else:
            delta = seq.detok.push([token])
            if seq.detok.stopped:
                status = RequestStatus.FINISHED_STOPPED
            elif req.num_output_tokens >= params.max_tokens:
                status = RequestStatus.FINISHED_LENGTH_CAPPED
                delta += seq.detok.finish()
        req.output_text = seq.detok.text
        calls: list[ToolCallDelta] = []
        reason = None
        if seq.calls is not None:
            delta, calls = seq.calls.push(delta)
            if status is not None:
                rest, last = seq.calls.finish()
                delta, calls = delta + rest, calls + last
                reason = "tool_calls" if seq.calls.called else None
        if status is not None:
            req.set_finished(status, reason)
        return RequestOutput(
            request_id=req.request_id,
            new_token_ids=[token],
            new_text=delta,
            tool_calls=calls,
            output_token_ids=list(req.output_token_ids),
            output_text=req.output_text,
            finished=status is not None,
            finish_reason=req.get_finish_reason() if status is not None else None,
            prompt_tokens=req.num_prompt_tokens,
            completion_tokens=req.num_output_tokens,
            cached_tokens=req.cached_tokens,
        )

    def _drop_rows(self, rows: list[int], keep_kv: bool = True) -> None:
        """Remove batch rows; with `keep_kv`, session KV goes to the prompt cache."""
        assert self._batch is not None
        for row in rows:
            seq = self._running[row]
            if keep_kv and seq.cache_key is not None:
                self._release(seq, [batch.extract(row) for batch in self._batch])
            if seq.req.is_finished():
                del self._seqs[seq.req.request_id]
        dropped = set(rows)
        keep = [i for i in range(len(self._running)) if i not in dropped]
        self._running = [self._running[i] for i in keep]
        if not keep:
            self._batch = self._pending = None
            mx.clear_cache()
            return
        for batch in self._batch:
            batch.filter(keep)
        assert self._pending is not None
        self._pending = self._pending[mx.array(keep)]  # drawn tokens of dropped rows: unread

    def _release(self, seq: _Seq, layers: list[Any]) -> None:
        if seq.cache_key is None or not layers:
            return
        kv_len = layers[0].offset
        if kv_len > 0:
            self.prompt_cache.put(seq.cache_key, seq.tokens[:kv_len], layers)


def _ints(tokens: mx.array) -> list[int]:
    """A 1-D array of token ids as a list."""
    # mlx types `tolist` for arrays of any rank and dtype; this one is 1-D integers.
    return cast("list[int]", tokens.tolist())
