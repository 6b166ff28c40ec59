"""The scripted teacher: a model double that solves built-in CPU tasks through a real harness's own tools.

Served over the engine protocol by :class:`warmstart.scripted_engine.ScriptedEngine`, so a real harness binary
(opencode, Codex, Qwen Code) calls it through the serving proxy like any policy: every demonstration is then on the
calls and trajectories topics by the path RL uses. Per task the teacher knows the task's checks (it is handed the
tasks it records), finds the task by its prompt in the conversation, the sandbox's workspace in the harness's prompt,
and answers one tool call per turn — first it shows every input file (``cat`` through the shell, or the harness's
read tool), then writes or deletes (opencode and Codex: their shell tool, names quoted as the prompt quotes them;
Qwen Code: its write tool) — then a plain final answer. Reading first makes a demonstration learnable: every content
the teacher writes is in the conversation the policy sees (a copy's source, a sum's numbers), as in the built-in
loop's demonstrations; without the reads the teacher wrote what only the grader knew, and 160 SFT steps on such
demonstrations solved no held-out task through opencode. Tool-less calls (titles) get a short title.

Harness versions the teacher's tool calls were recorded with: :data:`RECORDED_WITH`; ``installed_versions`` reads
what is installed now (``clawstream model demos`` writes both into its summary). Topics: none here (the recorder,
``warmstart.record``, runs the stack). Use::

    teacher = Teacher("opencode", tasks, sandboxes_root)
    async with ScriptedEngine(tokenizer, teacher.respond) as engine: ...
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from producers.harnesses.catalog import ADAPTERS
from producers.harnesses.install import HARNESSES, harness_root
from producers.tasks.model import DEFAULT_MOUNT_DIR, Task
from warmstart.scripted_engine import tool_call_text

# The harness versions the teacher's tool calls were written against and recorded with (npm package versions): each
# adapter file's ``teacher_version``.
RECORDED_WITH: dict[str, str] = {n: a.teacher_version for n, a in ADAPTERS.items() if a.teacher_version}
FINAL = "Done."
TITLE = '{"title": "Workspace task"}'

Action = tuple[str, str, str]  # ("read" | "write" | "delete", relative path, content)


def plan(task: Task) -> list[Action]:
    """What solves ``task`` (a built-in CPU task), from its checks: each input file read (unless the task only
    deletes, as in ``warmstart.demos.solution_calls``), each file's wanted content written, each absent file deleted."""
    checks = json.loads(task.grader.files["checks.json"])
    deletes = any(check["kind"] == "absent" for check in checks)
    actions: list[Action] = [] if deletes else [("read", rel, "") for rel in task.files]
    for check in checks:
        path = check["path"]
        if check["kind"] == "equals":
            content = check["text"] + "\n"
        elif check["kind"] == "lines":
            content = "\n".join(check["lines"]) + "\n"
        elif check["kind"] == "absent":
            actions.append(("delete", path, ""))
            continue
        else:
            continue  # "exists": a write covers it
        if task.files.get(path) != content.encode():  # already right (the source of a copy): nothing to do
            actions.append(("write", path, content))
    return actions


def _heredoc(rel: str, content: str) -> str:
    return f"cat > \"{rel}\" <<'EOF'\n{content.rstrip(chr(10))}\nEOF"  # the tasks' words never are `EOF`


def _shell(rel: str, kind: str, content: str) -> str:
    # Names double-quoted as the task's prompt quotes them: inside the call's JSON `\"todo.txt\"` is the same tokens
    # as in a JSON-quoted prompt (opencode's), so the policy copies token ids; a bare ` todo` or `/todo` is another id.
    # `rm -f` failed through codex 0.171.0; `cat` prints the file raw, as the built-in loop's read_file does.
    return {"delete": f'unlink "{rel}"', "read": f'cat "{rel}"'}.get(kind) or _heredoc(rel, content)


