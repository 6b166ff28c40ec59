"""Grading a finished rollout in its sandbox: the task's grader runs *inside* the sandbox, or an LLM judge is asked.

The grader files are copied in only now, after the harness ended, so the harness never sees them: into the
sandbox's grader directory, emptied first (nothing a rollout planted there survives), or — for a grader that
expects them inside the workspace (ClawGym-Bench's ``reward/``) — into that folder of the workspace, after clearing
whatever the agent left under that name, and removed again once graded. The command runs through the backend's
``run_grader``: every process of the rollout dead first, a snapshot of the workspace the rollout can no longer
change, another uid, its outputs where no rollout command could write; with ``grader_timeout_s``, in an empty
directory with every Python isolated (``grading_rules.grader_invocation``); its capture file is read back without
following a link, without blocking, bounded and off the event loop (:func:`read_grader_output`). The grading rules
themselves (invocation, output parsing, judge) are ``producers.tasks.grading_rules``. A grader that fails on the
rollout's workspace is a :class:`GraderRunFailure`; :func:`blame` then grades the task's untouched workspace: a
graded 0 flagged ``grader_error_by_rollout`` when that works, an infrastructure failure when it fails too. What
graders read about the conversation is built from the one the proxy recorded, never from what the harness wrote
(:func:`run_transcript`).
:func:`grade_directory` grades a workspace directory the same way, in a fresh local sandbox (``clawstream tasks
grade``).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import shutil
import stat
import uuid
from dataclasses import replace
from pathlib import Path
from typing import Any

from producers.sandbox.base import Sandbox, SandboxBackend, SandboxError, inside
from producers.sandbox.settings import SandboxSettings
from producers.tasks import pinchbench
from producers.tasks.grading_rules import (
    GradeResult,
    GraderFailure,
    GraderRunFailure,
    Judge,
    final_message,
    grader_invocation,
    judge_score,
    parse_grader_output,
    reward_payload,
    transcript_from_stdout,
)
from producers.tasks.model import Task, TaskError
from producers.tasks.transcript import (
    OPENCLAW_AGENTS_DIR,
    final_answer_messages,
    find_openclaw_session,
    parse_session_jsonl,
    session_transcript,
    stream_transcript,
)
from schemas.events import RewardStatus, now_ms

log = logging.getLogger(__name__)


async def run_in_sandbox(task: Task, box: Sandbox, transcript: list[dict[str, Any]], timeout_s: float) -> GradeResult:
    """Lay the task's grader out in ``box`` and run it there; its output scored by the grading rules. Raises
    :class:`GraderRunFailure` when the grader fails."""
    try:
        return await _run_in_sandbox(task, box, transcript, timeout_s)
    except GraderRunFailure:
        raise
    except GraderFailure as exc:
        raise GraderRunFailure(str(exc)) from exc


async def _run_in_sandbox(task: Task, box: Sandbox, transcript: list[dict[str, Any]], timeout_s: float) -> GradeResult:
    inv = grader_invocation(task, python=box.python, grader_dir=box.grader_dir, workspace=box.workspace)
    host_ws = box.host_path(box.workspace)
    try:
        # A grader directory emptied now, after the harness: whatever a rollout planted where the grader's Python
        # looks first (its script directory: a planted ``../grader/json.py`` would forge a 1.0) is gone.
        _empty(box.host_path(box.grader_dir))
        for name in inv.workspace_entries:  # whatever the agent left under these names (it cannot pre-plant checks)
            _remove(host_ws / name)
        box.write_files(inv.files_dir, inv.files)
        box.write_files(box.grader_dir, inv.support_files)
        box.host_path(inv.cwd).mkdir(parents=True, exist_ok=True)
        for rel in inv.support_files:
            box.host_path(inside(box.grader_dir, rel)).chmod(0o755)
        box.write_text(inv.transcript_path, json.dumps(transcript))
        if inv.payload_path:
            box.host_path(inv.payload_path).write_bytes(reward_payload(task, transcript))
        try:
            result = await box.run_grader(inv.argv, inv.env, inv.cwd, timeout_s, extra_path=inv.extra_path)
        except OSError as exc:  # the workspace's snapshot failed on what the rollout left there
            raise GraderRunFailure(f"the workspace could not be handed to the grader: {exc}"[:2000]) from exc
        capture = box.host_path(inv.capture_path) if inv.capture_path else None
        captured = await asyncio.to_thread(read_grader_output, capture) if capture else None
    finally:
        for name in inv.workspace_entries:  # the grader's files never outlive grading
            with contextlib.suppress(OSError):
                _remove(host_ws / name)
    if result.timed_out:
        raise GraderFailure(f"grader {task.grader.name} timed out after {timeout_s:.0f}s")
    return parse_grader_output(task, result.exit_code, result.stdout, result.stderr, captured=captured)


def _empty(folder: Path) -> None:
    """Remove everything inside ``folder`` (created if missing)."""
    folder.mkdir(parents=True, exist_ok=True)
    for entry in list(folder.iterdir()):
        _remove(entry)


def _remove(path: Path) -> None:
    """Remove a file, link (not its target) or directory tree, if there."""
    if path.is_symlink() or path.is_file():
        path.unlink()
    elif path.is_dir():
        shutil.rmtree(path)


def read_grader_output(path: Path, limit: int = 1 << 20) -> str | None:
    """The last ``limit`` bytes of a file a grader wrote (None when there is none). Opened without following a
    link (its directory too) and without blocking; anything but a regular file is a :class:`GraderRunFailure`
    (a FIFO would block the reader, a link would read another file). Blocking I/O: call it in a thread."""
    try:
        parent = os.open(path.parent, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise GraderRunFailure(f"grader output folder {path.parent}: {exc.strerror}") from exc
    try:
        fd = os.open(path.name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=parent)
    except FileNotFoundError:
        return None
    except OSError as exc:  # ELOOP: a symlink
        raise GraderRunFailure(f"grader output {path.name}: {exc.strerror} (not a regular file)") from exc
    finally:
        os.close(parent)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise GraderRunFailure(f"grader output {path.name} is not a regular file (mode {st.st_mode:o})")
        start = max(0, st.st_size - limit)
        return os.pread(fd, min(limit, st.st_size), start).decode(errors="replace")
    finally:
        os.close(fd)


def run_transcript(
    task: Task,
    box: Sandbox,
    stdout: str,
    *,
    messages: list[dict[str, Any]] | None = None,
    session_dir: str | None = None,
) -> list[dict[str, Any]]:
    """The transcript the task's grader reads (``Grader.transcript``); the judge prompt and ClawGym-Bench's payload
    (``final_message``, ``transcript``) are built from it too. ``messages``: the conversation the proxy recorded
    (the last main-agent call's messages plus the model's answer, OpenAI Chat shaped, as the seal reports them);
    ``stdout``: the harness's output; ``session_dir``: where under HOME the harness writes its own OpenClaw session
    files (OpenClaw only).

    Whenever the proxy reported a conversation, the transcript is built from it alone: the harness's stdout and a
    process it started can say anything (a forged answer written to /proc/<harness>/fd/1, a rewritten session file),
    the proxy has what the model saw and answered. ``openclaw_session``: OpenClaw session records of it
    (:func:`session_transcript`); ``stdout``: the records a stream-json harness prints, closed by a ``result``
    record holding the model's last answer (:func:`stream_transcript`), so graders that read a harness's ``result``
    (and :func:`final_message`) read the model's. Only when the proxy reported none (an older proxy, no main-agent
    call) is the transcript harness-written, with a warning: the stdout records; for ``openclaw_session`` the
    harness's own session file when it writes one, else the prompt and the final answer it printed."""
    recorded = [m for m in messages or () if isinstance(m, dict)]
    if recorded:
        if task.grader.transcript == "openclaw_session":
            return session_transcript(recorded, cwd=box.workspace, start_ms=now_ms())
        return stream_transcript(recorded)
    records = transcript_from_stdout(stdout)
    source = "the harness's stdout"
    transcript = records
    if task.grader.transcript == "openclaw_session":
        own = find_openclaw_session(box.host_path(box.home), session_dir) if session_dir else None
        if own is not None:
            source = f"the harness's session file {own.name}"
            transcript = parse_session_jsonl(own.read_text(encoding="utf-8", errors="replace"))
        else:
            source = "the final answer the harness printed"
            answer = final_answer_messages(task.prompt.replace(task.mount_dir, box.workspace), final_message(records))
            transcript = session_transcript(answer, cwd=box.workspace, start_ms=now_ms())
    log.warning(
        "%s in sandbox %s: the proxy reported no conversation; the grader's transcript is harness-written (%s)",
        task.ref,
        box.sandbox_id,
        source,
    )
    return transcript


