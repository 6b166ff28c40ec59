"""Learner service: sealed training batches in → one optimizer step each → a new weight version out, exactly once.

Topics: ``clawstream.batches`` (read_committed, manual offsets) → ``clawstream.weights`` + ``clawstream.metrics``
(and ``clawstream.deadletter`` for batches that cannot be trained). The weight version and the batch's input
offsets are committed in ONE Kafka transaction, so a crash before the commit publishes nothing and the batch is
trained again; versions are contiguous and no batch is trained twice (a re-read batch that a published version
already names is dead-lettered as already trained).

Untrainable batches never stop the learner: a seal that does not add up, a trajectory that does not decode, an empty
batch, a tree that cannot be packed or a trainable segment whose sampling settings are unknown goes to
``clawstream.deadletter`` with the reason, in the transaction that commits its offsets; packing is checked before any
parameter changes. A step that raises is rolled back to the last published version and dead-lettered the same way; a
batch the learner died in out of memory ``max_step_attempts`` times, on evidence (``learner.attempts``), is
dead-lettered untrained; any other death in a step (SIGKILL, SIGTERM, preemption) trains the batch again. Each
attempt writes its version under a name of its own, which the transaction publishes (``policy.weight_store``): a
fenced learner cannot change a published version; unpublished attempts' files are removed at start and after each
commit (``learner.version_files``). Scalars and log lines follow the commit (``learner.publish``). Resume: the newest
published version is loaded with the optimizer and RNG state saved with it, all sha256-verified, so a resumed run
continues exactly as an uninterrupted one. Every case in detail: docs/method.md#exactly-once-dead-letters-resume.

Run: ``clawstream learner --model-dir DIR --weight-store DIR`` or ``python -m learner.train ...``. Fault points
(docs/faults.md): ``learner.after_save``, ``learner.before_commit`` (learner/publish.py), ``learner.in_step``.
"""

from __future__ import annotations

import copy
import logging
import os
import sys
import time
from collections.abc import Iterator

import torch
from confluent_kafka import Consumer, Producer

from clawbase.errors import ClawstreamError
from clawbase.kafka.clients import (
    assign_from_beginning,
    check_broker,
    make_consumer,
    make_producer,
    read_to_end,
    require_topics,
    where,
)
from clawbase.settings import KafkaSettings
from clawbase.watchdog import deadline
from learner.attempts import FILE_NAME, StepAttempts
from learner.batches import BatchCollector, Refusal, SealedBatch
from learner.hparams import Hyperparams, parse_hparams
from learner.logit_scale import LogitScale
from learner.lora import LoRA
from learner.memory import GIB, available_bytes, plan_step, set_checkpointing
from learner.pack import MicroBatch, PackError, pack_trees
from learner.precision import load_policy
from learner.publish import TXN_DEADLINE_S, Publishing, tensorboard
from learner.reduce import Reduction
from learner.segment_sampling import UnreproducibleSampling
from learner.settings import LearnerSettings
from learner.step import ScoredTree, max_path_tokens, train_step
from learner.value import ValueHead
from learner.version_files import attempt_name
from learner.weights_http import default_base_url, serving
from policy import DEFAULT_MODEL_NAME
from policy.weight_store import trainer_state_path
from schemas.events import BatchRecord, Trajectory, WeightVersion
from schemas.topics import BATCHES, DEADLETTER, METRICS, WEIGHTS

log = logging.getLogger("clawstream.learner")


