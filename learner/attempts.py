"""Step attempts that outlive the learner, and the out-of-memory deaths among them, told apart on evidence.

Before a batch's training (packing dry run, step, rollback) the learner records an attempt in a small JSON file
beside its trainer state (``<weight store>/<model>/trainer-state/step-attempts.json``): the key, this process's
pid, its memory cgroup and that cgroup's ``oom_kill`` counter, and (once planned) the memory plan's estimate. The
entry goes when the training returns or raises. An entry a new process finds was left by a process that died in the
training, and a SIGKILL says nothing about why: an operator, a preemption and the OOM killer send the same one. So
the death counts as out-of-memory only on evidence, recorded by whoever saw it: a verdict file ``deaths/<pid>.json``
beside the attempts file (:func:`record_oom`: the supervisor, ``clawstream.stack.process``, from the kernel's OOM
record of that pid or its cgroup's counter), or the learner's own cgroup counter, risen since the attempt started.
Any other death retrains the batch, however often; ``max_step_attempts`` out-of-memory deaths dead-letter it. A
distributed step that raises ends its group (learner/train_ranks.py): the rank records ``raised`` verdicts
(:func:`record_failure`), and ``max_step_attempts`` of them dead-letter the batch too.

Each write goes to a temporary file, is fsynced and renamed: a kill at any instant leaves the old or the new file.
Keys name the batch's seal record and id (``topic[partition]@offset batch-id``). Pure: no Kafka, no torch. Why a
file and not a topic: docs/method.md#exactly-once-dead-letters-resume. Each training attempt writes its version's
files under ``vNNNNNN-<attempt>`` (``policy.weight_store``); :func:`remove_unpublished` removes those of attempts
no committed version names (a killed or fenced attempt's), never a published one's.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from collections.abc import Iterable
from dataclasses import asdict, dataclass
from pathlib import Path

from clawbase.errors import ClawstreamError

FILE_NAME = "step-attempts.json"
DEATHS = "deaths"  # beside FILE_NAME: one out-of-memory verdict per dead pid
CGROUP_ROOT = Path("/sys/fs/cgroup")
# An attempt's files (policy.weight_store): its directory, its trainer state and value head, and their partial writes.
ATTEMPT_FILE = re.compile(r"^(v\d{6}-[0-9]+-[0-9a-f]+)(\.pt|\.safetensors)?(\.partial)?$")
ATTEMPT_HOMES = (".", "trainer-state", "value-heads")  # under <weight store>/<model>


@dataclass
class Attempt:
    starts: int = 0  # training starts of the batch whose process did not return
    ooms: int = 0  # of those, deaths with evidence of an out-of-memory kill
    pid: int = 0  # the process of the latest start; 0 once its death is judged
    cgroup: str = ""  # its memory cgroup, and the cgroup's oom_kill counter at the start (-1: unreadable)
    oom_kills: int = -1
    estimate: str = ""  # the memory plan's estimate of the step (learner.memory)
    evidence: str = ""  # why the last out-of-memory death was judged one
    failures: int = 0  # deaths because the step raised (a rank of a distributed group), and the last error
    failure: str = ""


class StepAttempts:
    """Attempts per batch key in one small file, every change durable before the call returns."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.attempts: dict[str, Attempt] = {}
        if path.exists():
            try:
                loaded = json.loads(path.read_text())
                self.attempts = {str(k): _attempt(v) for k, v in loaded.items()}
            except (ValueError, AttributeError, TypeError) as exc:
                raise ClawstreamError(
                    f"{path} is not a JSON object of step attempts ({exc}); delete it to forget every attempt"
                ) from exc
        self._judge()

    def count(self, key: str) -> int:
        return self.attempts[key].starts if key in self.attempts else 0

    def ooms(self, key: str) -> Attempt | None:
        """The batch's attempt record when at least one of its deaths was out of memory."""
        attempt = self.attempts.get(key)
        return attempt if attempt is not None and attempt.ooms else None

    def start(self, key: str) -> int:
        """One more attempt of ``key`` by this process, on disk before this returns; the count now."""
        attempt = self.attempts.setdefault(key, Attempt())
        attempt.starts += 1
        attempt.pid = os.getpid()
        attempt.cgroup = memory_cgroup(attempt.pid) or ""
        attempt.oom_kills = oom_kills(attempt.cgroup) if attempt.cgroup else -1
        self._write()
        return attempt.starts

    def plan(self, key: str, estimate: str) -> None:
        """The memory plan's estimate of ``key``'s step, kept for the verdict should the step die."""
        if key in self.attempts:
            self.attempts[key].estimate = estimate
            self._write()

    def forget(self, key: str) -> None:
        """The training of ``key`` ended (returned, raised, or the batch is dead-lettered): its record goes."""
        if self.attempts.pop(key, None) is not None:
            self._write()

    def _judge(self) -> None:
        """Every attempt a dead process left: an out-of-memory death on evidence, else just a death."""
        judged = []
        for attempt in self.attempts.values():
            if not attempt.pid or attempt.pid == os.getpid():
                continue
            cause, evidence = _verdict(self.path.parent / DEATHS, attempt)
            if cause == "oom":
                attempt.ooms, attempt.evidence = attempt.ooms + 1, evidence
            elif cause == "raised":
                attempt.failures, attempt.failure = attempt.failures + 1, evidence
            judged.append(attempt.pid)
            attempt.pid = 0
        if judged:
            self._write()
            for pid in judged:  # after the write: a kill in between judges the same death again, never twice
                (self.path.parent / DEATHS / f"{pid}.json").unlink(missing_ok=True)

    def _write(self) -> None:
        _write_atomically(self.path, {k: asdict(v) for k, v in self.attempts.items()})


