"""Continuous-batching CPU engine over a Hugging Face causal LM: the scheduler behind the CPU inference worker.

No HTTP and no Kafka here (``consumers.inference.server`` puts the OpenAI-compatible server and the weight
consumer around it); topics in → out: none. Use::

    engine = Engine(model, eos_token_ids=[eos_id])
    engine.start()                                   # scheduler thread
    engine.submit([[1, 2, 3]], SamplingParams(max_tokens=8), callback)   # callback(GenerationResult | Exception)

How a step works
----------------
All active sequences live in one batch with one shared KV cache (transformers ``DynamicCache``): keys/values
(B, H, T, D), a 2-D attention mask (B, T) that marks which cache columns are real for each row, and each row's
next position id. Rows are left-padded to a common length T, so the newest token of every row is in the last
column. One scheduler step:

1. admits waiting requests (FIFO) while the batch has room (``max_batch_size`` rows, ``max_prefill_tokens``),
   prefills them together in a left-padded group of their own, samples their first token, duplicates the prompt
   cache ``n`` times (a prompt is prefilled once per request, not once per sample) and merges the group into the
   running batch (the shorter of the two is left-padded with masked columns);
2. decodes ONE token for every active row with a single forward pass over (B, 1) new tokens, reusing the cache;
3. drops rows that finished (eos, a stop token, ``max_tokens``) or were aborted, trims cache columns no
   remaining row uses, and completes requests whose sequences all finished.

A sequence never has its prefix recomputed. Positions are per row (prompt length + generated so far), so rotary
embeddings see the same positions as an unpadded run, and padding never changes results beyond float rounding.

Weight swaps
------------
``request_swap`` queues a new set of weights. From then on no request is admitted; the active rows finish on the
old weights (none fails), and when the batch is empty the scheduler applies the swap between two steps, bumps
``policy_version`` and admits again. Every response therefore comes from exactly one version (reported in
``GenerationResult.policy_version``). The cost is that new requests wait while in-flight ones drain; a second
model copy would avoid the wait but double memory and need a forward pass per version per step.
"""

from __future__ import annotations

import inspect
import logging
import threading
import time
import uuid
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Literal

import torch
from transformers import DynamicCache

from clawstream.errors import ClawstreamError
from consumers.inference import sampling
from consumers.inference.kv_batch import KVBatch, left_pad, merge, select

log = logging.getLogger(__name__)

LogprobsMode = Literal["processed_logprobs", "raw_logprobs"]


class EngineError(ClawstreamError):
    """The engine could not run a request (stopped, or the model failed)."""


@dataclass(frozen=True)
class SamplingParams:
    """Per-request sampling settings (a subset of vLLM's ``SamplingParams``, same meanings and defaults)."""

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: disabled
    seed: int | None = None
    n: int = 1
    stop_token_ids: tuple[int, ...] = ()
    logprobs: int | None = None  # None: no top-logprobs; k >= 0: the sampled token + the k most likely
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be at least 1, got {self.max_tokens}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be non-negative, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < -1:
            raise ValueError(f"top_k must be -1 (disable), or at least 1, got {self.top_k}")
        if self.n < 1:
            raise ValueError(f"n must be at least 1, got {self.n}")
        if self.logprobs is not None and self.logprobs < 0:
            raise ValueError(f"logprobs must be non-negative, got {self.logprobs}")

    @property
    def greedy(self) -> bool:
        return self.temperature < sampling.GREEDY_EPS


@dataclass
class SequenceOutput:
    """One generated sequence (one OpenAI ``choice``)."""

    prompt_index: int
    sample_index: int
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)  # log-prob of each sampled token (see .sampling)
    # Per step when requested: [(sampled id, logprob), then the k most likely (id, logprob)], vLLM's order.
    top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)
    finish_reason: str | None = None  # "stop" | "length"
    stop_reason: int | None = None  # the stop token id that ended it; None for eos or length (as vLLM)


@dataclass
class GenerationResult:
    request_id: str
    prompts: list[list[int]]
    outputs: list[SequenceOutput]  # prompt-major, then sample index: vLLM's choice order
    policy_version: int
    queued_s: float  # submit → admitted
    total_s: float  # submit → finished


