"""The learner on the real broker: sealed batches → contiguous weight versions that the inference worker applies,
exactly once across a crash."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
import torch
from confluent_kafka import TopicPartition

from clawbase import faults
from clawbase.kafka.clients import bootstrap_servers, make_consumer, make_producer
from clawbase.settings import KafkaSettings
from policy.weight_store import sha256_file, verify_file
from schemas.events import DeadLetter, WeightVersion
from schemas.topics import BATCHES, CATALOG, DEADLETTER, WEIGHTS
from tests.support.fault_report import FaultRow, record
from tests.support.inference import Worker
from tests.support.learner_data import batch_records, small_model

pytestmark = pytest.mark.integration
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return small_model(tmp_path_factory.mktemp("tiny"))


def _produce_batches(settings: KafkaSettings, specs: list[tuple[str, int]]) -> int:
    producer = make_producer(settings)
    n = 0
    for batch_id, step in specs:
        for rec in batch_records(batch_id, step, 4, seed=step):
            producer.produce(settings.topic(BATCHES), key=batch_id.encode(), value=rec.to_bytes())
            n += 1
    assert producer.flush(30) == 0
    return n


def _run_learner(
    settings: KafkaSettings,
    model_dir: Path,
    store: Path,
    *,
    fault: str | None = None,
    max_steps: int = 2,
    extra: tuple[str, ...] = (),
    env_extra: dict[str, str] | None = None,
) -> subprocess.CompletedProcess[str]:
    env = dict(
        os.environ,
        CLAWSTREAM_KAFKA_BOOTSTRAP_SERVERS=bootstrap_servers(settings),
        CLAWSTREAM_KAFKA_TOPIC_PREFIX=settings.topic_prefix,
        PYTHONPATH=str(ROOT),
        **(env_extra or {}),
    )
    env.pop(faults.ENV, None)
    if fault:
        env.update(faults.fault_env(store.parent / "faults", **{fault.split("=")[0]: fault.split("=")[1]}))
    cmd = [
        sys.executable,
        "-m",
        "learner.train",
        "--model-dir",
        str(model_dir),
        "--weight-store",
        str(store),
        "--max-steps",
        str(max_steps),
        "--idle-exit",
        "20",
        "--hp",
        "lr=1e-3",
        *extra,
    ]
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300, check=False)


def _read(settings: KafkaSettings, group: str, topic: str, decode):  # noqa: ANN001, ANN202
    """Every committed record of ``topic`` that arrives within 8 s, decoded (read_committed)."""
    consumer = make_consumer(settings, group)
    consumer.subscribe([settings.topic(topic)])
    out = []
    deadline = time.monotonic() + 8
    try:
        while time.monotonic() < deadline:
            msg = consumer.poll(0.5)
            if msg is not None and not msg.error():
                out.append(decode(msg.value()))
    finally:
        consumer.close()
    return out


def _versions(settings: KafkaSettings, group: str) -> list[WeightVersion]:
    return _read(settings, group, WEIGHTS, WeightVersion.from_bytes)


def _dead_letters(settings: KafkaSettings, group: str) -> list[DeadLetter]:
    return _read(settings, group, DEADLETTER, DeadLetter.from_bytes)


def test_two_batches_give_two_versions(kafka_settings: KafkaSettings, model_dir: Path, tmp_path: Path) -> None:
    _produce_batches(kafka_settings, [("b-1", 1), ("b-2", 2)])
    result = _run_learner(kafka_settings, model_dir, tmp_path / "store")
    assert result.returncode == 0, result.stderr[-3000:]
    versions = _versions(kafka_settings, "check-1")
    assert [(v.policy_version, v.step, v.batch_id) for v in versions] == [(1, 1, "b-1"), (2, 2, "b-2")]
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(model_dir).state_dict()
    for v in versions:
        from safetensors.torch import load_file

        state = load_file(str(verify_file(v)))
        assert v.metrics["trainable_tokens"] == 4 * 18 and v.metrics["reward/agentloop"] == 1.0
        changed = [name for name, t in state.items() if not torch.equal(t, base[name])]
        assert changed, f"v{v.policy_version} did not change any parameter"

    # The inference worker follows clawstream.weights and serves the newest version the learner published.
    env = {
        "CLAWSTREAM_KAFKA_BOOTSTRAP_SERVERS": bootstrap_servers(kafka_settings),
        "CLAWSTREAM_KAFKA_TOPIC_PREFIX": kafka_settings.topic_prefix,
    }
    worker = Worker(["--model", str(model_dir), "--served-model-name", "policy", "--metrics-interval-s", "0"], env)
    try:
        body = {"model": "policy", "prompt": [5, 6, 7], "max_tokens": 2, "temperature": 0}
        deadline = time.monotonic() + 60
        served = -1
        while time.monotonic() < deadline and served < 2:
            with urllib.request.urlopen(
                urllib.request.Request(  # noqa: S310 - loopback test server
                    f"{worker.url}/v1/completions",
                    data=json.dumps(body).encode(),
                    headers={"Content-Type": "application/json"},
                )
            ) as resp:
                served = json.loads(resp.read())["policy_version"]
            time.sleep(0.2)
        assert served == 2, worker.log()[-3000:]
    finally:
        worker.stop()


def test_crash_between_save_and_commit_trains_the_batch_once(
    kafka_settings: KafkaSettings, model_dir: Path, tmp_path: Path
) -> None:
    records = _produce_batches(kafka_settings, [("c-1", 1), ("c-2", 2)])
    store = tmp_path / "store"
    crashed = _run_learner(kafka_settings, model_dir, store, fault="learner.after_save@2=crash")
    assert crashed.returncode == faults.CRASH_STATUS, crashed.stderr[-3000:]
    [saved] = (store / "policy").glob("v000002-*/model.safetensors")  # saved under its attempt's name
    assert not (store / "policy" / "v000002").exists()  # never published
    assert [v.policy_version for v in _versions(kafka_settings, "check-a")] == [1]

    resumed = _run_learner(kafka_settings, model_dir, store, max_steps=1)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resumed policy at v1" in resumed.stderr
    versions = _versions(kafka_settings, "check-b")
    got = [(v.policy_version, v.batch_id) for v in versions]
    assert got == [(1, "c-1"), (2, "c-2")], resumed.stderr[-4000:]  # contiguous, once each
    assert versions[1].sha256 == sha256_file(store / "policy" / "v000002" / "model.safetensors")

    consumer = make_consumer(kafka_settings, f"{kafka_settings.topic_prefix}clawstream-learner-policy")
    committed = consumer.committed([TopicPartition(kafka_settings.topic(BATCHES), 0)], timeout=10)[0].offset
    consumer.close()
    assert committed == records  # every batch record (and seal) consumed, nothing left to train again


def test_poisoned_batches_are_dead_lettered_and_the_good_ones_trained_once(
    kafka_settings: KafkaSettings, model_dir: Path, tmp_path: Path
) -> None:
    """Between good batches: one whose trajectory does not decode, one with a path longer than a row may hold, one
    recorded without sampling settings. Before,
    either crashed the learner inside its transaction, and the restarted learner read the same batch again."""
    from dataclasses import replace

    import numpy as np

    from schemas.events import Trajectory

    undecodable = batch_records("b-2", 2, 4, seed=2)
    undecodable[1] = replace(undecodable[1], trajectory=b"\x00not a trajectory")
    oversized = batch_records("b-3", 3, 4, seed=3)
    big = Trajectory.from_bytes(oversized[2].trajectory)  # type: ignore[arg-type]
    big.segments[0] = replace(big.segments[0], tokens=np.arange(3, 103, dtype="<i4"))  # a path of 119 tokens > 100
    oversized[2] = replace(oversized[2], trajectory=big.to_bytes())
    unsampled = batch_records("b-4", 4, 4, seed=4)  # a trainable segment recorded without sampling settings
    old = Trajectory.from_bytes(unsampled[3].trajectory)  # type: ignore[arg-type]
    old.segments[1] = replace(old.segments[1], temperature=None, top_p=None, top_k=None, call_id="c-old")
    unsampled[3] = replace(unsampled[3], trajectory=old.to_bytes())
    producer = make_producer(kafka_settings)
    for rec in [
        *batch_records("b-1", 1, 4, seed=1),
        *undecodable,
        *oversized,
        *unsampled,
        *batch_records("b-5", 5, 4, seed=5),
    ]:
        producer.produce(kafka_settings.topic(BATCHES), key=rec.batch_id.encode(), value=rec.to_bytes())
    assert producer.flush(30) == 0

    result = _run_learner(
        kafka_settings,
        model_dir,
        tmp_path / "store",
        max_steps=5,
        extra=("--hp", "token_budget=64", "--hp", "max_path_tokens=100"),
    )
    assert result.returncode == 0 and "Traceback" not in result.stderr, result.stderr[-3000:]
    versions = _versions(kafka_settings, "check-poison")
    assert [(v.policy_version, v.batch_id) for v in versions] == [(1, "b-1"), (2, "b-5")]
    letters = _dead_letters(kafka_settings, "check-poison-dl")
    reasons = {d.error_type: d.reason for d in letters}
    assert len(letters) == 3 and set(reasons) == {"UntrainableBatch"}, [(d.error_type, d.reason) for d in letters]
    assert any("tree 3: trainable segment 1 (call c-old) carries no sampling settings" in d.reason for d in letters)
    assert any("does not decode" in d.reason for d in letters)
    assert any(
        "cannot pack" in d.reason and "path of 119 tokens is longer than the 100" in d.reason for d in letters
    ), [d.reason for d in letters]


def test_a_resumed_learner_equals_an_uninterrupted_one(
    kafka_settings: KafkaSettings, model_dir: Path, tmp_path: Path
) -> None:
    """Three batches in one run vs two, a stop, and the third in a new process: the same v3 to 1e-6. Before the
    optimizer state was saved with each version, the resumed step started from zero AdamW moments."""
    from safetensors.torch import load_file

    from clawbase.kafka.clients import create_topics

    other = KafkaSettings(
        bootstrap_servers=kafka_settings.bootstrap_servers, topic_prefix=kafka_settings.topic_prefix + "resumed."
    )
    create_topics(other, CATALOG)
    specs = [("b-1", 1), ("b-2", 2), ("b-3", 3)]
    for settings in (kafka_settings, other):
        _produce_batches(settings, specs)
    straight = _run_learner(kafka_settings, model_dir, tmp_path / "straight", max_steps=3)
    assert straight.returncode == 0, straight.stderr[-3000:]
    for steps in (2, 1):
        part = _run_learner(other, model_dir, tmp_path / "resumed", max_steps=steps)
        assert part.returncode == 0, part.stderr[-3000:]
    assert "fresh AdamW moments" not in part.stderr and "resumed policy at v2" in part.stderr, part.stderr[-3000:]
    [a] = [v for v in _versions(kafka_settings, "check-straight") if v.policy_version == 3]
    [b] = [v for v in _versions(other, "check-resumed") if v.policy_version == 3]
    sa, sb = load_file(str(verify_file(a))), load_file(str(verify_file(b)))
    base = base_state(model_dir)
    assert any(not torch.equal(sa[k], base[k]) for k in sa)  # the steps moved the weights
    worst = max(float((sa[k] - sb[k]).abs().max()) for k in sa)
    assert worst <= 1e-6, f"resumed v3 differs from the uninterrupted v3 by {worst}"


def base_state(model_dir: Path) -> dict[str, torch.Tensor]:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir).state_dict()


def test_a_batch_sealed_after_an_open_one_is_not_trained_twice_after_a_restart(
    kafka_settings: KafkaSettings, model_dir: Path, tmp_path: Path
) -> None:
    """b-1 opens, b-2 opens and seals, then b-1 seals. Trained in seal order; the offset committed with b-2 stays at
    b-1's first record, so the restarted learner reads b-2 again: it must dead-letter it, not train it twice."""
    one, two = batch_records("b-1", 1, 4, seed=1), batch_records("b-2", 2, 4, seed=2)
    producer = make_producer(kafka_settings)
    for rec in [*one[:-1], *two, one[-1]]:
        producer.produce(kafka_settings.topic(BATCHES), key=rec.batch_id.encode(), value=rec.to_bytes())
    assert producer.flush(30) == 0
    first = _run_learner(kafka_settings, model_dir, tmp_path / "store", max_steps=1)
    assert first.returncode == 0, first.stderr[-3000:]
    second = _run_learner(kafka_settings, model_dir, tmp_path / "store", max_steps=2)
    assert second.returncode == 0, second.stderr[-3000:]
    versions = _versions(kafka_settings, "check-twice")
    assert [(v.policy_version, v.batch_id) for v in versions] == [(1, "b-2"), (2, "b-1")]
    reasons = [d.reason for d in _dead_letters(kafka_settings, "check-twice-dl")]
    assert reasons == ["batch b-2 was already trained (published as v1)"]


