"""The compose `scale` profile: two of each service, one of each killed -9 while data flows, nothing lost.

A fresh Compose project with ``COMPOSE_PROFILES=scale`` (compose/docker-compose.yml): two CPU engines, two proxy
replicas behind HAProxy (``proxy-lb`` under the single proxy's names), two stream workers, two sandbox workers and
the learner as two gloo ranks (``learner-ranks``). The smoke (CI) trains 3 steps of 2 tasks × 2 rollouts; ``make
test-scale`` (``CLAWSTREAM_SCALE_FULL=1``) trains the quickstart, 3 steps of 4 × 4. Each kill is placed by the run's
own state, never by a sleep: a watcher inside the stack streams the topics' records to the test as they are written,
and the learner's log is followed line by line.

- a proxy replica, an engine, a stream worker, a sandbox worker: one after another, each once the run wrote a record
  since the last kill and attempts are running (started, neither ended nor graded);
- a learner rank (rank 1, not the Kafka owner): when rank 0 logs its second batch sealed, i.e. version 1 is
  committed and batch 2's step begins. The launcher then ends the group and exits 1.

A kill is SIGKILL of the service's main process inside its container (``docker kill`` would count as a manual stop,
which compose's ``restart: on-failure`` leaves stopped); the container is restarted by that policy, as in
production. At the end: every step's version is on ``clawstream.weights`` exactly once, and ``clawstream audit``
(nothing lost, doubled or trained twice) exits 0. A rollout's network reaches the balancer's harness port only.
Gated like tests/e2e/test_compose_stack.py: skipped without Docker or Compose, failed instead under CI.
"""

from __future__ import annotations

import json
import os
import secrets
import subprocess
import threading
import time
import uuid
from pathlib import Path
from typing import Any

import pytest

from tests.e2e.test_compose_stack import COMPOSE_FILE, Project, free_port, left_over, records, sandbox_reach
from tests.support.docker_images import ensure_images, require_compose

FULL = os.environ.get("CLAWSTREAM_SCALE_FULL") == "1"
# The smoke's third step: its requests wait for version 1, so rollouts still run after the first kills (with 2 steps
# a quiet machine finished every rollout before the fourth kill could find one running: CI, 2026-12-06).
STEPS, TASKS, GROUP = (3, 4, 4) if FULL else (3, 2, 2)
DEADLINE_S = 2400.0 if FULL else 1200.0
WAIT_S = 600.0

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(DEADLINE_S + 900), pytest.mark.provisioned("docker", "compose")]

# Inside the dashboard's container: every record of the weights, rollout events and rewards topics as one JSON line
# each, as they come (read_committed, partitions assigned by hand: no group, nothing committed).
WATCH = """
import json, sys
from confluent_kafka import OFFSET_BEGINNING, TopicPartition
from clawbase.kafka.clients import make_consumer
from clawbase.settings import KafkaSettings
from schemas.events import RewardEvent, RolloutEvent, RolloutState, WeightVersion
from schemas.topics import REWARDS, ROLLOUT_EVENTS, WEIGHTS
kafka = KafkaSettings()
consumer = make_consumer(kafka, "scale-test-watch", log_level=2)
parts = []
for name in (WEIGHTS, ROLLOUT_EVENTS, REWARDS):
    topic = kafka.topic(name)
    meta = consumer.list_topics(topic, timeout=30).topics[topic]
    parts += [TopicPartition(topic, p, OFFSET_BEGINNING) for p in meta.partitions]
consumer.assign(parts)
while True:
    msg = consumer.poll(0.5)
    if msg is None or msg.error():
        continue
    name = msg.topic()
    if name == kafka.topic(WEIGHTS):
        out = {"kind": "version", "v": WeightVersion.from_bytes(msg.value()).policy_version}
    elif name == kafka.topic(ROLLOUT_EVENTS):
        ev = RolloutEvent.from_bytes(msg.value())
        out = {"kind": "start" if ev.state == RolloutState.STARTED else "end", "a": ev.attempt_id}
    else:
        out = {"kind": "reward", "a": RewardEvent.from_bytes(msg.value()).attempt_id}
    print(json.dumps(out), flush=True)
"""

