"""``clawstream tasks``: list a suite, show a task, grade a workspace with a task's grader.

Stage modules are imported inside the commands, so ``clawstream --help`` stays fast.
"""

from __future__ import annotations

import json
from pathlib import Path

import click

from clawstream.cli.base import Group


# ---- tasks -------------------------------------------------------------------------------------------------------
@click.group(cls=Group)
def tasks() -> None:
    """Task suites: list one, show a task, grade a workspace with a task's grader (docs/task_suites.md).

    SUITE specs: builtin:cpu | native:DIR | clawgym:DIR | pinchbench:DIR | DIR (layout detected). TASK: a task
    directory (ClawGym-Bench data_entry.json, native task.json/task.toml), a PinchBench tasks/task_*.md file, or a
    task id together with --suite SUITE.
    """


_suite_option = click.option(
    "--suite",
    "suite",
    default=None,
    metavar="SUITE",
    help="Suite spec TASK is an id of (else TASK is a task directory or file).",
)


@tasks.command("list")
@click.argument("suite")
def tasks_list(suite: str) -> None:
    """The suite's tasks: id, split, timeout, availability (unloadable ones with the reason) and a title."""
    from producers.tasks.catalog import load_suite
    from producers.tasks.describe import suite_table

    click.echo(suite_table(load_suite(suite)))


@tasks.command("show")
@click.argument("task")
@_suite_option
@click.option("--json", "as_json", is_flag=True, help="Print JSON (file sizes instead of contents).")
def tasks_show(task: str, suite: str | None, as_json: bool) -> None:
    """A task's prompt, workspace files and grader (command, where its files go, how its output is read)."""
    from producers.tasks.describe import find_task, task_details, task_json

    found = find_task(task, suite)
    click.echo(task_json(found) if as_json else task_details(found))


@tasks.command("grade")
@click.argument("task")
@click.argument("workspace", type=click.Path(exists=True, file_okay=False, path_type=Path))
@_suite_option
@click.option(
    "--transcript",
    type=click.Path(exists=True, dir_okay=False, path_type=Path),
    default=None,
    help="The run's transcript, for graders that read one: an OpenClaw session file (JSON lines) for "
    "tasks graded on OpenClaw's session format (PinchBench, ClawGym-Bench), else the harness's "
    "machine-readable output.",
)
@click.option("--judge-url", default=None, help="OpenAI-compatible base URL (…/v1) of an LLM judge.")
@click.option("--judge-model", default="judge", show_default=True, help="Model name sent to the judge.")
@click.option("--timeout", type=float, default=120.0, show_default=True, help="Longest grader run (seconds).")
@click.option("--json", "as_json", is_flag=True, help="Print the result as JSON.")
def tasks_grade(
    task: str,
    workspace: Path,
    suite: str | None,
    transcript: Path | None,
    judge_url: str | None,
    judge_model: str,
    timeout: float,
    as_json: bool,
) -> None:
    """Grade WORKSPACE with TASK's grader, exactly as a rollout is graded: in a fresh local sandbox holding a copy
    of WORKSPACE (left unchanged). Prints the reward and the sub-scores; a grader failure is an error (exit 1)."""
    import asyncio
    import tempfile

    from producers.sandbox.local_backend import LocalBackend
    from producers.sandbox.run_grader import grade_directory
    from producers.sandbox.settings import SandboxSettings
    from producers.tasks.describe import find_task

    found = find_task(task, suite)
    text = transcript.read_text() if transcript else None
    session = text if found.grader.transcript == "openclaw_session" else None
    stdout = text if text is not None and session is None else ""
    with tempfile.TemporaryDirectory(prefix="clawstream-grade-") as tmp:
        settings = SandboxSettings(
            root=Path(tmp), grader_timeout_s=timeout, judge_url=judge_url, judge_model=judge_model
        )
        backend = LocalBackend(settings)
        result = asyncio.run(grade_directory(found, workspace, backend, settings, stdout=stdout, session=session))
    if as_json:
        click.echo(
            json.dumps(
                {
                    "task": found.ref,
                    "status": result.status.value,
                    "reward": result.reward,
                    "grader": result.grader,
                    "sub_scores": result.sub_scores,
                    "reason": result.reason,
                }
            )
        )
        return
    reward = "none" if result.reward is None else str(round(result.reward, 6))
    click.echo(f"reward {reward}  ({result.status.value}, grader {result.grader}, task {found.ref})")
    for name, score in result.sub_scores.items():
        click.echo(f"  {round(score, 6):<9} {name}")
    if result.reason:
        click.echo(f"reason: {result.reason}")
