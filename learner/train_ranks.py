"""The learner service on N data-parallel ranks: rank 0 is the Kafka learner of learner/train.py, the others follow.

Rank 0 owns the consumer, the producer and the transaction exactly as ``learner.train.Learner`` does (same exactly-
once, dead letters, resume); before each step it broadcasts the batch's decoded trees to the other ranks
(``broadcast_object_list``), every rank runs ``learner.step.train_step`` on its share with the process group's
reduction (``learner.distributed.GroupReduction``), and rank 0 publishes (its model and AdamW state are whole: data
parallel). Whenever rank 0 loads a version (resume, rollback) it broadcasts weights, optimizer and RNG state, so
every rank holds the same state. A step that raises cannot be rolled back in the process (the other ranks may be
waiting in a collective): the rank exits, the launcher stops the others, and the restarted group resumes from the
last published version — a SIGKILL's path; the rank that raised records it (``learner.attempts.record_failure``), and
``max_step_attempts`` such raises dead-letter the batch (docs/method.md#the-distributed-step). A
rank killed -9 (mid-collective or not) ends the group the same way: the launcher stops the others and exits 1
(tests/integration/test_learner_ranks.py); no rank outlives the launcher (parent-death signal); a collective that
waits past ``CLAWSTREAM_LEARNER_COLLECTIVE_TIMEOUT_S`` (600 s) fails its rank, and an idle rank 0 sends the others a
no-op well within it. A learned logit scale folds on every rank. LoRA (``lora_rank > 0``): every rank attaches the
same adapters (same seed; rank 0's broadcast on a load) and they are all that trains and is all-reduced; rank 0 merges
and publishes.

Run: ``clawstream learner-ranks --nproc-per-node 2 --model-dir DIR --weight-store DIR ...`` or ``python -m
learner.train_ranks ...`` (the rest as ``clawstream learner``); gloo on CPU. FSDP2 in the service is not wired yet
(learner/distributed.py has it).
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import sys
import time
from collections.abc import Sequence
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from clawbase.faults import fault_point
from learner.attempts import DEATHS, record_failure
from learner.distributed import GroupReduction
from learner.hparams import Hyperparams
from learner.logit_scale import LogitScale
from learner.lora import LoRA
from learner.memory import set_checkpointing
from learner.precision import load_policy
from learner.settings import LearnerSettings
from learner.step import ScoredTree, train_step
from learner.train import Learner
from learner.value import ValueHead
from policy.weight_store import trainer_state_path
from schemas.events import WeightVersion

log = logging.getLogger("clawstream.learner")


COLLECTIVE_TIMEOUT_S = 600.0  # a collective waiting longer fails the rank (gloo's own default is 30 min)
_sent_at = [time.monotonic()]  # rank 0: when the other ranks last heard from it


def _send(command: tuple[str, Any]) -> tuple[str, Any]:
    box: list[Any] = [command]
    dist.broadcast_object_list(box, src=0)
    _sent_at[0] = time.monotonic()
    return box[0]


class _KeepAlive:
    """Rank 0's consumer. The other ranks wait for its next command in a broadcast, and that wait now times out
    (COLLECTIVE_TIMEOUT_S, so that a rank stuck for good fails the group instead of hanging it): while rank 0 polls
    for batches it sends them a no-op every quarter of the timeout, so an idle learner is not taken for a hung one."""

    def __init__(self, consumer: Any, every_s: float) -> None:
        self._consumer, self._every_s = consumer, every_s

    def poll(self, timeout: float) -> Any:
        if time.monotonic() - _sent_at[0] > self._every_s:
            _send(("idle", None))
        return self._consumer.poll(timeout)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._consumer, name)


def _sync(model: torch.nn.Module, optimizer: torch.optim.Optimizer, head: ValueHead | None, lora: LoRA | None) -> None:
    """Every rank takes rank 0's weights, value head, adapters, AdamW state and RNG (after rank 0 loaded a version)."""
    tensors = list(model.state_dict().values()) + (list(head.state_dict().values()) if head else [])
    for tensor in tensors + (list(lora.parameters()) if lora is not None else []):
        dist.broadcast(tensor.data, src=0)
    box: list[Any] = [(optimizer.state_dict(), torch.get_rng_state())]
    dist.broadcast_object_list(box, src=0)
    if dist.get_rank() != 0:
        optimizer.load_state_dict(box[0][0])
        torch.set_rng_state(box[0][1])


def _set_lr(optimizer: torch.optim.Optimizer, config: Hyperparams, version: int) -> float:
    lr = config.lr_at(version)  # version = steps trained so far, as learner.train's _step
    warm = lr / config.lr if config.lr else 1.0  # the warm-up applies to the logit scale too (learner.train)
    for group in optimizer.param_groups:
        group["lr"] = config.logit_scale_lr * warm if group.get("logit_scale") else lr
        if group.get("lora"):
            group["lr"] = config.lora_lr * warm
    return lr


