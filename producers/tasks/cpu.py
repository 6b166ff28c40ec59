"""The built-in CPU task suite: small workspace tasks a tiny model can learn, with partial-credit graders.

Generated from templates with a seed (deterministic): exact file writes, copies, word replacements, appends,
deletions and one-digit computations over files (sum, line count). Following docs/method.md#task-design, every
name and content in a prompt is quoted (so the model can copy it token for token into the tool call's JSON), names
are whole words (``"notes.txt"``, ``"apple"``) and numbers have one digit. Each task is graded by one shared
``grade.py`` reading the task's ``checks.json`` (a list of checks: exists, absent, equals, lines); each check is one
sub-score in {0, 1}, so a half-done task earns partial credit (reward = mean).

Splits: ``train`` (``n_train`` tasks, seed ``seed``) and ``heldout`` (``n_heldout``, seed ``seed + 1``, never the
same prompt as a train task). Export as native directories: ``python -m producers.tasks list builtin:cpu --export
DIR``.
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable
from dataclasses import replace

from producers.tasks.model import Grader, Suite, Task, TaskError

SUITE = "cpu_builtin"
TIMEOUT_S = 60.0
WORDS = (
    "apple",
    "pear",
    "plum",
    "lemon",
    "grape",
    "mango",
    "cherry",
    "peach",
    "melon",
    "olive",
    "bread",
    "honey",
    "river",
    "cloud",
    "stone",
    "tiger",
    "horse",
    "eagle",
    "green",
    "blue",
    "red",
    "silver",
    "garden",
    "window",
)
NAMES = ("notes", "fruit", "answer", "list", "data", "words", "result", "items", "report", "draft", "todo", "output")

# The shared grader: stdlib only, run inside the sandbox as `python grade.py <workspace>`.
GRADE_PY = r'''"""Grade a workspace against checks.json (next to this file); print a JSON dict of sub-scores."""
import json, os, sys

ws = sys.argv[1]
checks = json.load(open(os.path.join(os.path.dirname(os.path.abspath(__file__)), "checks.json")))


def read(path):
    try:
        with open(os.path.join(ws, path), encoding="utf-8") as f:
            return f.read()
    except (OSError, UnicodeDecodeError):
        return None


scores = {}
for i, c in enumerate(checks):
    text = read(c["path"])
    kind = c["kind"]
    if kind == "exists":
        ok = text is not None
    elif kind == "absent":
        ok = not os.path.exists(os.path.join(ws, c["path"]))
    elif kind == "equals":
        ok = text is not None and text.strip() == c["text"].strip()
    elif kind == "lines":
        ok = text is not None and [s.strip() for s in text.strip().splitlines()] == c["lines"]
    else:
        raise SystemExit(f"unknown check kind {kind!r}")
    scores[f"{i}_{kind}:{c['path']}"] = 1.0 if ok else 0.0
print(json.dumps(scores))
'''


# The training-only grader of ``replace`` (``builtin:cpu?train_grader=partial``): credit per line of the wanted file.
# Only a rewrite of the file's own shape earns any: a missing file, a directory or symlink in its place, a file with
# more or fewer lines (every candidate written, padding) or the untouched original all score 0, so a wrong word in
# the right place (2 of 3 lines) scores above doing nothing (0) and below the answer (1).
PARTIAL_GRADE_PY = r'''"""Grade a rewrite per line against checks.json (next to this file); print JSON sub-scores.

