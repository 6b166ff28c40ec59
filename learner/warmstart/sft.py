"""Supervised warm start of the tiny policy on synthetic agent demonstrations, and an offline greedy evaluation.

RL through the built-in agent loops only has signal once the policy solves some tasks (DESIGN.md "Model for CPU
runs": a start of ~30-60%). This module writes a correct solution episode for each task of the built-in CPU suite
(``producers.tasks.cpu``) in both agent-loop dialects and trains the model on it with plain cross-entropy on the
assistant tokens.

Demonstrations are produced by the *real* agent loop (``producers.harnesses.builtin_loop.run_openai`` / ``run_anthropic``)
talking to an in-process stand-in for the serving proxy (:class:`InProcessProxy`): every request body the loop
builds is parsed with ``producers.proxy.dialects``, rendered with ``producers.proxy.render.RolloutRenderer`` (TITO, exactly as
the proxy does), answered by a *policy* (a callable ``prompt ids -> generated ids``), parsed back with
``producers.proxy.tool_parse`` and returned in the dialect's JSON (``producers.proxy.emit``). For a demonstration the policy
is scripted (it returns the canonical tool call); for evaluation it is the model, greedy. The loop's tools run
against a temporary workspace and the task's own grader scores it. The loop's HTTP ``post`` is swapped for the
in-process proxy with ``unittest.mock.patch`` (agentloop has no injectable transport; nothing in it is changed).

Training uses two exact shortcuts (same gradients as training every turn separately on its full prompt):
* TITO makes an episode append-only (turn k+1's prompt starts with turn k's prompt + generated ids), so one
  forward over the final sequence with the loss on every assistant span equals one forward per turn.
* Episodes of one dialect share the system prompt + tool schemas; its KV is computed once per batch (with grad)
  and repeated over the batch (DESIGN.md measured 2.2x).

Run::

    HF_HUB_OFFLINE=1 .venv/bin/python -m learner.warmstart.sft --model-dir models/tiny --out models/tiny-sft [--minutes 8]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import shutil
import string
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any
from unittest import mock

from policy.chat_template import IM_END
from producers.harnesses import builtin_loop as agentloop
from producers.proxy import emit
from producers.proxy.conversation import Message, ToolCall
from producers.proxy.dialects import PARSERS
from producers.proxy.render import RolloutRenderer, TemplateRenderer, common_prefix_len
from producers.proxy.tool_parse import parse_turn
from producers.tasks.cpu import generate
from producers.tasks.grading import GraderFailure, parse_reward_float, parse_subscores
from producers.tasks.model import Task
from schemas.events import Dialect

os.environ.setdefault("HF_HUB_OFFLINE", "1")

DIALECTS = ("openai", "anthropic")
_WIRE = {"openai": Dialect.OPENAI_CHAT, "anthropic": Dialect.ANTHROPIC_MESSAGES}
_TOOLS = {"openai": agentloop.OPENAI_TOOLS, "anthropic": agentloop.ANTHROPIC_TOOLS}
FINISH_ARGUMENT = "done"
# Held-out prompts the SFT data must never contain: the first this-many of the suite's held-out split (a held-out
# split of any smaller size is a prefix of it, so every evaluation up to this size is on unseen prompts).
HELDOUT_RESERVE = 256
TRAIN_CHUNK = 400  # <= 8 templates x (132 - HELDOUT_RESERVE / 8) distinct prompts, with room to spare
SUITE_TRAIN = 96  # cpu_suite's default train size: its held-out split excludes exactly these prompts

Policy = Callable[[list[int]], list[int]]  # prompt ids -> generated ids (ending with eos when it stopped)


# --- the agent loop against an in-process proxy ---------------------------------------------------------------


class InProcessProxy:
    """The serving proxy without HTTP/Kafka: dialect parse -> TITO render -> policy -> parse_turn -> dialect JSON.

    Mirrors ``producers.proxy.app.Proxy._call`` (same renderer calls, same answer message, same emit functions).
    """

    def __init__(self, renderer: TemplateRenderer, dialect: str, policy: Policy) -> None:
        self.r = renderer
        self.dialect = _WIRE[dialect]
        self.policy = policy
        self.rollout = RolloutRenderer(renderer)
        self.turns: list[tuple[list[int], list[int]]] = []  # (prompt ids, generated ids) per call

    def post(self, url: str, body: dict[str, Any], headers: dict[str, str], timeout: float) -> dict[str, Any]:
        # Through JSON like the real wire, so nothing of the loop's Python objects leaks into the conversation.
        body = json.loads(json.dumps(body))
        parsed = PARSERS[self.dialect](body)
        rendered = self.rollout.render(parsed.conversation)
        gen = list(self.policy(rendered.prompt_ids))
        turn = parse_turn(self.r.decode(gen))
        seq = len(self.turns)
        prefix = "toolu_" if self.dialect == Dialect.ANTHROPIC_MESSAGES else "call_"
        ids = [f"{prefix}{seq:012d}{i:012d}" for i in range(len(turn.tool_calls))]
        calls = tuple(ToolCall(i, c.name, c.arguments) for i, c in zip(ids, turn.tool_calls, strict=True))
        self.rollout.record(f"call{seq}", seq, rendered, gen, Message("assistant", turn.text, turn.reasoning, calls))
        self.turns.append((rendered.prompt_ids, gen))
        finish = "stop" if gen and gen[-1] == self.r.im_end_id else "length"
        answer = emit.Answer(turn, finish, len(rendered.prompt_ids), len(gen), parsed.model, f"r{seq}", 0, ids)
        if self.dialect == Dialect.ANTHROPIC_MESSAGES:
            return emit.anthropic_message(answer)
        return emit.chat_completion(answer)


@dataclass
class EpisodeResult:
    task_id: str
    dialect: str
    why: str  # how the loop ended: finished | answered without a tool call | max turns
    turns: list[tuple[list[int], list[int]]]
    reward: float | None = None
    sub_scores: dict[str, float] = field(default_factory=dict)


def grade_workspace(task: Task, workspace: Path, timeout_s: float = 60.0) -> tuple[float, dict[str, float]]:
    """Run the task's grader as a local subprocess (same argv templating as ``producers.tasks.grading``)."""
    g = task.grader
    with tempfile.TemporaryDirectory(prefix="sft-grader-") as gdir:
        for rel, data in g.files.items():
            path = Path(gdir, rel)
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes(data)
        transcript = Path(gdir, "transcript.json")
        transcript.write_text("[]")
        values = {"python": sys.executable, "grader_dir": gdir, "workspace": str(workspace),
                  "transcript": str(transcript)}  # fmt: skip
        argv = [string.Template(a).substitute(values) for a in g.argv]
        env = {**os.environ, "WORKSPACE": str(workspace), "PYTHONDONTWRITEBYTECODE": "1"}
        proc = subprocess.run(argv, cwd=gdir, env=env, capture_output=True, text=True, timeout=timeout_s)
    if proc.returncode != 0:
        raise GraderFailure(f"grader {g.name} exited {proc.returncode}: {proc.stderr[-300:]}")
    return (parse_subscores if g.output == "subscores_json" else parse_reward_float)(proc.stdout)


