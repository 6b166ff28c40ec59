"""In-process GRPO on the CPU suite, no Kafka or services: how far can RL move the shipped warm start, and along what?

An experiment behind issue #13's tuning (bench/results/rl_inprocess.md), kept so its numbers can be re-measured.
Rollouts run through the real built-in agent loop against the in-process proxy (``warmstart.episodes``),
sampled at temperature 1 from the model with HF ``generate``, graded by the tasks' own graders. Each step: ``--tasks``
training tasks of the suite's 96 (random dialect each) × ``--group`` rollouts, GRPO advantages per group, on-policy
REINFORCE loss (mean over rollouts of A × the rollout's token-mean logprob), one clipped AdamW step. Then the held-out
reward, sampled, on ``--eval`` tasks in the OpenAI dialect. Parameter groups: ``--lr`` (all weights), ``--norm-lr``
(the RMSNorm gains), ``--final-norm-lr`` (the last norm's gain), ``--scale-lr`` (one learned logit scale, as
``learner/logit_scale.py``), ``--only-norm`` (freeze the matrices). ``--temperatures`` instead measures the warm
start's held-out reward at other sampling temperatures and greedily.

Topics: none. Run: ``.venv/bin/python -m bench.rl_inprocess --lr 3e-5 --scale-lr 5e-2 --steps 12 --threads 1``
"""

import argparse
import os
import random
import sys
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402
from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig  # noqa: E402

from policy.chat_template import IM_END  # noqa: E402
from producers.proxy.render import TemplateRenderer  # noqa: E402
from producers.tasks.cpu import generate  # noqa: E402
from producers.tasks.model import Task  # noqa: E402
from warmstart.demos import heldout_tasks  # noqa: E402
from warmstart.episodes import EpisodeResult, run_episode  # noqa: E402

WARM_START = "models/warmstart"


def load(model_dir: str = WARM_START) -> tuple:
    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    return tok, model


def sampling_policy(model, eos: int, temperature: float = 1.0, max_new: int = 96):  # noqa: ANN001, ANN201
    """temperature 0 = greedy; else sampling with top_k=0, top_p=1 set explicitly (docs/method.md)."""
    if temperature == 0:
        cfg = GenerationConfig(
            do_sample=False,
            max_new_tokens=max_new,
            eos_token_id=eos,
            pad_token_id=eos,
            top_k=None,
            top_p=None,
            temperature=None,
        )
    else:
        cfg = GenerationConfig(
            do_sample=True,
            temperature=temperature,
            top_k=0,
            top_p=1.0,
            max_new_tokens=max_new,
            eos_token_id=eos,
            pad_token_id=eos,
        )

    def policy(prompt: list[int]) -> list[int]:
        ids = torch.tensor([prompt])  # (1, L)
        with torch.no_grad():
            out = model.generate(ids, attention_mask=torch.ones_like(ids), generation_config=cfg)
        return out[0, len(prompt) :].tolist()

    return policy


def summarize(res: list[EpisodeResult], tasks: list[Task]) -> str:
    tmpl = {t.task_id: t.metadata["template"] for t in tasks}
    rs = [x.reward or 0.0 for x in res]
    m = sum(rs) / len(rs)
    se = (sum((x - m) ** 2 for x in rs) / (len(rs) - 1)) ** 0.5 / len(rs) ** 0.5
    by: dict[str, list[float]] = {}
    for x in res:
        by.setdefault(tmpl[x.task_id], []).append(x.reward or 0.0)
    solved = sum(x >= 1 for x in rs) / len(rs)
    return f"mean {m:.3f} ± {se:.3f} solved {solved:.2f} n={len(rs)} " + " ".join(
        f"{k}:{sum(v) / len(v):.2f}" for k, v in sorted(by.items())
    )


def temperatures(threads: int, n: int) -> None:
    torch.set_num_threads(threads)
    tok, model = load()
    ho = heldout_tasks(n, 0)
    eos, r = tok.convert_tokens_to_ids(IM_END), TemplateRenderer(tok)
    for temperature in (1.0, 0.7, 0.5, 0.0):
        pol = sampling_policy(model, eos, temperature)
        res = [run_episode(t, "openai", pol, r) for t in ho]
        print("T", temperature, summarize(res, ho), flush=True)


