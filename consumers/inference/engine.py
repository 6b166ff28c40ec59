"""Continuous-batching CPU engine over a Hugging Face causal LM: the scheduler behind the CPU inference worker.

No HTTP and no Kafka here (``consumers.inference.server`` puts the OpenAI-compatible server and the weight
consumer around it); topics in → out: none. Use::

    engine = Engine(model, eos_token_ids=[eos_id])
    engine.start()                                   # scheduler thread
    engine.submit([[1, 2, 3]], SamplingParams(max_tokens=8), callback)   # callback(GenerationResult | Exception)

One scheduler step (details: docs/inference.md#the-scheduler-step): admit waiting requests (FIFO) while the batch has
room; **chunked prefill** of the prefilling prompts under a token budget, shortest remaining first (the oldest always
gets its chunk), each chunk after a **prefix cache** lookup (``consumers.inference.prefix_cache``); a finished prompt
samples its first token and joins the left-padded **decode batch** (``consumers.inference.kv_batch``); decode ONE
token for every row in one forward pass; retire finished rows (caching their full blocks) and complete requests.
Per-sequence state and the per-row sampling: ``consumers.inference.sequences``.

Weight swaps (``request_swap``): no request is admitted until the active rows finish on the old weights; the swap is
applied between two steps, **drops every cached block** and bumps ``policy_version``, so every response comes from
exactly one version (``GenerationResult.policy_version``).
"""

from __future__ import annotations

import inspect
import logging
import threading
import time
import uuid
from collections import deque
from collections.abc import Iterable
from typing import Any

import torch
from transformers.cache_utils import Cache

from consumers.inference.generation import (
    Callback,
    EngineError,
    GenerationResult,
    SamplingParams,
    SequenceOutput,
    SwapOutcome,
    WeightSwap,
)
from consumers.inference.kv_batch import (
    KVBatch,
    adopting_cache,
    cache_layers,
    growing_cache,
    merge,
    select,
    use_engine_attention,
)
from consumers.inference.prefix_cache import PrefixCache
from consumers.inference.sequences import (
    LogprobsMode,
    Prefill,
    Request,
    Row,
    cache_sequences,
    row_generator,
    sample_and_record,
)

__all__ = ["Engine", "EngineError", "GenerationResult", "SamplingParams", "SequenceOutput", "SwapOutcome", "WeightSwap"]

log = logging.getLogger(__name__)


