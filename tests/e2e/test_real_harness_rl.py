"""RL through a real harness binary: two GRPO steps on opencode's rollouts move the sampled tokens' logprobs in the
advantages' direction (#32).

Real parts: the Kafka broker, the serving proxy, one sandbox worker running opencode (npm ``opencode-ai``) in local
sandboxes, the streams worker (assembler → grouper → batcher, exactly-once, one group of four per batch), the learner
process training the tiny policy (the proxy's tokenizer on a one-layer net, as ``tests/e2e/test_mixed_batch.py``)
and its weight store. The model double is the scripted teacher (``warmstart/teacher.py``'s plan and opencode tool
calls, served by ``warmstart/scripted_engine.py``), made to err on purpose: each task creates two files, and the
four rollouts of a group write them right/right, right/wrong, wrong/right and wrong/wrong (:data:`PATTERNS`), so the
grader's rewards are 1, 0.75, 0.75 and 0.5 and the group's advantages are +, 0, 0, −. Two tasks, one group each:
two batches, two learner steps (v1, v2).

Asserts, per step: Σ_rollouts Σ_sampled tokens A_r · (log π_after − log π_before) > 0, with both logprobs recomputed
here by the learner's own forward (``learner.forward.packed_logprobs``) on the batch's trees read back from the
batches topic, under the version the step started from and the one it published (loaded from the weight store,
sha256-checked); the trained tokens are exactly the generated tokens the proxy recorded on the calls topic; the mean
Δlogprob of the positive-advantage rollout is above the negative one's; the learner's own ``update_adv_dot`` agrees
with the recomputation. Prints the figures.

opencode is installed from the npm registry on first use; without npm or the package the test SKIPS with the reason
(and FAILS under ``CI=true``, where the real harness must run).
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import subprocess
import sys
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

import pytest

from clawbase.kafka.clients import assign_from_beginning, bootstrap_servers, make_consumer, read_to_end
from clawbase.settings import KafkaSettings
from producers.tasks.catalog import load_suite
from producers.tasks.model import Task
from schemas.events import BatchRecord, BatchRecordKind, CallEvent, CallKind, RewardStatus, Trajectory, WeightVersion
from schemas.topics import BATCHES, CALLS, WEIGHTS
from tests.support import proxy_helpers as H
from tests.support import sandbox_helpers as S
from tests.support.harness_tasks import installed
from tests.support.sandbox_stack import assert_clean, by_rollout, run_requests, stack
from tests.support.stream_harness import Worker as StreamsWorker
from warmstart.scripted_engine import tool_call_text
from warmstart.teacher import FINAL, TITLE, TOOLS, plan, workspace_regex

# serial: assert_clean checks that no sandbox process is left anywhere on the machine (`make test` phase 3)
pytestmark = [pytest.mark.e2e, pytest.mark.integration, pytest.mark.serial]
ROOT = Path(__file__).resolve().parents[2]
HARNESS = "opencode"
TASKS = ("train-001-write_two", "train-009-write_two")  # two new files each: two write calls, four checks
# Per rollout of a group, in the order the rollouts start: is each of the task's writes right?
PATTERNS = ((True, True), (True, False), (False, True), (False, False))
WRONG = "not sure yet\n"  # a wrong write's content: the file exists (1 check) but does not match (0)
ATTEMPT = re.compile(r"Attempt (\d+) of the group\.")  # in the first answer: later turns know their pattern by it
LR = 1e-3  # AdamW's first steps move each weight by ~lr: large enough to see in a one-layer 32-wide net


def _install_or_skip() -> None:
    try:
        installed(HARNESS)
    except pytest.skip.Exception as exc:
        if os.environ.get("CI", "").strip().lower() in {"1", "true", "yes", "on"}:
            pytest.fail(f"CI=true: the real harness must run, but {exc.msg}", pytrace=False)
        print(f"\nSKIP: {exc.msg}", flush=True)
        raise


def erring_teacher(tasks: list[Task], sandboxes: Path, log: list[str]):  # noqa: ANN201 - a Responder
    """The teacher's answers (its plan, opencode's tools) with the writes of :data:`PATTERNS` made wrong.

    The k-th rollout of a task to make its first call takes pattern k and says so in that answer's text, which
    opencode sends back in every later call of the rollout, so each turn knows its pattern whatever the interleaving."""
    ws_re = workspace_regex(sandboxes)
    starts: dict[str, int] = defaultdict(int)

    def respond(prompt_text: str, _ids: list[int], _body: dict[str, Any]) -> str:
        if "<tools>" not in prompt_text:  # a tool-less side call (a title)
            log.append("side")
            return TITLE
        conversation = prompt_text.partition("<|im_start|>user")[2]
        task = next((t for t in tasks if t.prompt in conversation or json.dumps(t.prompt) in conversation), None)
        found = ws_re.search(prompt_text)
        if task is None or found is None:
            log.append("unknown task" if task is None else "no workspace")
            return "I cannot tell the task or its workspace."
        actions = plan(task)
        done = conversation.count("<tool_response>")
        if done >= len(actions):
            log.append(f"{task.task_id}:final")
            return FINAL
        if done == 0:
            k, text = starts[task.task_id], f"Attempt {starts[task.task_id]} of the group."
            starts[task.task_id] += 1
        else:
            said = ATTEMPT.search(conversation)
            if said is None:
                log.append(f"{task.task_id}:{done}: no attempt number in the conversation")
                return "I lost track of my attempt."
            k, text = int(said.group(1)), ""
        right = PATTERNS[k % len(PATTERNS)][done]
        log.append(f"{task.task_id}:{k}:{done}:{'right' if right else 'wrong'}")
        kind, rel, content = actions[done]
        action = (kind, rel, content if right else WRONG)
        name, args = TOOLS[HARNESS](found.group(0), action)
        return tool_call_text(name, args, text)

    return respond


def _read_all(kafka: KafkaSettings, topic: str) -> list[bytes]:
    """Every committed record of ``topic`` (read_committed), from the beginning to its end as of now."""
    consumer = make_consumer(kafka, f"check-{os.urandom(4).hex()}")
    try:
        ends = assign_from_beginning(consumer, kafka.topic(topic), 30)
        return [m.value() for m in read_to_end(consumer, kafka.topic(topic), ends, timeout=60)]
    finally:
        consumer.close()


def _policy_at(model_dir: Path, version: WeightVersion | None):  # noqa: ANN202 - a transformers model
    """The policy as the learner holds it (fp32, SDPA) at ``version``'s published weights (None: the initial model)."""
    from learner.precision import load_policy
    from policy.weight_store import copy_into, load_checked, verify_file

    model = load_policy(model_dir)
    if version is not None:
        copy_into(model, load_checked(verify_file(version), model))  # sha256 against the published event
    return model.eval()


