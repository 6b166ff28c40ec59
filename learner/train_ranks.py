"""The learner service on N data-parallel ranks: rank 0 is the Kafka learner of learner/train.py, the others follow.

Rank 0 owns the consumer, the producer and the transaction exactly as ``learner.train.Learner`` does (same exactly-
once, dead letters, resume); before each step it broadcasts the batch's decoded trees to the other ranks
(``broadcast_object_list``), every rank runs ``learner.distributed.distributed_train_step`` on its share, and rank 0
publishes (its model and AdamW state are whole: data parallel). Whenever rank 0 loads a version (resume, rollback) it
broadcasts weights, optimizer and RNG state, so every rank holds the same state. A step that raises cannot be rolled
back in the process (the other ranks may be waiting in a collective): the rank exits, the launcher stops the others,
and the restarted group resumes from the last published version — a SIGKILL's path, counted by the step attempts
(docs/method.md#the-distributed-step).

Run: ``clawstream learner-ranks --nproc-per-node 2 --model-dir DIR --weight-store DIR ...`` or ``python -m
learner.train_ranks ...`` (the rest as ``clawstream learner``); gloo on CPU. FSDP2 in the service is not wired yet
(learner/distributed.py has it).
"""

from __future__ import annotations

import logging
import os
import socket
import sys
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from learner.config import LearnerConfig, LearnerSettings
from learner.distributed import distributed_train_step
from learner.memory import set_checkpointing
from learner.precision import load_policy
from learner.step import ScoredTree
from learner.train import Learner
from learner.value import ValueHead
from schemas.events import WeightVersion

log = logging.getLogger("clawstream.learner")


def _send(command: tuple[str, Any]) -> tuple[str, Any]:
    box: list[Any] = [command]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def _sync(model: torch.nn.Module, optimizer: torch.optim.Optimizer, head: ValueHead | None) -> None:
    """Every rank takes rank 0's weights, value head, AdamW state and RNG (after rank 0 loaded a version)."""
    for tensor in list(model.state_dict().values()) + (list(head.state_dict().values()) if head else []):
        dist.broadcast(tensor, src=0)
    box: list[Any] = [(optimizer.state_dict(), torch.get_rng_state())]
    dist.broadcast_object_list(box, src=0)
    if dist.get_rank() != 0:
        optimizer.load_state_dict(box[0][0])
        torch.set_rng_state(box[0][1])


def _set_lr(optimizer: torch.optim.Optimizer, config: LearnerConfig, version: int) -> float:
    lr = config.lr_at(version)  # version = steps trained so far, as learner.train's _step
    for group in optimizer.param_groups:
        group["lr"] = lr
    return lr


class LeadLearner(Learner):
    """Rank 0: ``Learner`` whose step runs on every rank and whose loads reach every rank."""

    def __init__(self, settings: LearnerSettings, config: LearnerConfig, kafka: Any) -> None:
        super().__init__(settings, config, kafka)
        if self.logit_scale is not None:
            raise ValueError("logit_scale_lr > 0 is not supported on several ranks yet")

    def run(self) -> int:
        try:
            return super().run()
        finally:
            _send(("stop", None))

    def _resume(self) -> None:
        super()._resume()
        if self.latest is None:  # nothing loaded: still, rank 0's value head may come from a file the others lack
            _send(("sync", None))
            _sync(self.model, self.optimizer, self.value_head)

    def _step(self, trees: list[ScoredTree]) -> dict[str, float]:
        # The plan (learner.memory, in rank 0's dry run) is for the whole batch: every rank follows its checkpointing.
        _send(("step", (trees, self.version, bool(self.model.is_gradient_checkpointing))))
        lr = _set_lr(self.optimizer, self.config, self.version)
        try:
            metrics = distributed_train_step(
                self.model, self.optimizer, trees, self.config, self.value_head, self.ref_model
            )
        except BaseException:
            log.exception("the step raised on rank 0: the group cannot go on; exiting for a restart")
            os._exit(1)  # no rollback here: the batch's attempt stays counted (learner.attempts)
        return {**metrics, "lr": lr}

    def _load(self, version: WeightVersion | None) -> None:
        super()._load(version)
        _send(("sync", None))
        _sync(self.model, self.optimizer, self.value_head)


def follow(settings: LearnerSettings, config: LearnerConfig) -> None:
    """Ranks 1..N-1: the same model and optimizer as rank 0, driven by its broadcasts until it stops."""
    torch.manual_seed(config.seed)
    model = load_policy(settings.model_dir)
    ref = load_policy(settings.model_dir).eval().requires_grad_(False) if config.kl_coef > 0 else None
    head = ValueHead.for_model(model) if config.algorithm == "ppo" else None
    params = list(model.parameters()) + (list(head.parameters()) if head is not None else [])
    optimizer = torch.optim.AdamW(params, lr=config.lr, betas=config.betas, weight_decay=config.weight_decay)
    while True:
        kind, payload = _send(("", None))
        if kind == "stop":
            return
        if kind == "sync":
            _sync(model, optimizer, head)
        elif kind == "step":
            trees, version, checkpointing = payload
            set_checkpointing(model, checkpointing)
            _set_lr(optimizer, config, version)
            distributed_train_step(model, optimizer, trees, config, head, ref)


def _rank_main(rank: int, world: int, port: int, argv: Sequence[str]) -> None:
    from learner import train

    os.environ.update({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)})
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        if rank == 0:
            # learner.train's main() parses the command line and checks the broker, then builds ``Learner``: rank 0
            # runs that main with the lead learner in its place rather than a copy of it.
            train.Learner = LeadLearner  # type: ignore[misc]
            code = train.main(list(argv))
            if code:
                raise SystemExit(code)
        else:
            logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
            settings, config = _settings(argv)
            follow(settings, config)
    finally:
        dist.destroy_process_group()


def _settings(argv: Sequence[str]) -> tuple[LearnerSettings, LearnerConfig]:
    """What a follower needs of the command line: the model, the hyperparameters, the threads."""
    import argparse

    from learner.config import parse_hparams

    parser = argparse.ArgumentParser(add_help=False)
    parser.add_argument("--model-dir", required=True)
    parser.add_argument("--weight-store", required=True)
    parser.add_argument("--hp", action="append", default=[])
    args, _ = parser.parse_known_args(list(argv))
    settings = LearnerSettings(model_dir=args.model_dir, weight_store=args.weight_store)
    if settings.torch_threads:
        torch.set_num_threads(settings.torch_threads)
    return settings, parse_hparams(args.hp)


def main(argv: list[str] | None = None) -> int:
    import argparse

    import torch.multiprocessing as mp

    parser = argparse.ArgumentParser(prog="python -m learner.train_ranks", description=__doc__.splitlines()[0])
    parser.add_argument("--nproc-per-node", "--nproc", dest="nproc", type=int, default=2, help="ranks (gloo, CPU)")
    args, rest = parser.parse_known_args(argv)
    with socket.socket() as probe:  # a free port for the rendezvous
        probe.bind(("127.0.0.1", 0))
        port = int(probe.getsockname()[1])
    context = mp.start_processes(
        _rank_main, args=(args.nproc, port, rest), nprocs=args.nproc, join=False, start_method="spawn"
    )
    try:
        while not context.join():
            pass
    except Exception as exc:  # noqa: BLE001 - a rank failed: stop the others, exit non-zero for a restart
        print(f"error: {exc}", file=sys.stderr)
        return 1
    finally:
        for process in context.processes:
            if process.is_alive() and process.pid is not None:
                process.kill()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