def _attempts(store: Path) -> dict[str, dict]:
    path = store / "policy" / "trainer-state" / "step-attempts.json"
    return json.loads(path.read_text()) if path.exists() else {}


def _trainer_state(store: Path, version: int) -> dict:
    attempt = os.readlink(store / "policy" / f"v{version:06d}")  # the published attempt's directory name
    return torch.load(store / "policy" / "trainer-state" / f"{attempt}.pt", weights_only=True)["optimizer"]


@pytest.mark.parametrize("bad", [1, 2], ids=["from-v0", "from-v1"])
def test_a_step_that_raises_is_rolled_back_and_dead_lettered(
    kafka_settings: KafkaSettings, model_dir: Path, tmp_path: Path, bad: int
) -> None:
    """Batch ``bad`` of three raises inside its step, after its optimizer step moved the weights and AdamW state
    (fault point ``learner.in_step``, action ``raise``). The learner restores the last published version (v0: the
    initial model), dead-letters the batch with the reason and trains the next one in the same process; its v2 equals
    v2 of a learner that never saw the bad batch. Before, the exception ended the learner and the restarted one read
    the same batch again, for ever."""
    from safetensors.torch import load_file

    from clawbase.kafka.clients import create_topics

    clean = KafkaSettings(
        bootstrap_servers=kafka_settings.bootstrap_servers, topic_prefix=kafka_settings.topic_prefix + "clean."
    )
    create_topics(clean, CATALOG)
    specs = [("b-1", 1), ("b-2", 2), ("b-3", 3)]
    good = [s for i, s in enumerate(specs, 1) if i != bad]
    _produce_batches(kafka_settings, specs)
    _produce_batches(clean, good)
    store = tmp_path / "store"
    run = _run_learner(kafka_settings, model_dir, store, fault=f"learner.in_step@{bad}=raise", max_steps=3)
    assert run.returncode == 0, run.stderr[-3000:]
    assert f"fault injection: raise at learner.in_step (arrival {bad}" in run.stdout  # one process throughout
    versions = _versions(kafka_settings, "check-raise")
    assert [(v.policy_version, v.batch_id) for v in versions] == [(1, good[0][0]), (2, good[1][0])], run.stderr[-3000:]
    [letter] = _dead_letters(kafka_settings, "check-raise-dl")
    assert letter.error_type == "TrainingStepFailed" and letter.original_offset == 5 * bad - 1  # its SEAL record
    assert letter.reason == (
        f"batch b-{bad} ({kafka_settings.topic(BATCHES)}[0]@{5 * bad - 1}): the training step raised InjectedFault: "
        f"fault injection: raise at learner.in_step (arrival {bad}); model and optimizer restored to v{bad - 1}"
    )
    assert _attempts(store) == {}

    reference = _run_learner(clean, model_dir, tmp_path / "clean", max_steps=2)
    assert reference.returncode == 0, reference.stderr[-3000:]
    [a] = [v for v in versions if v.policy_version == 2]
    [b] = [v for v in _versions(clean, "check-clean") if v.policy_version == 2]
    sa, sb = load_file(str(verify_file(a))), load_file(str(verify_file(b)))
    worst = max(float((sa[k] - sb[k]).abs().max()) for k in sa)
    assert worst <= 1e-6, f"v2 after the rolled-back step differs from the clean v2 by {worst}"
    oa, ob = _trainer_state(store, 2), _trainer_state(tmp_path / "clean", 2)
    assert {k: float(s["step"]) for k, s in oa["state"].items()} == {
        k: float(s["step"]) for k, s in ob["state"].items()
    }
    moments = max(
        float((oa["state"][k][m] - ob["state"][k][m]).abs().max())
        for k in oa["state"]
        for m in ("exp_avg", "exp_avg_sq")
    )
    assert moments <= 1e-6, f"AdamW moments after the rolled-back step differ from the clean run's by {moments}"