def seq_of(turns: list[tuple[list[int], list[int]]]) -> tuple[list[int], list[int]]:
    """The rollout as one sequence (the built-in loop only appends) and its mask of generated tokens."""
    full = turns[-1][0] + turns[-1][1]
    mask = [0] * len(full)
    for prompt, gen in turns:
        if full[: len(prompt) + len(gen)] != prompt + gen:
            raise SystemExit("a call's prompt is not the previous history: not a single path")
        for i in range(len(prompt), len(prompt) + len(gen)):
            mask[i] = 1
    return full, mask


def main() -> None:  # noqa: PLR0915 - an experiment, one screen
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--tasks", type=int, default=8)
    p.add_argument("--group", type=int, default=8)
    p.add_argument("--lr", type=float, default=5e-5)
    p.add_argument("--norm-lr", type=float, default=0.0)
    p.add_argument("--final-norm-lr", type=float, default=0.0)
    p.add_argument("--scale-lr", type=float, default=0.0)
    p.add_argument("--only-norm", action="store_true")
    p.add_argument("--eval", type=int, default=128)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--temperatures", action="store_true")
    a = p.parse_args(sys.argv[1:])
    if a.temperatures:
        temperatures(a.threads, a.eval)
        return
    torch.set_num_threads(a.threads)
    torch.manual_seed(a.seed)
    rng = random.Random(a.seed)
    tok, model = load()
    eos, r = tok.convert_tokens_to_ids(IM_END), TemplateRenderer(tok)
    pool, ho = generate("train", 96, 0), heldout_tasks(a.eval, 0)
    named = list(model.named_parameters())
    fin = [model.model.norm.weight]
    norm = [q for n, q in named if "norm" in n and n != "model.norm.weight"]
    rest = [q for n, q in named if "norm" not in n]
    groups = [{"params": norm, "lr": a.norm_lr or a.lr}, {"params": fin, "lr": a.final_norm_lr or a.norm_lr or a.lr}]
    logscale = torch.nn.Parameter(torch.zeros(()))
    if a.scale_lr:
        groups.append({"params": [logscale], "lr": a.scale_lr})
        model.model.norm.register_forward_hook(lambda _m, _i, o: o * logscale.exp())
    if not a.only_norm:
        groups.append({"params": rest, "lr": a.lr})
    opt = torch.optim.AdamW(groups, betas=(0.9, 0.999), weight_decay=0.0)
    for step in range(a.steps):
        t0 = time.time()
        model.eval()
        pol = sampling_policy(model, eos)
        batch = []
        for t in rng.sample(pool, a.tasks):
            d = rng.choice(("openai", "anthropic"))
            eps = [run_episode(t, d, pol, r) for _ in range(a.group)]
            rs = torch.tensor([e.reward or 0.0 for e in eps])
            adv = (rs - rs.mean()) / (rs.std() + 1e-6)
            batch += [(e, ad) for e, ad in zip(eps, adv.tolist(), strict=True) if abs(ad) > 1e-8]
        ts = time.time() - t0
        model.train()
        opt.zero_grad()
        n = max(len(batch), 1)
        for e, ad in batch:
            full, mask = seq_of(e.turns)
            ids, m = torch.tensor([full]), torch.tensor(mask[1:], dtype=torch.float32)  # (1, L), (L-1,)
            logits = model(ids).logits[0, :-1]  # (L-1, V)
            lp = torch.log_softmax(logits.float(), -1).gather(1, ids[0, 1:, None])[:, 0]  # (L-1,)
            (-(ad * (lp * m).sum() / m.sum()) / n).backward()
        gn = torch.nn.utils.clip_grad_norm_([q for g in groups for q in g["params"]], 1.0)
        opt.step()
        print(
            f"step {step} trainable {len(batch)} sample {ts:.0f}s train {time.time() - t0 - ts:.0f}s "
            f"gradnorm {gn:.3f} finalnorm {model.model.norm.weight.mean().item():.3f} "
            f"scale {logscale.exp().item():.3f}",
            flush=True,
        )
    model.eval()
    t0 = time.time()
    res = [run_episode(t, "openai", sampling_policy(model, eos), r) for t in ho]
    print("EVAL final", summarize(res, ho), f"{time.time() - t0:.0f}s", flush=True)


if __name__ == "__main__":
    main()