class Learner(Publishing):
    """Owns the model, optimizer and Kafka clients; ``run`` is the top loop. A version's files:
    ``learner.version_files``; the transaction's contents and what follows its commit: ``learner.publish``."""

    reduction: Reduction | None = None  # how the step combines over ranks (learner.train_ranks); None: one rank

    def __init__(self, settings: LearnerSettings, config: Hyperparams, kafka: KafkaSettings) -> None:
        self.settings, self.config, self.kafka = settings, config, kafka
        port = settings.weights_http_port
        self.weights_base_url = settings.weights_base_url or (default_base_url(port) if port else None)
        if settings.torch_threads:
            torch.set_num_threads(settings.torch_threads)
        torch.manual_seed(config.seed)
        want_cuda = settings.device == "cuda" or (settings.device == "auto" and torch.cuda.is_available())
        self.device = torch.device("cuda" if want_cuda else "cpu")
        self.model = load_policy(settings.model_dir)  # fp32 master weights whatever the checkpoint's dtype
        self.model.to(self.device)
        # The KL term's reference is the initial policy (model_dir), also after a resume from a published version.
        self.ref_model: torch.nn.Module | None = None
        if config.kl_coef > 0:
            self.ref_model = load_policy(settings.model_dir)
            self.ref_model.to(self.device).eval().requires_grad_(False)
        self.value_head: ValueHead | None = None
        self.lora: LoRA | None = None
        if config.lora_rank > 0:  # adapters on a frozen base (learner/lora.py): the model's weights do not train
            self.lora = LoRA(self.model, config.lora_rank, config.lora_alpha, config.lora_targets, config.seed)
        params = [] if self.lora is not None else list(self.model.parameters())
        if config.algorithm == "ppo":
            self.value_head = ValueHead.for_model(self.model)
            if settings.value_head is not None:
                self.value_head.load(settings.value_head)
            params += list(self.value_head.parameters())
        groups: list[dict] = [{"params": params}] if params else []
        if self.lora is not None:
            groups.append({"params": list(self.lora.parameters()), "lr": config.lora_lr, "lora": True})
        self.logit_scale: LogitScale | None = None
        if config.logit_scale_lr > 0:  # one scalar with its own lr (learner/logit_scale.py: why)
            self.logit_scale = LogitScale(self.model)
            groups.append({"params": [self.logit_scale.log_scale], "lr": config.logit_scale_lr, "logit_scale": True})
        self.optimizer = torch.optim.AdamW(groups, lr=config.lr, betas=config.betas, weight_decay=config.weight_decay)
        self.version = 0
        self.latest: WeightVersion | None = None  # the last published version: what a failed step rolls back to
        self.trained: dict[str, int] = {}  # batch id → the version it was published as
        self.published: set[str] = set()  # the vNNNNNN-<attempt> of every committed version: files kept
        # What v0 restores (a step that raises before any version is published): the initial head, no moments, RNG.
        self._initial_head = copy.deepcopy(self.value_head.state_dict()) if self.value_head is not None else {}
        self._initial_state = {
            "optimizer": copy.deepcopy(self.optimizer.state_dict()),
            "torch_rng": torch.get_rng_state(),
            **({"lora": self.lora.state()} if self.lora is not None else {}),
        }
        state_dir = trainer_state_path(settings.weight_store, settings.model_name, 0).parent
        self.attempts = StepAttempts(state_dir / FILE_NAME)  # survive the process: an OOM kill raises nothing
        txn_id = settings.resolved_transactional_id(kafka.topic_prefix)
        self.producer: Producer = make_producer(kafka, **{"transactional.id": txn_id})
        group = settings.resolved_group_id(kafka.topic_prefix)
        self.consumer: Consumer = make_consumer(kafka, group, **settings.consumer_config(kafka.topic_prefix))
        self.writer = tensorboard(settings)

    # ---- the top loop: poll batch → logprobs → loss → step → publish -----------------------------------------------
    def run(self) -> int:
        with deadline("init_transactions", TXN_DEADLINE_S):
            self.producer.init_transactions(60)  # fences any earlier learner of this transactional id
        self._resume()
        self.consumer.subscribe([self.kafka.topic(BATCHES)])
        steps = 0
        for batch in self._sealed_batches():
            trees, problem = self._decode(batch)
            problem = self._refused_untrained(batch) or problem
            self.producer.begin_transaction()
            metrics, problem = self._train(batch, trees) if problem is None else ({}, problem)
            outcome = self._dead_letter(batch, problem) if problem else self._publish_version(batch, metrics)
            self._commit(batch)
            self._committed(outcome)  # scalars, log, link: only once the step is committed
            self.attempts.forget(self._key(batch))  # a batch dead-lettered for its kills: done with
            steps += 1
            if self.settings.max_steps is not None and steps >= self.settings.max_steps:
                break
        self.consumer.close()
        return steps

    # ---- pieces ----------------------------------------------------------------------------------------------------
    def _sealed_batches(self) -> Iterator[SealedBatch]:
        collector = BatchCollector()
        last_seen = time.monotonic()
        while True:
            msg = self.consumer.poll(0.5)
            if msg is None:
                idle = self.settings.idle_exit_s
                if idle is not None and time.monotonic() - last_seen > idle:
                    log.info("no batch for %.0fs: exiting", idle)
                    return
                continue
            if msg.error():
                log.warning("consumer error: %s", msg.error())
                continue
            last_seen = time.monotonic()
            try:
                record = BatchRecord.from_bytes(msg.value())
            except ClawstreamError as exc:
                log.error("%s: undecodable batch record (%s); dead-lettered", where(msg), exc)
                self._dead_letter_raw(msg, exc)
                continue
            sealed = collector.add(msg.offset(), record)
            if sealed is not None:
                log.info("%s: batch %s sealed (%d trajectories)", where(msg), sealed.batch_id, len(sealed.records))
                yield sealed

    def _refused_untrained(self, batch: SealedBatch) -> Refusal | None:
        """A batch a published version names, or one whose training killed the learner out of memory (on evidence)
        ``max_step_attempts`` times; a death without such evidence (SIGKILL, SIGTERM, preemption) retrains it."""
        if batch.batch_id in self.trained:
            return Refusal(f"batch {batch.batch_id} was already trained (published as v{self.trained[batch.batch_id]})")
        died = self.attempts.attempts.get(self._key(batch))
        if died is not None and died.failures >= self.settings.max_step_attempts:
            return Refusal(
                f"batch {batch.batch_id} ({self._where(batch)}): the distributed step raised {died.failures} times "
                f"(last: {died.failure}); the group cannot roll back in the process, so each raise restarted it",
                "TrainingStepFailed",
            )
        if died is None or died.ooms < self.settings.max_step_attempts:
            return None
        return Refusal(
            f"batch {batch.batch_id} ({self._where(batch)}): the learner died out of memory in its step {died.ooms} "
            f"times ({died.starts} attempts; last evidence: {died.evidence}); the memory plan estimated "
            f"{died.estimate or 'nothing yet (killed before planning)'}: lower the token budget or max_path_tokens "
            "(--hp), or set memory_limit_gib below what the device really has",
            "TrainingStepOutOfMemory",
        )

    def _train(self, batch: SealedBatch, trees: list[ScoredTree]) -> tuple[dict[str, float], Refusal | None]:
        """One optimizer step, or why the batch is dead-lettered instead: packing fails before any update; a step
        that raises is rolled back to the last published version. A SIGKILL in here counts as an attempt."""
        key = self._key(batch)
        n = self.attempts.start(key)  # on disk before anything that may be killed (the dry run, the step, a rollback)
        if n > 1:
            log.info("%s: batch %s: attempt %d (earlier ones died without evidence of OOM)", self._where(batch), key, n)
        try:
            refusal = self._dry_run(trees, key)
            if refusal is not None:
                return {}, refusal
            try:
                return self._step(trees), None
            except Exception as exc:  # noqa: BLE001 - whatever it was, the step may have half-applied: roll back
                failed = f"{type(exc).__name__}: {exc}"
                log.error("%s: batch %s: the training step raised", self._where(batch), batch.batch_id, exc_info=True)
            self._restore()  # outside the except: the failed step's frames (a CUDA OOM's activations) are freed
            return {}, Refusal(
                f"batch {batch.batch_id} ({self._where(batch)}): the training step raised {failed}; model and "
                f"optimizer restored to v{self.version}",
                "TrainingStepFailed",
            )
        finally:  # returned, raised or stopped (SIGTERM, Ctrl-C): not a kill by this batch
            self.attempts.forget(key)

    def _dry_run(self, trees: list[ScoredTree], key: str) -> Refusal | None:
        try:  # the batch's own data (a tree over the token budget, inconsistent segments): a packing dry run
            rows = pack_trees(
                [t.segments for t in trees], self.config.token_budget, max_path_tokens(self.model, self.config)
            )
        except UnreproducibleSampling as exc:
            return Refusal(f"cannot recompute the rollout logprobs' distribution: {exc}")
        except PackError as exc:
            return Refusal(f"cannot pack the batch: {exc}")
        return self._plan_memory(rows, key)

    def _plan_memory(self, rows: list[MicroBatch], key: str) -> Refusal | None:
        """Activation checkpointing on or off for this step, or the batch refused: it cannot fit (learner/memory.py)."""
        s = self.settings
        limit = int(s.memory_limit_gib * GIB) if s.memory_limit_gib else available_bytes(self.device)
        shapes = [(r.num_tokens, not r.is_chain, r.uses_top_k or r.uses_top_p) for r in rows]
        plan = plan_step(
            self.model,
            self.optimizer,
            shapes,
            mode=s.activation_checkpointing,
            limit=limit,
            chunk=self.config.logprob_chunk,
        )
        if plan.refusal is not None:
            return Refusal(plan.refusal, "InsufficientMemory")
        self.attempts.plan(key, f"{plan.estimate.explain()} of the {limit / GIB:.2f} GiB it may use")
        if set_checkpointing(self.model, plan.checkpointing):
            log.info(
                "activation checkpointing %s: the step needs %s",
                "on" if plan.checkpointing else "off",
                plan.estimate.explain(),
            )
        return None

    def _step(self, trees: list[ScoredTree]) -> dict[str, float]:
        lr = self.config.lr_at(self.version)  # self.version = steps trained so far, also after a resume
        warm = lr / self.config.lr if self.config.lr else 1.0  # the warm-up applies to the logit scale too
        for group in self.optimizer.param_groups:
            group["lr"] = self.config.logit_scale_lr * warm if group.get("logit_scale") else lr
            if group.get("lora"):
                group["lr"] = self.config.lora_lr * warm
        metrics = train_step(
            self.model, self.optimizer, trees, self.config, self.value_head, self.ref_model, self.reduction
        )
        if self.logit_scale is not None:  # the published weights are a plain model: exp(s) goes into the norm's gain
            metrics["logit_scale_step"] = self.logit_scale.fold()
            metrics["logit_scale"] = self.logit_scale.relative_gain()  # since the initial model (≈ 1/temperature)
        if self.lora is not None:
            metrics["lora_lr"] = self.config.lora_lr * warm
        return {**metrics, "lr": lr}

    def _restore(self) -> None:
        """Everything a step changes back to the last published version: reloaded from its files, as a resume does
        (exact, and free until needed; an in-memory copy would cost 3x the weights on every step)."""
        self.optimizer.zero_grad(set_to_none=True)
        if self.logit_scale is not None:  # 0 after every finished step (folded into the norm's gain)
            with torch.no_grad():
                self.logit_scale.log_scale.zero_()
        self._load(self.latest)
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
        log.info("model, optimizer and RNG restored to v%d", self.version)

    def _decode(self, batch: SealedBatch) -> tuple[list[ScoredTree], Refusal | None]:
        if batch.seal.index != len(batch.records):
            return [], Refusal(f"seal says {batch.seal.index} trajectories, {len(batch.records)} arrived")
        trees = []
        for rec in batch.records:
            if rec.trajectory is None:
                return [], Refusal(f"trajectory record {rec.index} of {batch.batch_id} carries no trajectory")
            try:
                traj = Trajectory.from_bytes(rec.trajectory)
            except ClawstreamError as exc:
                return [], Refusal(f"trajectory record {rec.index} ({rec.rollout_id}) does not decode: {exc}")
            trees.append(ScoredTree(traj.segments, rec.advantage, rec.reward, rec.harness or traj.harness))
        if not trees:
            return [], Refusal("empty batch")
        return trees, None

    def _key(self, batch: SealedBatch) -> str:
        return f"{self._where(batch)} {batch.batch_id}"  # exact: the same batch re-read, never another one

    def _resume(self) -> None:
        """Load the newest published version of this model (read_committed), if any; remove the files of attempts
        no published version names (the fence is taken: no earlier learner can publish them any more)."""
        versions = published_versions(self.kafka, self.settings.model_name)
        self.trained = {v.batch_id: v.policy_version for v in versions if v.batch_id}
        self.published = {attempt_name(v) for v in versions}
        self.latest = max(versions, key=lambda v: v.policy_version, default=None)
        self._remove_unpublished(self.published)
        if self.latest is None:
            log.info(
                "no published version of %s: starting from %s as v0", self.settings.model_name, self.settings.model_dir
            )
            return
        self._load(self.latest)
        self._link(self.latest)  # in case the last one died between its commit and its link
        self.version = self.latest.policy_version
        log.info("resumed %s at v%d (%s)", self.settings.model_name, self.version, self.latest.uri)