def _attempt(value: object) -> Attempt:
    if isinstance(value, int):  # an older file's bare count: starts without a pid, never judged out of memory
        return Attempt(starts=value)
    if not isinstance(value, dict):
        raise TypeError(f"an attempt is an object, not {value!r}")
    return Attempt(**value)


def _verdict(deaths: Path, attempt: Attempt) -> tuple[str, str]:
    """Why ``attempt``'s process died: ("oom" or "raised", the evidence), or ("", "") without evidence."""
    record = deaths / f"{attempt.pid}.json"
    if record.exists():
        try:
            loaded = json.loads(record.read_text())
            return str(loaded.get("cause", "oom")), str(loaded["evidence"])
        except (ValueError, KeyError, TypeError, AttributeError):
            return "oom", f"{record} (unreadable; a verdict file is written for an out-of-memory death)"
    now = oom_kills(attempt.cgroup) if attempt.cgroup and attempt.cgroup == memory_cgroup(os.getpid()) else -1
    if attempt.oom_kills >= 0 and now > attempt.oom_kills:
        kills = now - attempt.oom_kills
        return "oom", f"the memory cgroup {attempt.cgroup} counted {kills} OOM kill(s) during the attempt"
    return "", ""


def record_oom(deaths: Path, pid: int, evidence: str) -> Path:
    """The supervisor's verdict: process ``pid`` died out of memory, with the evidence (read by its next start)."""
    path = deaths / f"{pid}.json"
    _write_atomically(path, {"pid": pid, "cause": "oom", "evidence": evidence})
    return path


def record_failure(deaths: Path, pid: int, error: str) -> Path:
    """A rank's verdict: the step of the attempt that process ``pid`` (the lead rank) started raised ``error``."""
    path = deaths / f"{pid}.json"
    _write_atomically(path, {"pid": pid, "cause": "raised", "evidence": error})
    return path


def oom_evidence(pid: int, cgroup: str, kills_before: int) -> str:
    """The evidence that ``pid`` (dead by SIGKILL) was OOM-killed: the kernel's record of it, or its cgroup's
    ``oom_kill`` counter risen since ``kills_before``; '' without any. For whoever saw the death (a supervisor)."""
    kernel = kernel_oom_record(pid)
    if kernel:
        return f"kernel: {kernel}"
    now = oom_kills(cgroup) if cgroup else -1
    if kills_before >= 0 and now > kills_before:
        return f"the memory cgroup {cgroup} counted {now - kills_before} OOM kill(s) while pid {pid} ran"
    return ""


