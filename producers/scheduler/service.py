"""Rollout scheduler: publishes each training step's rollout requests, gated by policy lag; eval runs.

Topics: out ``clawstream.rollout.requests`` (key rollout id); in ``clawstream.weights`` (newest policy version, read
from the beginning), ``clawstream.rewards`` (re-issues INFRA_FAILURE rollouts with ``attempt + 1``, up to
``max_attempts``; eval mode also collects the scores) and, in train mode, ``clawstream.metrics`` (the grouper's verdict
on each group, which decides its refill). Pure planning lives in ``producers.scheduler.plan``.

Train mode resumes from the log, so a scheduler killed and restarted on the same run issues nothing twice and skips
nothing: it reads its run's requests, rewards and group verdicts (read_committed, to ends taken first), rebuilds what
was issued and is outstanding, publishes what is owed (re-issues, the rest of a step a kill cut short), re-plans the
issued steps without publishing (task sampling goes on as if uninterrupted) and follows on from those ends. Then for
step = max(start_step, last issued + 1) … steps−1: wait until the newest weight version ≥ step − max_policy_lag,
publish ``tasks_per_step × group_size`` requests (harnesses by ``harness_mix``). Whatever the lag, each group that
trains nothing (its rewards, or the grouper's verdict, say so: ``producers.scheduler.refill``) gets a refill group of
its step and harness, so every step still fills a batch. After the last step it waits ``drain_timeout_s``, counted
again from each reward or verdict read, for the last rewards and verdicts.

Eval mode (``--eval``): every task of ``eval_split`` (optionally the first ``eval_limit``) × each of
``eval_harnesses`` × each of ``eval_modes`` (``greedy``: temperature 0; ``sampled``: ``temperature``/``top_p``/
``top_k``), ``eval=True``, step −1; waits for the rewards (or ``eval_timeout_s``) and prints a table per mode: per
harness the mean reward, its standard error and the solved fraction. ``clawstream eval --model DIR`` starts the
services for a model and runs this.

Run: ``python -m producers.scheduler.service [--eval] [--steps N]`` (env ``CLAWSTREAM_SCHEDULER_*``, ``_KAFKA_*``).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import logging
import random
import sys
import time
import uuid
from collections.abc import Callable, Sequence
from typing import TypeVar

from confluent_kafka import OFFSET_BEGINNING, OFFSET_END, Consumer, KafkaException, TopicPartition

from clawbase.errors import ClawstreamError, CodecError
from clawbase.faults import fault_point
from clawbase.kafka.clients import check_broker, make_consumer, read_to_end, where
from clawbase.kafka.publisher import KafkaPublisher
from clawbase.settings import KafkaSettings, add_kafka_arguments, kafka_settings, load_settings
from producers.scheduler import curriculum
from producers.scheduler.plan import (
    EVAL_MODE_KEY,
    EvalScore,
    Outstanding,
    StepPlan,
    eval_scores,
    eval_seed,
    eval_table,
    instance_requests,
    may_issue,
    missing_requests,
    plan_step,
    rebuild,
)
from producers.scheduler.refill import REFILL_KEY, Refills
from producers.scheduler.settings import SchedulerSettings
from producers.tasks.catalog import SuiteCatalog
from producers.tasks.model import Task
from schemas.events import Event, Metric, RewardEvent, RolloutRequest, WeightVersion, group_verdict
from schemas.topics import METRICS, REWARDS, ROLLOUT_REQUESTS, WEIGHTS

log = logging.getLogger("clawstream.scheduler")
E = TypeVar("E", bound=Event)


class Scheduler:
    def __init__(self, settings: SchedulerSettings, kafka: KafkaSettings, catalog: SuiteCatalog | None = None) -> None:
        self.settings, self.kafka = settings, kafka
        self.catalog = catalog or SuiteCatalog(settings.suites)
        self.version = settings.initial_version
        self.outstanding = Outstanding(settings.max_attempts)  # train mode's keeps no settled reward (_resume)
        # Eval requests published (the eval table's rows). Train requests are not kept once settled: a long run
        # issues 10^5–10^6 of them (~1.6 KB each kept), and only the pending ones are needed (self.outstanding).
        self.issued: dict[str, RolloutRequest] = {}
        self.rng = random.Random(settings.seed)
        self.plan = StepPlan(
            settings.tasks_per_step,
            settings.group_size,
            settings.harness_mix,
            settings.timeout_s,
            settings.temperature,
            settings.top_p,
            settings.max_tokens,
            settings.max_attempts,
            settings.top_k,
        )
        self.refills = Refills(
            settings.refill_budget(),
            drop_equal=settings.zero_variance == "drop",
            run_key=f"{kafka.topic_prefix}|{settings.seed}",
            seed=settings.seed,
        )
        self.tasks: list[Task] = []  # the train split (train mode): refills draw from it
        self.publisher: KafkaPublisher | None = None
        self.weights: Consumer | None = None
        self.rewards: Consumer | None = None
        self.verdicts: Consumer | None = None  # train mode: the grouper's group metrics (clawstream.metrics)

    # --- Kafka edges --------------------------------------------------------------------------------------------

    def _open(self, *, read_log: bool = False) -> tuple[list[RolloutRequest], list[RewardEvent], list[Metric]]:
        """Connect. The rewards consumer starts at the ends of ``clawstream.rewards`` taken now: with ``read_log``
        (train mode) after reading this run's requests, rewards and metrics up to ends taken before any read,
        returned in log order (undecodable records logged and skipped); the verdicts consumer then follows
        ``clawstream.metrics`` from its end taken then."""
        self.publisher = KafkaPublisher(self.kafka, self.settings.publish_timeout_s)
        tag = uuid.uuid4().hex[:8]
        self.weights = make_consumer(self.kafka, f"scheduler-weights-{tag}")
        self.weights.subscribe([self.kafka.topic(WEIGHTS)])
        self.rewards = make_consumer(self.kafka, f"scheduler-rewards-{tag}")
        topic = self.kafka.topic(REWARDS)
        found: tuple[list[RolloutRequest], list[RewardEvent], list[Metric]] = ([], [], [])
        if not read_log:
            marks = self._watermarks(self.rewards, topic, strict=False)
        else:
            self.verdicts = make_consumer(self.kafka, f"scheduler-verdicts-{tag}")
            metrics_topic = self.kafka.topic(METRICS)
            reader = make_consumer(self.kafka, f"scheduler-resume-{tag}")
            try:
                requests_topic = self.kafka.topic(ROLLOUT_REQUESTS)
                request_marks = self._watermarks(reader, requests_topic, strict=True)  # all ends before any read
                marks = self._watermarks(self.rewards, topic, strict=True)
                metric_marks = self._watermarks(self.verdicts, metrics_topic, strict=True)
                found = (
                    self._read(reader, requests_topic, request_marks, RolloutRequest),
                    self._read(reader, topic, marks, RewardEvent),
                    self._read(reader, metrics_topic, metric_marks, Metric),
                )
            finally:
                reader.close()
            self.verdicts.assign([TopicPartition(metrics_topic, p, hi) for p, (_, hi) in sorted(metric_marks.items())])
        # Rewards from the ends taken before the log was read: none missed, none applied twice.
        self.rewards.assign([TopicPartition(topic, p, high) for p, (_, high) in sorted(marks.items())])
        return found

    def _watermarks(self, consumer: Consumer, topic: str, *, strict: bool) -> dict[int, tuple[int, int]]:
        """(low, high) per partition, retried while leadership settles (a fresh topic answers NOT_LEADER). Without
        ``strict`` a partition still unanswered gets OFFSET_END (resolved when fetching starts); with it, an error."""
        parts = consumer.list_topics(topic, timeout=30).topics[topic].partitions
        marks = {}
        for p in sorted(parts):
            for _ in range(50):
                try:
                    marks[p] = consumer.get_watermark_offsets(TopicPartition(topic, p), timeout=10)
                    break
                except KafkaException as exc:
                    log.debug("watermarks of %s[%d]: %s (retrying)", topic, p, exc)
                    time.sleep(0.2)
            else:
                if strict:
                    raise ClawstreamError(f"cannot read the end of {topic}[{p}] to resume from the log")
                marks[p] = (OFFSET_END, OFFSET_END)
        return marks

    @staticmethod
    def _read(reader: Consumer, topic: str, marks: dict[int, tuple[int, int]], kind: type[E]) -> list[E]:
        """The records of ``topic`` from the beginning to the high watermarks ``marks`` took, decoded as ``kind``, in
        log order per partition (``read_to_end``: the partitions are assigned by hand, nothing is committed)."""
        ends = {p: high for p, (low, high) in marks.items() if high > low}
        reader.assign([TopicPartition(topic, p, OFFSET_BEGINNING) for p in sorted(ends)])
        out = []
        for msg in read_to_end(reader, topic, ends, timeout=120):
            offset, partition = msg.offset(), msg.partition()
            if offset is None or partition is None or offset >= ends.get(partition, 0):
                continue  # past the end taken (read_to_end may hand over a finished partition's next records)
            try:
                out.append(kind.from_bytes(msg.value() or b""))
            except CodecError as exc:
                log.warning("%s: undecodable %s: %s", where(msg), kind.__name__, exc)
        return out

    def _close(self) -> None:
        for c in (self.weights, self.rewards, self.verdicts):
            if c is not None:
                c.close()
        if self.publisher is not None:
            self.publisher.close()

    async def publish(self, requests: list[RolloutRequest]) -> None:
        assert self.publisher is not None
        topic = self.kafka.topic(ROLLOUT_REQUESTS)
        await asyncio.gather(
            *(
                self.publisher.publish(topic, r.rollout_id, r.to_bytes(), self.settings.publish_timeout_s)
                for r in requests
            )
        )
        for r in requests:
            if r.eval:
                self.issued[r.rollout_id] = r
        self.outstanding.add(requests)
        self.refills.add(requests)

    async def _drain(self) -> int:
        """Apply every weight version, reward and group verdict waiting in Kafka (non-blocking); how many rewards and
        verdicts it read."""
        assert self.weights is not None and self.rewards is not None
        while (msg := self.weights.poll(0)) is not None:
            if msg.error():
                continue
            try:
                version = WeightVersion.from_bytes(msg.value()).policy_version
            except CodecError as exc:
                log.warning("%s: undecodable weight version: %s", where(msg), exc)
                continue
            if version > self.version:
                log.info("%s: policy version %d", where(msg), version)
                self.version = version
        read = 0
        while (msg := self.rewards.poll(0)) is not None:
            if msg.error():
                continue
            read += 1
            try:
                reward = RewardEvent.from_bytes(msg.value())
            except CodecError as exc:
                log.warning("%s: undecodable reward: %s", where(msg), exc)
                continue
            request = self.outstanding.pending.get(reward.rollout_id)
            again = self.outstanding.on_reward(reward)
            if request is not None and reward.rollout_id not in self.outstanding.pending:
                self.refills.settle(request, reward)  # final: graded, ungraded, or given up (no reward)
            if again is not None:
                log.info(
                    "%s: rollout %s infra failure (%s): re-issuing attempt %d",
                    where(msg),
                    reward.rollout_id,
                    reward.reason,
                    again.attempt,
                )
                await self.publish([again])
        while self.verdicts is not None and (msg := self.verdicts.poll(0)) is not None:
            if msg.error():
                continue
            try:
                verdict = group_verdict(Metric.from_bytes(msg.value()))
            except CodecError as exc:
                log.warning("%s: undecodable metric: %s", where(msg), exc)
                continue
            if verdict is not None:
                read += 1
                self.refills.verdict(*verdict)
        return read

    # --- modes --------------------------------------------------------------------------------------------------

    async def train(self, stop: asyncio.Event | None = None) -> int:
        stop = stop or asyncio.Event()
        tasks = self.tasks = self.catalog.suite(self.settings.suite).split(self.settings.split)
        self.plan = dataclasses.replace(self.plan, curriculum=curriculum.parse(self.settings.curriculum, tasks))
        log_read = await asyncio.to_thread(self._open, read_log=True)
        try:
            step = await self._resume(tasks, *log_read)
            del log_read  # the run's log as read: not held for the rest of the run
            while step < self.settings.steps and not stop.is_set():
                await self._drain()
                await self._refill()  # not gated by policy lag: the batches the lag waits for need them
                if may_issue(step, self.version, self.settings.max_policy_lag):
                    requests = plan_step(step, tasks, self.plan, self.rng, self.version)
                    await self.publish(requests)
                    fault_point("scheduler.after_publish")  # the step is on the log, the next one not (docs/faults.md)
                    log.info("step %d: %d requests (policy version %d)", step, len(requests), self.version)
                    step += 1
                else:
                    await asyncio.sleep(0.2)
            # After the last step its rewards and the grouper's verdicts settle the last groups and say which need a
            # refill: wait while they keep coming. The deadline counts from the last reward, verdict or refill, so a
            # slow harness (an opencode step takes minutes on 2 cores) is not cut off mid-step, refills unissued.
            deadline = time.monotonic() + self.settings.drain_timeout_s
            while not stop.is_set():
                progress = await self._drain()
                if await self._refill() or progress:
                    deadline = time.monotonic() + self.settings.drain_timeout_s
                settled = not self.outstanding.pending and not self.refills.undecided()
                if settled or time.monotonic() >= deadline:
                    break
                await asyncio.sleep(0.2)
        finally:
            self._close()
        return step

    async def _refill(self) -> int:
        """Issue the refill groups owed (``producers.scheduler.refill``: one per group that trains nothing, within
        the step's budget); returns how many."""
        issued = 0
        for refill in self.refills.owed():
            requests = self.refills.plan(refill, self.tasks, self.plan, self.version)
            if requests is None:
                log.warning("step %d: no task left for a refill of harness %s", refill.step, refill.harness)
                continue
            await self.publish(requests)
            issued += 1
            log.info(
                "step %d: refill %d of harness %s (%s): a group of the step trains nothing",
                refill.step,
                refill.k,
                refill.harness,
                requests[0].group_id,
            )
        for step, missing in self.refills.short():
            log.warning(
                "step %d: %d groups train nothing and its refill budget (%d) is spent: batches fall that short",
                step,
                missing,
                self.refills.max_per_step,
            )
        return issued

    async def _resume(
        self,
        tasks: list[Task],
        requests: list[RolloutRequest],
        rewards: list[RewardEvent],
        metrics: Sequence[Metric] = (),
    ) -> int:
        """Take over the state the run's log holds (``plan.rebuild``); publish what is owed; the step to go on at."""
        found = rebuild(requests, rewards, self.settings.max_attempts, self.settings.start_step)
        # Only what is still in flight goes on: the rewards of settled rollouts stay on the log (keep_settled off).
        self.outstanding = Outstanding(self.settings.max_attempts, found.outstanding.pending, keep_settled=False)
        cut_short: list[RolloutRequest] = []
        # Refills: which groups of the log train nothing, which refills were issued; owed ones go out in train().
        self.refills.add(found.issued.values())
        for rid, reward in {**found.outstanding.final, **found.outstanding.gave_up}.items():
            self.refills.settle(found.issued[rid], reward)
        for verdict in filter(None, map(group_verdict, metrics)):
            self.refills.verdict(*verdict)
        cut_short += self.refills.cut_short()
        for step in range(self.settings.start_step, found.next_step):
            planned = plan_step(step, tasks, self.plan, self.rng, self.version)  # the RNG moves as when it was issued
            issued = [r for r in found.steps.get(step, []) if REFILL_KEY not in r.metadata]
            missing = missing_requests(planned, issued)
            if missing is None:
                log.warning("step %d on the log is not what this seed plans (seed, suite or sizes changed?)", step)
            elif missing:
                log.warning("step %d: %d of its requests never reached the log: issuing them now", step, len(missing))
                cut_short += missing
        for again in found.reissue:
            log.info("rollout %s: infra failure while down: re-issuing attempt %d", again.rollout_id, again.attempt)
        if found.reissue or cut_short:
            await self.publish(found.reissue + cut_short)
        if found.issued:
            log.info(
                "resuming at step %d: %d requests outstanding, %d re-issued",
                found.next_step,
                len(self.outstanding.pending),
                len(found.reissue),
            )
        else:
            log.info("starting at step %d (no earlier request of this run on the log)", found.next_step)
        return found.next_step

    def eval_requests(self) -> list[RolloutRequest]:
        tasks = self.catalog.suite(self.settings.suite).split(self.settings.eval_split)
        if self.settings.eval_limit:
            tasks = tasks[: self.settings.eval_limit]
        out = []
        for mode in dict.fromkeys(self.settings.eval_modes):
            greedy = mode == "greedy"
            plan = StepPlan(
                len(tasks),
                1 if greedy else self.settings.eval_repeats,
                {},
                self.settings.timeout_s,
                0.0 if greedy else self.settings.temperature,
                1.0 if greedy else self.settings.top_p,
                self.settings.max_tokens,
                self.settings.max_attempts,
                0 if greedy else self.settings.top_k,
            )
            for task in tasks:
                for h in self.settings.eval_harnesses:
                    for i, r in enumerate(instance_requests(task, h, -1, plan, self.version, eval_mode=True)):
                        r.metadata[EVAL_MODE_KEY] = mode
                        if self.settings.eval_seed is not None:
                            r.seed = eval_seed(self.settings.eval_seed, task.suite, task.task_id, h, mode, i)
                        out.append(r)
        return out

    def sampling_note(self) -> str:
        s = self.settings
        return f"temperature {s.temperature:g}, top_p {s.top_p:g}, top_k {s.top_k or 'off'}"

    async def evaluate_scores(self, progress: Callable[[int, int], None] | None = None) -> list[EvalScore]:
        """Publish the eval requests, wait for their rewards (or ``eval_timeout_s``); rows per harness and mode.

        ``progress(done, total)`` is called at every poll (~5 times a second) with the rollouts that have a final
        reward (or were given up): a caller can draw a bar, or raise to stop waiting (e.g. a service died)."""
        await asyncio.to_thread(self._open)
        try:
            await self._drain()
            requests = self.eval_requests()
            await self.publish(requests)
            deadline = time.monotonic() + self.settings.eval_timeout_s
            while self.outstanding.pending and time.monotonic() < deadline:
                await self._drain()
                if progress is not None:
                    progress(len(requests) - len(self.outstanding.pending), len(requests))
                await asyncio.sleep(0.2)
            if progress is not None:
                progress(len(requests) - len(self.outstanding.pending), len(requests))
        finally:
            self._close()
        return eval_scores(self.issued, self.outstanding)

    async def evaluate(self) -> str:
        """``evaluate_scores`` as the printed table (one per mode)."""
        return eval_table(await self.evaluate_scores(), self.sampling_note())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m producers.scheduler.service", description=__doc__.split("\n")[0])
    parser.add_argument(
        "--eval",
        action="store_true",
        help="run the eval split through the running services and print per-harness tables (mean, "
        "standard error, solved); `clawstream eval --model DIR` also starts the services",
    )
    parser.add_argument("--steps", type=int)
    parser.add_argument("--suite")
    add_kafka_arguments(parser)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s %(message)s")
    overrides = {k: v for k, v in {"steps": args.steps, "suite": args.suite}.items() if v is not None}
    kafka = kafka_settings(args)
    log.info("Kafka at %s", check_broker(kafka))
    scheduler = Scheduler(load_settings(SchedulerSettings, **overrides), kafka)
    if args.eval:
        print(asyncio.run(scheduler.evaluate()))
    else:
        asyncio.run(scheduler.train())
    return 0


if __name__ == "__main__":
    sys.exit(main())