def _sampled_logprobs(model, trees: list) -> list[Any]:  # noqa: ANN001
    """Per rollout, the logprobs (K_r,) of its sampled tokens under ``model``, packed as the learner packs them."""
    import torch

    from learner.forward import packed_logprobs
    from learner.hparams import Hyperparams
    from learner.pack import pack_trees

    per: list[list[torch.Tensor]] = [[] for _ in trees]
    with torch.no_grad():
        for row in pack_trees([t.segments for t in trees], Hyperparams().token_budget, None):
            lp = packed_logprobs(model, row, only_trainable=True)[row.loss_mask]  # (K,) the row's sampled tokens
            index = row.rollout_index[row.loss_mask]  # (K,) the rollout of each, in row order
            for r in index.unique().tolist():
                per[r].append(lp[index == r])
    return [torch.cat(p).double() for p in per]


@pytest.mark.timeout(600)
async def test_two_rl_steps_through_opencode_move_sampled_logprobs_with_the_advantages(
    kafka_settings, group_id, tmp_path
) -> None:
    await asyncio.to_thread(_install_or_skip)
    from learner.step import ScoredTree
    from policy.tiny_model import init_tiny_model

    t_start = time.monotonic()
    # The learner's policy: the proxy's tokenizer (same seed and corpus) on a one-layer net, so a step over opencode's
    # ~10k-token trees stays a few seconds on CPU.
    model_dir = init_tiny_model(
        tmp_path / "policy",
        seed=0,
        hidden_size=32,
        intermediate_size=64,
        num_layers=1,
        num_heads=2,
        num_kv_heads=1,
        progress=None,
    )
    assert (model_dir / "tokenizer.json").read_bytes() == (H.tiny_model_dir() / "tokenizer.json").read_bytes()
    suite = load_suite("builtin:cpu")
    tasks = [suite.tasks[t] for t in TASKS]
    assert all(len(plan(t)) == 2 and not t.files for t in tasks)  # two new files: PATTERNS covers each write
    (tmp_path / "streams").mkdir()
    streams = StreamsWorker(
        kafka_settings,
        tmp_path / "streams",
        app_id=f"streams-{group_id}",
        store="memory://",
        group_size=len(PATTERNS),
        batch_groups=1,  # one group per batch: one learner step per task
        settle_interval_s=1.0,
        commit_interval_s=0.5,
    )
    streams.start()
    learner_log = open(tmp_path / "learner.log", "w+")  # noqa: SIM115 - the child's output, read at the end
    learner = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "learner.train",
            "--model-dir",
            str(model_dir),
            "--weight-store",
            str(tmp_path / "store"),
            "--max-steps",
            str(len(TASKS)),
            "--idle-exit",
            "400",
            "--hp",
            f"lr={LR}",
        ],
        cwd=ROOT,
        env={
            **os.environ,
            "PYTHONPATH": str(ROOT),
            "CLAWSTREAM_KAFKA_BOOTSTRAP_SERVERS": bootstrap_servers(kafka_settings),
            "CLAWSTREAM_KAFKA_TOPIC_PREFIX": kafka_settings.topic_prefix,
        },
        stdout=learner_log,
        stderr=subprocess.STDOUT,
    )
    sandboxes = tmp_path / "sandboxes"
    said: list[str] = []
    reqs = [
        S.request(task, HARNESS, suite="cpu", rollout_id=f"rl-{task}-{k}", timeout_s=180, step=step)
        for step, task in enumerate(TASKS, start=1)
        for k in range(len(PATTERNS))
    ]
    try:
        async with stack(
            kafka_settings,
            group_id,
            tmp_path,
            erring_teacher(tasks, sandboxes, said),
            suites={"cpu": "builtin:cpu"},
            concurrency=4,
            policy_version=0,
        ):
            events, rewards = await run_requests(kafka_settings, reqs, timeout=300)
        rollouts_s = time.monotonic() - t_start
        _, rw = by_rollout(events, rewards)
        log = f"teacher {said}; rewards { {k: [r.reward for r in v] for k, v in rw.items()} }"
        for task in TASKS:
            got = sorted(rw[f"rl-{task}-{k}"][0].reward for k in range(len(PATTERNS)))
            assert all(rw[f"rl-{task}-{k}"][0].status == RewardStatus.OK for k in range(len(PATTERNS))), log
            assert got == [0.5, 0.75, 0.75, 1.0], (task, log)  # every pattern graded as written: reward variance
        assert_clean(sandboxes)

        await asyncio.to_thread(learner.wait, 400)
        learner_log.seek(0)
        learner_out = learner_log.read()
        assert learner.returncode == 0, learner_out[-4000:]
    finally:
        if learner.poll() is None:
            learner.kill()
            learner.wait(10)
        learner_log.close()
        streams.stop()

    versions = sorted(
        (WeightVersion.from_bytes(v) for v in await asyncio.to_thread(_read_all, kafka_settings, WEIGHTS)),
        key=lambda v: v.policy_version,
    )
    assert [v.policy_version for v in versions] == [1, 2], learner_out[-3000:]
    trees: dict[str, list[ScoredTree]] = defaultdict(list)  # batch id → its trees, with their advantages
    ids: dict[str, list[str]] = defaultdict(list)  # batch id → rollout ids, in the same order
    for raw in await asyncio.to_thread(_read_all, kafka_settings, BATCHES):
        rec = BatchRecord.from_bytes(raw)
        if rec.kind is BatchRecordKind.TRAJECTORY:
            traj = Trajectory.from_bytes(rec.trajectory)
            trees[rec.batch_id].append(ScoredTree(traj.segments, rec.advantage, rec.reward, traj.harness))
            ids[rec.batch_id].append(rec.rollout_id)
    assert sorted(trees) == sorted(v.batch_id for v in versions), list(trees)  # one batch per version, both trained
    assert {t.harness for batch in trees.values() for t in batch} == {HARNESS}
    calls = [CallEvent.from_bytes(v) for v in await asyncio.to_thread(_read_all, kafka_settings, CALLS)]

    # The tokens trained on are the proxy's: per rollout, the trees' trainable tokens are its main calls' generated
    # tokens, in order.
    for batch_id, batch in trees.items():
        for rid, tree in zip(ids[batch_id], batch, strict=True):
            mine = sorted(
                (c for c in calls if c.rollout_id == rid and c.call_kind == CallKind.MAIN), key=lambda c: c.seq
            )
            recorded = [int(t) for c in mine for t in c.generated_tokens]
            trained = [int(t) for s in tree.segments if s.trainable for t in s.tokens]
            assert trained == recorded and len(mine) == 3, (rid, len(mine))  # two writes and the final answer

    figures = []
    for before, after in zip([None, *versions[:-1]], versions, strict=True):
        batch = trees[after.batch_id]
        assert sorted(round(t.reward, 2) for t in batch) == [0.5, 0.75, 0.75, 1.0], after.batch_id
        lp_before = _sampled_logprobs(_policy_at(model_dir, before), batch)
        lp_after = _sampled_logprobs(_policy_at(model_dir, after), batch)
        deltas = [a - b for a, b in zip(lp_after, lp_before, strict=True)]  # per rollout (K_r,)
        pairs = list(zip(batch, deltas, strict=True))
        positive = [float(d.mean()) for t, d in pairs if t.advantage > 0]
        negative = [float(d.mean()) for t, d in pairs if t.advantage < 0]
        assert positive and negative, [t.advantage for t in batch]
        figures.append(
            {
                "version": after.policy_version,
                "sum_adv_x_dlogprob": sum(t.advantage * float(d.sum()) for t, d in pairs),
                "sampled_tokens": sum(len(d) for d in deltas),
                "mean_dlogprob_pos": sum(positive) / len(positive),
                "mean_dlogprob_neg": sum(negative) / len(negative),
                "advantages": sorted(round(t.advantage, 3) for t in batch),
                "update_adv_dot": after.metrics["update_adv_dot"],
                # the learner's measure: the mean over rollouts of A · (mean Δ over the rollout's sampled tokens)
                "recomputed_adv_dot": sum(t.advantage * float(d.mean()) for t, d in pairs) / len(pairs),
                "step_seconds": after.metrics["step_seconds"],
            }
        )
    print(f"\nrollouts {rollouts_s:.0f}s, total {time.monotonic() - t_start:.0f}s")
    for figure in figures:
        print(json.dumps(figure), flush=True)
    for figure in figures:
        assert figure["sum_adv_x_dlogprob"] > 0, figure  # the step moved the sampled logprobs the advantages' way
        assert figure["mean_dlogprob_pos"] > figure["mean_dlogprob_neg"], figure
        assert figure["update_adv_dot"] == pytest.approx(figure["recomputed_adv_dot"], rel=0.05, abs=1e-7), figure