def _committed(settings: KafkaSettings) -> int:
    consumer = make_consumer(settings, f"{settings.topic_prefix}clawstream-learner-policy")
    committed = consumer.committed([TopicPartition(settings.topic(BATCHES), 0)], timeout=10)[0].offset
    consumer.close()
    return committed


def _audit(settings: KafkaSettings) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, CLAWSTREAM_KAFKA_BOOTSTRAP_SERVERS=bootstrap_servers(settings), PYTHONPATH=str(ROOT))
    cmd = [sys.executable, "-m", "consumers.analytics", "audit", "--topic-prefix", settings.topic_prefix]
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=120, check=False)


def test_a_batch_killed_in_its_step_three_times_is_trained_once(
    kafka_settings: KafkaSettings, model_dir: Path, tmp_path: Path
) -> None:
    """A SIGKILL is no evidence of an out-of-memory kill (an operator, a preemption and the OOM killer send the same
    one). b-2's step is SIGKILLed (fault point ``learner.in_step``, action ``kill``) in three runs in a row, no
    supervisor recording an OOM; the fourth start trains b-2 as v2, once, then b-3, and dead-letters nothing."""
    records = _produce_batches(kafka_settings, [("b-1", 1), ("b-2", 2), ("b-3", 3)])
    store = tmp_path / "store"
    key = f"{kafka_settings.topic(BATCHES)}[0]@9 b-2"  # b-2's SEAL record
    faults_in_step = ["learner.in_step@2=kill", "learner.in_step=kill", "learner.in_step=kill"]  # b-1 trains first
    started = time.monotonic()
    for n, fault in enumerate(faults_in_step, 1):
        killed = _run_learner(kafka_settings, model_dir, store, fault=fault, max_steps=3)
        assert killed.returncode == -9, killed.stderr[-3000:]
        assert list(_attempts(store)) == [key], (n, _attempts(store), killed.stderr[-3000:])  # b-2's, not b-3's
        assert _attempts(store)[key]["starts"] == n
    assert [(v.policy_version, v.batch_id) for v in _versions(kafka_settings, "check-killed-a")] == [(1, "b-1")]

    fourth = _run_learner(kafka_settings, model_dir, store, max_steps=2)
    assert fourth.returncode == 0, fourth.stderr[-3000:]
    assert "attempt 4 (earlier ones died without evidence of OOM)" in fourth.stderr
    versions = _versions(kafka_settings, "check-killed-b")
    assert [(v.policy_version, v.batch_id) for v in versions] == [(1, "b-1"), (2, "b-2"), (3, "b-3")]
    assert _dead_letters(kafka_settings, "check-killed-dl") == []
    assert _attempts(store) == {}
    assert _committed(kafka_settings) == records
    audit = _audit(kafka_settings)
    assert audit.returncode == 0 and "CLEAN" in audit.stdout, audit.stdout[-3000:] + audit.stderr[-2000:]
    took = round(time.monotonic() - started, 1)  # the three killed runs and the fourth, start-ups included
    trained = [v.batch_id for v in versions]
    lost, twice = 3 - len(set(trained)), len(trained) - len(set(trained))
    note = "batches sealed / versions published; stall: from b-1's run to the fourth run's end; audit CLEAN"
    record(FaultRow("learner SIGKILLed three times inside one step", 3, len(trained), lost, twice, took, took, note))