def run_episode(
    task: Task,
    dialect: str,
    policy: Policy,
    renderer: TemplateRenderer,
    *,
    max_turns: int = 8,
    grade: bool = True,
) -> EpisodeResult:
    """One agent-loop episode on a fresh copy of the task's workspace; graded with the task's grader."""
    proxy = InProcessProxy(renderer, dialect, policy)
    with tempfile.TemporaryDirectory(prefix="sft-ws-") as ws:
        root = Path(ws)
        for rel, data in task.files.items():
            (root / rel).parent.mkdir(parents=True, exist_ok=True)
            (root / rel).write_bytes(data)
        args = argparse.Namespace(prompt=task.prompt, base_url="http://in-process", model="policy",
                                  max_turns=max_turns, max_tokens=1024, http_timeout=60.0)  # fmt: skip
        loop = agentloop.run_openai if dialect == "openai" else agentloop.run_anthropic
        with mock.patch.object(agentloop, "post", proxy.post):
            why = loop(args, agentloop.Tools(root, run_timeout=10.0), "")
        result = EpisodeResult(task.task_id, dialect, why, proxy.turns)
        if grade:
            result.reward, result.sub_scores = grade_workspace(task, root)
    return result


# --- demonstrations ---------------------------------------------------------------------------------------------


def tool_call_text(name: str, arguments: dict[str, Any]) -> str:
    """The assistant turn the policy must generate for one tool call: the template's own markup + ``<|im_end|>``."""
    args = json.dumps(arguments, ensure_ascii=False)  # the template's `tojson`: ", " / ": " separators
    return f'<tool_call>\n{{"name": "{name}", "arguments": {args}}}\n</tool_call>{IM_END}'


