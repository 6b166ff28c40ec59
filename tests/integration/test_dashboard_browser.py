"""The dashboard in a real headless Chromium (Debian's chromium + chromedriver, driven with selenium).

A live run's events go to the real broker — call events recorded as the proxy delta-encodes them, lifecycle
events, rewards, trajectories built by the streams' pure core, weight versions, learner / engine metrics — half
before the page is opened and half while it is open. The dashboard runs as its own process
(``python -m consumers.analytics.dashboard --port 0``). The test reads each chart's data back from plotly.js in
the page, checks the numbers against the events it produced, checks the browser console holds no error and saves
a screenshot (to ``bench/results/dashboard.png``, shown in the README, with CLAWSTREAM_SAVE_SCREENSHOT=1).
Skipped, with the reason, when Chromium or its driver is missing — except in CI (``CI=true``), where
``.ci/run`` installs them.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from clawbase.kafka.clients import make_producer
from clawbase.settings import KafkaSettings
from schemas.events import (
    CallEvent,
    CallKind,
    Dialect,
    Event,
    Metric,
    RewardEvent,
    RewardStatus,
    RolloutEvent,
    RolloutRequest,
    RolloutState,
    Trajectory,
    WeightVersion,
)
from schemas.topics import CALLS, CATALOG, METRICS, REWARDS, ROLLOUT_EVENTS, ROLLOUT_REQUESTS, TRAJECTORIES, WEIGHTS
from streams.rollout import RolloutAccumulator
from streams.settings import StreamsSettings
from streams.trajectory import build_trajectory

pytestmark = pytest.mark.integration
ROOT = Path(__file__).resolve().parents[2]
# The README shows bench/results/dashboard.png; a test run writes it only when asked (CLAWSTREAM_SAVE_SCREENSHOT=1),
# so `make test` leaves the working tree as it found it.
README_SCREENSHOT = ROOT / "bench" / "results" / "dashboard.png"
CHROMIUM, CHROMEDRIVER = "/usr/bin/chromium", "/usr/bin/chromedriver"
FLAGS = (
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--disable-dev-shm-usage",
)
TOPIC = {
    RolloutRequest: ROLLOUT_REQUESTS,
    RolloutEvent: ROLLOUT_EVENTS,
    CallEvent: CALLS,
    RewardEvent: REWARDS,
    Trajectory: TRAJECTORIES,
    WeightVersion: WEIGHTS,
    Metric: METRICS,
}


def _need_browser() -> None:
    missing = [p for p in (CHROMIUM, CHROMEDRIVER) if not (Path(p).exists() or shutil.which(Path(p).name))]
    if missing and os.environ.get("CI") != "true":
        pytest.skip(f"{', '.join(missing)} not installed (Debian: apt-get install chromium chromium-driver)")
    assert not missing, f"CI must have {missing} (.ci/run installs chromium and chromium-driver)"


# ---- a live run, as events ------------------------------------------------------------------------------------------
class Run:
    """Events of a small two-harness run, with the numbers the dashboard must show."""

    def __init__(self, start_ms: int) -> None:
        self.t = start_ms
        self.rewards: dict[tuple[str, int], list[float]] = {}
        self.status: dict[str, str] = {}

    def tick(self, ms: int = 700) -> int:
        self.t += ms
        return self.t

    def calls(self, rid: str, attempt_id: str, version: int, fork: bool) -> list[CallEvent]:
        """Three main calls; with ``fork`` the third re-lays the history out (OpenClaw) and is flagged."""
        sys_ids, ctx = [1, 2, 3, 4, 5, 6], [7, 60, 61, 62]
        prompts = [sys_ids + [7, 10, 11] + ctx + [5]]
        gens = [[100, 101, 102, 99], [103, 104, 99], [105, 106, 107, 108, 99]]
        prompts.append(prompts[0] + gens[0] + [7, 30, 31] + [5])
        if fork:
            prompts.append(sys_ids + [7, 10, 11] + [5] + gens[0] + [7, 30, 31] + [5] + gens[1] + [7, 32] + ctx + [5])
        else:
            prompts.append(prompts[1] + gens[1] + [7, 32] + [5])
        out: list[CallEvent] = []
        fulls: list[list[int]] = []
        for seq, (prompt, gen) in enumerate(zip(prompts, gens, strict=True)):
            shared, parent = 0, None
            for i, full in enumerate(fulls):  # the proxy's delta encoding: the longest common prefix
                n = next(
                    (k for k, (a, b) in enumerate(zip(full, prompt, strict=False)) if a != b),
                    min(len(full), len(prompt)),
                )
                if n > shared or (n == shared and n > 0):
                    shared, parent = n, out[i].call_id
            out.append(
                CallEvent(
                    rollout_id=rid,
                    policy_version=version,
                    timestamp_ms=self.tick(),
                    call_id=f"{rid}-{seq}",
                    seq=seq,
                    dialect=Dialect.OPENAI_CHAT,
                    requested_model="policy",
                    call_kind=CallKind.MAIN,
                    new_tokens=np.array(prompt[shared:], np.int32),
                    prompt_len=len(prompt),
                    generated_tokens=np.array(gen, np.int32),
                    logprobs=np.full(len(gen), -0.5, np.float32),
                    finish_reason="stop",
                    parent_call_id=parent,
                    shared_prefix_len=shared,
                    flags=["full_render"] if fork and seq == 2 else [],
                    cached_prompt_tokens=shared,
                    attempt_id=attempt_id,
                    temperature=1.0,
                    top_p=1.0,
                    top_k=0,
                )
            )
            fulls.append(prompt + gen)
        return out

    def rollout(
        self, rid: str, harness: str, step: int, version: int, outcome: str, reward: float | None
    ) -> list[Event]:
        """One rollout: request, STARTED, calls, then per ``outcome`` its end, reward and trajectory."""
        group, attempt_id = f"t{step}|{harness}|{step}", f"{rid}-a0"
        events: list[Event] = [
            RolloutRequest(
                rollout_id=rid,
                policy_version=version,
                timestamp_ms=self.tick(),
                suite="builtin:cpu",
                task_id=f"t{step}",
                harness=harness,
                group_id=group,
                step=step,
                timeout_s=60.0,
            ),
            RolloutEvent(
                rollout_id=rid,
                policy_version=version,
                timestamp_ms=self.tick(),
                attempt_id=attempt_id,
                state=RolloutState.STARTED,
                group_id=group,
                harness=harness,
            ),
        ]
        calls = self.calls(rid, attempt_id, version, fork=harness == "openclaw")
        if outcome == "running":  # its second request held an assistant turn the proxy never generated
            calls[1].tampered = True
        events += calls
        self.status[rid] = outcome
        if outcome == "running":
            return events
        state = {
            "ok": RolloutState.HARNESS_EXITED,
            "failed": RolloutState.HARNESS_EXITED,
            "timed_out": RolloutState.TIMED_OUT,
            "infra": RolloutState.FAILED,
        }[outcome]
        events.append(
            RolloutEvent(
                rollout_id=rid,
                policy_version=version,
                timestamp_ms=self.tick(),
                attempt_id=attempt_id,
                state=state,
                group_id=group,
                harness=harness,
                exit_code={"ok": 0, "failed": 1}.get(outcome),
                calls_served=3,
            )
        )
        status = RewardStatus.INFRA_FAILURE if outcome == "infra" else RewardStatus.OK
        events.append(
            RewardEvent(
                rollout_id=rid,
                policy_version=version,
                timestamp_ms=self.tick(),
                attempt_id=attempt_id,
                status=status,
                grader="native",
                reward=reward,
            )
        )
        acc = RolloutAccumulator(
            rid,
            self.t,
            self.t,
            attempt_id=attempt_id,
            request={
                "group_id": group,
                "task_id": f"t{step}",
                "step": step,
                "harness": harness,
                "suite": "builtin:cpu",
                "eval": False,
                "metadata": {},
                "timeout_s": 60.0,
            },
            started={"group_id": group, "harness": harness, "policy_version": version},
            terminal={
                "state": state.value,
                "calls_served": 3,
                "group_id": group,
                "harness": harness,
                "policy_version": version,
                "reason": "harness failed" if outcome == "infra" else None,
            },
            reward={
                "attempt_id": attempt_id,
                "status": status.value,
                "reward": reward,
                "reason": None,
                "grader": "native",
            },
        )
        events.append(build_trajectory(acc, calls, self.tick(), StreamsSettings()))
        if outcome != "infra" and reward is not None:
            self.rewards.setdefault((harness, step), []).append(reward)
        return events

    def step_events(self, step: int) -> list[Event]:
        plan = {
            0: [
                ("agentloop", "ok", 1.0),
                ("agentloop", "failed", 0.0),
                ("openclaw", "ok", 0.25),
                ("openclaw", "ok", 0.75),
            ],
            1: [
                ("agentloop", "ok", 1.0),
                ("agentloop", "running", None),
                ("openclaw", "timed_out", 0.5),
                ("openclaw", "infra", None),
            ],
        }[step]
        events: list[Event] = []
        version = step + 1
        events.append(
            WeightVersion(
                policy_version=version,
                timestamp_ms=self.tick(),
                model_name="policy",
                step=step,
                uri=f"file:///w/v{version}.safetensors",
                sha256="0" * 64,
            )
        )
        for engine, latency in (("inference-worker/a", 0.12), ("inference-worker/b", 0.31)):
            events.append(
                Metric(
                    policy_version=version,
                    timestamp_ms=self.tick(),
                    source=engine,
                    name="weights_applied",
                    values={"publish_to_applied_s": latency},
                )
            )
            events.append(
                Metric(
                    policy_version=version,
                    timestamp_ms=self.tick(),
                    source=engine,
                    name="inference_stats",
                    values={"prefix_cache_hit_rate": 0.5 + 0.1 * step, "tokens_per_s": 100.0 + step},
                )
            )
        for i, (harness, outcome, reward) in enumerate(plan):
            events += self.rollout(f"s{step}-{harness}-{i}", harness, step, version, outcome, reward)
        events.append(
            Metric(
                policy_version=version,
                timestamp_ms=self.tick(),
                source="learner",
                name="train_step",
                step=step,
                values={"loss": 0.5 - 0.1 * step},
            )
        )
        return events


def produce(settings: KafkaSettings, events: list[Event]) -> None:
    producer = make_producer(settings)
    for event in events:
        key = getattr(event, "rollout_id", None) or getattr(event, "model_name", None) or event.source
        producer.produce(settings.topic(TOPIC[type(event)]), key=key.encode(), value=event.to_bytes())
    assert producer.flush(30) == 0


# ---- the page -------------------------------------------------------------------------------------------------------
CHART_DATA = """
const out = {};
for (const el of document.querySelectorAll('.chart')) {
  out[el.id] = (el.data || []).map(t => ({name: t.name, x: Array.from(t.x || []), y: Array.from(t.y || [])}));
}
return JSON.stringify({charts: out, updates: window.clawstreamDashboard.updates,
                       health: Array.from(document.querySelectorAll('#health-table tbody tr')).map(
                         tr => Array.from(tr.children).map(td => td.textContent))});