# SIGKILL a service's main process (the child of the container's init) or, for the learner, rank 1 of the launcher
# (a child of the launcher started by multiprocessing's spawn; the other child is its resource tracker).
KILL_MAIN = "kill -9 $(cat /proc/1/task/1/children)"
KILL_RANK = """
read -r launcher rest < /proc/1/task/1/children  # the file is 'PID ' (a trailing space)
for pid in $(cat /proc/$launcher/task/$launcher/children); do
  if grep -q spawn_main /proc/$pid/cmdline; then ranks="$ranks $pid"; fi
done
set -- $ranks
[ $# -eq 2 ] || { echo "ranks: $ranks"; exit 1; }
kill -9 $2 && echo "killed rank pid $2"
"""


class Watch:
    """The run's state from the watcher's stream: versions, attempts started / ended / graded."""

    def __init__(self, project: Project) -> None:
        argv = ["docker", "compose", "-f", str(COMPOSE_FILE), "-p", project.name, "exec", "-T", "dashboard"]
        self.proc = subprocess.Popen(
            [*argv, "python", "-c", WATCH],
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
            env=project.env,
        )
        self.versions: list[int] = []
        self.started: set[str] = set()
        self.done: set[str] = set()
        self.lock = threading.Lock()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            try:
                rec = json.loads(line)
            except ValueError:
                continue
            with self.lock:
                if rec["kind"] == "version":
                    self.versions.append(rec["v"])
                elif rec["kind"] == "start":
                    self.started.add(rec["a"])
                else:
                    self.done.add(rec["a"])

    def running(self) -> int:
        with self.lock:
            return len(self.started - self.done)

    def version(self) -> int:
        with self.lock:
            return max(self.versions, default=0)

    def count(self) -> int:
        with self.lock:
            return len(self.versions) + len(self.started) + len(self.done)

    def moved(self, since: int) -> bool:
        """A record arrived since ``since`` (a count) and attempts are running."""
        return self.count() > since and self.running() > 0

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(30)


class LearnerLog:
    """Follows the learner's log from its start and kills rank 1 when rank 0 logs its second batch sealed: version 1
    is then committed (rank 0 reads the next batch only after committing the last) and batch 2's step begins."""

    def __init__(self, project: Project, watch: Watch) -> None:
        self.watch = watch
        argv = ["docker", "compose", "-f", str(COMPOSE_FILE), "-p", project.name, "logs", "-f", "--no-log-prefix"]
        self.proc = subprocess.Popen(
            [*argv, "learner-ranks"], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=project.env
        )
        # `docker exec` on the container itself: a compose CLI start less between the log line and the kill
        self.container = project.run("ps", "-q", "learner-ranks").stdout.strip()
        self.killed = threading.Event()
        self.note = ""
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        sealed = 0
        for line in self.proc.stdout:
            sealed += " sealed (" in line
            if sealed == 2 and not self.killed.is_set():
                argv = ["docker", "exec", self.container, "sh", "-c", KILL_RANK]
                out = subprocess.run(argv, capture_output=True, text=True, timeout=60, check=False)
                self.note = (
                    f"{line.strip()[-70:]} -> {(out.stdout + out.stderr).strip()} "
                    f"(versions out at the kill: {self.watch.version()})"
                )
                self.killed.set()

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(30)


def restart_counts(project: str) -> dict[str, int]:
    """Per service of the project: how often Docker's restart policy started its container again."""
    label = f"label=com.docker.compose.project={project}"
    ids = subprocess.run(["docker", "ps", "-aq", "--filter", label], capture_output=True, text=True, check=True)
    fmt = '{{index .Config.Labels "com.docker.compose.service"}} {{.RestartCount}}'
    out = subprocess.run(
        ["docker", "inspect", "-f", fmt, *ids.stdout.split()], capture_output=True, text=True, check=True
    ).stdout
    return {svc: int(n) for svc, n in (line.split() for line in out.splitlines() if line.strip())}


def wait(project: Project, what: str, predicate: Any, timeout: float = WAIT_S) -> float:
    """Poll ``predicate`` until it holds; a service that stays exited non-zero fails the test."""
    t0 = time.monotonic()
    seen: dict[str, int] = {}  # exited non-zero in this many polls in a row (a killed one restarts within one)
    while not predicate():
        exited = {s["Service"] for s in project.services() if s.get("State") == "exited" and int(s["ExitCode"]) != 0}
        seen = {name: seen.get(name, 0) + 1 for name in exited}
        assert not [n for n, k in seen.items() if k >= 5], f"services failed: {seen}"
        assert time.monotonic() - t0 < timeout, f"not within {timeout:.0f} s: {what}"
        time.sleep(0.5)
    return time.monotonic() - t0