def solution_calls(task: Task, dialect: str) -> list[tuple[str, dict[str, Any]]]:
    """A correct (name, arguments) sequence for a task, derived from its ``checks.json`` (CPU suite graders).

    Read every input file first (unless the task only deletes), then write each file whose expected content
    differs from what is there, remove each file that must be absent, then finish.
    """
    checks = json.loads(task.grader.files["checks.json"])
    by_role = {t[0]: (name, t[3]) for name, t in _TOOLS[dialect].items()}

    def call(role: str, *values: Any) -> tuple[str, dict[str, Any]]:
        name, arg_names = by_role[role]
        return name, dict(zip(arg_names, values, strict=False))

    current = {rel: data.decode() for rel, data in task.files.items()}
    absent = [c["path"] for c in checks if c["kind"] == "absent"]
    out = [] if absent else [call("read", rel) for rel in current]
    for c in checks:
        if c["kind"] in ("equals", "lines"):
            want = c["text"] if c["kind"] == "equals" else "\n".join(c["lines"])
            if current.get(c["path"], "").strip() != want.strip():
                out.append(call("write", c["path"], want))
                current[c["path"]] = want
    out += [call("run", f"rm {path}") for path in absent]
    out.append(call("finish", FINISH_ARGUMENT))
    return out


def scripted_policy(tokenizer: Any, texts: list[str]) -> Policy:
    """A policy returning ``texts`` one per call (then a bare ``<|im_end|>``: an answer without a tool call)."""
    queue = [tokenizer.encode(t, add_special_tokens=False) for t in texts]
    eos = tokenizer.convert_tokens_to_ids(IM_END)
    return lambda _prompt: queue.pop(0) if queue else [eos]


