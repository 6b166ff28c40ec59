"""PPO's value model: a value head on the policy's last hidden state, and its pretraining from recorded trajectories.

Departure from the paper: ClawGym II trains a separate value model. Here the value head is a linear layer over the
policy's final hidden state, fed *detached* hidden states, so value gradients never reach the policy's weights; this
costs no extra forward pass and keeps the CPU path cheap. With γ = λ = 1 and a terminal reward the target of every
state of a rollout is its reward R, so pretraining is a regression of V(s_t) on R over the trainable tokens of
recorded trajectories (read back from ``clawstream.trajectories``), with the policy frozen, as the paper does
before RL.

Run: ``python -m learner.value --model-dir DIR --out HEAD.safetensors [--steps 200] [--limit 512]``
(Kafka from ``CLAWSTREAM_KAFKA_*``); then ``clawstream learner ... --value-head HEAD.safetensors --hp algorithm=ppo``.
"""

from __future__ import annotations

import argparse
import logging
import time
from collections.abc import Sequence
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from clawbase.errors import ClawstreamError
from learner.forward import DEFAULT_LOGPROB_CHUNK, head_logprobs, packed_hidden
from learner.pack import MicroBatch, pack_trees
from learner.precision import load_policy

log = logging.getLogger("clawstream.value")


class ValueHead(torch.nn.Module):
    """V(s) = w · h(s) + b over the policy's final hidden state (zero-initialised: V = 0 before pretraining)."""

    def __init__(self, hidden_size: int) -> None:
        super().__init__()
        self.proj = torch.nn.Linear(hidden_size, 1)
        torch.nn.init.zeros_(self.proj.weight)
        torch.nn.init.zeros_(self.proj.bias)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:  # (..., H) -> (...)
        return self.proj(hidden.float()).squeeze(-1)

    @classmethod
    def for_model(cls, model: torch.nn.Module) -> ValueHead:
        return cls(int(model.config.hidden_size)).to(next(model.parameters()).device)

    def save(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        save_file({k: v.detach().cpu().contiguous() for k, v in self.state_dict().items()}, str(path))

    def load(self, path: Path) -> ValueHead:
        try:
            self.load_state_dict(load_file(str(path)))
        except (OSError, RuntimeError) as exc:
            raise ClawstreamError(f"cannot load value head {path}: {exc}") from exc
        return self


def policy_and_values(
    model: torch.nn.Module, head: ValueHead, row: MicroBatch, *, chunk: int = DEFAULT_LOGPROB_CHUNK
) -> tuple[torch.Tensor, torch.Tensor]:
    """One forward pass → (logprob of each trainable token, V of the state each token was chosen in), both (T,).

    ``values[t] = V(h[predictor[t]])``: the state in which token t was sampled (0 where there is no predictor).
    The logprobs go through the LM head ``chunk`` positions at a time (learner/forward.py).
    """
    body = packed_hidden(model, row)  # (T, H) the final norm's output, as hidden_states[-1]
    logp = head_logprobs(model, body, row, only_trainable=True, chunk=chunk)  # (T,): each token's own sampling
    hidden = body.detach()  # (T, H): no value gradient into the policy
    has_pred = row.predictor >= 0  # (T,)
    values = torch.zeros(row.num_tokens, device=hidden.device)  # (T,)
    values[has_pred] = head(hidden[row.predictor[has_pred]])
    return logp, values


def pretrain_value(
    model: torch.nn.Module,
    head: ValueHead,
    trees: Sequence[tuple[Sequence, float]],
    *,
    steps: int = 200,
    lr: float = 1e-3,
    token_budget: int = 4096,
    log_every: int = 20,
) -> list[float]:
    """Fit V(s_t) ≈ R on the trainable tokens of ``(segments, reward)`` pairs with the policy frozen; returns losses."""
    if not trees:
        raise ClawstreamError("no trajectories with a reward to pretrain the value head on")
    device = next(model.parameters()).device
    rows = [r.to(device) for r in pack_trees([t for t, _ in trees], token_budget)]
    rewards = torch.tensor([r for _, r in trees], dtype=torch.float32, device=device)  # (R,)
    model.eval()
    with torch.no_grad():  # the policy is frozen: cache its hidden states once
        hidden = [packed_hidden(model, r) for r in rows]  # (T, H) each; no (T, V) logits
    optimizer = torch.optim.Adam(head.parameters(), lr=lr)
    losses = []
    for step in range(steps):
        optimizer.zero_grad(set_to_none=True)
        total = torch.zeros((), device=device)
        n_tokens = sum(int(r.loss_mask.sum()) for r in rows)
        for row, h in zip(rows, hidden, strict=True):
            mask = row.loss_mask & (row.predictor >= 0)  # (T,)
            values = head(h[row.predictor[mask]])  # (K,)
            target = rewards[row.rollout_index[mask]]  # (K,)
            total = total + 0.5 * ((values - target) ** 2).sum() / max(n_tokens, 1)
        total.backward()
        optimizer.step()
        losses.append(float(total.detach()))
        if log_every and step % log_every == 0:
            log.info("value pretraining step %d/%d: loss %.5f", step, steps, losses[-1])
    return losses


def read_scored_trajectories(kafka, limit: int, timeout: float = 30.0) -> list[tuple[Sequence, float]]:  # noqa: ANN001
    """Read back up to ``limit`` graded, trainable trajectories from ``clawstream.trajectories`` (read_committed)."""
    from clawbase.kafka.clients import assign_from_beginning, make_consumer, read_to_end
    from schemas.events import Trajectory, TrajectoryStatus
    from schemas.topics import TRAJECTORIES

    topic = kafka.topic(TRAJECTORIES)
    consumer = make_consumer(kafka, f"clawstream-value-{time.monotonic_ns()}")
    out: list[tuple[Sequence, float]] = []
    try:
        ends = assign_from_beginning(consumer, topic, timeout)
        for msg in read_to_end(consumer, topic, ends, timeout=timeout, poll_timeout=0.5):
            traj = Trajectory.from_bytes(msg.value())
            usable = traj.status in (TrajectoryStatus.COMPLETE, TrajectoryStatus.TIMED_OUT)
            if usable and traj.reward is not None and traj.segments:
                out.append((traj.segments, traj.reward))
                if len(out) >= limit:
                    break
        return out
    finally:
        consumer.close()


def main(argv: list[str] | None = None) -> int:
    from clawbase.kafka.clients import check_broker
    from clawbase.settings import add_kafka_arguments, kafka_settings

    parser = argparse.ArgumentParser(prog="python -m learner.value", description=__doc__.splitlines()[0])
    parser.add_argument("--model-dir", required=True, type=Path, help="the policy (HF format)")
    parser.add_argument("--out", required=True, type=Path, help="where to write the value head (.safetensors)")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--limit", type=int, default=512, help="at most this many trajectories")
    add_kafka_arguments(parser)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    model = load_policy(args.model_dir)
    kafka = kafka_settings(args)
    log.info("Kafka at %s", check_broker(kafka))
    trees = read_scored_trajectories(kafka, args.limit)
    log.info("pretraining the value head on %d trajectories", len(trees))
    head = ValueHead.for_model(model)
    losses = pretrain_value(model, head, trees, steps=args.steps, lr=args.lr)
    head.save(args.out)
    log.info("value loss %.5f → %.5f; saved %s", losses[0], losses[-1], args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