class LeadLearner(Learner):
    """Rank 0: ``Learner`` whose step runs on every rank and whose loads reach every rank."""

    reduction = GroupReduction()

    def __init__(self, settings: LearnerSettings, config: Hyperparams, kafka: Any) -> None:
        super().__init__(settings, config, kafka)
        self.consumer = _KeepAlive(self.consumer, _timeout_s() / 4)  # type: ignore[assignment]

    def run(self) -> int:
        try:
            return super().run()
        finally:
            _send(("stop", None))

    def _resume(self) -> None:
        super()._resume()
        if self.latest is None:  # nothing loaded: still, rank 0's value head may come from a file the others lack
            _send(("sync", None))
            _sync(self.model, self.optimizer, self.value_head, self.lora)

    def _step(self, trees: list[ScoredTree]) -> dict[str, float]:
        # The plan (learner.memory, in rank 0's dry run) is for the whole batch: every rank follows its checkpointing.
        _send(("step", (trees, self.version, bool(self.model.is_gradient_checkpointing), os.getpid())))
        try:
            fault_point("learner.rank0.step")  # a hold here leaves the other ranks in the step's first collective
            return super()._step(trees)  # every rank folds the same all-reduced logit scale step: the ranks stay equal
        except BaseException as exc:
            log.exception("the step raised on rank 0: the group cannot go on; exiting for a restart")
            if isinstance(exc, Exception) and not _lost_peer(exc):  # a lost peer records its own raise, if it raised
                record_failure(self.attempts.path.parent / DEATHS, os.getpid(), f"rank 0: {type(exc).__name__}: {exc}")
            os._exit(1)  # no rollback here: the batch's attempt stays on disk (learner.attempts)

    def _load(self, version: WeightVersion | None) -> None:
        super()._load(version)
        _send(("sync", None))
        _sync(self.model, self.optimizer, self.value_head, self.lora)


def follow(settings: LearnerSettings, config: Hyperparams) -> None:
    """Ranks 1..N-1: the same model and optimizer as rank 0, driven by its broadcasts until it stops."""
    torch.manual_seed(config.seed)
    model = load_policy(settings.model_dir)
    ref = load_policy(settings.model_dir).eval().requires_grad_(False) if config.kl_coef > 0 else None
    # LoRA: the same adapters as rank 0's (same seed, its own generator), on the same frozen base.
    lora = None
    if config.lora_rank > 0:
        lora = LoRA(model, config.lora_rank, config.lora_alpha, config.lora_targets, config.seed)
    head = ValueHead.for_model(model) if config.algorithm == "ppo" else None
    params = [] if lora is not None else list(model.parameters())
    params += list(head.parameters()) if head is not None else []
    # rank 0's groups, in its order (learner.train.Learner): the broadcast AdamW state loads group by group
    groups: list[dict[str, Any]] = [{"params": params}] if params else []
    if lora is not None:
        groups.append({"params": list(lora.parameters()), "lr": config.lora_lr, "lora": True})
    scale = LogitScale(model) if config.logit_scale_lr > 0 else None
    if scale is not None:
        groups.append({"params": [scale.log_scale], "lr": config.logit_scale_lr, "logit_scale": True})
    optimizer = torch.optim.AdamW(groups, lr=config.lr, betas=config.betas, weight_decay=config.weight_decay)
    while True:
        kind, payload = _send(("", None))
        if kind == "stop":
            return
        if kind == "sync":
            _sync(model, optimizer, head, lora)
        elif kind == "step":
            trees, version, checkpointing, lead = payload
            fault_point(f"learner.rank{dist.get_rank()}.step")
            set_checkpointing(model, checkpointing)
            _set_lr(optimizer, config, version)
            try:
                train_step(model, optimizer, trees, config, head, ref, GroupReduction())
            except Exception as exc:
                if not _lost_peer(exc):  # the verdict for the lead's attempt: its next start reads it
                    deaths = trainer_state_path(settings.weight_store, settings.model_name, 0).parent / DEATHS
                    record_failure(deaths, lead, f"rank {dist.get_rank()}: {type(exc).__name__}: {exc}")
                raise
            if scale is not None:
                scale.fold()


def _lost_peer(exc: Exception) -> bool:
    """A collective that failed because another rank went away (killed, or raised itself): no verdict on the batch."""
    text = str(exc).lower()
    lost = ("gloo", "connection closed", "connection reset")
    return isinstance(exc, dist.DistError) or any(word in text for word in lost)


def _timeout_s() -> float:
    return float(os.environ.get("CLAWSTREAM_LEARNER_COLLECTIVE_TIMEOUT_S") or COLLECTIVE_TIMEOUT_S)


def _die_with(launcher: int) -> None:
    """A rank must not outlive its launcher: killed -9, nothing would stop the group, and a restarted launcher would
    start a second one beside it. Linux sends SIGKILL to this process when the launcher ends (prctl
    PR_SET_PDEATHSIG); a launcher already gone before that call is caught by the parent check."""
    if sys.platform.startswith("linux"):
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # 1: PR_SET_PDEATHSIG
    if os.getppid() != launcher:
        os._exit(1)


def _rank_main(rank: int, world: int, port: int, argv: Sequence[str], launcher: int) -> None:
    from learner import train

    _die_with(launcher)
    os.environ.update({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)})
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=_timeout_s()))
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


def _settings(argv: Sequence[str]) -> tuple[LearnerSettings, Hyperparams]:
    """What a follower needs of the command line: the model, the hyperparameters, the threads."""
    import argparse

    from learner.hparams import parse_hparams

    parser = argparse.ArgumentParser(add_help=False)
    parser.add_argument("--model-dir", required=True)
    parser.add_argument("--weight-store", required=True)
    parser.add_argument("--model-name", default=None)
    parser.add_argument("--hp", action="append", default=[])
    args, _ = parser.parse_known_args(list(argv))
    named = {"model_name": args.model_name} if args.model_name else {}
    settings = LearnerSettings(model_dir=args.model_dir, weight_store=args.weight_store, **named)
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
        _rank_main, args=(args.nproc, port, rest, os.getpid()), nprocs=args.nproc, join=False, start_method="spawn"
    )
    try:
        # join() returns when any rank ends; one that ends non-zero (an error, a kill -9) makes it stop the others
        # (SIGTERM: a rank waiting in a gloo collective has no handler and ends at once) and raise: the group is
        # torn down within seconds, and the exit status asks the supervisor (compose: restart on-failure) for a
        # new group, which resumes from the last published version.
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