def train_tasks(n_tasks: int, seed: int = 0) -> list[Task]:
    """``n_tasks`` training tasks; never a prompt of the first ``HELDOUT_RESERVE`` held-out tasks.

    Several templates have only 132 distinct prompts (a pair of file names; the contents vary), so the tasks come
    in chunks of ``TRAIN_CHUNK`` with seeds ``seed``, ``seed + 1000``, ...: prompts are distinct within a chunk and
    may repeat across chunks with other file contents. The first chunk starts with the suite's train split.
    """
    reserved = {t.prompt for t in heldout_tasks(HELDOUT_RESERVE, seed)}
    out: list[Task] = []
    for chunk in range((n_tasks + TRAIN_CHUNK - 1) // TRAIN_CHUNK):
        k = min(TRAIN_CHUNK, n_tasks - len(out))
        out += [replace(t, task_id=f"{t.task_id}-c{chunk}") if chunk else t
                for t in generate("train", k, seed + 1000 * chunk, exclude=set(reserved))]  # fmt: skip
    return out


def heldout_tasks(n: int, seed: int = 0) -> list[Task]:
    """The CPU suite's held-out split (``cpu_suite(seed=seed)``), extended to ``n`` tasks."""
    return generate("heldout", n, seed + 1, exclude={t.prompt for t in generate("train", SUITE_TRAIN, seed)})


def build_episodes(tokenizer: Any, tasks: list[Task], dialects: tuple[str, ...] = DIALECTS) -> list[EpisodeResult]:
    """One scripted (correct) episode per task and dialect, through the real agent loop (ungraded, fast)."""
    renderer = TemplateRenderer(tokenizer)
    out = []
    for task in tasks:
        for dialect in dialects:
            texts = [tool_call_text(n, a) for n, a in solution_calls(task, dialect)]
            out.append(run_episode(task, dialect, scripted_policy(tokenizer, texts), renderer, grade=False))
    return out


def build_demonstrations(
    tokenizer_dir: str | Path, split: str = "train", n_tasks: int = 1024, seed: int = 0
) -> list[tuple[list[int], list[int]]]:
    """(prompt ids, target ids) for every assistant turn of a correct episode of each task, in both dialects."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    tasks = train_tasks(n_tasks, seed) if split == "train" else heldout_tasks(n_tasks, seed)
    return [turn for ep in build_episodes(tokenizer, tasks) for turn in ep.turns]


@dataclass
class Sequence:
    """An episode as one training sequence: ``ids`` (L,) and ``mask`` (L,) = 1 on the assistant tokens."""

    dialect: str
    ids: list[int]
    mask: list[int]


def episode_sequence(dialect: str, turns: list[tuple[list[int], list[int]]]) -> Sequence:
    """Merge an append-only episode into one sequence (raises if TITO's prefix property does not hold)."""
    last_prompt, last_gen = turns[-1]
    ids = last_prompt + last_gen
    mask = [0] * len(ids)
    for prompt, gen in turns:
        if ids[: len(prompt) + len(gen)] != prompt + gen:
            raise ValueError("episode is not append-only: a later prompt does not extend an earlier turn")
        mask[len(prompt) : len(prompt) + len(gen)] = [1] * len(gen)
    return Sequence(dialect, ids, mask)


# --- training ---------------------------------------------------------------------------------------------------


def _cache_kw() -> str:
    """transformers >= 5.2x calls the KV-cache argument ``cache``; earlier versions ``past_key_values``."""
    import inspect

    from transformers import Qwen3ForCausalLM

    return "cache" if "cache" in inspect.signature(Qwen3ForCausalLM.forward).parameters else "past_key_values"


_CACHE_KW = ""


def _batch_loss(model: Any, seqs: list[Sequence], prefix_len: int, pad_id: int) -> tuple[Any, int]:
    """Summed token cross-entropy of a same-dialect batch and its number of target tokens.

    The first ``prefix_len`` tokens are identical in every sequence (system prompt + tools, never a target): their
    KV is computed once, with grad, and repeated over the batch.
    """
    import torch

    global _CACHE_KW
    _CACHE_KW = _CACHE_KW or _cache_kw()
    b = len(seqs)
    tails = [s.ids[prefix_len:] for s in seqs]
    width = max(len(t) for t in tails)
    ids = torch.full((b, width), pad_id, dtype=torch.long)  # (B, T); right padding never affects earlier tokens
    labels = torch.full((b, width), -100, dtype=torch.long)  # (B, T): label of the token at each position
    for i, (s, tail) in enumerate(zip(seqs, tails, strict=True)):
        ids[i, : len(tail)] = torch.tensor(tail)
        m = torch.tensor(s.mask[prefix_len:], dtype=torch.bool)
        labels[i, : len(tail)] = torch.where(m, torch.tensor(tail), torch.tensor(-100))
    if prefix_len:
        prefix = torch.tensor([seqs[0].ids[:prefix_len]])  # (1, P)
        out = model(input_ids=prefix, use_cache=True)
        cache = getattr(out, _CACHE_KW)
        cache.batch_repeat_interleave(b)  # (1, H, P, D) -> (B, H, P, D) per layer, still attached to the graph
        first = out.logits[:, -1:].expand(b, -1, -1)  # (B, 1, V): the prefix's last position predicts tail[0]
        rest = model(input_ids=ids, use_cache=False, **{_CACHE_KW: cache}).logits  # (B, T, V)
        pred, gold = torch.cat([first, rest[:, :-1]], 1), labels  # (B, T, V), (B, T)
    else:
        pred, gold = model(input_ids=ids).logits[:, :-1], labels[:, 1:]  # (B, T-1, V), (B, T-1)
    loss = torch.nn.functional.cross_entropy(pred.reshape(-1, pred.shape[-1]), gold.reshape(-1), reduction="sum")
    return loss, int((gold != -100).sum())


@dataclass
class SFTConfig:
    minutes: float = 8.0
    steps: int = 0  # 0: time budget only
    lr: float = 2e-3
    warmup_steps: int = 20
    batch_size: int = 16
    n_tasks: int = 1024
    seed: int = 0
    eval_every: int = 0  # steps; 0: evaluate only at the end
    eval_tasks: int = 64
    log_every: int = 10
    shared_prefix: bool = True


def sft(model_dir: str | Path, out_dir: str | Path, cfg: SFTConfig | None = None, **overrides: Any) -> dict[str, Any]:
    """Train on demonstrations for ``cfg.minutes`` (or ``cfg.steps``) and save the model to ``out_dir``.

    Returns a summary (steps, minutes, final loss, and the held-out evaluation when ``cfg.eval_tasks`` > 0).
    """
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    cfg = replace(cfg or SFTConfig(), **overrides)  # unknown names raise TypeError
    t_start = time.perf_counter()
    torch.manual_seed(cfg.seed)
    rng = random.Random(cfg.seed)
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    episodes = build_episodes(tokenizer, train_tasks(cfg.n_tasks, cfg.seed))
    pools = {d: [episode_sequence(e.dialect, e.turns) for e in episodes if e.dialect == d] for d in DIALECTS}
    prefix = {d: _common_prefix(p) if cfg.shared_prefix else 0 for d, p in pools.items()}
    n_target = sum(sum(s.mask) for p in pools.values() for s in p)
    print(f"[sft] {len(episodes)} episodes, {n_target} target tokens, shared prefix {prefix} "
          f"({time.perf_counter() - t_start:.1f}s)", flush=True)  # fmt: skip

    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, betas=(0.9, 0.95), weight_decay=0.0)
    budget_s = cfg.minutes * 60.0
    t0 = time.perf_counter()
    step, window_loss, window_tok, window_pos, t_log, eval_s = 0, 0.0, 0, 0, 0.0, 0.0
    history: list[tuple[int, float]] = []
    order: dict[str, list[int]] = {d: [] for d in DIALECTS}
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    model.train()
    while True:
        elapsed = time.perf_counter() - t0 - eval_s
        progress = max(step / cfg.steps if cfg.steps else 0.0, elapsed / budget_s if budget_s > 0 else 0.0)
        if progress >= 1.0:
            break
        # Linear warmup, then cosine to 10% over the budget (by steps or by time, whichever runs out first).
        scale = min(1.0, (step + 1) / cfg.warmup_steps) * (0.1 + 0.45 * (1 + math.cos(math.pi * progress)))
        for group in opt.param_groups:
            group["lr"] = cfg.lr * scale
        dialect = DIALECTS[step % len(DIALECTS)]
        if len(order[dialect]) < cfg.batch_size:  # reshuffle each epoch
            order[dialect] += rng.sample(range(len(pools[dialect])), len(pools[dialect]))
        batch = [pools[dialect][order[dialect].pop()] for _ in range(min(cfg.batch_size, len(pools[dialect])))]
        loss_sum, n_tok = _batch_loss(model, batch, prefix[dialect], pad)
        opt.zero_grad(set_to_none=True)
        (loss_sum / max(n_tok, 1)).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        step += 1
        window_loss += float(loss_sum.detach())
        window_tok += n_tok
        window_pos += sum(len(s.ids) for s in batch)
        if step % cfg.log_every == 0:
            dt = time.perf_counter() - t0 - eval_s
            history.append((step, window_loss / max(window_tok, 1)))
            print(f"[sft] step {step} {dt / 60:.1f}min loss {history[-1][1]:.4f} lr {cfg.lr * scale:.2e} "
                  f"{window_pos / max(dt - t_log, 1e-9):.0f} tok/s", flush=True)  # fmt: skip
            t_log = dt
            window_loss, window_tok, window_pos = 0.0, 0, 0
        if cfg.eval_every and step % cfg.eval_every == 0:  # not counted in the time budget
            t_eval = time.perf_counter()
            model.eval()
            report = evaluate_model(model, tokenizer, n=min(cfg.eval_tasks, 16), seed=cfg.seed)
            model.train()
            eval_s += time.perf_counter() - t_eval
            print(f"[sft] eval step {step} ({time.perf_counter() - t_eval:.0f}s): {_fmt(report)}", flush=True)
    train_s = time.perf_counter() - t0 - eval_s
    model.eval()
    save_model(model, tokenizer, model_dir, out_dir)
    summary: dict[str, Any] = {"steps": step, "train_minutes": round(train_s / 60, 2),
                               "final_loss": history[-1][1] if history else None, "history": history,
                               "config": vars(cfg)}  # fmt: skip
    if cfg.eval_tasks:
        summary["eval"] = evaluate_model(model, tokenizer, n=cfg.eval_tasks, seed=cfg.seed)
        print(f"[sft] held-out eval: {_fmt(summary['eval'])}", flush=True)
    Path(out_dir, "sft_summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    return summary


def _common_prefix(seqs: list[Sequence]) -> int:
    """Tokens every sequence starts with, minus one so the shared part never reaches a target (P >= 0)."""
    n = min(len(s.ids) for s in seqs)
    for s in seqs[1:]:
        n = min(n, common_prefix_len(seqs[0].ids, s.ids))
    first_target = min(s.mask.index(1) for s in seqs)
    return max(0, min(n, first_target) - 1)


def save_model(model: Any, tokenizer: Any, model_dir: str | Path, out_dir: str | Path) -> None:
    """HF-format weights + the source directory's tokenizer / template / model-info files."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    for src in Path(model_dir).iterdir():
        skip = src.suffix == ".safetensors" or src.name in ("config.json", "generation_config.json", "sft_summary.json")
        if src.is_file() and not skip:
            shutil.copy2(src, out / src.name)


# --- evaluation -------------------------------------------------------------------------------------------------


def greedy_policy(model: Any, eos_id: int, max_new_tokens: int = 96) -> Policy:
    import torch
    from transformers import GenerationConfig

    config = GenerationConfig(do_sample=False, max_new_tokens=max_new_tokens, eos_token_id=eos_id,
                              pad_token_id=eos_id, top_k=None, top_p=None, temperature=None)  # fmt: skip

    def policy(prompt: list[int]) -> list[int]:
        ids = torch.tensor([prompt])  # (1, L)
        with torch.no_grad():
            out = model.generate(ids, attention_mask=torch.ones_like(ids), generation_config=config)
        return out[0, len(prompt) :].tolist()

    return policy


def evaluate_policy(
    make_policy: Callable[[Task, str], Policy], tokenizer: Any, tasks: list[Task], dialects: tuple[str, ...] = DIALECTS
) -> dict[str, Any]:
    """Run every task in every dialect with the policy ``make_policy(task, dialect)``; mean reward + solve rate."""
    renderer = TemplateRenderer(tokenizer)
    results = [run_episode(t, d, make_policy(t, d), renderer) for t in tasks for d in dialects]
    report: dict[str, Any] = {"episodes": len(results)}
    for name, subset in [("all", results), *((d, [r for r in results if r.dialect == d]) for d in dialects)]:
        rewards = [r.reward or 0.0 for r in subset]
        n = max(len(rewards), 1)
        report[name] = {"mean_reward": sum(rewards) / n, "solve_rate": sum(x >= 1.0 for x in rewards) / n,
                        "n": len(subset)}  # fmt: skip
    templates = {t.task_id: t.metadata.get("template", "?") for t in tasks}
    by_template: dict[str, list[float]] = {}
    for r in results:
        by_template.setdefault(templates[r.task_id], []).append(r.reward or 0.0)
    report["by_template"] = {k: round(sum(v) / len(v), 3) for k, v in sorted(by_template.items())}
    return report


def evaluate_model(model: Any, tokenizer: Any, n: int = 64, seed: int = 0, split: str = "heldout") -> dict[str, Any]:
    tasks = heldout_tasks(n, seed) if split == "heldout" else train_tasks(n, seed)
    policy = greedy_policy(model, tokenizer.convert_tokens_to_ids(IM_END))
    return evaluate_policy(lambda _t, _d: policy, tokenizer, tasks)


def evaluate(model_dir: str | Path, split: str = "heldout", n: int = 64, seed: int = 0) -> dict[str, Any]:
    """Greedy offline evaluation of a saved model on ``n`` tasks of ``split`` in both dialects."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    return evaluate_model(model, tokenizer, n=n, seed=seed, split=split)


def _fmt(report: dict[str, Any]) -> str:
    parts = [f"{k} reward {v['mean_reward']:.3f} solved {v['solve_rate']:.3f}" for k, v in report.items()
             if isinstance(v, dict) and "mean_reward" in v]  # fmt: skip
    return "; ".join(parts) + f"; by template {report['by_template']}"


def main(argv: list[str] | None = None) -> int:
    d = SFTConfig()
    p = argparse.ArgumentParser(prog="python -m learner.warmstart.sft", description=__doc__.split("\n")[0])
    p.add_argument("--model-dir", type=Path, required=True, help="model to warm-start (policy.tiny_model output)")
    p.add_argument("--out", type=Path, help="where to save the warm-started model (required unless --eval-only)")
    p.add_argument("--minutes", type=float, default=d.minutes, help="training time budget")
    p.add_argument("--steps", type=int, default=d.steps, help="step budget (0: time budget only)")
    p.add_argument("--lr", type=float, default=d.lr)
    p.add_argument("--batch-size", type=int, default=d.batch_size)
    p.add_argument("--n-tasks", type=int, default=d.n_tasks, help="training tasks (each in both dialects)")
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--eval-every", type=int, default=d.eval_every, help="steps between small evals (0: off)")
    p.add_argument("--eval-tasks", type=int, default=d.eval_tasks, help="held-out tasks for the final eval (x2)")
    p.add_argument("--eval-only", action="store_true", help="only evaluate --model-dir")
    a = p.parse_args(argv)
    if a.eval_only:
        report = evaluate(a.model_dir, n=a.eval_tasks, seed=a.seed)
        print(json.dumps(report, indent=2))
        return 0
    if a.out is None:
        p.error("--out is required")
    cfg = SFTConfig(minutes=a.minutes, steps=a.steps, lr=a.lr, batch_size=a.batch_size, n_tasks=a.n_tasks,
                    seed=a.seed, eval_every=a.eval_every, eval_tasks=a.eval_tasks)  # fmt: skip
    sft(a.model_dir, a.out, cfg)
    return 0


if __name__ == "__main__":
    sys.exit(main())
