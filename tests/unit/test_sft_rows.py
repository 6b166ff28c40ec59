"""SFT from the event log, the pure part (``warmstart/sft_rows.py``) and the loss mask it feeds.

Token ids are readable: 1xx system/tools, 2xx user, 3xx model-generated, 4xx tool results. A tree with two leaves
(a branch after the first answer) gives two rows whose ids are the recorded tokens in order and whose mask is 1
exactly on the 3xx tokens; rejected trajectories (reward below the floor, no reward, not complete) give none; the
loss of a row counts only its masked tokens (it fails if prompt tokens are trained); the teacher's plan solves
every template of the built-in CPU suite.
"""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from producers.tasks.cpu import generate
from warmstart.sft_rows import build_rows, rows_of
from warmstart.teacher import plan


def seg(parent: int, tokens: list[int], trainable: bool) -> SimpleNamespace:
    return SimpleNamespace(parent=parent, tokens=np.asarray(tokens, dtype="<i4"), trainable=trainable)


def trajectory(rid: str = "r1", reward: float | None = 1.0, status: str = "COMPLETE") -> SimpleNamespace:
    segments = [
        seg(-1, [101, 102, 201], False),  # system + tools + user
        seg(0, [301, 302], True),  # first answer (a tool call)
        seg(1, [401], False),  # tool result
        seg(2, [303], True),  # final answer, leaf 1
        seg(1, [402, 403], False),  # another branch: a different tool result
        seg(4, [304, 305], True),  # leaf 2
    ]
    return SimpleNamespace(
        rollout_id=rid, harness="opencode", task_id="t", reward=reward, status=status, segments=segments
    )


def test_rows_are_the_recorded_paths_with_the_model_tokens_masked_in() -> None:
    rows = rows_of(trajectory())
    assert [r.ids for r in rows] == [[101, 102, 201, 301, 302, 401, 303], [101, 102, 201, 301, 302, 402, 403, 304, 305]]
    for row in rows:
        assert [t for t, m in zip(row.ids, row.mask, strict=True) if m] == [t for t in row.ids if t // 100 == 3]
        assert all(m == 0 for t, m in zip(row.ids, row.mask, strict=True) if t // 100 != 3)


def test_only_complete_trajectories_at_or_above_the_reward_floor() -> None:
    trajectories = [
        trajectory("good"),
        trajectory("low", reward=0.5),
        trajectory("none", reward=None),
        trajectory("timeout", status="TIMED_OUT"),
        trajectory("dup", reward=0.0),
        trajectory("dup", reward=1.0),  # the last record of a rollout wins
    ]
    rows, skipped = build_rows(trajectories, min_reward=1.0)
    assert sorted({r.rollout_id for r in rows}) == ["dup", "good"]
    assert skipped == {"reward below min_reward": 1, "no reward": 1, "status TIMED_OUT": 1}
    assert {r.rollout_id for r in build_rows(trajectories, min_reward=0.5)[0]} == {"dup", "good", "low"}


def test_the_loss_trains_only_masked_tokens() -> None:
    torch = pytest.importorskip("torch")
    from warmstart.sft import Sequence, _batch_loss

    (row, _) = rows_of(trajectory())
    vocab = 512

    class Probe(torch.nn.Module):  # logits that depend on each position's own input token only
        def __init__(self) -> None:
            super().__init__()
            self.emb = torch.nn.Embedding(vocab, vocab)

        def forward(self, input_ids, **_kw):  # noqa: ANN001, ANN003, ANN201
            return SimpleNamespace(logits=self.emb(input_ids))

    model = Probe()
    loss, n = _batch_loss(model, [Sequence("", row.ids, row.mask)], 0, 0)
    assert n == 3  # 301, 302, 303
    loss.backward()
    grad_rows = {i for i in range(vocab) if model.emb.weight.grad[i].abs().sum() > 0}
    # position t predicts token t+1: only inputs right before a 3xx target carry gradient
    assert grad_rows == {row.ids[i - 1] for i in range(1, len(row.ids)) if row.mask[i]} == {201, 301, 401}


@pytest.mark.parametrize("template", ["write", "write_two", "copy", "replace", "append", "delete", "sum", "count"])
def test_teacher_plan_solves_each_template(template: str) -> None:
    import json

    task = next(t for t in generate("train", 16, 0) if t.metadata["template"] == template)
    files = {k: v.decode() for k, v in task.files.items()}
    actions = plan(task)
    # every input file is read before anything is written (what the teacher writes is in the conversation)
    assert [a[1] for a in actions if a[0] == "read"] == ([] if template == "delete" else list(task.files))
    assert all(a[0] == "read" for a in actions[: len(task.files)]) or template == "delete"
    for kind, path, content in actions:
        if kind == "delete":
            files.pop(path, None)
        elif kind == "write":
            files[path] = content
    for check in json.loads(task.grader.files["checks.json"]):
        text = files.get(check["path"])
        ok = {
            "exists": text is not None,
            "absent": text is None,
            "equals": text is not None and text.strip() == check.get("text", "").strip(),
            "lines": text is not None and [s.strip() for s in text.strip().splitlines()] == check.get("lines"),
        }[check["kind"]]
        assert ok, (template, check, files)