def test_a_batch_killed_out_of_memory_is_dead_lettered_with_the_evidence(
    kafka_settings: KafkaSettings, model_dir: Path, tmp_path: Path
) -> None:
    """The same SIGKILL with evidence of an out-of-memory kill, as the supervisor records it (``record_oom``, from
    the kernel's record or the cgroup's counter: clawstream/stack/process.py): with ``--max-step-attempts 1`` the next
    start dead-letters the batch untrained, naming the evidence and the memory plan's estimate, and trains the next."""
    from learner.attempts import DEATHS, record_oom

    records = _produce_batches(kafka_settings, [("b-1", 1), ("b-2", 2)])
    store = tmp_path / "store"
    key = f"{kafka_settings.topic(BATCHES)}[0]@4 b-1"
    killed = _run_learner(kafka_settings, model_dir, store, fault="learner.in_step=kill", max_steps=2)
    assert killed.returncode == -9, killed.stderr[-3000:]
    attempt = _attempts(store)[key]
    assert attempt["estimate"].startswith("≈ ") and "GiB it may use" in attempt["estimate"], attempt
    evidence = f"kernel: Out of memory: Killed process {attempt['pid']} (python)"
    record_oom(store / "policy" / "trainer-state" / DEATHS, attempt["pid"], evidence)

    again = _run_learner(kafka_settings, model_dir, store, extra=("--max-step-attempts", "1"), max_steps=2)
    assert again.returncode == 0, again.stderr[-3000:]
    assert [(v.policy_version, v.batch_id) for v in _versions(kafka_settings, "check-oom")] == [(1, "b-2")]
    [letter] = _dead_letters(kafka_settings, "check-oom-dl")
    assert letter.error_type == "TrainingStepOutOfMemory" and letter.original_offset == 4
    assert letter.reason.startswith(
        f"batch b-1 ({kafka_settings.topic(BATCHES)}[0]@4): the learner died out of memory in its step 1 times "
        f"(1 attempts; last evidence: {evidence}); the memory plan estimated {attempt['estimate']}: lower the token"
    ), letter.reason
    assert _attempts(store) == {} and not any((store / "policy" / "trainer-state" / DEATHS).iterdir())
    assert _committed(kafka_settings) == records