# harness → (workspace, action) → (tool name, arguments): the harness's own tools.
ToolCall = Callable[[str, Action], tuple[str, dict[str, Any]]]


def _opencode(ws: str, action: Action) -> tuple[str, dict[str, Any]]:
    kind, rel, content = action
    # Everything through bash: opencode's write takes an absolute filePath, whose `/todo` is not the prompt's token
    # (and refuses to overwrite a file its read tool has not read); its read tool numbers lines (`00001| river`).
    return "bash", {"command": _shell(rel, kind, content), "workdir": ws}


def _codex(ws: str, action: Action) -> tuple[str, dict[str, Any]]:
    kind, rel, content = action
    return "exec_command", {"cmd": _shell(rel, kind, content), "workdir": ws}


def _qwen_code(ws: str, action: Action) -> tuple[str, dict[str, Any]]:
    kind, rel, content = action
    if kind == "read":
        return "read_file", {"file_path": f"{ws}/{rel}"}
    if kind == "write":
        return "write_file", {"file_path": f"{ws}/{rel}", "content": content}
    return "run_shell_command", {"command": f"cd {ws} && rm -f {rel}", "description": f"delete {rel}"}


TOOLS: dict[str, ToolCall] = {"opencode": _opencode, "codex": _codex, "qwen-code": _qwen_code}


def workspace_regex(sandboxes: str | Path) -> re.Pattern[str]:
    """The sandbox workspace as a harness prompt names it: ``SANDBOXES/<id>/workspace`` (no isolation) or the task's
    mount dir (bubblewrap binds the workspace there)."""
    host = re.escape(str(sandboxes)) + r"/[^/\s\"'<>\\]+/workspace"
    mount = r"(?<![\w/.-])" + re.escape(DEFAULT_MOUNT_DIR) + r"(?![\w.-])"
    return re.compile(f"{host}|{mount}")


class Teacher:
    """The responder of a :class:`~warmstart.scripted_engine.ScriptedEngine`: (prompt text, ids, request) → text."""

    def __init__(self, harness: str, tasks: Sequence[Task], sandboxes: str | Path) -> None:
        if harness not in TOOLS:
            raise ValueError(f"harness: the teacher speaks {sorted(TOOLS)}, not {harness!r}; pick one of those")
        self.harness, self.tasks = harness, list(tasks)
        self.ws_re = workspace_regex(sandboxes)
        self.log: list[str] = []  # what each call was answered with (task id and turn, side, unknown)

    def respond(self, prompt_text: str, _ids: list[int], _body: dict[str, Any]) -> str:
        if "<tools>" not in prompt_text:
            self.log.append("side")
            return TITLE
        conversation = prompt_text.partition("<|im_start|>user")[2]
        # a harness may pass the prompt JSON-quoted (opencode's argv reaches the model as "...\"x\"...")
        task = next((t for t in self.tasks if t.prompt in conversation or json.dumps(t.prompt) in conversation), None)
        if task is None:
            self.log.append("unknown task")
            return "I do not know this task."
        actions = plan(task)
        done = conversation.count("<tool_response>")
        self.log.append(f"{task.task_id}:{done}")
        if done >= len(actions):
            return FINAL
        found = self.ws_re.search(prompt_text)
        if found is None:
            self.log.append("no workspace in the prompt")
            return f"{self.harness}: the prompt names no sandbox workspace"
        action = actions[done]
        name, args = TOOLS[self.harness](found.group(0), action)
        return tool_call_text(name, args)


def installed_versions(names: Sequence[str], home: Path | None = None) -> dict[str, str | None]:
    """The npm version of each harness installed under ``$CLAWSTREAM_HOME/harnesses`` now (None: not installed)."""
    out: dict[str, str | None] = {}
    for name in names:
        pkg = HARNESSES[name]
        manifest = harness_root(home) / name / "node_modules" / pkg.package / "package.json"
        out[name] = json.loads(manifest.read_text())["version"] if manifest.exists() else None
    return out