async def grade(
    task: Task,
    box: Sandbox,
    stdout: str,
    settings: SandboxSettings,
    *,
    messages: list[dict[str, Any]] | None = None,
    session_dir: str | None = None,
) -> GradeResult:
    """Grade a rollout (raises :class:`GraderRunFailure` when the grader fails on it or its transcript cannot be
    built, :class:`GraderFailure` when the judge fails); ``messages`` / ``session_dir``: where the transcript comes
    from (:func:`run_transcript`)."""
    try:
        transcript = run_transcript(task, box, stdout, messages=messages, session_dir=session_dir)
    except Exception as exc:  # built from what the rollout sent and wrote: whatever it raises is the rollout's
        raise GraderRunFailure(f"the transcript could not be built: {exc!r}"[:2000]) from exc
    g = task.grader
    auto = None
    if g.grading_type != "llm_judge":
        auto = await run_in_sandbox(task, box, transcript, settings.grader_timeout_s)
        if g.grading_type == "automated":
            return auto
    if not settings.judge_url:
        subs = dict(auto.sub_scores) if auto else {}
        return GradeResult(RewardStatus.UNGRADED, g.name, None, subs, f"{g.grading_type} task and no judge_url")
    judge = Judge(settings.judge_url, settings.judge_model, settings.judge_api_key, settings.grader_timeout_s)
    score, breakdown = await judge_score(judge, task, transcript)
    if auto is None:
        return GradeResult(RewardStatus.OK, g.name, score, breakdown)
    reward, subs = pinchbench.combine(task, auto.reward or 0.0, auto.sub_scores, score, breakdown)
    return GradeResult(RewardStatus.OK, g.name, reward, subs)


