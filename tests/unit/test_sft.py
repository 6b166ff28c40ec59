"""SFT warm start: demonstrations render like the proxy (append-only, parseable targets), training lowers the loss
(and the shared-prefix KV shortcut changes nothing), the offline eval loop solves a task with a correct scripted
policy and fails it with a wrong one. Uses a small model built by ``policy.tiny_model`` (a few seconds)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from policy.chat_template import IM_END, render_chat  # noqa: E402
from policy.tiny_model import init_tiny_model  # noqa: E402
from producers.harnesses import builtin_loop  # noqa: E402
from producers.proxy.render import TemplateRenderer  # noqa: E402
from producers.proxy.tool_parse import parse_turn  # noqa: E402
from producers.tasks.grading_rules import GraderFailure  # noqa: E402
from producers.tasks.model import Grader, GraderOutput, Task  # noqa: E402
from warmstart import sft  # noqa: E402
from warmstart.demos import (  # noqa: E402
    HELDOUT_RESERVE,
    build_demonstrations,
    build_episodes,
    heldout_tasks,
    scripted_policy,
    solution_calls,
    tool_call_text,
    train_tasks,
)
from warmstart.episodes import DIALECTS, EpisodeResult, Policy, grade_workspace, run_episode  # noqa: E402
from warmstart.evaluate import evaluate_policy, greedy_policy  # noqa: E402


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("sft") / "tiny"
    init_tiny_model(
        out,
        seed=0,
        vocab_size=1024,
        hidden_size=64,
        intermediate_size=128,
        num_layers=2,
        num_heads=2,
        num_kv_heads=1,
        num_documents=3000,
        progress=None,
    )
    return out


@pytest.fixture(scope="module")
def tok(model_dir: Path) -> Any:
    return transformers.AutoTokenizer.from_pretrained(model_dir)


@pytest.fixture(scope="module")
def tasks() -> list[Task]:
    return train_tasks(8)  # round-robin: one task of each template


@pytest.fixture(scope="module")
def episodes(tok: Any, tasks: list[Task]) -> list[EpisodeResult]:
    return build_episodes(tok, tasks)


def test_every_template_and_dialect_is_covered(episodes: list[EpisodeResult], tasks: list[Task]) -> None:
    assert {t.metadata["template"] for t in tasks} == {
        "write",
        "write_two",
        "copy",
        "replace",
        "append",
        "delete",
        "sum",
        "count",
    }
    assert sorted(e.dialect for e in episodes) == sorted(list(DIALECTS) * len(tasks))
    assert all(e.why == "finished" for e in episodes)


def test_demonstrations_are_append_only(episodes: list[EpisodeResult]) -> None:
    for ep in episodes:
        assert len(ep.turns) >= 2
        for (prompt, target), (nxt, _) in zip(ep.turns, ep.turns[1:], strict=False):
            assert nxt[: len(prompt) + len(target)] == prompt + target  # TITO: turn k+1 extends turn k
            assert len(nxt) > len(prompt) + len(target)  # ... with the tool result in between
        seq = sft.episode_sequence(ep.dialect, ep.turns)
        assert sum(seq.mask) == sum(len(t) for _, t in ep.turns)


def test_build_demonstrations_flattens_turns(model_dir: Path) -> None:
    demos = build_demonstrations(model_dir, n_tasks=8)
    assert len(demos) == sum(len(solution_calls(t, d)) for t in train_tasks(8) for d in DIALECTS)
    assert all(prompt and target for prompt, target in demos)


def test_prompts_start_with_system_tools_and_generation_prompt(tok: Any, episodes: list[EpisodeResult]) -> None:
    for ep in episodes:
        text = tok.decode(ep.turns[0][0])
        system = builtin_loop.OPENAI_SYSTEM if ep.dialect == "openai" else builtin_loop.ANTHROPIC_SYSTEM
        assert text.startswith(f"<|im_start|>system\n{system}\n\n# Tools")
        assert text.endswith("<|im_start|>assistant\n")


def test_targets_parse_back_into_the_intended_calls(tok: Any, episodes: list[EpisodeResult], tasks: list[Task]) -> None:
    by_id = {t.task_id: t for t in tasks}
    eos = tok.convert_tokens_to_ids(IM_END)
    for ep in episodes:
        want = solution_calls(by_id[ep.task_id], ep.dialect)
        assert len(ep.turns) == len(want)
        for (_, target), (name, arguments) in zip(ep.turns, want, strict=True):
            assert target[-1] == eos
            turn = parse_turn(tok.decode(target, skip_special_tokens=True))
            assert not turn.flags and turn.text == ""
            assert [(c.name, c.arguments) for c in turn.tool_calls] == [(name, arguments)]


def test_target_markup_is_the_templates_own() -> None:
    args = {"path": "notes.txt", "content": "apple\npear"}
    call = {"type": "function", "function": {"name": "write_file", "arguments": args}}
    stub = [{"role": "user", "content": "."}]
    before = render_chat(stub, add_generation_prompt=True)
    after = render_chat([*stub, {"role": "assistant", "content": "", "tool_calls": [call]}])
    assert after[len(before) :] == tool_call_text("write_file", args) + IM_END + "\n"  # the end of turn: the policy's


def test_shared_prefix_kv_gives_the_same_loss_and_gradient(model_dir: Path, episodes: list[EpisodeResult]) -> None:
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    seqs = [sft.episode_sequence(e.dialect, e.turns) for e in episodes if e.dialect == "anthropic"]
    prefix = sft._common_prefix(seqs)
    assert prefix > 100  # system prompt + tool schemas
    results = []
    for p in (prefix, 0):
        model.zero_grad()
        loss, n = sft._batch_loss(model, seqs, p, 0)
        (loss / n).backward()
        results.append((float(loss.detach()), n, model.model.layers[0].self_attn.q_proj.weight.grad.clone()))
    assert results[0][1] == results[1][1] == sum(sum(s.mask) for s in seqs)
    assert results[0][0] == pytest.approx(results[1][0], rel=1e-5)
    torch.testing.assert_close(results[0][2], results[1][2], rtol=1e-4, atol=1e-6)


def test_sft_steps_reduce_the_loss_and_save_a_loadable_model(model_dir: Path, tmp_path: Path) -> None:
    summary = sft.sft(
        model_dir,
        tmp_path / "out",
        minutes=5.0,
        steps=30,
        lr=3e-3,
        warmup_steps=2,
        batch_size=4,
        n_tasks=8,
        eval_tasks=0,
        log_every=5,
    )
    assert summary["steps"] == 30
    losses = [loss for _, loss in summary["history"]]
    assert losses[-1] < 0.7 * losses[0]
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out")
    assert reloaded.config.num_hidden_layers == 2
    assert transformers.AutoTokenizer.from_pretrained(tmp_path / "out").chat_template
    assert (tmp_path / "out" / "sft_summary.json").exists()


def _scripted(tok: Any, wrong: bool) -> Any:
    def make(task: Task, dialect: str) -> Policy:
        calls = solution_calls(task, dialect)
        if wrong:  # finish straight away: nothing is written or deleted
            calls = calls[-1:]
        return scripted_policy(tok, [tool_call_text(n, a) for n, a in calls])

    return make


def test_eval_solves_with_a_correct_policy_and_fails_with_a_wrong_one(tok: Any) -> None:
    tasks = heldout_tasks(8)
    good = evaluate_policy(_scripted(tok, wrong=False), tok, tasks)
    assert good["all"] == {"mean_reward": 1.0, "solve_rate": 1.0, "n": 16}
    bad = evaluate_policy(_scripted(tok, wrong=True), tok, tasks)
    assert bad["all"]["solve_rate"] == 0.0 and bad["all"]["mean_reward"] < 0.5
    assert bad["by_template"]["write"] == 0.0


def test_greedy_model_episode_runs_end_to_end(model_dir: Path, tok: Any) -> None:
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    policy = greedy_policy(model, tok.convert_tokens_to_ids(IM_END), max_new_tokens=8)
    result = run_episode(heldout_tasks(1)[0], "openai", policy, TemplateRenderer(tok), max_turns=2)
    assert 0.0 <= (result.reward or 0.0) <= 1.0
    assert 1 <= len(result.turns) <= 2 and all(len(gen) <= 8 for _, gen in result.turns)


def test_heldout_prompts_never_in_training() -> None:
    held = {t.prompt for t in heldout_tasks(HELDOUT_RESERVE)}
    train = train_tasks(1200)
    assert len({t.task_id for t in train}) == 1200
    assert not held & {t.prompt for t in train}


def _grader_task(script: str, output: GraderOutput = "subscores_json") -> Task:
    grader = Grader(
        "probe", {"check.py": script.encode()}, ("${python}", "${grader_dir}/check.py", "${workspace}"), output=output
    )
    return Task("probe", "probe-0", "-", 10.0, {}, grader)


def test_grade_workspace_runs_the_grader_through_the_shared_rules(tmp_path: Path) -> None:
    (tmp_path / "a.txt").write_text("x")
    script = (
        "import json, os, sys; ws = sys.argv[1]; assert os.environ['WORKSPACE'] == ws; "
        "assert json.load(open('transcript.json')) == []; "
        "print(json.dumps({'a': float(os.path.exists(os.path.join(ws, 'a.txt'))), 'b': 0.0}))"
    )
    assert grade_workspace(_grader_task(script), tmp_path) == (0.5, {"a": 1.0, "b": 0.0})
    assert grade_workspace(_grader_task("print(0.25)", "reward_float"), tmp_path) == (0.25, {})
    with pytest.raises(GraderFailure, match="exited 1"):
        grade_workspace(_grader_task("raise SystemExit(1)"), tmp_path)
    with pytest.raises(GraderFailure, match="timed out"):
        grade_workspace(_grader_task("import time; time.sleep(30)"), tmp_path, timeout_s=0.5)
