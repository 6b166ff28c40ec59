"""SFT from the event log (``clawstream model sft --from-topics PREFIX``): a topic prefix's trajectories are the data.

Reads the prefix's ``clawstream.trajectories`` topic to its end (no consumer group, nothing committed), keeps the
complete trajectories with reward >= ``--min-reward`` and trains on exactly the token ids the proxy recorded: one row
per root-to-leaf path, cross-entropy on the model-generated tokens only (the prompt is loss-masked; rows and masks:
``warmstart.sft_rows``). Bounded by optimizer steps and seeded; writes the model directory with ``sft_summary.json``
(recipe, source prefix and record counts, loss and target log-prob before/after on the rows, sha256 of base and
result) as ``models/warmstart`` has.

Topics: ``PREFIX.clawstream.trajectories`` in → a model directory out. Run::

    clawstream model sft --from-topics demo1 --model-dir models/warmstart --out models/from-demos \
        [--min-reward 1.0 --steps 20 --seed 0 --batch-size 2 --lr 1e-3 --score-rows 16 --mix-builtin 0 \\
         --checkpoint-every 0]

``--mix-builtin N`` adds N rows of the shipped warm start's own data (scripted agent-loop episodes, both dialects),
to limit how much of the built-in loop training on a real harness forgets (bench/results/real_harness.md: 160 steps with
64 + 64 rows still took it from 0.615 to 0.396 held out).
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from clawbase.kafka.clients import assign_from_beginning, make_consumer, read_to_end
from clawbase.settings import KafkaSettings, load_settings
from schemas.events import Trajectory
from schemas.topics import TRAJECTORIES
from warmstart.sft import Sequence, _batch_loss, _common_prefix, lr_scale, save_model, weights_sha256
from warmstart.sft_rows import Row, build_rows, target_tokens


@dataclass(frozen=True)
class TopicSFTConfig:
    prefix: str
    min_reward: float = 1.0
    steps: int = 20
    seed: int = 0
    lr: float = 1e-3
    warmup_steps: int = 2
    batch_size: int = 2
    # Rows of one harness start with the same system prompt and tools (13-40k tokens): computed once per batch.
    shared_prefix: bool = True
    # Loss before/after is measured on this many rows (a seeded sample; 0: all): scoring 64 real-harness rows of
    # 14k tokens twice cost more than a few training steps on 2 cores.
    score_rows: int = 16
    # Agent-loop rows of the shipped warm start's data mixed in (10 steps on opencode rows alone took the
    # built-in loop from 0.615 to 0.437 held out: forgetting).
    mix_builtin: int = 0
    checkpoint_every: int = 0  # also save OUT/checkpoints/step-N every this many steps (0: off)

    def __post_init__(self) -> None:
        if self.steps < 1:
            raise ValueError(f"steps must be >= 1, got {self.steps} (pass --steps N with N >= 1)")
        if self.batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {self.batch_size} (pass --batch-size N with N >= 1)")
        if self.score_rows < 0:
            raise ValueError(f"score_rows must be >= 0, got {self.score_rows} (pass --score-rows N, 0 for all)")
        if self.mix_builtin < 0:
            raise ValueError(f"mix_builtin must be >= 0, got {self.mix_builtin} (pass --mix-builtin N, 0 for none)")
        if self.checkpoint_every < 0:
            raise ValueError(
                f"checkpoint_every must be >= 0, got {self.checkpoint_every} (pass --checkpoint-every N, 0 for off)"
            )


def read_records(kafka: KafkaSettings, name: str, event: Any, timeout: float = 60.0) -> list[Any]:
    """Every record of the prefix's topic ``name`` decoded as ``event``, read to its end as of now (no group)."""
    topic = kafka.topic(name)
    consumer = make_consumer(kafka, f"read-{name}-{time.time_ns()}", **{"enable.auto.commit": False})
    try:
        ends = assign_from_beginning(consumer, topic, missing_ok=True)
        return [event.from_bytes(msg.value()) for msg in read_to_end(consumer, topic, ends, timeout=timeout)]
    finally:
        consumer.close()


def read_trajectories(kafka: KafkaSettings, timeout: float = 60.0) -> list[Trajectory]:
    """Every record of the prefix's trajectories topic, read to its end as of now."""
    return read_records(kafka, TRAJECTORIES, Trajectory, timeout)


BUILTIN_HARNESS = {"openai": "agentloop", "anthropic": "agentloop-anthropic"}  # dialect → the harness's name


