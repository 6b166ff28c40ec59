"""The learner service on 2 data-parallel gloo ranks (learner/train_ranks.py) on the real broker: its versions equal
the 1-rank step's on the same batches (also with kv_share: rows of their own sharing their prompt); a step that
raises, or one rank killed -9 while the other waits for it in the step's first collective, stops the group (the
launcher exits non-zero within seconds, no rank left behind), and the restarted group trains the batch once; LoRA's
adapters on every rank, through such a restart."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import pytest
import torch

from clawbase import faults
from clawbase.kafka.clients import bootstrap_servers
from clawbase.settings import KafkaSettings
from learner.hparams import parse_hparams
from learner.logit_scale import LogitScale
from learner.lora import LoRA
from learner.precision import load_policy
from learner.step import ScoredTree, train_step
from policy.weight_store import attempt_of, trainer_state_path, verify_file
from schemas.events import Trajectory, WeightVersion
from tests.integration.test_learner import _dead_letters, _produce_batches, _versions
from tests.support.learner_data import batch_records, small_model

pytestmark = pytest.mark.integration
ROOT = Path(__file__).resolve().parents[2]
SCALE_LR = 0.1  # the compose learners' learned logit scale (docs/quickstart.md), in the kill test
# Every tree (50 tokens) over the token budget: its two paths are rows of their own sharing the 24-token prompt.
KV_SHARE = ["token_budget=40", "kv_share_min=16"]
LORA = ["lora_rank=4", "lora_lr=5e-3"]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return small_model(tmp_path_factory.mktemp("tiny"))


def _trees(batch_id: str, step: int) -> list[ScoredTree]:
    """The batch's trees as the learner decodes them (the records _produce_batches wrote)."""
    trees = []
    for rec in batch_records(batch_id, step, 4, seed=step)[:-1]:
        traj = Trajectory.from_bytes(rec.trajectory)
        trees.append(ScoredTree(traj.segments, rec.advantage, rec.reward, rec.harness or traj.harness))
    return trees


def _command(
    settings: KafkaSettings,
    model_dir: Path,
    store: Path,
    fault: str | None = None,
    scale_lr: float = 0.0,
    hp: Sequence[str] = (),
) -> tuple[list[str], dict[str, str]]:
    env = dict(
        os.environ,
        CLAWSTREAM_KAFKA_BOOTSTRAP_SERVERS=bootstrap_servers(settings),
        CLAWSTREAM_KAFKA_TOPIC_PREFIX=settings.topic_prefix,
        CLAWSTREAM_LEARNER_TORCH_THREADS="1",
        PYTHONPATH=str(ROOT),
    )
    env.pop(faults.ENV, None)
    if fault:
        env.update(faults.fault_env(store.parent / "faults", **dict([fault.split("=")])))
    cmd = [sys.executable, "-m", "learner.train_ranks", "--nproc", "2", "--model-dir", str(model_dir)]
    cmd += ["--weight-store", str(store), "--max-steps", "2", "--idle-exit", "20", "--hp", "lr=1e-3"]
    return cmd + [a for h in [f"logit_scale_lr={scale_lr}", *hp] for a in ("--hp", h)], env


def _run(
    settings: KafkaSettings,
    model_dir: Path,
    store: Path,
    fault: str | None = None,
    scale_lr: float = 0.0,
    hp: Sequence[str] = (),
) -> subprocess.CompletedProcess:
    cmd, env = _command(settings, model_dir, store, fault, scale_lr, hp)
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300, check=False)


def _check_v2(version: WeightVersion, model_dir: Path, scale_lr: float = 0.0, hp: Sequence[str] = ()) -> None:
    """v2 equals two 1-rank steps on b-1 and b-2 with the learner's AdamW (and its logit scale, folded after each)."""
    from safetensors.torch import load_file

    config = parse_hparams(["lr=1e-3", f"logit_scale_lr={scale_lr}", *hp])
    model = load_policy(model_dir)
    initial = {k: v.clone() for k, v in model.state_dict().items()}
    groups: list[dict] = [{"params": list(model.parameters())}]
    scale = LogitScale(model) if scale_lr else None
    if scale is not None:  # as learner.train.Learner builds it
        groups.append({"params": [scale.log_scale], "lr": scale_lr, "logit_scale": True})
    optimizer = torch.optim.AdamW(groups, lr=config.lr, betas=config.betas, weight_decay=config.weight_decay)
    for batch_id, step in (("b-1", 1), ("b-2", 2)):
        metrics = train_step(model, optimizer, _trees(batch_id, step), config)
        assert metrics.get("kv_shared_tokens", 0) == (4 * 23 if hp == KV_SHARE else 0)  # 4 trees, 2 paths each
        if scale is not None:
            scale.fold()
    published = load_file(str(verify_file(version)))
    diff = max(float((published[k] - v).abs().max()) for k, v in model.state_dict().items() if k in published)
    moved = max(float((v - initial[k]).abs().max()) for k, v in model.state_dict().items())
    print(f"2-rank service v2 vs 1-rank steps: max abs {diff:.2e} (the steps moved weights up to {moved:.2e})")
    assert moved > 100 * 1e-5 and diff < 1e-5


