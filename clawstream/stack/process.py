"""Supervised child processes: start a service, wait until it is ready, notice when it dies, stop them all.

Each service is the same ``python -m …`` entry point an operator would run by hand, started in its own process
group with its output in ``<log_dir>/<name>.log``; readiness is a line it prints (a regex) or an HTTP endpoint
answering. ``Stack.stop`` sends SIGTERM to every group in reverse start order, then SIGKILL after a grace period.
``Stack.check`` is the supervisor: a service that exits with ``RESTART_EXIT`` (a streams worker evicted from its group:
``streams.eos.close_dirty``), or one marked ``restart`` that dies (a broker outage it did not ride out), is started
again, up to ``MAX_RESTARTS`` times; any other death stops the run. The supervisor is who sees a death: for a service
with a ``deaths`` folder (the learner's), a SIGKILL with evidence of an out-of-memory kill (the kernel's record of the
pid, or the cgroup's ``oom_kill`` counter risen since the start) is recorded there for the service's next start
(``learner.attempts``); a SIGKILL alone is no evidence. Pure process plumbing: no Kafka.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from clawbase.errors import ClawstreamError
from learner.attempts import memory_cgroup, oom_evidence, oom_kills, record_oom

ROOT = Path(__file__).resolve().parent.parent.parent  # the repository root: `python -m` runs from there
RESTART_EXIT = 75  # EX_TEMPFAIL: "restart me" (streams.eos.EVICTED_EXIT; a unit test keeps them equal)
MAX_RESTARTS = 5


class StackError(ClawstreamError):
    """A service did not start, or died."""


@dataclass
class Service:
    name: str
    args: list[str]  # after `python -m`
    env: dict[str, str] = field(default_factory=dict)
    ready_line: str | None = None  # regex on an output line; group 1 (if any) is captured as `found`
    ready_url: str | None = None  # GET answering < 500
    may_finish: bool = False  # a job (not a server): exiting 0 is success, not a death
    restart: bool = False  # started again when it dies (every service resumes from the log), as compose's on-failure
    deaths: Path | None = None  # where an out-of-memory death is recorded, with its evidence (learner.attempts)
    proc: subprocess.Popen[bytes] | None = None
    log: Path | None = None
    found: str | None = None
    restarts: int = 0
    cgroup: str = ""  # the process's memory cgroup and its oom_kill counter at the start (-1: unreadable)
    oom_kills: int = -1


class Stack:
    def __init__(self, log_dir: Path, env: dict[str, str] | None = None) -> None:
        self.log_dir = log_dir
        self.env = {
            **os.environ,
            "PYTHONUNBUFFERED": "1",
            "HF_HUB_OFFLINE": "1",
            "TOKENIZERS_PARALLELISM": "false",
            **(env or {}),
        }
        self.services: list[Service] = []
        log_dir.mkdir(parents=True, exist_ok=True)

    def start(self, service: Service, *, timeout: float = 120.0) -> Service:
        service.log = self.log_dir / f"{service.name}.log"
        # Appended, not truncated: a resumed run (`clawstream demo --resume`) starts its services again in the same
        # log directory, and what they logged before the resume is the evidence of why it stopped.
        since = service.log.stat().st_size if service.log.exists() else 0
        self._spawn(service, "ab")
        self.services.append(service)
        self._wait_ready(service, timeout, since=since)
        return service

    def _spawn(self, service: Service, mode: str) -> None:
        assert service.log is not None
        handle = open(service.log, mode)  # noqa: SIM115 - owned by the child from here on
        try:
            service.proc = subprocess.Popen(
                [sys.executable, "-m", *service.args],
                cwd=ROOT,
                env={**self.env, **service.env},
                stdout=handle,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
            )
        finally:
            handle.close()
        service.cgroup = memory_cgroup(service.proc.pid) or ""
        service.oom_kills = oom_kills(service.cgroup) if service.cgroup else -1

    def restart(self, service: Service, *, timeout: float = 120.0, env: dict[str, str] | None = None) -> Service:
        """Start ``service`` again (after it died or was killed), its log appended; ``env`` replaces its own extra
        environment (e.g. without the fault a test injected). Ready as at the first start; the same arguments, so a
        server comes back on the port it had (start servers on fixed ports when they may be restarted)."""
        if service.proc is not None and service.proc.poll() is None:
            raise StackError(f"{service.name} (pid {service.proc.pid}) is still running: stop it before a restart")
        if env is not None:
            service.env = env
        assert service.log is not None
        since = service.log.stat().st_size if service.log.exists() else 0
        service.restarts += 1
        self._spawn(service, "ab")
        self._wait_ready(service, timeout, since=since)
        return service

    def kill(self, service: Service) -> int:
        """SIGKILL the service's whole process group (a kill -9 of its container, harness children included); returns
        the main process's exit status."""
        assert service.proc is not None
        with contextlib.suppress(ProcessLookupError):
            os.killpg(service.proc.pid, signal.SIGKILL)
        return service.proc.wait(30)

    def _wait_ready(self, service: Service, timeout: float, *, since: int = 0) -> None:
        assert service.proc is not None and service.log is not None
        pattern = re.compile(service.ready_line) if service.ready_line else None
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if service.proc.poll() is not None and not (service.may_finish and service.proc.returncode == 0):
                raise StackError(
                    f"{service.name} exited with {service.proc.returncode} during start-up:\n{self.tail(service)}"
                )
            if pattern is not None:
                with open(service.log, "rb") as handle:  # only what this start wrote: a restart appends
                    handle.seek(since)
                    text = handle.read().decode(errors="replace")
                match = pattern.search(text)
                if match:
                    service.found = match.group(1) if match.groups() else match.group(0)
                    return
            elif service.ready_url is not None:
                with contextlib.suppress(OSError):
                    with urllib.request.urlopen(service.ready_url, timeout=2) as resp:  # noqa: S310 - loopback
                        if resp.status < 500:
                            return
            else:
                return
            time.sleep(0.3)
        raise StackError(f"{service.name} was not ready within {timeout:.0f}s:\n{self.tail(service)}")

    def check(self) -> None:
        """Restart a service that asked for it (``RESTART_EXIT``) or is marked ``restart``; raise if any other died."""
        for service in self.services:
            code = service.proc.poll() if service.proc is not None else None
            if code is None or (service.may_finish and code == 0):
                continue
            self._judge_death(service, code)
            if (code == RESTART_EXIT or service.restart) and service.restarts < MAX_RESTARTS:
                service.restarts += 1
                why = "restart me" if code == RESTART_EXIT else "died"
                print(
                    f"{service.name} exited with {code} ({why}): restart {service.restarts} of {MAX_RESTARTS}; its "
                    f"log ended:\n{self.tail(service, 8)}",
                    file=sys.stderr,
                )
                self._spawn(service, "ab")
            else:
                raise StackError(f"{service.name} died with {code}:\n{self.tail(service)}")

    def _judge_death(self, service: Service, code: int) -> None:
        """Record an out-of-memory death of a service that keeps a ``deaths`` folder, on evidence only."""
        if service.deaths is None or service.proc is None or code != -signal.SIGKILL:
            return
        evidence = oom_evidence(service.proc.pid, service.cgroup, service.oom_kills)
        if evidence:
            path = record_oom(service.deaths, service.proc.pid, evidence)
            print(f"{service.name} (pid {service.proc.pid}) died out of memory: {evidence} ({path})", file=sys.stderr)

    def tail(self, service: Service, lines: int = 25) -> str:
        if service.log is None or not service.log.exists():
            return ""
        return "\n".join(service.log.read_text(errors="replace").splitlines()[-lines:])

    def stop(self, *, grace: float = 20.0) -> None:
        for service in reversed(self.services):
            if service.proc is not None and service.proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(service.proc.pid, signal.SIGTERM)
        deadline = time.monotonic() + grace
        for service in reversed(self.services):
            if service.proc is None:
                continue
            try:
                service.proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(service.proc.pid, signal.SIGKILL)
                service.proc.wait(10)