def test_scale_profile_trains_through_a_kill_of_each_kind(tmp_path: Path) -> None:
    require_compose()
    ensure_images("runtime", "harnesses", "trainer", "kafka", "haproxy")
    name = f"csscale{uuid.uuid4().hex[:8]}"
    project = Project(
        name,
        {
            "COMPOSE_PROFILES": "scale",
            "CLAWSTREAM_STEPS": str(STEPS),
            "CLAWSTREAM_TASKS_PER_STEP": str(TASKS),
            "CLAWSTREAM_GROUP_SIZE": str(GROUP),
            "CLAWSTREAM_CONCURRENCY": "2",  # per sandbox worker: 4 rollout containers at most on the 2 cores
            "CLAWSTREAM_DASHBOARD_PORT": str(free_port()),
            "CLAWSTREAM_ADMIN_TOKEN": secrets.token_urlsafe(32),
        },
    )
    t0 = time.monotonic()
    passed = False
    watch = learner_log = None
    kills: list[str] = []
    try:
        project.run("up", "-d", "--quiet-pull", timeout=DEADLINE_S)
        print(f"scale stack up in {time.monotonic() - t0:.0f} s", flush=True)
        harness, by_proxy_name, by_admin_name = sandbox_reach(project)
        assert harness == "open" and by_proxy_name != "open" and by_admin_name != "open", (harness, by_proxy_name)
        watch = Watch(project)
        learner_log = LearnerLog(project, watch)
        for service in ("proxy-1", "engine", "streams-2", "sandbox-worker-2"):
            seen = watch.count()  # the next kill once the run has moved on since the last one, attempts running
            waited = wait(project, f"attempts running before killing {service}", lambda seen=seen: watch.moved(seen))
            out = project.run("exec", "-T", service, "sh", "-c", KILL_MAIN, check=False)
            kills.append(f"{service} (after {waited:.0f} s, {watch.running()} running, exec exit {out.returncode})")
            print(f"killed {kills[-1]} at {time.monotonic() - t0:.0f} s", flush=True)
        wait(project, "a learner rank killed as batch 2's step begins", learner_log.killed.is_set)
        kills.append(f"learner-ranks rank 1: {learner_log.note}")
        print(f"killed {kills[-1]} at {time.monotonic() - t0:.0f} s", flush=True)
        wait(project, f"version {STEPS} out", lambda: watch.version() >= STEPS, DEADLINE_S)
        print(f"v{STEPS} out {time.monotonic() - t0:.0f} s after `up`", flush=True)
        counts = restart_counts(name)
        print(f"restart counts: {counts}", flush=True)
        for service in ("proxy-1", "engine", "streams-2", "sandbox-worker-2", "learner-ranks"):
            assert counts.get(service, 0) >= 1, f"{service} was not restarted by its policy: {counts}"
        # Read back: each version once, then the audit of the whole run.
        versions = [r["policy_version"] for r in records(project, "clawstream.weights")]
        assert sorted(versions) == list(range(1, STEPS + 1)), versions
        audit = project.run("exec", "-T", "dashboard", "clawstream", "audit", timeout=300, check=False)
        print(audit.stdout[-4000:], flush=True)
        assert audit.returncode == 0, audit.stdout[-4000:] + audit.stderr[-2000:]
        passed = True
        print(f"scale smoke: {time.monotonic() - t0:.0f} s, kills: {kills}", flush=True)
    finally:
        for follower in (watch, learner_log):
            if follower is not None:
                follower.close()
        if not passed:
            print(f"--- logs of {name} ---\n{project.logs()}")
            every = project.run("logs", "--no-color", "--timestamps", timeout=120, check=False).stdout
            (tmp_path / "compose.log").write_text(every)  # every service's whole log, for the post-mortem
            print(f"every service's log: {tmp_path / 'compose.log'}")
        down = project.run("down", "-v", "--remove-orphans", timeout=600, check=False)
        leftovers = left_over(name)
    assert down.returncode == 0, down.stdout + down.stderr
    assert not any(leftovers.values()), f"left behind by `down -v`: {leftovers}"