def test_two_ranks_publish_the_versions_of_one(kafka_settings: KafkaSettings, model_dir: Path, tmp_path: Path) -> None:
    """With kv_share: each rank computes its trees' shared prompts once (the other tests pack trees into rows)."""
    _produce_batches(kafka_settings, [("b-1", 1), ("b-2", 2)])
    store = tmp_path / "store"
    result = _run(kafka_settings, model_dir, store, hp=KV_SHARE)
    assert result.returncode == 0, result.stderr[-3000:]
    versions = _versions(kafka_settings, "check-ranks")
    assert [(v.policy_version, v.batch_id) for v in versions] == [(1, "b-1"), (2, "b-2")]
    attempt = attempt_of(verify_file(versions[-1]))  # rank 0 keeps AdamW's state for the resume, with its version's
    assert trainer_state_path(store, "policy", 2, attempt).exists()
    for v in versions:  # both ranks computed each of their trees' prompts once: the 1-rank step's count
        assert v.metrics["ranks"] == 2 and v.metrics["kv_shared_tokens"] == 4 * 23, v.metrics
    _check_v2(versions[-1], model_dir, hp=KV_SHARE)


def test_a_step_that_raises_stops_the_group_and_the_restart_trains_the_batch_once(
    kafka_settings: KafkaSettings, model_dir: Path, tmp_path: Path
) -> None:
    """b-2's step raises on both ranks after its optimizer step: the group exits non-zero with v1 published; the
    restarted group resumes v1 (rank 0 loads it and broadcasts it) and publishes b-2 once, equal to 1-rank steps."""
    _produce_batches(kafka_settings, [("b-1", 1), ("b-2", 2)])
    store = tmp_path / "store"
    failed = _run(kafka_settings, model_dir, store, fault="learner.in_step@2=raise")
    assert failed.returncode != 0 and "fault injection: raise at learner.in_step" in failed.stderr + failed.stdout
    assert [(v.policy_version, v.batch_id) for v in _versions(kafka_settings, "check-raise-1")] == [(1, "b-1")]
    restarted = _run(kafka_settings, model_dir, store)
    assert restarted.returncode == 0, restarted.stderr[-3000:]
    versions = _versions(kafka_settings, "check-raise-2")
    assert [(v.policy_version, v.batch_id) for v in versions] == [(1, "b-1"), (2, "b-2")]
    _check_v2(versions[-1], model_dir)


def test_lora_ranks_publish_the_versions_of_one_also_after_a_restart(
    kafka_settings: KafkaSettings, model_dir: Path, tmp_path: Path
) -> None:
    """``--hp lora_rank``: every rank attaches the same adapters. b-2's step raises on both ranks; the restarted group
    resumes v1 (rank 0 loads its adapters from the trainer state and broadcasts them) and publishes b-2, equal to two
    1-rank LoRA steps merged into the base."""
    from safetensors.torch import load_file

    _produce_batches(kafka_settings, [("b-1", 1), ("b-2", 2)])
    store = tmp_path / "store"
    failed = _run(kafka_settings, model_dir, store, fault="learner.in_step@2=raise", hp=LORA)
    assert failed.returncode != 0 and "fault injection: raise at learner.in_step" in failed.stderr + failed.stdout
    restarted = _run(kafka_settings, model_dir, store, hp=LORA)
    assert restarted.returncode == 0, restarted.stderr[-3000:]
    versions = _versions(kafka_settings, "check-lora")
    assert [(v.policy_version, v.batch_id) for v in versions] == [(1, "b-1"), (2, "b-2")]
    config = parse_hparams(["lr=1e-3", *LORA])
    model = load_policy(model_dir)
    initial = {k: v.clone() for k, v in model.state_dict().items()}
    adapters = LoRA(model, config.lora_rank, config.lora_alpha, config.lora_targets, config.seed)
    groups = [{"params": list(adapters.parameters()), "lr": config.lora_lr, "lora": True}]  # as learner.train's
    optimizer = torch.optim.AdamW(groups, lr=config.lr, betas=config.betas, weight_decay=config.weight_decay)
    for batch_id, step in (("b-1", 1), ("b-2", 2)):
        train_step(model, optimizer, _trees(batch_id, step), config)
    merged = adapters.merged_state_dict(model)
    published = load_file(str(verify_file(versions[-1])))
    diff = max(float((published[k] - v).abs().max()) for k, v in merged.items() if k in published)
    moved = max(float((v - initial[k]).abs().max()) for k, v in merged.items())
    print(f"2-rank LoRA service v2 vs 1-rank LoRA steps: max abs {diff:.2e} (merged weights moved up to {moved:.2e})")
    assert moved > 100 * 1e-5 and diff < 1e-5


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0] != "Z"  # a zombie has ended


