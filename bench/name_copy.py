"""Why greedy delete does not move under RL (#49): can the policy copy a quoted file name into a shell command?

``Delete the file "report.txt" and keep "todo.txt".`` is solved by ``rm report.txt``: the prompt's name is the token
``report`` (after a quote), the command's is `` report`` (after a space), a different token of the tiny tokenizer;
every other template copies a name after a quote, the same token. This measures, on the held-out delete tasks, the
policy's probability of the correct name's first token at the ``rm`` slot of the scripted correct episode (teacher
forced), how often it is the argmax, and the argmax names. With ``--sft-lr`` it then asks whether the skill can be
learnt at all here: supervised steps on correct delete episodes of fresh prompts (every held-out prompt excluded),
the strongest signal there is, the same measurement every ``--every`` steps.

Topics: none. Run: ``.venv/bin/python -m bench.name_copy --model models/warmstart [RUN_DIR/final-model ...]
[--sft-lr 1e-3 --sft-steps 60]``; results in bench/results/rl_inprocess.md.
"""

import argparse
import random
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

import torch

from bench.rl_inprocess import load, seq_of
from producers.tasks.cpu import NAMES, generate
from warmstart.demos import build_episodes, heldout_tasks

HELDOUT = 256  # the demo's held-out tasks per harness; delete is one family in eight of them


def delete_tasks(n: int = HELDOUT) -> list[Any]:
    return [t for t in heldout_tasks(n, 0) if t.metadata["template"] == "delete"]


def probe(model: Any, tok: Any, tasks: list[Any]) -> dict[str, Any]:
    """P(correct name's first token) at the rm slot, argmax hits, the argmax names."""
    first = {n: tok(" " + n)["input_ids"][0] for n in NAMES}  # ' fruit', ' draft' are several tokens: the first
    probs, hits, tops = [], 0, Counter()
    model.eval()
    for task, ep in zip(tasks, build_episodes(tok, tasks, ("openai",)), strict=True):
        prompt, gen = ep.turns[0]
        target = first[task.prompt.split('"')[1].removesuffix(".txt")]
        pos = len(prompt) + gen.index(target)  # the name's position in prompt + gen
        with torch.no_grad():
            p = torch.softmax(model(torch.tensor([prompt + gen])).logits[0, pos - 1].float(), -1)  # (V,)
        probs.append(p[target].item())
        hits += int(p.argmax()) == target
        tops[tok.decode([int(p.argmax())])] += 1
    return {"p_correct": sum(probs) / len(probs), "argmax_correct": hits, "tasks": len(tasks), "argmax": tops}


def show(label: str, r: dict[str, Any]) -> str:
    top = ", ".join(f"{k!r} {v}" for k, v in r["argmax"].most_common(3))
    return (
        f"{label}: P(correct name) {r['p_correct']:.3f}, argmax correct {r['argmax_correct']}/{r['tasks']} "
        f"(argmax: {top})"
    )


def sft_curve(model: Any, tok: Any, tasks: list[Any], lr: float, steps: int, every: int, batch: int = 8) -> None:
    held = {t.prompt for t in heldout_tasks(HELDOUT, 0)}
    fresh = [t for t in generate("train", 500, 11, exclude=set(held)) if t.metadata["template"] == "delete"]
    seqs = [seq_of(e.turns) for e in build_episodes(tok, fresh, ("openai", "anthropic"))]
    print(f"SFT lr {lr:g}: {len(fresh)} fresh delete prompts x 2 dialects, batches of {batch}", flush=True)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    rng, t0 = random.Random(0), time.time()
    for step in range(1, steps + 1):
        model.train()
        opt.zero_grad()
        for full, mask in rng.sample(seqs, batch):
            ids, m = torch.tensor([full]), torch.tensor(mask[1:], dtype=torch.float32)  # (1, L), (L-1,)
            lp = torch.log_softmax(model(ids).logits[0, :-1], -1).gather(1, ids[0, 1:, None])[:, 0]  # (L-1,)
            (-(lp * m).sum() / m.sum() / batch).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        if step % every == 0:
            print(show(f"  step {step} ({time.time() - t0:.0f} s)", probe(model, tok, tasks)), flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", type=Path, nargs="+", default=[Path("models/warmstart")])
    p.add_argument("--sft-lr", type=float, nargs="*", default=[], help="then SFT the first model at these lrs")
    p.add_argument("--sft-steps", type=int, default=60)
    p.add_argument("--every", type=int, default=20)
    p.add_argument("--threads", type=int, default=2)
    a = p.parse_args(sys.argv[1:])
    torch.set_num_threads(a.threads)
    tasks = delete_tasks()
    for model_dir in a.model:
        tok, model = load(str(model_dir))
        print(show(str(model_dir), probe(model, tok, tasks)), flush=True)
    for lr in a.sft_lr:
        torch.manual_seed(0)
        tok, model = load(str(a.model[0]))
        sft_curve(model, tok, tasks, lr, a.sft_steps, a.every)


if __name__ == "__main__":
    main()
