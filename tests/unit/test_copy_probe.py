"""The copy probe (warmstart/copy_probe.py): the template keeps the harness's quoting, the name tokens are the file
name's stem, and a model double that predicts every next target token scores 1.0 where one that repeats the last
token does not (the probe measures the model, not itself)."""

from __future__ import annotations

import json
import os

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
torch = pytest.importorskip("torch", reason="the probe needs torch (the 'ml' extra)")

from tests.support.proxy_helpers import tiny_tokenizer  # noqa: E402
from warmstart.copy_probe import name_spans, probe, split_template  # noqa: E402
from warmstart.demos import heldout_tasks  # noqa: E402

SYSTEM = "<|im_start|>system\nWorking directory: /workspace\n<tools>\n</tools><|im_end|>\n"
RECORDED = 'Create the file "a.txt" containing "b".'


def recorded(prompt: str) -> str:
    return f"{SYSTEM}<|im_start|>user\n{prompt}<|im_end|>\n<|im_start|>assistant\n"


def test_the_template_keeps_the_harness_quoting() -> None:
    task = heldout_tasks(1)[0]
    quoted = split_template(recorded(json.dumps(RECORDED)))
    assert quoted.quoted and quoted.prompt(task) == recorded(json.dumps(task.prompt))
    raw = split_template(recorded(RECORDED))
    assert not raw.quoted and raw.prompt(task) == recorded(task.prompt)
    with pytest.raises(ValueError, match="no user turn"):
        split_template(SYSTEM)


def test_the_name_is_the_stem_wherever_it_appears() -> None:
    target = 'cat "todo.txt" > "todo.bak"'
    assert [target[a:b] for a, b in name_spans(target, "todo.txt")] == ["todo", "todo"]


class NextToken(torch.nn.Module):
    """A model double: logits whose argmax at position i is the input's token i + 1 (``shift``), or token i."""

    def __init__(self, vocab: int, shift: int) -> None:
        super().__init__()
        self.vocab, self.shift = vocab, shift

    def forward(self, ids: torch.Tensor) -> object:  # (1, L) -> .logits (1, L, V)
        nxt = torch.roll(ids, -self.shift, dims=1)
        return type("Out", (), {"logits": torch.nn.functional.one_hot(nxt, self.vocab).float()})()


def test_a_model_that_predicts_the_target_scores_one_and_one_that_repeats_does_not() -> None:
    tok = tiny_tokenizer()
    template = split_template(recorded(json.dumps(RECORDED)))
    tasks = heldout_tasks(4)
    right = probe(NextToken(len(tok), 1), tok, template, tasks, "opencode")
    assert right["tasks"] == right["names_all_right"] == right["calls_all_right"] == 4, right
    assert right["name_accuracy"] == right["other_accuracy"] == 1.0 and right["name_tokens"] >= 4, right
    wrong = probe(NextToken(len(tok), 0), tok, template, tasks, "opencode")
    assert wrong["names_all_right"] < 4 and wrong["name_accuracy"] < 0.5, wrong
    assert wrong["name_tokens"] == right["name_tokens"] and wrong["other_tokens"] == right["other_tokens"]