"""


def page_data(driver: Any) -> dict[str, Any]:
    return json.loads(driver.execute_script(CHART_DATA))


def wait_for(driver: Any, check: Any, timeout: float = 60.0) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    data: dict[str, Any] = {}
    while time.monotonic() < deadline:
        data = page_data(driver)
        if check(data):
            return data
        time.sleep(0.5)
    raise AssertionError(f"the page never showed what was expected; last: {json.dumps(data)[:3000]}")


def trace(data: dict[str, Any], chart: str, name: str) -> dict[str, Any]:
    return next(t for t in data["charts"][chart] if t["name"] == name)


@pytest.fixture
def dashboard(kafka_settings: KafkaSettings) -> Any:
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "consumers.analytics.dashboard",
            "--port",
            "0",
            "--refresh-ms",
            "500",
            "--bootstrap",
            kafka_settings.bootstrap_servers or "",
            "--topic-prefix",
            kafka_settings.topic_prefix,
        ],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    lines: list[str] = []
    try:
        assert proc.stdout is not None
        deadline = time.monotonic() + 60
        url = None
        while url is None and time.monotonic() < deadline:
            line = proc.stdout.readline()
            if not line and proc.poll() is not None:
                break
            lines.append(line)
            match = re.search(r"dashboard on (http://\S+/)", line)
            url = match.group(1) if match else None
        assert url, "the dashboard did not print its URL:\n" + "".join(lines)
        yield url
    finally:
        proc.terminate()
        proc.wait(15)


def test_dashboard_page_draws_a_live_run_without_console_errors(
    kafka_settings: KafkaSettings, dashboard: str, tmp_path: Path
) -> None:
    _need_browser()
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    run = Run(int(time.time() * 1000) - 60_000)
    produce(kafka_settings, run.step_events(0))

    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for flag in FLAGS:
        options.add_argument(flag)
    profile = tempfile.mkdtemp(prefix="clawstream-chromium-")
    options.add_argument(f"--user-data-dir={profile}")
    options.add_argument("--window-size=1500,1000")
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    driver = webdriver.Chrome(service=Service(CHROMEDRIVER), options=options)
    try:
        driver.set_page_load_timeout(60)
        driver.get(dashboard)
        assert driver.title == "clawstream dashboard"
        assert driver.execute_script("return typeof Plotly") == "object"  # served locally, from the package

        # step 0 arrives: rewards, statuses, capture health, trees, weights
        data = wait_for(
            driver,
            lambda d: (
                len(d["charts"]["chart-reward"]) == 2
                and any(t["name"] == "published" and t["y"] == [1] for t in d["charts"]["chart-weights"])
            ),
        )
        for harness in ("agentloop", "openclaw"):
            assert trace(data, "chart-reward", harness)["x"] == [0]
            assert trace(data, "chart-reward", harness)["y"] == [pytest.approx(0.5)]

        # step 1 arrives while the page is open
        produce(kafka_settings, run.step_events(1))
        data = wait_for(
            driver,
            lambda d: (
                trace(d, "chart-reward", "openclaw")["x"] == [0, 1]
                and sum(d["charts"]["chart-status"][0]["y"]) == 8
                and len(trace(d, "chart-weights", "published")["y"]) == 2
            ),
        )
        for (harness, step), rewards in run.rewards.items():
            t = trace(data, "chart-reward", harness)
            assert t["y"][t["x"].index(step)] == pytest.approx(sum(rewards) / len(rewards))
        status = data["charts"]["chart-status"][0]
        assert dict(zip(status["x"], status["y"], strict=True)) == {
            "running": 1,
            "ok": 4,
            "failed": 1,
            "timed_out": 1,
            "infra": 1,
        }

        # capture health: the openclaw rollouts fork (and re-render) once each, agentloop's only extend
        rows = {r[0]: r for r in data["health"]}
        assert rows["agentloop"][4] == "100.0% (8/8)" and rows["agentloop"][6] == "0.00"
        assert rows["openclaw"][4] == "50.0% (4/8)" and rows["openclaw"][5] == "1.00" and rows["openclaw"][6] == "1.00"
        assert rows["agentloop"][12] == "1 (1)" and rows["openclaw"][12] == "0 (0)"  # tampered: shown when zero
        extend = trace(data, "chart-health", "extend exactly %")
        assert dict(zip(extend["x"], extend["y"], strict=True)) == {
            "agentloop / openai_chat": 100.0,
            "openclaw / openai_chat": 50.0,
        }

        tree = trace(data, "chart-tree", "leaves / rollout")
        assert tree["x"] == ["agentloop", "openclaw"] and all(v >= 1 for v in tree["y"])
        trained = trace(data, "chart-tokens", "tokens trained")
        path = trace(data, "chart-tokens", "Σ path tokens")
        assert all(0 < t <= p for t, p in zip(trained["y"], path["y"], strict=True))

        calls = trace(data, "chart-throughput", "calls/s")
        assert sum(calls["y"]) * 10 == pytest.approx(8 * 3)  # 24 calls in 10 s buckets
        lag = trace(data, "chart-lag", "max")
        assert lag["y"] and max(lag["y"]) == 0  # every call was served by the newest version

        applied = {t["name"]: t["y"] for t in data["charts"]["chart-weights"]}
        assert applied == {
            "published": [1, 2],
            "applied: inference-worker/a": [1, 2],
            "applied: inference-worker/b": [1, 2],
        }

        metrics = urllib.request.urlopen(dashboard + "metrics", timeout=10).read().decode()  # noqa: S310 - loopback
        assert 'clawstream_capture_extends_share{harness="openclaw",template="openai_chat"} 0.5' in metrics
        assert 'clawstream_capture_full_renders_total{harness="openclaw",template="openai_chat"} 4.0' in metrics
        assert 'clawstream_rollouts{status="running"} 1.0' in metrics

        for _ in range(3):  # grow the window until the whole page fits in the viewport (browser chrome differs)
            inner, height = driver.execute_script("return [window.innerHeight, document.documentElement.scrollHeight]")
            if inner >= height:
                break
            driver.set_window_size(1500, min(driver.get_window_size()["height"] + height - inner + 20, 5000))
        time.sleep(1.5)  # two refreshes at the new size (plotly relayouts responsively)
        shot = README_SCREENSHOT if os.environ.get("CLAWSTREAM_SAVE_SCREENSHOT") == "1" else tmp_path / "dashboard.png"
        assert driver.save_screenshot(str(shot)) and shot.stat().st_size > 20_000

        logs = driver.get_log("browser")
        errors = [entry for entry in logs if entry["level"] == "SEVERE"]
        assert errors == [], errors
        assert page_data(driver)["updates"] >= 3
    finally:
        driver.quit()
        shutil.rmtree(profile, ignore_errors=True)


def _get(url: str) -> tuple[int, str, bytes]:
    try:
        with urllib.request.urlopen(url, timeout=10) as resp:  # noqa: S310 - loopback
            return resp.status, resp.headers.get("Content-Type", ""), resp.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.headers.get("Content-Type", ""), exc.read()


def test_dashboard_in_process_picks_up_topics_created_later_and_counts_bad_records(
    kafka_bootstrap: str, topic_prefix: str
) -> None:
    """No browser needed: the in-process starter the demo can use, the HTTP routes, a topic that appears after
    start, an undecodable record (counted, not fatal)."""
    from clawbase.kafka.clients import create_topics
    from consumers.analytics.dashboard.server import plotly_js, start_dashboard

    settings = KafkaSettings(bootstrap_servers=kafka_bootstrap, topic_prefix=topic_prefix)
    handle = start_dashboard(settings, port=0)  # before any topic of the prefix exists
    try:
        assert handle.url.startswith("http://127.0.0.1:")
        status, ctype, body = _get(handle.url)
        assert status == 200 and "text/html" in ctype and b"/static/plotly.min.js" in body
        status, ctype, body = _get(handle.url + "static/plotly.min.js")
        assert status == 200 and "javascript" in ctype and body == plotly_js().read_bytes()
        assert _get(handle.url + "static/..%2F..%2Fserver.py")[0] == 404
        assert _get(handle.url + "static/secret.txt")[0] == 404
        assert _get(handle.url + "healthz")[0] == 200

        create_topics(settings, CATALOG)
        run = Run(int(time.time() * 1000) - 30_000)
        produce(settings, run.step_events(0))
        producer = make_producer(settings)
        producer.produce(settings.topic(CALLS), key=b"r-bad", value=b"\x00not avro")
        assert producer.flush(30) == 0

        deadline, state = time.monotonic() + 60, {}
        while time.monotonic() < deadline:
            state = json.loads(_get(handle.url + "api/state")[2])
            if state["errors"]["count"] == 1 and state["records"].get(CALLS, 0) == 12:
                break
            time.sleep(0.5)
        assert state["errors"]["count"] == 1 and "not Avro" in state["errors"]["last"], state["errors"]
        assert state["records"][CALLS] == 12 and state["feed"]["alive"] and state["feed"]["error"] is None
        assert state["status"] == {"running": 0, "ok": 3, "failed": 1, "timed_out": 0, "infra": 0}
        metrics = _get(handle.url + "metrics")[2].decode()
        assert "clawstream_dashboard_decode_errors_total 1.0" in metrics
        assert 'clawstream_weights_applied_version{engine="inference-worker/a"} 1.0' in metrics
    finally:
        handle.stop()
    assert not handle._thread.is_alive()