class Engine:
    """Batches concurrent generation requests on one model; thread-safe ``submit``, one scheduler thread."""

    def __init__(
        self,
        model: torch.nn.Module,
        *,
        eos_token_ids: Iterable[int],
        policy_version: int = 0,
        max_batch_size: int = 32,
        max_prefill_tokens: int = 2048,
        prefill_chunk_tokens: int = 256,
        prefix_cache_bytes: int = 2 << 30,
        prefix_block_size: int = 32,
        logprobs_mode: LogprobsMode = "processed_logprobs",
        pad_token_id: int = 0,
    ) -> None:
        if prefill_chunk_tokens < 1 or max_prefill_tokens < 1:
            raise ValueError("max_prefill_tokens and prefill_chunk_tokens must be at least 1")
        self.model = model.eval()
        use_engine_attention(model)
        param = next(model.parameters())
        self.device = param.device
        self.vocab_size = int(model.get_output_embeddings().weight.shape[0])
        self.num_layers = int(model.config.get_text_config().num_hidden_layers)
        self.eos_token_ids = frozenset(int(t) for t in eos_token_ids)
        self.max_batch_size = max_batch_size
        self.max_prefill_tokens = max_prefill_tokens
        self.prefill_chunk_tokens = prefill_chunk_tokens
        self.logprobs_mode = logprobs_mode
        self.pad_token_id = pad_token_id
        self.prefix_cache = PrefixCache(prefix_block_size, prefix_cache_bytes)
        # transformers 5.24 renamed `past_key_values` to `cache` (the old name is deprecated, removed in 5.40).
        params = inspect.signature(model.forward).parameters
        self._cache_kwarg = "cache" if "cache" in params else "past_key_values"
        self._policy_version = policy_version
        self._cond = threading.Condition()
        self._waiting: deque[Request] = deque()
        self._live: dict[str, Request] = {}  # submitted, not yet completed, failed or dropped
        self._swap: WeightSwap | None = None
        self._prefilling: list[Prefill] = []  # admission order
        self._batch: KVBatch | None = None
        self._thread: threading.Thread | None = None
        self._stopping = False
        self.tokens_generated = 0
        self.tokens_prefilled = 0  # prompt tokens computed (not taken from the cache)
        self.prompt_tokens = 0  # prompt tokens of finished prefills
        self.cached_prompt_tokens = 0  # ... of which came from the prefix cache
        self.requests_finished = 0
        self.steps = 0

    # ---- public, thread-safe ------------------------------------------------------------------------------
    @property
    def policy_version(self) -> int:
        return self._policy_version

    @property
    def active_sequences(self) -> int:
        """Rows decoding plus rows (``n`` per prompt) still prefilling."""
        batch = self._batch
        return (len(batch.rows) if batch else 0) + sum(p.request.params.n for p in list(self._prefilling))

    @property
    def queued_requests(self) -> int:
        return len(self._waiting)

    def submit(
        self, prompts: list[list[int]], params: SamplingParams, callback: Callback, request_id: str | None = None
    ) -> str:
        """Queue ``prompts`` × ``params.n`` sequences; ``callback`` gets the result (or the exception) once, from
        the scheduler thread. Raises ``ValueError`` for an empty prompt or an id outside the vocabulary."""
        if not prompts:
            raise ValueError("no prompt given")
        for prompt in prompts:
            if not prompt:
                raise ValueError("a prompt must contain at least one token")
            bad = [t for t in prompt if not 0 <= int(t) < self.vocab_size]
            if bad:
                raise ValueError(f"token id {bad[0]} is outside the vocabulary [0, {self.vocab_size})")
        request = Request(
            request_id or f"cmpl-{uuid.uuid4().hex}",
            [list(map(int, p)) for p in prompts],
            params,
            callback,
            time.monotonic(),
        )
        request.remaining = len(prompts) * params.n
        request.cached = [0] * len(prompts)
        with self._cond:
            if self._stopping:
                raise EngineError("engine is stopped")
            self._waiting.append(request)
            self._live[request.request_id] = request
            self._cond.notify_all()
        return request.request_id

    def abort(self, request_id: str) -> None:
        """Stop generating for a request (its client went away); its callback is not called."""
        with self._cond:
            request = self._live.get(request_id)
            if request is not None:
                request.cancelled = True  # dropped from the queue, the prefill or the batch at the next step

    def request_swap(self, swap: WeightSwap) -> None:
        """Apply new weights once the in-flight sequences have finished (a newer pending swap replaces an older)."""
        with self._cond:
            if self._swap is not None:
                self._swap.done(SwapOutcome(self._swap.version, EngineError("superseded by a newer version"), 0, 0))
            self._swap = swap
            self._cond.notify_all()

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="engine-scheduler", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 30.0) -> None:
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
        if self._thread is not None:
            self._thread.join(timeout)
        self._fail_everything(EngineError("engine stopped"))

    def stats(self) -> dict[str, float]:
        cache = self.prefix_cache
        return {
            "tokens_generated": float(self.tokens_generated),
            "tokens_prefilled": float(self.tokens_prefilled),
            "requests_finished": float(self.requests_finished),
            "steps": float(self.steps),
            "active_sequences": float(self.active_sequences),
            "queued_requests": float(self.queued_requests),
            "prefix_cache_queries": float(self.prompt_tokens),
            "prefix_cache_hits": float(self.cached_prompt_tokens),
            "prefix_cache_hit_rate": self.cached_prompt_tokens / self.prompt_tokens if self.prompt_tokens else 0.0,
            "prefix_cache_blocks": float(cache.blocks),
            "prefix_cache_bytes": float(cache.bytes),
            "prefix_cache_evictions": float(cache.stats.evicted_blocks),
        }

    # ---- scheduler ------------------------------------------------------------------------------------------
    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._stopping and not (self._waiting or self._prefilling or self._batch or self._swap):
                    self._cond.wait(timeout=1.0)
                if self._stopping:
                    return
            self.step()

    def step(self) -> bool:
        """One scheduler iteration (admit, prefill chunks, decode one token for all); returns whether it did
        anything. Called by the scheduler thread only (tests may call it directly instead of ``start``)."""
        swap: WeightSwap | None = None
        with self._cond:
            for request in [r for r in self._waiting if r.cancelled]:
                self._waiting.remove(request)
                self._live.pop(request.request_id, None)
            if self._swap is not None:
                if self._batch is None and not self._prefilling:
                    swap, self._swap = self._swap, None
            else:
                for request in self._take_admissible():
                    self._prefilling.extend(Prefill(request, i) for i in range(len(request.prompts)))
        if swap is not None:
            self._apply_swap(swap)
            return True
        if not self._prefilling and self._batch is None:
            return False
        try:
            with torch.inference_mode():
                self._prefill_chunks()
                if self._batch is not None:
                    self._decode()
        except Exception as exc:  # the model failed: fail what was running rather than hang its clients
            log.exception("engine step failed; failing %d active sequences", self.active_sequences)
            self._fail_everything(EngineError(f"generation failed: {exc!r}"))
        self.steps += 1
        return True

    def _take_admissible(self) -> list[Request]:
        rows = self.active_sequences
        taken: list[Request] = []
        while self._waiting:
            request = self._waiting[0]
            need = len(request.prompts) * request.params.n
            alone = rows == 0 and not taken  # an oversized request still runs, alone
            if not alone and rows + need > self.max_batch_size:
                break
            self._waiting.popleft()
            request.admitted = time.monotonic()
            request.policy_version = self._policy_version
            taken.append(request)
            rows += need
        return taken

    def _apply_swap(self, swap: WeightSwap) -> None:
        drained = time.monotonic()
        error: BaseException | None = None
        try:
            with torch.no_grad():
                swap.apply(self.model)
            self._policy_version = swap.version
        except Exception as exc:  # keep serving the old weights
            log.exception("applying weights version %d failed", swap.version)
            error = exc
        # Even a failed apply may have copied some tensors in: no cached KV is trusted after any attempt.
        self.prefix_cache.clear()
        outcome = SwapOutcome(swap.version, error, drained - swap.requested_at, time.monotonic() - drained)
        swap.done(outcome)

    def _forward(self, ids: torch.Tensor, mask: torch.Tensor | None, positions: torch.Tensor, cache: Cache) -> Any:
        """Run ids (B, S) with mask (B, T+S) or None (one unpadded row), positions (B, S); returns the last
        position's logits (B, V)."""
        out = self.model(
            input_ids=ids,
            attention_mask=mask,
            position_ids=positions,
            use_cache=True,
            logits_to_keep=1,
            **{self._cache_kwarg: cache},
        )
        return out.logits[:, -1, :]

    # ---- prefill --------------------------------------------------------------------------------------------
    def _prefill_chunks(self) -> None:
        """Advance the prefilling prompts by at most ``max_prefill_tokens`` tokens in all (see the module doc)."""
        dropped = [p for p in self._prefilling if p.request.cancelled]
        if dropped:
            with self._cond:
                self._prefilling = [p for p in self._prefilling if not p.request.cancelled]
                for unit in dropped:
                    self._live.pop(unit.request.request_id, None)
        if not self._prefilling:
            return
        budget = self.max_prefill_tokens - (len(self._batch.rows) if self._batch else 0)
        oldest = self._prefilling[0]
        # Shortest remaining first: a short prompt finishes (and is answered) before a long prompt's chunk runs.
        # The oldest prompt always gets its chunk, even past the budget, so a stream of short ones cannot starve it.
        for unit in sorted(self._prefilling, key=lambda u: u.remaining):
            if unit is not oldest and budget <= 0:
                continue
            budget -= self._prefill_one(
                unit,
                max(1, min(budget, self.prefill_chunk_tokens)) if unit is not oldest else self.prefill_chunk_tokens,
            )

    def _prefill_one(self, unit: Prefill, limit: int) -> int:
        """Reuse the cached prefix, compute the next ``limit`` prompt tokens at most; returns tokens computed."""
        tokens = unit.tokens
        # At least the last token is computed: its logits give the first generated token.
        # Room for the rest of the prompt and the answer: the buffer never regrows for this sequence.
        room = len(tokens) + unit.request.params.max_tokens + 1
        if self.prefix_cache.cached_tokens(tokens[: len(tokens) - 1]) > unit.done:
            hit = self.prefix_cache.lookup(tokens, limit=len(tokens) - 1, count=False, reserve=room - len(tokens))
            assert hit.buffer is not None
            unit.cache, unit.done = adopting_cache(hit.buffer, hit.tokens), hit.tokens
            unit.request.cached[unit.prompt_index] = hit.tokens
        if unit.cache is None:
            unit.cache = growing_cache(num_layers=self.num_layers, reserve=room)
        start, end = unit.done, min(len(tokens), unit.done + limit)
        ids = torch.tensor([tokens[start:end]], device=self.device)  # (1, S)
        positions = torch.arange(start, end, device=self.device).unsqueeze(0)  # (1, S)
        logits = self._forward(ids, None, positions, unit.cache)  # (1, V)
        unit.done = end
        self.tokens_prefilled += end - start
        self.prefix_cache.insert(tokens[:end], cache_layers(unit.cache))
        if end == len(tokens):
            self._start_decoding(unit, logits)
        return end - start

    def _start_decoding(self, unit: Prefill, logits: torch.Tensor) -> None:
        """The prompt is in its cache: sample the first token of its ``n`` samples, move them to the batch."""
        request, n = unit.request, unit.request.params.n
        rows: list[Row] = []
        for s_index in range(n):
            output = SequenceOutput(prompt_index=unit.prompt_index, sample_index=s_index)
            request.outputs.append(output)
            rows.append(Row(request, output, row_generator(request.params, s_index, self.device)))
        length = len(unit.tokens)
        assert unit.cache is not None
        one = KVBatch(
            unit.cache,
            torch.ones((1, length), dtype=torch.long, device=self.device),
            torch.tensor([length], device=self.device),
            torch.zeros(1, dtype=torch.long),
            [],
        )
        if n == 1:  # the prompt's own cache becomes the row's (no copy)
            one.rows = rows
            group = one
        else:
            group = select(one, torch.zeros(n, dtype=torch.long, device=self.device), rows)  # (n, ...) copies
        group.pending = self._sample_and_record(rows, logits.expand(n, -1))
        with self._cond:
            self._prefilling.remove(unit)
            self._batch = group if self._batch is None else merge(self._batch, group)
        self.prompt_tokens += length
        self.cached_prompt_tokens += request.cached[unit.prompt_index]
        self._retire_finished()

    # ---- decode ---------------------------------------------------------------------------------------------
    def _decode(self) -> None:
        batch = self._batch
        assert batch is not None
        ones = torch.ones((len(batch.rows), 1), dtype=batch.mask.dtype, device=self.device)
        mask = torch.cat([batch.mask, ones], dim=1)  # (B, T+1)
        # No padding column (one row, or rows of equal length): no mask, so SDPA takes its unmasked kernel, which
        # is ~1.7x faster at 35k cached tokens (where attention is most of a decode step).
        padded = bool(batch.mask[:, 0].eq(0).any())  # rows are right-aligned: padding shows in column 0
        logits = self._forward(
            batch.pending.unsqueeze(1), mask if padded else None, batch.positions.unsqueeze(1), batch.cache
        )
        batch.mask = mask
        batch.positions = batch.positions + 1
        batch.pending = self._sample_and_record(batch.rows, logits)
        self._retire_finished()

    def _sample_and_record(self, rows: list[Row], logits: torch.Tensor) -> torch.Tensor:
        """Sample one token per row from logits (B, V), append it and its log-prob to each output; returns (B,)."""
        tokens = sample_and_record(
            rows, logits, logprobs_mode=self.logprobs_mode, eos_token_ids=self.eos_token_ids, device=self.device
        )
        self.tokens_generated += len(rows)
        return tokens

    def _retire_finished(self) -> None:
        batch = self._batch
        assert batch is not None
        keep = [i for i, row in enumerate(batch.rows) if row.output.finish_reason is None and not row.request.cancelled]
        if len(keep) == len(batch.rows):
            return
        finished = [
            i for i, row in enumerate(batch.rows) if row.output.finish_reason is not None and not row.request.cancelled
        ]
        cache_sequences(self.prefix_cache, batch, finished)
        with self._cond:
            for row in batch.rows:
                if row.request.cancelled:
                    self._live.pop(row.request.request_id, None)
            if keep:
                index = torch.tensor(keep, device=self.device)
                self._batch = select(batch, index, [batch.rows[i] for i in keep])
            else:
                self._batch = None
        for i in finished:
            request = batch.rows[i].request
            request.remaining -= 1
            if request.remaining == 0:
                self._complete(request)

    def _complete(self, request: Request) -> None:
        now = time.monotonic()
        outputs = sorted(request.outputs, key=lambda o: (o.prompt_index, o.sample_index))
        result = GenerationResult(
            request.request_id,
            request.prompts,
            outputs,
            request.policy_version,
            request.admitted - request.arrival,
            now - request.arrival,
            list(request.cached),
        )
        self.requests_finished += 1
        with self._cond:
            self._live.pop(request.request_id, None)
        self._notify(request, result)

    @staticmethod
    def _notify(request: Request, outcome: GenerationResult | BaseException) -> None:
        try:
            request.callback(outcome)
        except Exception:  # a broken callback must not take the scheduler down
            log.exception("callback of request %s failed", request.request_id)

    def _fail_everything(self, error: BaseException) -> None:
        with self._cond:
            requests: dict[str, Request] = {}
            for row in self._batch.rows if self._batch else ():
                requests[row.request.request_id] = row.request
            for request in [p.request for p in self._prefilling] + list(self._waiting):
                requests[request.request_id] = request
            self._batch = None
            self._prefilling = []
            self._waiting.clear()
            for request_id in requests:
                self._live.pop(request_id, None)
            swap, self._swap = self._swap, None
        for request in requests.values():
            if not request.cancelled:
                self._notify(request, error)
        if swap is not None:
            swap.done(SwapOutcome(swap.version, error, 0.0, 0.0))
