"""The LLM stage's model runner: the forwards that prefill prompts and decode the
running rows, and the batched KV cache those rows share.

Rules of this file:
1. Every row of `batch` has one pending decode input in `pending`. Either it is the
   row's last recorded token (`unread` false: the row just joined, its KV covers
   `tokens[:-1]`), or it was drawn by the decode step still in flight and the host has
   not read it yet (`unread` true: the KV covers all of `tokens`). The next step feeds
   `pending` to the model and launches that forward before it reads the old tokens,
   so the CPU computes while the host detokenizes, checks stops and hands outputs out.
2. Prefill's last chunk ends with the last prompt token and samples the next one from
   its logits, so a request's first token costs no forward of its own. Requests whose
   last chunk falls in the same step share one padded forward. New, cached and
   preempted requests all enter the batch the same way, which is why a resumed
   request continues exactly where it stopped.
3. A dropped row's pending token is never read, so nothing drawn past a finish or an
   abort is ever emitted; a preempted row gets its random key back (`rewind`), so its
   resumed draw repeats the dropped one.
4. A prefill forward of this project's own model class (`engine.models.llama`) calls
   `pause` between its layers: on a CPU such a forward of a large model takes seconds,
   and an urgent request of another lane must not wait for it
   (`engine.runtime.urgency`). Decode steps are short and run whole.
5. Where the model is this project's llama class and the native step builds
   (`engine.native.llama_step`), a decode step is one C call over the same batched KV
   cache; it needs the step's input tokens on the host, so it waits for the step before
   to finish drawing them, where MLX's step would chain onto that draw.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, cast

import mlx.core as mx
from mlx_lm.models.cache import BatchKVCache, KVCache, make_prompt_cache

from engine.llm.sampling import sample_batch
from engine.llm.sequence import LlmSequence
from engine.models.llama import LlamaModel, Model

__all__ = ["ModelRunner", "SampledToken"]

# A row's token read back from the decode step before, and the error its logits
# processor raised then (None: it ran cleanly).
SampledToken = tuple[int, Exception | None]


class ModelRunner:
    """Runs the model over the LLM stage's prefilling requests and running batch."""

    def __init__(self, model: Any) -> None:
        self.model = model
        self.pause: Callable[[], None] | None = None  # rule 4
        self._check_plain_kv()
        # The decode step as one native call where it can run (rule 5).
        self._native = model.native_step() if isinstance(model, Model) else None
        self.native_step = self._native
        self.batch: list[BatchKVCache] | None = None
        self.pending: mx.array | None = None  # (running,) next decode inputs
        # Tokens computed so far (read by /metrics from another thread: values only change).
        self.token_counts = {"prefill": 0, "decode": 0}

    def _check_plain_kv(self) -> None:
        if not all(type(c) is KVCache for c in self.new_kv()):
            raise ValueError("LlmStage supports models whose every layer uses a plain KVCache")

    def use_native_step(self, on: bool) -> None:
        """Decode steps as one native call where the model has one (True), or as MLX
        operations (for side-by-side timing and checks)."""
        self.native_step = self._native if on else None

    def new_kv(self) -> list[Any]:
        """An empty per-layer KV cache for one prompt."""
        return make_prompt_cache(self.model)

    # --- prefill -------------------------------------------------------------------

    def prefill_kv(self, tokens: list[int], chunk_tokens: int) -> list[Any]:
        """The KV of `tokens`, prefilled `chunk_tokens` at a time."""
        layers = self.new_kv()
        for start in range(0, len(tokens), chunk_tokens):
            self._forward_layers(layers, tokens[start : start + chunk_tokens])
        return layers

    def prefill_slice(self, seq: LlmSequence, size: int) -> None:
        """Prefill the next `size` prompt tokens of `seq` into its own KV."""
        self._forward_layers(seq.layers, seq.tokens[seq.kv_tokens : seq.kv_tokens + size])
        self._computed(seq, size)

    def prefill_last(self, group: list[LlmSequence]) -> tuple[list[BatchKVCache], list[int]]:
        """Prefill the last chunks of `group` in one forward and sample each sequence's
        next token from its last position (rule 2). Returns the group's KV, one row per
        sequence, and the tokens; `end_prefill` then records each sequence's chunk."""
        chunks = [seq.tokens[seq.kv_tokens :] for seq in group]
        per_layer = zip(*(seq.layers for seq in group), strict=True)
        cache = [BatchKVCache.merge(list(layer)) for layer in per_layer]
        logits = self._last_logits(cache, chunks)
        samplers = [seq.sampler for seq in group]
        tokens = sample_batch(logits, samplers)
        mx.eval(tokens, [s.key for s in samplers], [c.state for c in cache])
        return cache, _ints(tokens)

    def end_prefill(self, seq: LlmSequence) -> None:
        """`seq`'s last chunk is in the KV `prefill_last` returned, not in its own."""
        chunk = len(seq.tokens) - seq.kv_tokens
        seq.layers = []
        self._computed(seq, chunk)

    def _computed(self, seq: LlmSequence, n: int) -> None:
        self.token_counts["prefill"] += n
        seq.req.num_computed_tokens += n
        seq.req.remaining_tokens = seq.tokens[seq.kv_tokens : len(seq.tokens) - 1]

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
        hidden = mx.take_along_axis(self._prefill_body(body, tokens, cache), positions, axis=1)
        if getattr(args, "tie_word_embeddings", False):
            return body.embed_tokens.as_linear(hidden)[:, 0, :]
        return self.model.lm_head(hidden)[:, 0, :]

    def _forward_layers(self, layers: list[Any], chunk: list[int]) -> None:
        body = getattr(self.model, "model", self.model)  # skip the LM head: no logits needed
        hidden = self._prefill_body(body, mx.array([chunk]), layers)
        mx.eval(hidden, [c.state for c in layers])

    def _prefill_body(self, body: Any, tokens: mx.array, cache: list[Any]) -> mx.array:
        """The model body's hidden states over prompt `tokens` (rule 4)."""
        if self.pause is not None and isinstance(body, LlamaModel):
            return body(tokens, cache=cache, pause=self.pause)
        return cast(mx.array, body(tokens, cache=cache))

    # --- the running batch ---------------------------------------------------------

    def join_batch(
        self, group: list[LlmSequence], cache: list[BatchKVCache], keep: list[int]
    ) -> None:
        """Append the `keep` rows of `cache` (`group`'s KV from `prefill_last`) to the
        running batch; each one's pending input is its last token, already recorded."""
        if not keep:
            return
        if len(keep) < len(group):
            for c in cache:
                c.filter(keep)
        joined = [group[row] for row in keep]
        inputs = mx.array([seq.tokens[-1] for seq in joined], dtype=mx.uint32)
        if self.batch is None or self.pending is None:
            self.batch, self.pending = cache, inputs
        else:
            for batch, rows in zip(self.batch, cache, strict=True):
                batch.extend(rows)
            self.pending = mx.concatenate([self.pending, inputs])
        for seq in joined:
            seq.unread = False

    def decode(self, rows: list[LlmSequence]) -> list[SampledToken | None]:
        """Launch the forward of the pending inputs of `rows` (the batch's, in order),
        then read the inputs that the previous step drew (reading them waits for that
        step only). A row whose input prefill already emitted reads None."""
        assert self.pending is not None and self.batch is not None
        inputs = self.pending
        unread = [seq.unread for seq in rows]
        errors = [seq.sampler.error for seq in rows]  # before this step's processors
        for seq in rows:
            seq.rewind_key = seq.sampler.key
        pending = [inputs[i : i + 1] if u else None for i, u in enumerate(unread)]
        tokens = _ints(inputs) if any(unread) or self.native_step is not None else []
        if self.native_step is not None:
            logits = self.native_step.logits(tokens, self.batch)
        else:
            logits = self.model(inputs[:, None], cache=self.batch)[:, -1, :]
        self.token_counts["decode"] += len(rows)
        drawn = sample_batch(logits, [seq.sampler for seq in rows], pending)
        mx.async_eval(drawn, [seq.sampler.key for seq in rows])
        self.pending = drawn
        for seq in rows:
            seq.unread = True
        return [
            (tokens[row], errors[row]) if was_unread else None
            for row, was_unread in enumerate(unread)
        ]

    def row_kv(self, row: int) -> list[Any]:
        """A copy of one batch row's per-layer KV."""
        assert self.batch is not None
        return [batch.extract(row) for batch in self.batch]

    def keep_rows(self, keep: list[int]) -> None:
        """Keep only the `keep` rows of the batch; the others' drawn tokens stay unread."""
        assert self.batch is not None
        if not keep:
            self.batch = self.pending = None
            if self.native_step is not None:
                self.native_step.forget()
            mx.clear_cache()
            return
        for batch in self.batch:
            batch.filter(keep)
        assert self.pending is not None
        self.pending = self.pending[mx.array(keep)]

    @staticmethod
    def rewind(seq: LlmSequence) -> None:
        """Rule 3: `seq`'s row is gone; resuming draws its dropped token again, identically."""
        if seq.unread:
            assert seq.rewind_key is not None  # saved before every draw
            seq.sampler.key = seq.rewind_key
            seq.unread = False


def _ints(tokens: mx.array) -> list[int]:
    """A 1-D array of token ids as a list."""
    # mlx types `tolist` for arrays of any rank and dtype; this one is 1-D integers.
    return cast("list[int]", tokens.tolist())