def memory_cgroup(pid: int) -> str | None:
    """The memory cgroup of ``pid`` as a path under :data:`CGROUP_ROOT` (v2 or v1), or None when unknown."""
    try:
        lines = Path(f"/proc/{pid}/cgroup").read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if "memory" in controllers.split(","):
            return f"memory{path}"
    v2 = [path for _, controllers, path in (line.split(":", 2) for line in lines) if controllers == ""]
    return v2[0] if v2 and (CGROUP_ROOT / v2[0].lstrip("/") / "memory.events").exists() else None


def oom_kills(cgroup: str) -> int:
    """The cgroup's ``oom_kill`` counter (v2 ``memory.events``, v1 ``memory.oom_control``); -1 when unreadable."""
    base = CGROUP_ROOT / cgroup.lstrip("/")
    for name in ("memory.events", "memory.oom_control"):
        try:
            fields = dict(line.split() for line in (base / name).read_text().splitlines() if line.strip())
        except (OSError, ValueError):
            continue
        if "oom_kill" in fields:
            return int(fields["oom_kill"])
    return -1


def kernel_oom_record(pid: int, kmsg: str = "/dev/kmsg") -> str:
    """The kernel log's line saying it killed ``pid`` out of memory, when the log is readable; else ''."""
    try:
        fd = os.open(kmsg, os.O_RDONLY | os.O_NONBLOCK)
    except OSError:
        return ""
    found = ""
    try:
        while True:
            try:
                record = os.read(fd, 8192).decode(errors="replace")
            except BlockingIOError:
                break
            except OSError:  # a record overwritten while reading (EPIPE): read on
                continue
            if not record:
                break
            text = record.split(";", 1)[-1].strip()
            if f"Killed process {pid} " in text or f",pid={pid}," in text:
                found = text
    finally:
        os.close(fd)
    return found


def _write_atomically(path: Path, value: object) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(path.name + ".partial")
    with partial.open("w") as f:
        json.dump(value, f, sort_keys=True)
        f.flush()
        os.fsync(f.fileno())
    partial.replace(path)
    directory = os.open(path.parent, os.O_RDONLY)
    try:  # the rename itself durable too (a SIGKILL alone would not need it; a power cut would)
        os.fsync(directory)
    finally:
        os.close(directory)


def unpublished(model_dir: Path, published: Iterable[str]) -> list[Path]:
    """The files and directories under ``model_dir`` (``<weight store>/<model>``) of training attempts whose name
    (``vNNNNNN-<attempt>``) is not in ``published`` nor the target of a ``vNNNNNN`` link: what killed or fenced
    attempts left. Links, versions written before attempts and anything else are never listed."""
    keep = set(published)
    try:  # whatever a vNNNNNN link points at was published, whatever the caller read
        keep |= {os.readlink(p) for p in model_dir.iterdir() if p.is_symlink()}
    except OSError:
        return []
    found = []
    for home in ATTEMPT_HOMES:
        try:
            entries = sorted((model_dir / home).iterdir())
        except OSError:  # not there yet
            continue
        for entry in entries:
            match = ATTEMPT_FILE.match(entry.name)
            if match and match.group(1) not in keep and not entry.is_symlink():
                found.append(entry)
    return found


def remove_unpublished(model_dir: Path, published: Iterable[str]) -> list[Path]:
    """Remove :func:`unpublished` files and directories; the ones removed (one that vanished meanwhile is skipped)."""
    removed = []
    for path in unpublished(model_dir, published):
        try:
            if path.is_dir():
                shutil.rmtree(path)
            else:
                path.unlink()
        except FileNotFoundError:
            continue
        removed.append(path)
    return removed