# Tasks whose grader graded their untouched workspace in this process (bounded: cleared when full).
_SOUND: set[str] = set()


async def blame(
    task: Task, backend: SandboxBackend, settings: SandboxSettings, failure: GraderRunFailure
) -> GradeResult:
    """Whose failure ``failure`` (the grader on a rollout's workspace) is: the grader runs on the task's untouched
    workspace in a fresh sandbox (once per task and process). It grades that one: the rollout's doing — a graded 0
    flagged ``by_rollout``, the reason saying so. Raises :class:`GraderFailure` when it fails there too (a broken
    grader or sandbox: infrastructure) and :class:`SandboxError` when no sandbox can be made."""
    if task.ref not in _SOUND:
        box = await backend.create(f"ctl-{task.task_id[:24]}-{uuid.uuid4().hex[:8]}", task)
        try:
            await run_in_sandbox(task, box, run_transcript(task, box, ""), settings.grader_timeout_s)
        except GraderFailure as exc:
            raise GraderFailure(f"{failure}; on the task's untouched workspace too: {exc}") from exc
        finally:
            await box.destroy()
        if len(_SOUND) > 4096:
            _SOUND.clear()
        _SOUND.add(task.ref)
    reason = f"grader_error_by_rollout: {failure}"[:2000]
    return GradeResult(RewardStatus.OK, task.grader.name, 0.0, {}, reason, by_rollout=True)


async def grade_directory(
    task: Task,
    workspace: Path,
    backend: SandboxBackend,
    settings: SandboxSettings,
    *,
    stdout: str = "",
    session: str | None = None,
) -> GradeResult:
    """Grade a workspace directory exactly as a rollout's workspace is graded: a fresh sandbox of ``backend`` gets a
    copy of the directory as its workspace (the directory itself is left as it is), the task's grader runs in it,
    then the sandbox is destroyed. The transcript: ``stdout`` (the harness's output) for graders that read it, or
    ``session`` (an OpenClaw session file's text, JSON lines) for graders that read OpenClaw's session format; no
    proxy recorded this run, so they are used as :func:`run_transcript` uses harness-written ones."""
    if not workspace.is_dir():
        raise TaskError(f"workspace {workspace} is not a directory")
    # A fresh id per grading: two gradings of one task at once must not share a kill marker (kill_all matches it).
    box = await backend.create(f"grade-{task.task_id[:24]}-{uuid.uuid4().hex[:8]}", replace(task, files={}))
    try:
        await asyncio.to_thread(
            shutil.copytree, workspace, box.host_path(box.workspace), symlinks=True, dirs_exist_ok=True
        )
        session_dir = None
        if session is not None:  # where OpenClaw keeps it, so the grader finds it as it finds OpenClaw's own
            box.write_text(inside(box.home, OPENCLAW_AGENTS_DIR, "main", "sessions", "given.jsonl"), session)
            session_dir = OPENCLAW_AGENTS_DIR
        result = await grade(task, box, stdout, settings, session_dir=session_dir)
    finally:
        report = await box.destroy()
    if not report.clean:
        raise SandboxError(f"sandbox {box.sandbox_id} not clean after grading: {report}")
    return result