Training only: a rewrite of the file's own shape earns a point per wanted line it has; anything else scores 0.
"""
import json, os, stat, sys

ws = sys.argv[1]
checks = json.load(open(os.path.join(os.path.dirname(os.path.abspath(__file__)), "checks.json")))


def lines(path):
    try:
        st = os.lstat(path)
        if not stat.S_ISREG(st.st_mode):
            return None
        with open(path, encoding="utf-8") as f:
            return [s.strip() for s in f.read(1 << 20).strip().splitlines()]
    except (OSError, UnicodeDecodeError):
        return None


scores = {}
for i, c in enumerate(checks):
    if c["kind"] != "lines_partial":
        raise SystemExit(f"unknown check kind {c['kind']!r}")
    got, want, before = lines(os.path.join(ws, c["path"])), c["lines"], c["before"]
    valid = got is not None and len(got) == len(want) and got != before
    for j, line in enumerate(want):
        scores[f"{i}_line{j}:{c['path']}"] = 1.0 if valid and got[j] == line else 0.0
print(json.dumps(scores))
'''
TRAIN_GRADERS = ("partial",)  # builtin:cpu?train_grader=...


def checks_grader(checks: list[dict]) -> Grader:
    return Grader(
        name="cpu_checks",
        files={"grade.py": GRADE_PY.encode(), "checks.json": json.dumps(checks, indent=1).encode()},
        argv=("${python}", "${grader_dir}/grade.py", "${workspace}"),
    )


Made = tuple[str, dict[str, str], list[dict]]  # prompt, workspace files, checks


def _names(rng: random.Random, k: int) -> list[str]:
    return [f"{n}.txt" for n in rng.sample(NAMES, k)]


def _write(rng: random.Random) -> Made:
    (f,), w = _names(rng, 1), rng.choice(WORDS)
    return (
        f'Create the file "{f}" containing "{w}".',
        {},
        [{"kind": "exists", "path": f}, {"kind": "equals", "path": f, "text": w}],
    )


def _write_two(rng: random.Random) -> Made:
    (f, g), (a, b) = _names(rng, 2), rng.sample(WORDS, 2)
    checks = [
        {"kind": "exists", "path": f},
        {"kind": "equals", "path": f, "text": a},
        {"kind": "exists", "path": g},
        {"kind": "equals", "path": g, "text": b},
    ]
    return f'Create the file "{f}" containing "{a}" and the file "{g}" containing "{b}".', {}, checks


def _copy(rng: random.Random) -> Made:
    (src, dst), w = _names(rng, 2), rng.choice(WORDS)
    checks = [
        {"kind": "exists", "path": dst},
        {"kind": "equals", "path": dst, "text": w},
        {"kind": "equals", "path": src, "text": w},
    ]
    return f'Copy the content of "{src}" into a new file "{dst}".', {src: w + "\n"}, checks


def _replace(rng: random.Random) -> Made:
    (f,), words = _names(rng, 1), rng.sample(WORDS, 4)
    old, new, others = words[0], words[1], words[2:]
    lines = [others[0], old, others[1]]
    rng.shuffle(lines)
    want = [new if x == old else x for x in lines]
    checks = [{"kind": "exists", "path": f}, {"kind": "lines", "path": f, "lines": want}]
    return f'In "{f}", replace the word "{old}" with "{new}".', {f: "\n".join(lines) + "\n"}, checks


def _append(rng: random.Random) -> Made:
    (f,), words = _names(rng, 1), rng.sample(WORDS, 3)
    checks = [{"kind": "exists", "path": f}, {"kind": "lines", "path": f, "lines": words}]
    return f'Add the line "{words[2]}" at the end of "{f}".', {f: "\n".join(words[:2]) + "\n"}, checks


def _delete(rng: random.Random) -> Made:
    (f, keep), (a, b) = _names(rng, 2), rng.sample(WORDS, 2)
    checks = [{"kind": "absent", "path": f}, {"kind": "equals", "path": keep, "text": b}]
    return f'Delete the file "{f}" and keep "{keep}".', {f: a + "\n", keep: b + "\n"}, checks


def _sum(rng: random.Random) -> Made:
    (f, out) = _names(rng, 2)
    n = rng.randint(2, 3)
    nums = [rng.randint(1, 9) for _ in range(n)]
    while sum(nums) > 9:  # one-digit answers
        nums = [rng.randint(1, 4) for _ in range(n)]
    checks = [{"kind": "exists", "path": out}, {"kind": "equals", "path": out, "text": str(sum(nums))}]
    prompt = f'The file "{f}" has one number per line. Write their sum to "{out}".'
    return prompt, {f: "\n".join(map(str, nums)) + "\n"}, checks


def _count(rng: random.Random) -> Made:
    (f, out) = _names(rng, 2)
    words = rng.sample(WORDS, rng.randint(2, 9))
    checks = [{"kind": "exists", "path": out}, {"kind": "equals", "path": out, "text": str(len(words))}]
    return f'Write the number of lines in "{f}" to "{out}".', {f: "\n".join(words) + "\n"}, checks


TEMPLATES: dict[str, Callable[[random.Random], Made]] = {
    "write": _write,
    "write_two": _write_two,
    "copy": _copy,
    "replace": _replace,
    "append": _append,
    "delete": _delete,
    "sum": _sum,
    "count": _count,
}


def generate(split: str, n: int, seed: int, exclude: set[str] | None = None) -> list[Task]:
    rng = random.Random(seed)
    exclude = exclude if exclude is not None else set()
    tasks: list[Task] = []
    kinds = list(TEMPLATES)
    attempts = 0
    while len(tasks) < n:
        attempts += 1
        if attempts > 100 * n:
            raise RuntimeError(f"cannot generate {n} distinct {split} tasks")
        kind = kinds[len(tasks) % len(kinds)]  # round-robin: every split covers every template evenly
        prompt, files, checks = TEMPLATES[kind](rng)
        if prompt in exclude:
            continue
        exclude.add(prompt)
        tasks.append(
            Task(
                suite=SUITE,
                task_id=f"{split}-{len(tasks):03d}-{kind}",
                prompt=prompt,
                timeout_s=TIMEOUT_S,
                files={k: v.encode() for k, v in files.items()},
                grader=checks_grader(checks),
                split=split,
                metadata={"template": kind},
            )
        )
    return tasks


def partial_grader(task: Task) -> Task:
    """The task with the training-only per-line grader when it is a ``replace`` task (unchanged otherwise)."""
    if task.metadata.get("template") != "replace":
        return task
    (check,) = [c for c in json.loads(task.grader.files["checks.json"]) if c["kind"] == "lines"]
    before = [s.strip() for s in task.files[check["path"]].decode().strip().splitlines()]
    checks = [{"kind": "lines_partial", "path": check["path"], "lines": check["lines"], "before": before}]
    files = {"grade.py": PARTIAL_GRADE_PY.encode(), "checks.json": json.dumps(checks, indent=1).encode()}
    return replace(task, grader=replace(task.grader, name="cpu_lines_partial", files=files))


def suite_for(query: str) -> Suite:
    """The suite a ``builtin:cpu?KEY=VALUE&...`` spec names (only ``train_grader`` is known)."""
    train_grader = ""
    for part in filter(None, query.split("&")):
        key, _, value = part.partition("=")
        if key != "train_grader":
            raise TaskError(f"builtin:cpu option {key!r} is unknown; known: train_grader (e.g. ?train_grader=partial)")
        train_grader = value
    return cpu_suite(train_grader=train_grader)


def cpu_suite(n_train: int = 96, n_heldout: int = 48, seed: int = 0, train_grader: str = "") -> Suite:
    """The suite; ``train_grader="partial"`` grades the train split's ``replace`` tasks per line (training only:
    the held-out split, which evaluations run, keeps the exact grader)."""
    seen: set[str] = set()
    train = generate("train", n_train, seed, seen)
    heldout = generate("heldout", n_heldout, seed + 1, seen)
    if train_grader == "partial":
        train = [partial_grader(t) for t in train]
    elif train_grader:
        raise TaskError(f"train_grader={train_grader!r} is unknown; known: {', '.join(TRAIN_GRADERS)}")
    return Suite(SUITE, {t.task_id: t for t in train + heldout})
