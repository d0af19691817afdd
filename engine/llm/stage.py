"""The LLM stage: continuous-batching text generation over mlx-lm models (llama models
load with the engine's own model file, `engine.models.llama`).

The stage turns each input into a request and steps it through three collaborators:
its scheduler (`engine.llm.scheduler`: who waits, prefills, decodes or is preempted,
and when decoding can wait for speech), its model runner (`engine.llm.model_runner`:
the forwards and the batched KV cache) and its output processor
(`engine.llm.output_processor`: sampled tokens into outputs).

Rules of this file:
1. A request with tools (`LlmInput.tools`) sees them in its prompt, and its reply goes
   through a `CallReader`: a call comes out as `tool_calls` deltas, never as text. Its
   `CallMask` logits processor (`engine.llm.grammar`) keeps the call valid; it is one more
   per-row processor, so constrained and free rows share the batch.
2. Abort, finish and preemption free the KV at once and drop the row's pending token
   unread, so nothing drawn past a finish or an abort is ever emitted; a preempted row
   also gets its random key back, so its resumed draw repeats the dropped one. A
   session-keyed request hands its KV to the prompt cache instead, recorded with
   exactly the tokens that KV covers.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mlx_lm.models.cache import BatchKVCache

from engine.llm.context import ContextFitter, ContextLimits
from engine.llm.detokenizer import StreamingDetokenizer
from engine.llm.model_runner import ModelRunner
from engine.llm.output_processor import OutputProcessor
from engine.llm.prompt_cache import PromptCache, common_prefix_length
from engine.llm.sampling import RowSampler, new_key
from engine.llm.scheduler import AHEAD_S, PREFILL_AGEING_TOKENS_PER_S, Scheduler
from engine.llm.sequence import LlmSequence
from engine.llm.tool_calls import CallReader, native_messages, renders_tools, template_messages
from engine.native import gemv_forward
from engine.runtime.request import Request, RequestStatus, SamplingParams
from engine.runtime.stage import StageOutput

__all__ = ["AHEAD_S", "PREFILL_AGEING_TOKENS_PER_S", "LlmInput", "LlmStage", "SHARED_PREFIX_KEY"]

log = logging.getLogger(__name__)

# The prompt-cache key of the system-prompt prefix every new session copies; the NUL
# keeps it apart from any session key.
SHARED_PREFIX_KEY = "\x00shared-prefix"


@dataclass
class LlmInput:
    """One generation request: a token prompt or chat messages, and how to sample.

    `cache_key` names the conversation whose KV is reused between turns (None: no
    reuse). `priority`: lower is admitted first, as in `Request.__lt__`. `truncate`:
    messages over the stage's context limit lose their oldest history instead of
    failing the request (`engine.llm.context`); with `retention_ratio` they lose enough to
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
        call_threshold: float = 0.0,
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
        self.call_threshold = call_threshold
        self._clock = clock
        self.prompt_cache = PromptCache(prompt_cache_bytes)
        self._context = None if context_limits is None else self._fitter(context_limits)
        self._eos = set(getattr(tokenizer, "eos_token_ids", None) or ())
        self._runner = ModelRunner(model)
        self._scheduler = Scheduler(
            max_running_sequences=max_running_sequences,
            prefill_chunk_tokens=prefill_chunk_tokens,
            prefill_slice_tokens=self.prefill_slice_tokens,
            max_kv_tokens=max_kv_tokens,
            prompt_cache=self.prompt_cache,
            new_kv=self._runner.new_kv,
            clock=clock,
        )
        self._outputs = OutputProcessor(self._eos)
        self._call_grammar: Any = None  # engine.llm.grammar.CallGrammar, built on first use

    @classmethod
    def from_path(cls, path: str | Path, **limits: Any) -> LlmStage:
        from engine.models import llama

        model, tokenizer = llama.load(path)
        # Weights dequantized from 4- and 8-bit blocks (the embedded model's) get their
        # compact twins: decode steps read a fraction of the bytes. Groups the converter
        # kept are joined as the model's own projections are.
        groups = gemv_forward.load_groups(path)
        if isinstance(model, llama.Model):
            groups = llama.join_projections(groups)
        compact = gemv_forward.compress(model, groups)
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

    @property
    def num_preemptions(self) -> int:
        return self._scheduler.num_preemptions

    @property
    def token_counts(self) -> dict[str, int]:
        """Tokens computed so far (read by /metrics from another thread: values only change)."""
        return self._runner.token_counts

    # --- Stage interface -----------------------------------------------------------

    def add(self, request_id: str, inputs: LlmInput) -> None:
        if request_id in self._scheduler.seqs:
            raise ValueError(f"request {request_id!r} is already live")
        if not isinstance(inputs, LlmInput):
            raise ValueError(f"LlmStage takes LlmInput, got {type(inputs).__name__}")
        prompt = self._prompt_ids(inputs)
        params = inputs.sampling_params
        self._scheduler.check_fits(prompt, params)
        tools = inputs.offered_tools
        if tools:
            mask = self._grammar().mask(
                tools, len(prompt), forced=inputs.forces_call, call_threshold=self.call_threshold
            )
            processors = [*(params.logits_processors or []), mask]
            params = dataclasses.replace(params, logits_processors=processors)
        req = Request(request_id, prompt, params, priority=inputs.priority)
        sampler = RowSampler(params, prompt, req.output_token_ids, new_key(params.seed))
        detok = StreamingDetokenizer(self.tokenizer.decode, params.stop)
        seq = LlmSequence(
            req, list(prompt), sampler, detok, inputs.cache_key, added_at=self._clock()
        )
        seq.calls = CallReader() if tools else None
        self._scheduler.add(seq)

    def _grammar(self) -> Any:
        if self._call_grammar is None:
            from engine.llm.grammar import CallGrammar

            hf = getattr(self.tokenizer, "_tokenizer", self.tokenizer)
            self._call_grammar = CallGrammar(hf, sorted(self._eos))
        return self._call_grammar

    def abort(self, request_id: str) -> None:
        seq = self._scheduler.seqs.get(request_id)
        if seq is None:
            return
        if seq in self._scheduler.running:
            self._drop_rows([self._scheduler.running.index(seq)])
        else:
            self._scheduler.unqueue(seq)
        seq.req.set_finished(RequestStatus.FINISHED_ABORTED)
        self._scheduler.forget_request(seq)

    def has_work(self) -> bool:
        return bool(self._scheduler.seqs)

    def step(self) -> list[StageOutput]:
        self._scheduler.admit()
        outputs = self._prefill(self.max_tokens_per_step - len(self._scheduler.running))
        if not self._scheduler.running:
            return outputs
        self._make_room()
        if not self._scheduler.running:
            return outputs
        return outputs + self._decode()

    def give_way_with(self, pause: Callable[[], None] | None) -> None:
        """Call `pause` between the layers of every prefill forward
        (`engine.llm.model_runner` rule 4), where an urgent request of another lane may
        hold this one (`engine.runtime.urgency.Urgency.pause`); None: forwards run whole."""
        self._runner.pause = pause

    def use_native_step(self, on: bool) -> bool:
        """Decode steps as one native call where the model has one (True, the default),
        or as MLX operations (`engine.llm.model_runner` rule 5); returns whether the
        native step runs now."""
        self._runner.use_native_step(on)
        return self._runner.native_step is not None

    def set_runway(self, request_id: str, seconds: float) -> None:
        """`request_id`'s listener has `seconds` of speech queued (audio not yet played
        and text not yet spoken; `engine.llm.scheduler` rule 3). Unknown ids (finished a
        moment ago) are ignored."""
        self._scheduler.set_runway(request_id, seconds)

    def deferrable(self) -> bool:
        """Only rows with speech enough queued, and no prompt waiting."""
        return self._scheduler.deferrable()

    def stats(self) -> dict[str, int]:
        return {
            "waiting": len(self._scheduler.waiting),
            "prefilling": len(self._scheduler.prefilling),
            "running": len(self._scheduler.running),
            "kv_tokens": self._scheduler.kv_in_use(),
            "prompt_cache_entries": len(self.prompt_cache),
            "prompt_cache_bytes": self.prompt_cache.nbytes,
            "preemptions": self.num_preemptions,
        }

    def cache_stats(self) -> dict[str, tuple[int | None, int]]:
        """(entries, bytes) of the stage's KV: the prompt cache between turns, and the
        live requests' KV (read by /metrics from another thread: no lock, a snapshot)."""
        batch = self._runner.batch
        live = sum(layer.nbytes for layer in batch or ())
        for seq in list(self._scheduler.prefilling):
            live += sum(layer.nbytes for layer in list(seq.layers))
        return {
            "llm_prompt_cache": (len(self.prompt_cache), self.prompt_cache.nbytes),
            "llm_live_kv": (len(self._scheduler.seqs), live),
        }

    def request(self, request_id: str) -> Request | None:
        seq = self._scheduler.seqs.get(request_id)
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
        layers = self._runner.prefill_kv(tokens, self.prefill_chunk_tokens)
        self.prompt_cache.put(SHARED_PREFIX_KEY, tokens, layers, pinned=True)
        return len(tokens)

    def forget(self, cache_key: str) -> None:
        """The conversation under `cache_key` is over: drop its cached KV, and keep none
        of a request of it that is still live (its abort may be processed later)."""
        if cache_key == SHARED_PREFIX_KEY:
            return
        for seq in self._scheduler.seqs.values():
            if seq.cache_key == cache_key:
                seq.cache_key = None
        self.prompt_cache.discard(cache_key)

    # --- prompts -------------------------------------------------------------------

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
        if tools and renders_tools(self.tokenizer):
            # The model's own tool prompt (Qwen2.5's), the one it learned to call from.
            shown = native_messages(messages)
            ids = template(shown, tools=tools, add_generation_prompt=True, tokenize=True)
        else:
            shown = template_messages(messages, tools or [])
            ids = template(shown, add_generation_prompt=True, tokenize=True)
        return [int(t) for t in ids]

    # --- a step --------------------------------------------------------------------

    def _prefill(self, budget: int) -> list[StageOutput]:
        """Advance prefills as the scheduler plans (`Scheduler.schedule_prefill`): a
        slice of one long prompt, or the last chunks of the prompts that finish."""
        plan = self._scheduler.schedule_prefill(budget)
        if plan.slice is not None:
            self._runner.prefill_slice(*plan.slice)
        outputs: list[StageOutput] = []
        for group in plan.groups:
            outputs += self._prefill_last(group)
        return outputs

    def _prefill_last(self, group: list[LlmSequence]) -> list[StageOutput]:
        """Prefill the last chunks of `group`, emit each sequence's first token, and
        move the survivors into the batch."""
        cache, tokens = self._runner.prefill_last(group)
        now = time.time()
        outputs = []
        for seq, token in zip(group, tokens, strict=True):
            self._scheduler.end_prefill(seq)
            self._runner.end_prefill(seq)
            outputs.append(self._outputs.output(seq, token, now, seq.sampler.error))
        self._join_batch(group, cache)
        return outputs

    def _join_batch(self, group: list[LlmSequence], cache: list[BatchKVCache]) -> None:
        """Rule 2: the rows of requests that already finished hand their KV to the prompt
        cache instead of joining the batch."""
        keep = self._scheduler.start_running(group, lambda row: [c.extract(row) for c in cache])
        self._runner.join_batch(group, cache, keep)

    def _make_room(self) -> None:
        while (seq := self._scheduler.preemption_victim()) is not None:
            self._preempt(seq)

    def _preempt(self, seq: LlmSequence) -> None:
        if seq in self._scheduler.running:
            self._drop_rows([self._scheduler.running.index(seq)], keep_kv=False)
            self._runner.rewind(seq)
        self._scheduler.preempt(seq)

    def _decode(self) -> list[StageOutput]:
        """One decode step of every running row; outputs for the tokens the step before drew."""
        running = list(self._scheduler.running)
        sampled = self._runner.decode(running)
        now = time.time()
        outputs, done = [], []
        for row, (seq, drawn) in enumerate(zip(running, sampled, strict=True)):
            if drawn is None:
                continue  # its input is the token prefill already emitted
            token, error = drawn
            outputs.append(self._outputs.output(seq, token, now, error))
            if seq.req.is_finished():
                done.append(row)
        if done:
            self._drop_rows(done)
        return outputs

    def _drop_rows(self, rows: list[int], keep_kv: bool = True) -> None:
        """Remove batch rows (rule 2); with `keep_kv`, session KV goes to the prompt cache."""
        row_kv = self._runner.row_kv if keep_kv else None
        keep = self._scheduler.drop_running(rows, row_kv)
        self._runner.keep_rows(keep)
