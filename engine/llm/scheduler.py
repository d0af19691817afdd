"""The LLM stage's scheduler: which requests wait, prefill or decode, within the KV
budget and each step's prefill budget, and when decoding can wait for speech.

Rules of this file:
1. A request is in exactly one of `waiting` (a heap ordered by `Request.__lt__`),
   `prefilling` (its own per-layer KV cache, filled a chunk at a time) or `running`
   (a row of the model runner's batched KV cache, in the batch's row order). `seqs`
   holds every live request.
2. The KV budget counts the KV of every prefilling and running request. A request is
   admitted only when its prompt fits; when the running rows' next tokens would not
   fit, the live request that sorts last is preempted back to `waiting` with no KV.
3. Speech pacing (`set_runway`): the orchestrator tells the stage how many seconds of
   speech each request already has queued for its listener. While every running row has
   more than AHEAD_S queued and no prompt waits, the stage's work is `deferrable`: the
   engine thread steps it only when no other stage of its lane has work, so text no one
   can speak yet never delays audio someone is about to need.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from engine.llm.prompt_cache import PromptCache
from engine.llm.sequence import LlmSequence
from engine.runtime.request import Request, RequestStatus, SamplingParams

__all__ = ["AHEAD_S", "PREFILL_AGEING_TOKENS_PER_S", "PrefillPlan", "Scheduler"]

# The KV depth at which a long prompt's prefill slice is half its full size (`_slice_at`).
SLICE_HALVING_DEPTH = 512
# A row whose listener has more than this much speech queued (seconds) is not decoded
# further while no row is short of it (rule 3): text it could not speak yet. Generous:
# once due, a row's next clause takes tens of decode steps, each behind a TTS step, so a
# small margin (6 s was measured) lets a lone speaker's audio run dry on a loaded CPU.
AHEAD_S = 20.0
# Prefill ageing: each second a prompt has waited counts as this many fewer tokens left to
# prefill, so a long prompt is eventually first even under a steady stream of short ones.
PREFILL_AGEING_TOKENS_PER_S = 64


@dataclass
class PrefillPlan:
    """One step's prefill: either the next slice of one prompt (`slice`: the request and
    how many tokens), or the last chunks of the prompts that finish, in padded groups."""

    slice: tuple[LlmSequence, int] | None = None
    groups: list[list[LlmSequence]] = field(default_factory=list)


class Scheduler:
    """The queues of the LLM stage's live requests and the budgets that move them."""

    def __init__(
        self,
        *,
        max_running_sequences: int,
        prefill_chunk_tokens: int,
        prefill_slice_tokens: int,
        max_kv_tokens: int | None,
        prompt_cache: PromptCache,
        new_kv: Callable[[], list[Any]],
        clock: Callable[[], float],
    ) -> None:
        self.max_running_sequences = max_running_sequences
        self.prefill_chunk_tokens = prefill_chunk_tokens
        self.prefill_slice_tokens = prefill_slice_tokens
        self.max_kv_tokens = max_kv_tokens
        self.prompt_cache = prompt_cache
        self._new_kv = new_kv  # an empty per-layer KV cache for a prompt not in the cache
        self._clock = clock
        self.seqs: dict[str, LlmSequence] = {}
        self.waiting: list[Request] = []
        self.prefilling: list[LlmSequence] = []
        self.running: list[LlmSequence] = []
        self.num_preemptions = 0

    # --- requests ------------------------------------------------------------------

    def check_fits(self, prompt: Sequence[int], params: SamplingParams) -> None:
        need = len(prompt) + params.max_tokens
        if self.max_kv_tokens is not None and need > self.max_kv_tokens:
            raise ValueError(
                f"prompt ({len(prompt)}) + max_tokens ({params.max_tokens}) exceeds the "
                f"KV budget of {self.max_kv_tokens} tokens"
            )

    def add(self, seq: LlmSequence) -> None:
        self.seqs[seq.req.request_id] = seq
        heapq.heappush(self.waiting, seq.req)

    def unqueue(self, seq: LlmSequence) -> None:
        """Take a request that is not running out of its queue (an abort); the KV of a
        prefilling one goes to the prompt cache."""
        if seq in self.prefilling:
            self.prefilling.remove(seq)
            self.release(seq, seq.layers)
        elif seq.req in self.waiting:
            self.waiting.remove(seq.req)
            heapq.heapify(self.waiting)
        # Else a step raised between its prefill and the batch: nothing holds it.

    def forget_request(self, seq: LlmSequence) -> None:
        del self.seqs[seq.req.request_id]

    def release(self, seq: LlmSequence, layers: list[Any]) -> None:
        """Hand a session-keyed request's KV to the prompt cache, recorded with exactly
        the tokens it covers."""
        if seq.cache_key is None or not layers:
            return
        kv_len = layers[0].offset
        if kv_len > 0:
            self.prompt_cache.put(seq.cache_key, seq.tokens[:kv_len], layers)

    # --- admission -----------------------------------------------------------------

    def admit(self) -> None:
        while self.waiting and self._live_slots() < self.max_running_sequences:
            seq = self.seqs[self.waiting[0].request_id]
            if not self._kv_fits(len(seq.tokens)):
                return
            heapq.heappop(self.waiting)
            self._start_prefill(seq)

    def _start_prefill(self, seq: LlmSequence) -> None:
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
            seq.layers = self._new_kv()
            req.num_computed_tokens = 0
            req.cache_hit_type = "miss" if seq.cache_key is not None else None
        if not req.output_token_ids:  # a resumed request keeps its first-turn count
            req.cached_tokens = req.num_computed_tokens
        req.prompt_cache = seq.layers
        self.prefilling.append(seq)

    def _live_slots(self) -> int:
        return len(self.prefilling) + len(self.running)

    def kv_in_use(self) -> int:
        return sum(s.kv_tokens for s in self.prefilling) + sum(s.kv_tokens for s in self.running)

    def _kv_fits(self, extra: int) -> bool:
        return self.max_kv_tokens is None or self.kv_in_use() + extra <= self.max_kv_tokens

    # --- prefill -------------------------------------------------------------------

    def schedule_prefill(self, budget: int) -> PrefillPlan:
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
        if budget <= 0 or not self.prefilling:
            return PrefillPlan()
        now = self._clock()

        def aged_rest(seq: LlmSequence) -> float:
            waited = now - seq.added_at
            return len(seq.tokens) - seq.kv_tokens - PREFILL_AGEING_TOKENS_PER_S * waited

        shortest_first = sorted(self.prefilling, key=aged_rest)
        last: list[LlmSequence] = []
        for seq in shortest_first:
            todo = len(seq.tokens) - seq.kv_tokens
            if todo > min(budget, self.prefill_slice_tokens):
                break
            last.append(seq)
            budget -= todo
        if not last:
            seq = shortest_first[0]
            return PrefillPlan(slice=(seq, min(budget, self._slice_at(seq.kv_tokens))))
        return PrefillPlan(groups=self._padded_groups(last))

    def _slice_at(self, depth: int) -> int:
        """The most one forward prefills of a prompt whose KV holds `depth` tokens: the
        full slice up front, half of it at SLICE_HALVING_DEPTH, never below a quarter."""
        scaled = self.prefill_slice_tokens * SLICE_HALVING_DEPTH // (SLICE_HALVING_DEPTH + depth)
        return max(self.prefill_slice_tokens // 4, scaled, 1)

    def _padded_groups(self, seqs: list[LlmSequence]) -> list[list[LlmSequence]]:
        """Split last chunks into groups whose padded size (rows x longest chunk) stays
        within one chunk, so a long chunk never makes short ones pay for its length."""
        groups: list[list[LlmSequence]] = []
        width = 0
        for seq in sorted(seqs, key=lambda s: s.kv_tokens - len(s.tokens)):
            n = len(seq.tokens) - seq.kv_tokens
            if groups and (len(groups[-1]) + 1) * width <= self.prefill_chunk_tokens:
                groups[-1].append(seq)
            else:
                groups.append([seq])
                width = n
        return groups

    def end_prefill(self, seq: LlmSequence) -> None:
        self.prefilling.remove(seq)

    def start_running(
        self, group: list[LlmSequence], row_kv: Callable[[int], list[Any]]
    ) -> list[int]:
        """`group` has prefilled and its first tokens are out: the rows (indices into
        `group`) that go on running, in order. A request that already finished hands its
        KV (`row_kv(row)`) to the prompt cache instead."""
        keep = []
        for row, seq in enumerate(group):
            if seq.req.is_finished():
                self.release(seq, row_kv(row))
                self.forget_request(seq)
            else:
                keep.append(row)
        for row in keep:
            seq = group[row]
            seq.req.prompt_cache = None
            seq.req.remaining_tokens = []
            self.running.append(seq)
        return keep

    # --- running rows --------------------------------------------------------------

    def drop_running(self, rows: list[int], row_kv: Callable[[int], list[Any]] | None) -> list[int]:
        """Remove `rows` of `running`; with `row_kv`, session KV goes to the prompt cache.
        Returns the rows that stay, in order."""
        for row in rows:
            seq = self.running[row]
            if row_kv is not None and seq.cache_key is not None:
                self.release(seq, row_kv(row))
            if seq.req.is_finished():
                self.forget_request(seq)
        dropped = set(rows)
        keep = [i for i in range(len(self.running)) if i not in dropped]
        self.running = [self.running[i] for i in keep]
        return keep

    def preemption_victim(self) -> LlmSequence | None:
        """The live request to preempt before this step's decode, if the budget needs one."""
        # Each running row grows by one token this step; preempt the live request that
        # sorts last (lowest priority, latest arrival) until the budget holds.
        if self._live_slots() > 1 and not self._kv_fits(len(self.running)):
            return max(self.running + self.prefilling, key=lambda s: s.req)
        return None

    def preempt(self, seq: LlmSequence) -> None:
        """Send `seq` back to waiting with no KV (its batch row, if any, is gone already)."""
        if seq in self.prefilling:
            self.prefilling.remove(seq)
            seq.layers = []
        seq.req.status = RequestStatus.PREEMPTED
        seq.req.num_computed_tokens = 0
        seq.req.prompt_cache = None
        heapq.heappush(self.waiting, seq.req)
        self.num_preemptions += 1

    # --- speech pacing -------------------------------------------------------------

    def set_runway(self, request_id: str, seconds: float) -> None:
        """Rule 3: `request_id`'s listener has `seconds` of speech queued (audio not yet
        played and text not yet spoken). Unknown ids (finished a moment ago) are ignored."""
        seq = self.seqs.get(request_id)
        if seq is not None:
            seq.speech_until = self._clock() + seconds

    def deferrable(self) -> bool:
        """Rule 3: only rows with speech enough queued, and no prompt waiting."""
        if self.waiting or self.prefilling or not self.running:
            return False
        return not self._decode_due()

    def _decode_due(self) -> bool:
        """Whether some running row is short of speech (rows without a runway always are)."""
        now = self._clock()
        return any(self._ahead_by(seq, now) <= 0 for seq in self.running)

    @staticmethod
    def _ahead_by(seq: LlmSequence, now: float) -> float:
        if seq.speech_until is None:
            return 0.0
        return seq.speech_until - now - AHEAD_S
