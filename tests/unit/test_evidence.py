"""Per-version held-out evidence (warmstart/heldout_evidence.py, clawstream/demo/evidence.py): the log-likelihood
counts exactly the model-generated tokens, rises when the model is trained on those episodes, pairs changes per
episode; versions load only when their sha256 matches; a finished run's versions become evidence.jsonl + a PNG."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")

from warmstart import heldout_evidence as he  # noqa: E402

WARM = Path(__file__).resolve().parents[2] / "models" / "warmstart"


@pytest.fixture(scope="module")
def loaded() -> tuple[Any, Any, he.Slices]:
    torch.manual_seed(0)
    model, tokenizer = he.load_model(WARM)
    return model, tokenizer, he.build_slices(tokenizer, ll_tasks=3, greedy_tasks=1)


def _reference(model: Any, seq: Any) -> tuple[float, float, int]:
    """(Σ log p over the mask's tokens, Σ log p over every predicted token, mask count): one plain forward."""
    ids = torch.tensor([seq.ids])
    with torch.no_grad():
        logp = torch.log_softmax(model(input_ids=ids).logits[0, :-1].float(), -1)  # (T-1, V)
    token_lp = logp.gather(-1, ids[0, 1:, None])[:, 0]  # (T-1,)
    mask = torch.tensor(seq.mask[1:], dtype=torch.bool)
    return float(token_lp[mask].sum()), float(token_lp.sum()), int(mask.sum())


def test_only_the_model_generated_tokens_count(loaded: tuple[Any, Any, he.Slices]) -> None:
    model, _, slices = loaded
    seqs = [slices.sequences[k] for k in sorted(slices.sequences)]
    assert {s.dialect for s in seqs} == {"openai", "anthropic"} and len(seqs) == 6
    got = he.episode_logliks(model, seqs, batch_size=2)  # shared-prefix KV, padded batches
    for seq, (ll, n) in zip(seqs, got, strict=True):
        masked, everything, count = _reference(model, seq)
        assert n == count == sum(seq.mask) < len(seq.ids) // 2  # the prompts (system, tools, results) are most
        assert ll == pytest.approx(masked, abs=1e-3)
        assert abs(everything - masked) > 1.0  # counting prompt tokens would show


def test_log_likelihood_rises_after_one_sft_step_on_the_slice(loaded: tuple[Any, Any, he.Slices]) -> None:
    from warmstart.sft import _batch_loss

    _, tokenizer, slices = loaded
    model, _ = he.load_model(WARM)
    keys = sorted(slices.sequences)
    base = he.measure(model, tokenizer, he.Slices(slices.sequences, [], slices.dialects))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    model.train()
    for dialect in slices.dialects:
        loss, n = _batch_loss(model, [slices.sequences[k] for k in keys if k.endswith(dialect)], 0, 0)
        (loss / n).backward()
    opt.step()
    after = he.measure(model, tokenizer, he.Slices(slices.sequences, [], slices.dialects))
    summary = he.compare(after, base)
    assert summary["ll_change"] > 0 and summary["episodes_up"] == len(keys) and summary["episodes_down"] == 0
    assert summary["ll_per_token"] > he.compare(base, base)["ll_per_token"]
    assert summary["greedy_reward"] is None and summary["greedy_episodes"] == 0


def test_compare_pairs_each_episode_with_the_warm_start() -> None:
    base = {"ll": {"a": -1.0, "b": -2.0, "c": -3.0}, "tokens": {"a": 2, "b": 2, "c": 2}, "greedy": {"a": 0.0, "b": 1.0}}
    now = {"ll": {"a": -0.5, "b": -2.5, "c": -1.0}, "tokens": base["tokens"], "greedy": {"a": 1.0, "b": 1.0}}
    for r in (base, now):
        r.update(ll_seconds=1.0, greedy_seconds=2.0)
    s = he.compare(now, base)
    diffs = [0.5, -0.5, 2.0]
    mean = sum(diffs) / 3
    se = math.sqrt(sum((d - mean) ** 2 for d in diffs) / 2 / 3)
    assert s["ll_change"] == pytest.approx(mean) and s["ll_change_se"] == pytest.approx(se)
    assert s["ll_change_per_token"] == pytest.approx(sum(diffs) / 6)
    assert (s["episodes_up"], s["episodes_down"]) == (2, 1)
    assert s["ll_per_token"] == pytest.approx(-4.0 / 6) and s["ll_per_episode"] == pytest.approx(-4.0 / 3)
    assert s["greedy_reward"] == 1.0 and s["greedy_solved"] == 1.0
    assert s["greedy_change"] == pytest.approx(0.5) and s["greedy_change_se"] == pytest.approx(0.5)
    printed = he.line(3, s)
    assert "Δ +0.6667 ± 0.7265 per episode" in printed and "Δ +0.500 ± 0.500" in printed
    assert "2 up, 1 down of 3" in printed


def test_the_change_is_also_split_by_task_family() -> None:
    from producers.tasks.cpu import generate

    tasks = generate("heldout", 16, 1)
    for t in tasks:  # the family is read from the suite's own task ids
        assert he.family_of(f"{t.task_id}/anthropic") == t.metadata["template"]
    base = {"heldout-000-delete/openai": -2.0, "heldout-000-delete/anthropic": -2.2, "heldout-001-sum/openai": -1.0}
    base["heldout-001-sum/anthropic"] = -1.5
    now = {"heldout-000-delete/openai": -2.0, "heldout-000-delete/anthropic": -2.2, "heldout-001-sum/openai": -0.5}
    now["heldout-001-sum/anthropic"] = -0.7
    fams = he.by_family(base, now)
    assert list(fams) == ["delete", "sum"]
    assert fams["delete"] == {"change": 0.0, "se": 0.0, "n": 2, "up": 0, "down": 0}
    assert fams["sum"]["change"] == pytest.approx(0.65) and fams["sum"]["se"] == pytest.approx(0.15)
    assert (fams["sum"]["up"], fams["sum"]["down"]) == (2, 0)
    record = {"ll": now, "tokens": dict.fromkeys(now, 3), "greedy": {}, "ll_seconds": 1.0, "greedy_seconds": 0.0}
    summary = he.compare(record, {**record, "ll": base})
    assert summary["ll_change_by_family"] == fams
    assert "by family: delete +0.000 sum +0.650" in he.line(1, summary)


def test_the_greedy_slice_is_graded_through_the_built_in_loop(loaded: tuple[Any, Any, he.Slices]) -> None:
    model, tokenizer, slices = loaded
    task = slices.greedy[0]
    rewards = he.greedy_rewards(model, tokenizer, he.Slices({}, [task], ("openai",)))
    assert list(rewards) == [f"{task.task_id}/openai"] and 0.0 <= rewards[f"{task.task_id}/openai"] <= 1.0


def _publish(model: Any, store: Path, version: int) -> Any:
    from policy.weight_store import link_published, new_attempt, save_weights

    saved = save_weights(model, store, "policy", version, new_attempt())
    link_published(saved.path)
    return saved


def test_a_finished_runs_versions_become_rows_and_a_curve(tmp_path: Path) -> None:
    from clawstream.demo import evidence
    from clawstream.demo.report import plot
    from policy.weight_store import WeightsRejected

    run = tmp_path / "run"
    model, _ = he.load_model(WARM)
    with torch.no_grad():
        model.model.norm.weight.mul_(0.8)  # a different policy: softer logits, every correct episode less likely
    saved = _publish(model, run / "weights", 1)
    (run / "weights" / "policy" / "v000002-junk").mkdir()  # an unpublished attempt: no link, not a version
    assert [v for v, _ in evidence.published_versions(run)] == [1]

    measurer = evidence.Measurer(WARM, run, ll_tasks=2, greedy_tasks=0, seed=0)
    with pytest.raises(WeightsRejected, match="sha256"):
        measurer.measure(1, saved.path, "0" * 64)
    row = measurer.measure(1, saved.path, saved.sha256)  # measures version 0 first: the base
    assert [r["version"] for r in evidence.read_rows(run)] == [0, 1]
    assert row["ll_change"] < 0 and row["episodes_down"] == 4 and row["greedy_episodes"] == 0
    assert evidence.read_rows(run)[0]["ll_change"] == 0.0

    assert evidence.main(["--model", str(WARM), "--versions", str(run), "--tasks", "2", "--greedy-tasks", "0"]) == 0
    rows = evidence.read_rows(run)
    assert [r["version"] for r in rows] == [0, 1] and (run / evidence.PNG).stat().st_size > 0
    curve = evidence.curve(rows)
    assert "record" not in curve[1] and json.dumps(curve)
    assert plot(tmp_path / "learning.png", [], None, None, evidence=curve).stat().st_size > 0


def test_evidence_sizes_are_checked() -> None:
    from clawbase.errors import ClawstreamError
    from clawstream.demo.config import DemoConfig, check

    check(DemoConfig(evidence=False, evidence_tasks=0))
    with pytest.raises(ClawstreamError, match="evidence_tasks"):
        check(DemoConfig(evidence_tasks=1))


def test_a_worker_behind_measures_the_newest_version_and_skips_the_rest() -> None:
    from clawstream.demo.evidence import pick

    waiting = [(2, "file:///w2", "b"), (4, "file:///w4", "d"), None, (3, "file:///w3", "c"), (2, "file:///w2", "b")]
    assert pick(waiting, done={0: {}, 1: {}}) == ((4, "file:///w4", "d"), [2, 3])
    assert pick(waiting, done={2: {}, 3: {}, 4: {}}) == (None, [])  # a resumed run's measured versions: not again
    assert pick([(5, "u", "s")], done={}) == ((5, "u", "s"), [])