def _children(pid: int) -> list[int]:
    return [int(p) for p in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]


def _is_rank(pid: int) -> bool:  # the launcher's other child is multiprocessing's resource tracker
    return b"spawn_main" in Path(f"/proc/{pid}/cmdline").read_bytes()


# rank 1 in `make test-long`: `make test` kills it in the compose scale smoke (tests/e2e/test_compose_scale.py)
@pytest.mark.parametrize("rank", [0, pytest.param(1, marks=pytest.mark.long)])
def test_a_rank_killed_mid_step_stops_the_group_and_the_restart_trains_the_batch_once(
    kafka_settings: KafkaSettings, model_dir: Path, tmp_path: Path, rank: int
) -> None:
    """b-1 is published; in b-2's step rank ``rank`` holds (fault point ``learner.rank<N>.step``) while the other
    rank waits for it in the step's first collective; the held rank is killed -9. The launcher must end the group
    and exit non-zero, leaving no rank behind; v1 only is published; the restarted group resumes v1 and publishes
    b-2 once, equal to 1-rank steps (with the compose recipe's learned logit scale, folded on every rank)."""
    _produce_batches(kafka_settings, [("b-1", 1), ("b-2", 2)])
    store, fault_dir = tmp_path / "store", tmp_path / "faults"
    point = f"learner.rank{rank}.step"
    cmd, env = _command(kafka_settings, model_dir, store, fault=f"{point}@2=hold", scale_lr=SCALE_LR)
    log = (tmp_path / "group.log").open("w+")
    group = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    children: list[int] = []
    try:
        pid = faults.wait_held(fault_dir, point, timeout=240, alive=group)
        children = _children(group.pid)
        ranks = [p for p in children if _is_rank(p)]
        assert pid in ranks and len(ranks) == 2, (pid, ranks)
        os.kill(pid, signal.SIGKILL)
        killed = time.monotonic()
        code = group.wait(timeout=120)
        ended = time.monotonic() - killed
        survivors = [p for p in ranks if _alive(p)]  # no rank outlives the launcher
        # multiprocessing's resource tracker ends by itself once the launcher's pipe closes, after its cleanup
        # (CI saw it still unlinking semaphores at the launcher's exit): bounded, then it must be gone too.
        tracker_deadline = time.monotonic() + 15
        while any(_alive(p) for p in children) and time.monotonic() < tracker_deadline:
            time.sleep(0.2)
        survivors += [p for p in children if p not in ranks and _alive(p)]
    finally:
        if group.poll() is None:
            os.killpg(group.pid, signal.SIGKILL)
            group.wait(30)
        for p in children:  # the test's own processes, by pid: nothing may outlive it
            if _alive(p):
                os.kill(p, signal.SIGKILL)
        log.seek(0)
        text = log.read()
        log.close()
    print(f"rank {rank} killed -9 mid-step: the launcher exited {code} after {ended:.1f} s, survivors {survivors}")
    assert code != 0 and not survivors, text[-3000:]
    assert ended < 60, text[-3000:]
    assert [(v.policy_version, v.batch_id) for v in _versions(kafka_settings, "check-kill-1")] == [(1, "b-1")]
    restarted = _run(kafka_settings, model_dir, store, scale_lr=SCALE_LR)
    assert restarted.returncode == 0, restarted.stderr[-3000:]
    versions = _versions(kafka_settings, "check-kill-2")
    assert [(v.policy_version, v.batch_id) for v in versions] == [(1, "b-1"), (2, "b-2")]  # each once, none lost
    assert _dead_letters(kafka_settings, "check-kill-dl") == []  # nothing refused: b-2's kill was one attempt
    _check_v2(versions[-1], model_dir, SCALE_LR)


def test_a_launcher_killed_leaves_no_rank(kafka_settings: KafkaSettings, model_dir: Path, tmp_path: Path) -> None:
    """The launcher killed -9 while its ranks hold mid-step: both ranks end with it (parent-death signal)."""
    _produce_batches(kafka_settings, [("b-1", 1)])
    store, fault_dir = tmp_path / "store", tmp_path / "faults"
    cmd, env = _command(kafka_settings, model_dir, store, fault="learner.rank1.step=hold")
    group = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, start_new_session=True)
    children: list[int] = []
    ranks: list[int] = []
    try:
        faults.wait_held(fault_dir, "learner.rank1.step", timeout=240, alive=group)
        children = _children(group.pid)
        ranks = [p for p in children if _is_rank(p)]
        group.kill()
        group.wait(30)
        deadline = time.monotonic() + 30
        while any(_alive(p) for p in ranks) and time.monotonic() < deadline:
            time.sleep(0.1)
        survivors = [p for p in ranks if _alive(p)]
    finally:
        for p in children:  # the ranks and the resource tracker, by pid
            if _alive(p):
                os.kill(p, signal.SIGKILL)
        if group.poll() is None:
            group.kill()
    assert len(ranks) == 2 and not survivors, (ranks, survivors)