def test_a_batch_that_cannot_fit_is_dead_lettered_and_one_that_fits_only_checkpointed_trains_so(
    kafka_settings: KafkaSettings, model_dir: Path, tmp_path: Path
) -> None:
    """The pre-step memory check (learner/memory.py): under a limit below even the checkpointed estimate, both
    batches are dead-lettered InsufficientMemory with the estimate, nothing trained, offsets committed; under a limit
    between the two estimates the learner turns activation checkpointing on and trains, and its v2 equals v2 of a
    learner with checkpointing off and no limit (checkpointing is exact)."""
    from safetensors.torch import load_file

    from clawbase.kafka.clients import create_topics
    from learner.hparams import Hyperparams
    from learner.memory import GIB, step_memory
    from learner.pack import pack_trees
    from learner.precision import load_policy
    from schemas.events import Trajectory

    def prefixed(suffix: str) -> KafkaSettings:
        out = KafkaSettings(
            bootstrap_servers=kafka_settings.bootstrap_servers, topic_prefix=kafka_settings.topic_prefix + suffix
        )
        create_topics(out, CATALOG)
        return out

    # The first step's estimate both ways (no gradients, no AdamW moments yet: the learner's state at b-1).
    model = load_policy(model_dir)
    trajectories = [Trajectory.from_bytes(r.trajectory) for r in batch_records("b-1", 1, 4, seed=1) if r.trajectory]
    rows = pack_trees([t.segments for t in trajectories], Hyperparams().token_budget)
    shapes = [(r.num_tokens, not r.is_chain, r.uses_top_k or r.uses_top_p) for r in rows]
    optimizer = torch.optim.AdamW(model.parameters())
    plain, ckpt = (step_memory(model, optimizer, shapes, checkpointing=c, chunk=256).needed for c in (False, True))
    assert ckpt < plain

    tiny = prefixed("tiny.")
    records = _produce_batches(tiny, [("b-1", 1), ("b-2", 2)])
    env = {"CLAWSTREAM_LEARNER_MEMORY_LIMIT_GIB": repr(ckpt * 0.9 / GIB)}
    refused = _run_learner(tiny, model_dir, tmp_path / "tiny", env_extra=env)
    assert refused.returncode == 0, refused.stderr[-3000:]
    assert _versions(tiny, "check-mem-v") == []
    letters = _dead_letters(tiny, "check-mem-dl")
    assert [(d.error_type, d.original_offset) for d in letters] == [
        ("InsufficientMemory", 4),
        ("InsufficientMemory", 9),
    ]
    assert "with activation checkpointing" in letters[0].reason and "more than the" in letters[0].reason
    consumer = make_consumer(tiny, f"{tiny.topic_prefix}clawstream-learner-policy")
    committed = consumer.committed([TopicPartition(tiny.topic(BATCHES), 0)], timeout=10)[0].offset
    consumer.close()
    assert committed == records

    fits = prefixed("fits.")
    _produce_batches(fits, [("b-1", 1), ("b-2", 2)])
    env = {"CLAWSTREAM_LEARNER_MEMORY_LIMIT_GIB": repr((plain + ckpt) / 2 / GIB)}
    checkpointed = _run_learner(fits, model_dir, tmp_path / "fits", env_extra=env)
    assert checkpointed.returncode == 0, checkpointed.stderr[-3000:]
    assert "activation checkpointing on" in checkpointed.stderr
    plain_run = prefixed("plain.")
    _produce_batches(plain_run, [("b-1", 1), ("b-2", 2)])
    off = {"CLAWSTREAM_LEARNER_ACTIVATION_CHECKPOINTING": "off"}
    reference = _run_learner(plain_run, model_dir, tmp_path / "plain", env_extra=off)
    assert reference.returncode == 0, reference.stderr[-3000:]
    assert "activation checkpointing" not in reference.stderr
    [a] = [v for v in _versions(fits, "check-fits") if v.policy_version == 2]
    [b] = [v for v in _versions(plain_run, "check-plain") if v.policy_version == 2]
    sa, sb = load_file(str(verify_file(a))), load_file(str(verify_file(b)))
    assert max(float((sa[k] - sb[k]).abs().max()) for k in sa) <= 1e-6