def builtin_rows(tokenizer: Any, n: int, seed: int = 0) -> list[Row]:
    """``n`` rows of the shipped warm start's data: a scripted correct episode of each of the CPU suite's first train
    tasks through the built-in agent loop, in both dialects (``warmstart.demos``), loss on the assistant tokens."""
    from warmstart.demos import build_episodes, train_tasks
    from warmstart.sft import episode_sequence

    out = []
    for ep in build_episodes(tokenizer, train_tasks((n + 1) // 2, seed))[:n]:
        seq = episode_sequence(ep.dialect, ep.turns)
        harness = BUILTIN_HARNESS[ep.dialect]
        out.append(Row(f"builtin-{ep.task_id}-{harness}", harness, ep.task_id, 1.0, seq.ids, seq.mask))
    return out


def rows_loss(model: Any, rows: list[Row], pad_id: int, shared_prefix: bool = True) -> tuple[Any, int]:
    """Summed cross-entropy of ``rows``' target tokens and their count. With ``shared_prefix`` the rows of each
    harness run their common leading tokens (never a target) once, with gradient, their keys and values repeated
    over the group (``warmstart.sft._batch_loss``): the same loss and gradients as row by row, to float rounding."""
    groups: dict[str, list[Sequence]] = {}
    for r in rows:
        groups.setdefault(r.harness, []).append(Sequence(r.harness, r.ids, r.mask))
    total: Any = 0.0
    count = 0
    for seqs in groups.values():
        loss, n = _batch_loss(model, seqs, _common_prefix(seqs) if shared_prefix and len(seqs) > 1 else 0, pad_id)
        total, count = total + loss, count + n
    return total, count


def score(model: Any, rows: list[Row], pad_id: int, shared_prefix: bool = True, chunk: int = 4) -> dict[str, Any]:
    """Mean token cross-entropy over the rows' target tokens (= minus their mean log-prob), no gradient; ``chunk``
    rows of a harness at a time (their logits are chunk x tail x vocabulary floats)."""
    import torch

    by_harness: dict[str, list[Row]] = {}
    for r in rows:
        by_harness.setdefault(r.harness, []).append(r)
    loss, n = 0.0, 0
    per: dict[str, float] = {}
    with torch.no_grad():
        for harness, group in sorted(by_harness.items()):
            h_loss, h_n = 0.0, 0
            for i in range(0, len(group), chunk):
                total, count = rows_loss(model, group[i : i + chunk], pad_id, shared_prefix)
                h_loss += float(total)
                h_n += count
            per[harness] = round(h_loss / max(h_n, 1), 4)
            loss, n = loss + h_loss, n + h_n
    out: dict[str, Any] = {"loss": loss / max(n, 1), "target_logprob": -loss / max(n, 1), "target_tokens": n}
    if len(per) > 1:
        out["loss_by_harness"] = per
    return out


def sft_from_rows(model_dir: str | Path, out_dir: str | Path, rows: list[Row], cfg: TopicSFTConfig) -> dict[str, Any]:
    """Train ``cfg.steps`` steps on ``rows`` (shuffled each epoch by ``cfg.seed``) and save to ``out_dir``."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if not rows:
        raise ValueError(
            f"prefix {cfg.prefix!r}: no trajectory with reward >= {cfg.min_reward} (lower --min-reward, or record "
            "demonstrations first: clawstream model demos)"
        )
    torch.manual_seed(cfg.seed)
    rng = random.Random(cfg.seed)
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    model.eval()
    scored = rows
    if 0 < cfg.score_rows < len(rows):
        scored = [rows[i] for i in sorted(random.Random(cfg.seed).sample(range(len(rows)), cfg.score_rows))]
    before = score(model, scored, pad, cfg.shared_prefix, chunk=8)
    print(
        f"[sft-topics] {len(rows)} rows, {target_tokens(rows)} target tokens; before (on {len(scored)} rows): {before}",
        flush=True,
    )
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, betas=(0.9, 0.95), weight_decay=0.0)
    order: list[int] = []
    history: list[tuple[int, float]] = []
    t0 = time.perf_counter()
    model.train()
    for step in range(cfg.steps):
        for group in opt.param_groups:
            group["lr"] = cfg.lr * lr_scale(step, cfg.steps, cfg.warmup_steps)
        if len(order) < cfg.batch_size:
            order += rng.sample(range(len(rows)), len(rows))
        batch = [rows[order.pop()] for _ in range(min(cfg.batch_size, len(rows)))]
        loss_sum, n_tok = rows_loss(model, batch, pad, cfg.shared_prefix)
        opt.zero_grad(set_to_none=True)
        (loss_sum / max(n_tok, 1)).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        history.append((step + 1, float(loss_sum.detach()) / max(n_tok, 1)))
        elapsed = time.perf_counter() - t0
        print(f"[sft-topics] step {step + 1}/{cfg.steps} loss {history[-1][1]:.4f} ({elapsed:.0f} s)", flush=True)
        if cfg.checkpoint_every and (step + 1) % cfg.checkpoint_every == 0 and step + 1 < cfg.steps:
            save_model(model, tokenizer, model_dir, Path(out_dir, "checkpoints", f"step-{step + 1}"))
    train_s = time.perf_counter() - t0
    model.eval()
    after = score(model, scored, pad, cfg.shared_prefix, chunk=8)
    print(f"[sft-topics] after: {after}", flush=True)
    save_model(model, tokenizer, model_dir, out_dir)
    return {
        "source": "topics",
        "recipe": asdict(cfg),
        "rows": len(rows),
        "rollouts": sorted({r.rollout_id for r in rows}),
        "harnesses": sorted({r.harness for r in rows}),
        "scored_rows": len(scored),
        "before": before,
        "after": after,
        "history": history,
        "train_s": round(train_s, 2),
        "base_sha256": weights_sha256(model_dir),
        "sha256": weights_sha256(out_dir),
        "torch": torch.__version__,
    }


def sft_from_topics(
    model_dir: str | Path, out_dir: str | Path, cfg: TopicSFTConfig, kafka: KafkaSettings | None = None
) -> dict[str, Any]:
    """Read ``cfg.prefix``'s trajectories, train on the kept ones, write ``out_dir/sft_summary.json``."""
    base = load_settings(KafkaSettings) if kafka is None else kafka
    kafka = base.model_copy(update={"topic_prefix": cfg.prefix})
    trajectories = read_trajectories(kafka)
    rows, skipped = build_rows(trajectories, cfg.min_reward)
    summary: dict[str, Any] = {
        "topic": kafka.topic(TRAJECTORIES),
        "trajectories": len(trajectories),
        "skipped": skipped,
    }
    if rows and cfg.mix_builtin:
        from transformers import AutoTokenizer

        mixed = builtin_rows(AutoTokenizer.from_pretrained(str(model_dir)), cfg.mix_builtin, cfg.seed)
        summary["topic_rows"], summary["builtin_rows"] = len(rows), len(mixed)
        rows = rows + mixed
    summary |= sft_from_rows(model_dir, out_dir, rows, cfg)
    Path(out_dir, "sft_summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    return summary


def main(argv: list[str] | None = None) -> int:
    from clawbase.settings import add_kafka_arguments, kafka_settings

    p = argparse.ArgumentParser(prog="clawstream model sft --from-topics", description=__doc__.split("\n")[0])
    p.add_argument("--from-topics", dest="prefix", metavar="PREFIX", required=True, help="topic prefix to train on")
    p.add_argument("--model-dir", type=Path, required=True, help="the model to start from (HF format)")
    p.add_argument("--out", type=Path, required=True, help="where to save the trained model")
    d = TopicSFTConfig(prefix="")
    p.add_argument("--min-reward", type=float, default=d.min_reward, help="keep rewards >= this (%(default)s)")
    p.add_argument("--steps", type=int, default=d.steps, help="optimizer steps (%(default)s)")
    p.add_argument("--seed", type=int, default=d.seed, help="seed of the order and torch (%(default)s)")
    p.add_argument("--lr", type=float, default=d.lr, help="peak learning rate (%(default)s)")
    p.add_argument("--batch-size", type=int, default=d.batch_size, help="rows per step (%(default)s)")
    p.add_argument(
        "--mix-builtin",
        type=int,
        default=d.mix_builtin,
        metavar="N",
        help="add N agent-loop rows of the shipped warm start's data, to keep the built-in loop (%(default)s)",
    )
    p.add_argument(
        "--checkpoint-every",
        type=int,
        default=d.checkpoint_every,
        metavar="N",
        help="also save OUT/checkpoints/step-N every N steps (0: off)",
    )
    p.add_argument(
        "--no-shared-prefix", action="store_true", help="run every row's whole context (slower; the same loss)"
    )
    p.add_argument(
        "--score-rows",
        type=int,
        default=d.score_rows,
        help="rows scored before/after, seeded sample (0: all; %(default)s)",
    )
    add_kafka_arguments(p)
    a = p.parse_args(argv)
    try:
        cfg = TopicSFTConfig(
            a.prefix,
            a.min_reward,
            a.steps,
            a.seed,
            a.lr,
            d.warmup_steps,
            a.batch_size,
            not a.no_shared_prefix,
            a.score_rows,
            a.mix_builtin,
            a.checkpoint_every,
        )
        summary = sft_from_topics(a.model_dir, a.out, cfg, kafka_settings(a))
    except ValueError as exc:
        p.error(str(exc))
    print(json.dumps({k: summary[k] for k in ("rows", "before", "after", "sha256")}))
    return 0


def model_sft(argv: list[str]) -> int:
    """``clawstream model sft``: from a topic prefix with ``--from-topics``, else the synthetic warm start."""
    if any(a == "--from-topics" or a.startswith("--from-topics=") for a in argv):
        return main(argv)
    from warmstart.sft import main as synthetic

    return synthetic(argv)


if __name__ == "__main__":
    sys.exit(main())