@dataclass(frozen=True)
class SwapOutcome:
    version: int
    error: BaseException | None
    wait_s: float  # swap requested → batch drained (in-flight requests finishing on the old weights)
    apply_s: float  # copying the new weights in


@dataclass
class WeightSwap:
    """New weights to apply between steps: ``apply(model)`` copies them in; ``done`` hears how it went."""

    version: int
    apply: Callable[[torch.nn.Module], None]
    done: Callable[[SwapOutcome], None]
    requested_at: float = field(default_factory=time.monotonic)


Callback = Callable[[GenerationResult | BaseException], None]


@dataclass
class _Request:
    request_id: str
    prompts: list[list[int]]
    params: SamplingParams
    callback: Callback
    arrival: float
    outputs: list[SequenceOutput] = field(default_factory=list)
    remaining: int = 0
    admitted: float = 0.0
    policy_version: int = 0
    cancelled: bool = False


@dataclass
class _Row:
    request: _Request
    output: SequenceOutput
    generator: torch.Generator | None


class Engine:
    """Batches concurrent generation requests on one model; thread-safe ``submit``, one scheduler thread."""

    def __init__(
        self,
        model: torch.nn.Module,
        *,
        eos_token_ids: Iterable[int],
        policy_version: int = 0,
        max_batch_size: int = 32,
        max_prefill_tokens: int = 8192,
        logprobs_mode: LogprobsMode = "processed_logprobs",
        pad_token_id: int = 0,
    ) -> None:
        self.model = model.eval()
        param = next(model.parameters())
        self.device = param.device
        self.vocab_size = int(model.get_output_embeddings().weight.shape[0])
        self.eos_token_ids = frozenset(int(t) for t in eos_token_ids)
        self.max_batch_size = max_batch_size
        self.max_prefill_tokens = max_prefill_tokens
        self.logprobs_mode = logprobs_mode
        self.pad_token_id = pad_token_id
        # transformers 5.24 renamed `past_key_values` to `cache` (the old name is deprecated, removed in 5.40).
        params = inspect.signature(model.forward).parameters
        self._cache_kwarg = "cache" if "cache" in params else "past_key_values"
        self._policy_version = policy_version
        self._cond = threading.Condition()
        self._waiting: deque[_Request] = deque()
        self._live: dict[str, _Request] = {}  # submitted, not yet completed, failed or dropped
        self._swap: WeightSwap | None = None
        self._batch: KVBatch | None = None
        self._thread: threading.Thread | None = None
        self._stopping = False
        self.tokens_generated = 0
        self.requests_finished = 0
        self.steps = 0

    # ---- public, thread-safe ------------------------------------------------------------------------------
    @property
    def policy_version(self) -> int:
        return self._policy_version

    @property
    def active_sequences(self) -> int:
        batch = self._batch
        return len(batch.rows) if batch else 0

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
        request = _Request(request_id or f"cmpl-{uuid.uuid4().hex}", [list(map(int, p)) for p in prompts], params,
                           callback, time.monotonic())  # fmt: skip
        request.remaining = len(prompts) * params.n
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
                request.cancelled = True  # dropped from the queue or the batch at the next step

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
        return {
            "tokens_generated": float(self.tokens_generated),
            "requests_finished": float(self.requests_finished),
            "steps": float(self.steps),
            "active_sequences": float(self.active_sequences),
            "queued_requests": float(self.queued_requests),
        }

    # ---- scheduler ------------------------------------------------------------------------------------------
    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._stopping and not (self._waiting or self._batch or self._swap):
                    self._cond.wait(timeout=1.0)
                if self._stopping:
                    return
            self.step()

    def step(self) -> bool:
        """One scheduler iteration (admit + prefill, decode one token for all); returns whether it did anything.

        Called by the scheduler thread only (tests may call it directly instead of ``start``).
        """
        swap: WeightSwap | None = None
        admitted: list[_Request] = []
        with self._cond:
            for request in [r for r in self._waiting if r.cancelled]:
                self._waiting.remove(request)
                self._live.pop(request.request_id, None)
            if self._swap is not None:
                if self._batch is None:
                    swap, self._swap = self._swap, None
            else:
                admitted = self._take_admissible()
        if swap is not None:
            self._apply_swap(swap)
            return True
        if not admitted and self._batch is None:
            return False
        try:
            with torch.inference_mode():
                if admitted:
                    self._prefill(admitted)
                if self._batch is not None:
                    self._decode()
        except Exception as exc:  # the model failed: fail what was running rather than hang its clients
            log.exception("engine step failed; failing %d active requests", self.active_sequences)
            self._fail_everything(EngineError(f"generation failed: {exc!r}"), also=admitted)
        self.steps += 1
        return True

    def _take_admissible(self) -> list[_Request]:
        rows = self.active_sequences
        tokens = 0
        taken: list[_Request] = []
        while self._waiting:
            request = self._waiting[0]
            need = len(request.prompts) * request.params.n
            prompt_tokens = sum(len(p) for p in request.prompts)
            alone = rows == 0 and not taken  # an oversized request still runs, alone
            if not alone and (rows + need > self.max_batch_size or tokens + prompt_tokens > self.max_prefill_tokens):
                break
            self._waiting.popleft()
            request.admitted = time.monotonic()
            request.policy_version = self._policy_version
            taken.append(request)
            rows += need
            tokens += prompt_tokens
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
        outcome = SwapOutcome(swap.version, error, drained - swap.requested_at, time.monotonic() - drained)
        swap.done(outcome)

    def _forward(
        self, ids: torch.Tensor, mask: torch.Tensor, positions: torch.Tensor, cache: DynamicCache
    ) -> torch.Tensor:
        """Run ids (B, S) with mask (B, T+S) and positions (B, S); returns the last position's logits (B, V)."""
        out = self.model(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=True,
                         logits_to_keep=1, **{self._cache_kwarg: cache})  # fmt: skip
        return out.logits[:, -1, :]

    def _prefill(self, requests: list[_Request]) -> None:
        prompts = [p for r in requests for p in r.prompts]
        ids, mask, positions = left_pad(prompts, self.pad_token_id, self.device)  # (G, L) each
        cache = DynamicCache()
        logits = self._forward(ids, mask, positions, cache)  # (G, V)

        source: list[int] = []  # prompt row each new sequence row comes from
        rows: list[_Row] = []
        prompt_row = 0
        for request in requests:
            for p_index in range(len(request.prompts)):
                for s_index in range(request.params.n):
                    output = SequenceOutput(prompt_index=p_index, sample_index=s_index)
                    request.outputs.append(output)
                    rows.append(_Row(request, output, self._generator(request.params, s_index)))
                    source.append(prompt_row)
                prompt_row += 1
        index = torch.tensor(source, device=self.device)
        # Positions of the first generated token = prompt lengths; `pending` is filled in after sampling.
        group = select(KVBatch(cache, mask, mask.sum(dim=1), mask.sum(dim=1), []), index, rows)
        group.pending = self._sample_and_record(rows, logits.index_select(0, index))
        self._batch = group if self._batch is None else merge(self._batch, group)
        self._retire_finished()

    def _decode(self) -> None:
        batch = self._batch
        assert batch is not None
        ones = torch.ones((len(batch.rows), 1), dtype=batch.mask.dtype, device=self.device)
        mask = torch.cat([batch.mask, ones], dim=1)  # (B, T+1)
        logits = self._forward(batch.pending.unsqueeze(1), mask, batch.positions.unsqueeze(1), batch.cache)
        batch.mask = mask
        batch.positions = batch.positions + 1
        batch.pending = self._sample_and_record(batch.rows, logits)
        self._retire_finished()

    def _generator(self, params: SamplingParams, sample_index: int) -> torch.Generator | None:
        if params.seed is None or params.greedy:
            return None
        # vLLM gives the i-th of n parallel samples the seed `seed + i` (vllm/v1/engine/parallel_sampling.py).
        generator = torch.Generator(device=self.device)
        generator.manual_seed(params.seed + sample_index)
        return generator

    def _sample_and_record(self, rows: list[_Row], logits: torch.Tensor) -> torch.Tensor:
        """Sample one token per row from logits (B, V), append it and its log-prob to each output; returns (B,)."""
        params = [row.request.params for row in rows]
        dev = self.device
        temperature = torch.tensor([p.temperature for p in params], device=dev)  # (B,)
        # Stages nobody in the batch asked for are skipped (decided here, on the host: no device sync).
        scaled = any(p.temperature != 1.0 and not p.greedy for p in params)
        top_k = torch.tensor([p.top_k for p in params], device=dev) if any(p.top_k > 0 for p in params) else None
        top_p = torch.tensor([p.top_p for p in params], device=dev) if any(p.top_p < 1 for p in params) else None
        drawn_from = sampling.processed_logprobs(logits, temperature if scaled else None, top_k, top_p)  # (B, V)
        reported = drawn_from if self.logprobs_mode == "processed_logprobs" else sampling.raw_logprobs(logits)
        tokens = sampling.sample(drawn_from, temperature < sampling.GREEDY_EPS, [row.generator for row in rows])
        chosen = reported.gather(1, tokens.unsqueeze(1))  # (B, 1)
        k_max = max((p.logprobs or 0 for p in params), default=0)
        top_values, top_ids = sampling.top_logprobs(reported, k_max)  # (B, k) each
        # One device-to-host copy per step: float64 holds token ids and float32 log-probs exactly.
        host = torch.cat([tokens.unsqueeze(1).double(), chosen.double(), top_ids.double(), top_values.double()], 1)
        host_rows = host.cpu().tolist()  # (B, 2 + 2k)
        for row, p, values in zip(rows, params, host_rows, strict=True):
            out, token, logprob = row.output, int(values[0]), values[1]
            out.token_ids.append(token)
            out.logprobs.append(logprob)
            if p.logprobs is not None:
                ids, lps = values[2 : 2 + p.logprobs], values[2 + k_max : 2 + k_max + p.logprobs]
                out.top_logprobs.append([(token, logprob), *((int(t), lp) for t, lp in zip(ids, lps, strict=True))])
            # vLLM's order (vllm/v1/core/sched/utils.py check_stop): eos, then stop_token_ids, then length.
            if token in self.eos_token_ids and not p.ignore_eos:
                out.finish_reason = "stop"
            elif token in p.stop_token_ids:
                out.finish_reason, out.stop_reason = "stop", token
            elif len(out.token_ids) >= p.max_tokens:
                out.finish_reason = "length"
        self.tokens_generated += len(rows)
        return tokens

    def _retire_finished(self) -> None:
        batch = self._batch
        assert batch is not None
        keep = [i for i, row in enumerate(batch.rows) if row.output.finish_reason is None and not row.request.cancelled]
        finished = [row for row in batch.rows if row.output.finish_reason is not None and not row.request.cancelled]
        if len(keep) == len(batch.rows):
            return
        with self._cond:
            for row in batch.rows:
                if row.request.cancelled:
                    self._live.pop(row.request.request_id, None)
            if keep:
                index = torch.tensor(keep, device=self.device)
                self._batch = select(batch, index, [batch.rows[i] for i in keep])
            else:
                self._batch = None
        for row in finished:
            request = row.request
            request.remaining -= 1
            if request.remaining == 0:
                self._complete(request)

    def _complete(self, request: _Request) -> None:
        now = time.monotonic()
        outputs = sorted(request.outputs, key=lambda o: (o.prompt_index, o.sample_index))
        result = GenerationResult(request.request_id, request.prompts, outputs, request.policy_version,
                                  request.admitted - request.arrival, now - request.arrival)  # fmt: skip
        self.requests_finished += 1
        with self._cond:
            self._live.pop(request.request_id, None)
        self._notify(request, result)

    @staticmethod
    def _notify(request: _Request, outcome: GenerationResult | BaseException) -> None:
        try:
            request.callback(outcome)
        except Exception:  # a broken callback must not take the scheduler down
            log.exception("callback of request %s failed", request.request_id)

    def _fail_everything(self, error: BaseException, also: list[_Request] | None = None) -> None:
        with self._cond:
            requests: dict[str, _Request] = {}
            for row in self._batch.rows if self._batch else ():
                requests[row.request.request_id] = row.request
            for request in (also or []) + list(self._waiting):
                requests[request.request_id] = request
            self._batch = None
            self._waiting.clear()
            for request_id in requests:
                self._live.pop(request_id, None)
            swap, self._swap = self._swap, None
        for request in requests.values():
            if not request.cancelled:
                self._notify(request, error)
        if swap is not None:
            swap.done(SwapOutcome(swap.version, error, 0.0, 0.0))