def test_a_lora_learner_publishes_merged_plain_weights_and_resumes_from_them(
    kafka_settings: KafkaSettings, model_dir: Path, tmp_path: Path
) -> None:
    """``--hp lora_rank=8``: v1 is a plain safetensors file in which only the adapters' targets moved, its trainer
    state carries the adapters; a new process resumes from v1 (base from model_dir, adapters from the state)."""
    from safetensors.torch import load_file

    _produce_batches(kafka_settings, [("b-1", 1), ("b-2", 2)])
    store, lora = tmp_path / "store", ("--hp", "lora_rank=8", "--hp", "lora_lr=1e-3")
    for _ in range(2):
        result = _run_learner(kafka_settings, model_dir, store, max_steps=1, extra=lora)
        assert result.returncode == 0, result.stderr[-3000:]
    assert "resumed policy at v1" in result.stderr and "fresh AdamW moments" not in result.stderr, result.stderr[-3000:]
    versions = _versions(kafka_settings, "check-lora")
    assert [(v.policy_version, v.batch_id) for v in versions] == [(1, "b-1"), (2, "b-2")]
    base = base_state(model_dir)
    targets = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
    for v in versions:
        state = load_file(str(verify_file(v)))
        assert {k: t.shape for k, t in state.items()} == {k: base[k].shape for k in state}
        changed = {k for k, t in state.items() if not torch.equal(t, base[k])}
        assert changed and all(k.split(".")[-2] in targets for k in changed), sorted(changed)
    adapters = torch.load(
        store / "policy" / "trainer-state" / f"{os.readlink(store / 'policy' / 'v000002')}.pt", weights_only=True
    )["lora"]
    assert adapters["rank"] == 8 and len(adapters["A"]) == 2 * len(targets)  # the small model's 2 layers
