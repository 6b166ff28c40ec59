"""``clawstream harness check``'s verdict: is one harness's traffic trainable? Computed from its recorded calls.

Input: per rollout, the calls the proxy recorded (:class:`CheckCall`, delta-encoded as on the calls topic; rollouts
of the same task paired by ``task``), the adapter's declared dialect and a ``decode`` (token ids → text). Output: a
:class:`Verdict` — dialects seen, calls per rollout, call kinds (main / side / subagent / compaction), prefix
consistency (each main call's prompt extends the previous main call's prompt + answer token for token), trainable
token share (main calls' generated tokens over the tokens a prefix tree of the rollout holds), first-call cache
share across two rollouts of one task (the engine's reported cached tokens and the common prefix), and where two
first prompts of one task first differ, as % of the first prompt with the differing text decoded and named (a
path, a clock, an id). Each problem comes with its fix; ``failed`` when any is an error (a check that compared no
two first prompts, or whose every rollout ended without exit 0, fails: it judged nothing). Thresholds:
:class:`CheckSettings` (env prefix ``CLAWSTREAM_HARNESS_CHECK_``). Pure: no Kafka, no processes.
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict

from policy.token_prefix import common_prefix_len


class CheckSettings(BaseSettings):
    """What ``clawstream harness check`` runs and what it accepts (env prefix ``CLAWSTREAM_HARNESS_CHECK_``)."""

    model_config = SettingsConfigDict(env_prefix="CLAWSTREAM_HARNESS_CHECK_", frozen=True, extra="forbid")

    min_first_prompt_share: float = Field(
        default=0.90,
        gt=0,
        le=1,
        description="Two rollouts' first prompts of one task must agree on at least this share of the first prompt: "
        "a per-rollout id or clock earlier than that costs every rollout's prefix cache and KV sharing (OpenClaw's "
        "timestamp and session id sit at ~97.8 %).",
    )
    min_trainable_share: float = Field(
        default=0.0, ge=0, lt=1, description="The trainable token share must be above this (0: any trainable token)."
    )
    tasks: int = Field(default=2, ge=1, le=8, description="Built-in CPU tasks run, each twice (two rollouts).")
    rollout_timeout_s: float = Field(default=180.0, gt=0, description="Each rollout's wall-clock bound.")
    timeout_s: float = Field(default=600.0, gt=0, description="Longest wait for every rollout's calls.")


@dataclass(frozen=True)
class CheckCall:
    call_id: str
    seq: int
    parent_call_id: str | None
    shared_prefix_len: int
    new_tokens: Sequence[int]
    generated_tokens: Sequence[int]
    call_kind: str  # MAIN | SIDE | SUBAGENT | COMPACTION
    dialect: str
    cached_prompt_tokens: int | None = None


@dataclass(frozen=True)
class Problem:
    severity: str  # "error" fails the verdict; "warning" does not
    what: str
    fix: str


@dataclass
class Verdict:
    harness: str
    dialects: list[str] = field(default_factory=list)
    calls_per_rollout: list[int] = field(default_factory=list)
    kinds: dict[str, int] = field(default_factory=dict)
    main_extends: tuple[int, int] = (0, 0)  # main calls that extend the previous one, main calls after a first
    trainable_share: float = 0.0
    first_prompt_share: float | None = None  # the smallest over task pairs: common prefix / first prompt
    first_call_cached_share: float | None = None  # the engine's cached tokens / prompt, the pair's later first call
    divergence: str = ""  # the differing text at the earliest divergence, decoded
    outcomes: list[str] = field(default_factory=list)  # how each rollout ended ("exit 0", "timed out", ...)
    problems: list[Problem] = field(default_factory=list)

    @property
    def failed(self) -> bool:
        return any(p.severity == "error" for p in self.problems)

    def lines(self) -> list[str]:
        ext, n = self.main_extends
        pct = lambda x: "n/a" if x is None else f"{100 * x:.1f} %"  # noqa: E731
        out = [
            f"harness {self.harness}: {'FAIL' if self.failed else 'PASS'}",
            f"  dialect seen:          {', '.join(self.dialects) or 'none'}",
            f"  rollouts ended:        {', '.join(self.outcomes) or '?'}",
            f"  calls per rollout:     {', '.join(map(str, self.calls_per_rollout)) or 'none'}",
            f"  call kinds:            {', '.join(f'{k.lower()} {v}' for k, v in sorted(self.kinds.items())) or '-'}",
            f"  prefix consistency:    {ext}/{n} main calls extend the previous one token for token",
            f"  trainable tokens:      {pct(self.trainable_share)}",
            f"  first prompts agree:   {pct(self.first_prompt_share)} of the first prompt (two rollouts, one task)",
            f"  first-call cache:      {pct(self.first_call_cached_share)} of the later first prompt (prefix cache)",
        ]
        if self.divergence:
            out.append(f"  first difference:      {self.divergence}")
        for p in self.problems:
            out.append(f"  {p.severity.upper()}: {p.what}\n    fix: {p.fix}")
        return out


def rebuild_prompts(calls: Sequence[CheckCall]) -> dict[str, list[int]]:
    """Every call's full prompt from the delta encoding (parent's prompt + answer, cut, + new tokens)."""
    prompts: dict[str, list[int]] = {}
    gen: dict[str, list[int]] = {}
    for c in sorted(calls, key=lambda c: c.seq):
        base: list[int] = []
        if c.parent_call_id is not None and c.parent_call_id in prompts:
            base = (prompts[c.parent_call_id] + gen[c.parent_call_id])[: c.shared_prefix_len]
        prompts[c.call_id] = base + list(c.new_tokens)
        gen[c.call_id] = list(c.generated_tokens)
    return prompts


def _mains(calls: Sequence[CheckCall]) -> list[CheckCall]:
    return [c for c in sorted(calls, key=lambda c: c.seq) if c.call_kind.upper() == "MAIN"]


def _tree_counts(mains: Sequence[CheckCall], prompts: Mapping[str, list[int]]) -> tuple[int, int, int]:
    """(main calls extending the previous, trainable tokens, tokens a prefix tree holds) of one rollout."""
    extends = trainable = held = 0
    seen: list[list[int]] = []
    for i, c in enumerate(mains):
        prompt, out = prompts[c.call_id], list(c.generated_tokens)
        if i:
            prev = seen[-1]
            extends += len(prompt) >= len(prev) and common_prefix_len(prompt, prev) == len(prev)
        shared = max((common_prefix_len(prompt, s) for s in seen), default=0)
        held += len(prompt) - shared + len(out)
        trainable += len(out)
        seen.append(prompt + out)
    return extends, trainable, held


ID_RE = re.compile(r"[0-9a-f]{8,}|[A-Za-z0-9_-]{20,}", re.I)
CLOCK_RE = re.compile(r"\d{4}-\d{2}-\d{2}|\d{1,2}:\d{2}(:\d{2})?|\b(19|20)\d{2}\b|(Mon|Tue|Wed|Thu|Fri|Sat|Sun)\w*")
PATH_RE = re.compile(r"(/[\w.-]+){2,}")


def name_difference(a: str, b: str) -> str:
    """What kind of text differs between two rollouts: a clock, an id, a path, or text."""
    both = a + " " + b
    if PATH_RE.search(both):
        return "a path"
    if CLOCK_RE.search(both):
        return "a clock (date/time)"
    if ID_RE.search(both):
        return "an id"
    return "text"


def _pair_divergence(
    a: list[int], b: list[int], decode: Callable[[Sequence[int]], str], window: int
) -> tuple[float, str, str]:
    k = common_prefix_len(a, b)
    share = k / len(a) if a else 1.0
    if k >= min(len(a), len(b)) and len(a) == len(b):
        return share, "", ""
    before = decode(a[max(0, k - 8) : k])
    ta, tb = decode(a[k : k + window]), decode(b[k : k + window])
    wide = decode(a[max(0, k - 16) : k + 4 * window]), decode(b[max(0, k - 16) : k + 4 * window])
    kind = name_difference(*wide)
    text = f"at token {k} of {len(a)} ({100 * share:.1f} %), {kind}: ...{before!r} then {ta!r} vs {tb!r}"
    return share, text, kind


def verdict(
    harness: str,
    declared_dialect: str,
    rollouts: Mapping[str, Sequence[CheckCall]],
    task_of: Mapping[str, str],
    decode: Callable[[Sequence[int]], str],
    settings: CheckSettings | None = None,
    outcomes: Mapping[str, str] | None = None,
) -> Verdict:
    """The verdict over the rollouts' recorded calls (rollout id → its calls; ``task_of`` pairs rollouts by task;
    ``outcomes``: how each rollout ended, ``"exit 0"`` for a harness that exited by itself without an error)."""
    s = settings or CheckSettings()
    v = Verdict(harness, outcomes=[(outcomes or {}).get(rid, "?") for rid in rollouts] if outcomes else [])
    kinds: Counter[str] = Counter()
    dialects: set[str] = set()
    ext = n_after = trainable = held = 0
    firsts: dict[str, list[tuple[str, list[int], CheckCall]]] = {}
    for rid, calls in rollouts.items():
        v.calls_per_rollout.append(len(calls))
        kinds.update(c.call_kind.upper() for c in calls)
        dialects.update(c.dialect for c in calls)
        prompts = rebuild_prompts(calls)
        mains = _mains(calls)
        e, t, h = _tree_counts(mains, prompts)
        ext, n_after, trainable, held = ext + e, n_after + max(0, len(mains) - 1), trainable + t, held + h
        if mains:
            firsts.setdefault(task_of.get(rid, rid), []).append((rid, prompts[mains[0].call_id], mains[0]))
    v.kinds, v.dialects, v.main_extends = dict(kinds), sorted(dialects), (ext, n_after)
    v.trainable_share = trainable / held if held else 0.0
    _first_prompts(v, firsts, decode)
    _problems(v, declared_dialect, len(rollouts), s)
    return v


def _first_prompts(
    v: Verdict, firsts: Mapping[str, list[tuple[str, list[int], CheckCall]]], decode: Callable[[Sequence[int]], str]
) -> None:
    for pair in firsts.values():
        if len(pair) < 2:
            continue
        (_, a, first_a), (_, b, first_b) = pair[0], pair[1]
        share, text, _kind = _pair_divergence(a, b, decode, window=12)
        if v.first_prompt_share is None or share < v.first_prompt_share:
            v.first_prompt_share, v.divergence = share, text
        # the one served second found the other's prompt in the engine's prefix cache (they may run at once)
        reported = [
            c.cached_prompt_tokens / len(p)
            for p, c in ((a, first_a), (b, first_b))
            if c.cached_prompt_tokens is not None and p
        ]
        if reported:
            cached = max(reported)
            v.first_call_cached_share = min(
                cached, 1.0 if v.first_call_cached_share is None else v.first_call_cached_share
            )


def _problems(v: Verdict, declared: str, n_rollouts: int, s: CheckSettings) -> None:
    add = v.problems.append
    if not any(v.calls_per_rollout):
        add(
            Problem(
                "error",
                f"no model call reached the proxy in {n_rollouts} rollouts",
                "point the harness at the rollout's base URL: env/config templated with ${base_url} or "
                "${base_url_v1}, the key ${secret}, the model ${model}; run it by hand to see its error",
            )
        )
        return
    bad = [o for o in v.outcomes if o != "exit 0"]
    if bad:
        add(
            Problem(
                "error" if len(bad) == len(v.outcomes) else "warning",
                f"{len(bad)} of {len(v.outcomes)} rollouts did not end with exit 0: {', '.join(bad)}",
                "run the adapter's command by hand against the proxy (its stderr says why); a harness that "
                "fails on a proxy answer may need another dialect or a longer timeout",
            )
        )
    if v.dialects and v.dialects != [declared]:
        add(
            Problem(
                "error",
                f"the adapter declares {declared} but the proxy saw {', '.join(v.dialects)}",
                f'set dialect = "{v.dialects[0].lower().replace("_", "-")}" in the adapter file',
            )
        )
    if v.kinds.get("MAIN", 0) == 0:
        add(
            Problem(
                "error",
                "no call was classified MAIN: nothing of this harness trains",
                "give main calls tools and the full system prompt, or the side model another name than the "
                "policy's (CLAWSTREAM_PROXY_SIDE_MODEL_PATTERN)",
            )
        )
    if v.trainable_share <= s.min_trainable_share:
        add(
            Problem(
                "error",
                f"trainable token share {100 * v.trainable_share:.1f} % is not above "
                f"{100 * s.min_trainable_share:.1f} %",
                "the policy must generate the main calls' answers",
            )
        )
    ext, n = v.main_extends
    if ext < n:
        add(
            Problem(
                "warning",
                f"{n - ext} of {n} main calls do not extend the previous one token for token "
                "(the prefix tree branches there; context is stored and prefilled again)",
                "keep the history append-only: no message moved or rewritten between calls, no per-call "
                "reminder re-inserted before the last turn",
            )
        )
    if v.first_prompt_share is None:
        add(
            Problem(
                "error",
                "no task had two rollouts with a main call: first prompts not compared",
                "run with more tasks or a longer rollout timeout",
            )
        )
    elif v.first_prompt_share < s.min_first_prompt_share:
        add(
            Problem(
                "error",
                f"the first prompts of two rollouts of one task differ at "
                f"{100 * v.first_prompt_share:.1f} % of the first prompt, before "
                f"{100 * s.min_first_prompt_share:.0f} %: {v.divergence}",
                "make everything before it the same in every rollout: move per-rollout ids, clocks and paths "
                "to the end of the prompt (or leave them out); a prefix cache and the learner's shared prefix "
                "reuse only what agrees",
            )
        )