def published_versions(kafka: KafkaSettings, model_name: str, timeout: float = 30.0) -> list[WeightVersion]:
    """Scan ``clawstream.weights`` (read_committed) to its end: every published version of ``model_name``."""
    consumer = make_consumer(kafka, f"clawstream-scan-{os.getpid()}-{time.monotonic_ns()}")
    topic = kafka.topic(WEIGHTS)
    try:
        ends = assign_from_beginning(consumer, topic, timeout, missing_ok=True)
        events = (WeightVersion.from_bytes(msg.value()) for msg in read_to_end(consumer, topic, ends, timeout=timeout))
        return [e for e in events if e.model_name == model_name]
    finally:
        consumer.close()


def main(argv: list[str] | None = None) -> int:
    import argparse

    from clawbase.settings import add_kafka_arguments, kafka_settings, load_settings

    parser = argparse.ArgumentParser(
        prog="python -m learner.train",
        description=__doc__.splitlines()[0],
        epilog="hyperparameters (--hp NAME=VALUE):\n" + Hyperparams.help_table(),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--model-dir", required=True)
    parser.add_argument("--weight-store", required=True)
    parser.add_argument("--model-name", default=DEFAULT_MODEL_NAME, help="key of the published weight versions")
    parser.add_argument("--max-steps", type=int, default=None)
    parser.add_argument("--idle-exit", type=float, default=None, help="exit after this many idle seconds")
    parser.add_argument("--tensorboard-dir", default=None)
    parser.add_argument("--value-head", default=None, help="PPO: pretrained value head (python -m learner.value)")
    parser.add_argument(
        "--max-step-attempts",
        type=int,
        default=None,
        help=f"{LearnerSettings.model_fields['max_step_attempts'].description} Default "
        f"{LearnerSettings.model_fields['max_step_attempts'].default} (CLAWSTREAM_LEARNER_MAX_STEP_ATTEMPTS).",
    )
    parser.add_argument("--weights-http-port", type=int, default=None, help="serve versions over HTTP on this port")
    parser.add_argument("--weights-base-url", default=None, help="base of the published weight URIs (docs/scaling.md)")
    parser.add_argument("--hp", action="append", default=[], metavar="NAME=VALUE", help="override a hyperparameter")
    add_kafka_arguments(parser)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    settings = load_settings(
        LearnerSettings,
        model_dir=args.model_dir,
        weight_store=args.weight_store,
        model_name=args.model_name,
        max_steps=args.max_steps,
        idle_exit_s=args.idle_exit,
        tensorboard_dir=args.tensorboard_dir,
        value_head=args.value_head,
        **{k: v for k in ("weights_http_port", "weights_base_url") if (v := getattr(args, k)) is not None},
        **({} if args.max_step_attempts is None else {"max_step_attempts": args.max_step_attempts}),
    )
    config = parse_hparams(args.hp)
    kafka = kafka_settings(args)
    try:  # before loading the model: a wrong broker or prefix is one clear line, not a traceback at first produce
        log.info("Kafka at %s", check_broker(kafka))
        require_topics(kafka, (BATCHES, WEIGHTS, METRICS, DEADLETTER))
    except ClawstreamError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    with serving(settings.weight_store, settings.weights_http_port):
        try:
            steps = Learner(settings, config, kafka).run()
        except ClawstreamError as exc:  # e.g. a published version's files changed since: the file and the fix
            print(f"error: {exc}", file=sys.stderr)
            return 2
    log.info("trained %d batches", steps)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
