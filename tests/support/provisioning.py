"""What ``.ci/run`` provisions behind the first tests: tests that need it run last and wait for it.

On a fresh machine the Docker Engine's images (and Compose v2, built from source) and real vLLM on CPU take
~30 minutes to provision, and most tests need neither. ``.ci/run`` starts them in the background and sets
``CLAWSTREAM_PROVISIONING_DIR``; each job writes ``<dir>/<name>.log`` and, when it ends, ``<dir>/<name>.rc`` (its
exit status). Tests marked ``@pytest.mark.provisioned("docker")`` (``"compose"``, ``"vllm"``) are then moved to the
end of the session, and before the first of them runs the session waits for its job, outside the test's own
timeout. A job that failed fails its tests with the tail of its log. Without the variable (a developer's run,
`make test` on a machine already set up) nothing moves and nothing waits.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

ENV = "CLAWSTREAM_PROVISIONING_DIR"
# engine + images; Compose v2; vLLM on CPU; the schema registry + Go modules
JOBS = ("docker", "compose", "vllm", "registry")
WAIT_LIMIT_S = 80 * 60  # a fresh machine's slowest job (~30 min) with room; CI's own limit is 90 min
PROGRESS_S = 60.0

_done: dict[str, str | None] = {}  # job → None (ready) or why it is not


def directory() -> Path | None:
    value = os.environ.get(ENV, "").strip()
    return Path(value) if value else None


def needs(item: pytest.Item) -> list[str]:
    """The background jobs ``item`` needs (its ``provisioned`` markers), checked against :data:`JOBS`."""
    names = [name for mark in item.iter_markers("provisioned") for name in mark.args]
    unknown = sorted(set(names) - set(JOBS))
    if unknown:
        raise pytest.UsageError(f"{item.nodeid}: provisioned{tuple(unknown)} is not one of {JOBS}")
    return names


def reorder(items: list[pytest.Item]) -> None:
    """With background provisioning, the tests that need it go last (stable: each group keeps its order)."""
    if directory() is None:
        return
    items[:] = [i for i in items if not needs(i)] + [i for i in items if needs(i)]


def _wait(job: str, where: Path) -> str | None:
    rc_file, log = where / f"{job}.rc", where / f"{job}.log"
    t0 = next_say = time.monotonic()
    while not rc_file.exists():
        now = time.monotonic()
        if now - t0 > WAIT_LIMIT_S:
            return f"the background job `{job}` did not end within {WAIT_LIMIT_S // 60} min (log {log})"
        if now >= next_say:
            tail = log.read_text(errors="replace").strip().splitlines()[-1:] if log.exists() else []
            print(f"\n[provisioning] waiting for `{job}` ({now - t0:.0f} s): {tail[0] if tail else '...'}", flush=True)
            next_say = now + PROGRESS_S
        time.sleep(2.0)
    rc = rc_file.read_text().strip()
    if rc != "0":
        text = log.read_text(errors="replace") if log.exists() else "(no log)"
        return f"the background job `{job}` failed (exit {rc}); the end of {log}:\n{text[-4000:]}"
    print(f"\n[provisioning] `{job}` ready after waiting {time.monotonic() - t0:.0f} s", flush=True)
    return None


def wait_for(item: pytest.Item) -> str | None:
    """Block until every job ``item`` needs has ended; why one is not usable, or None. Called once per job."""
    where = directory()
    if where is None:
        return None
    for job in needs(item):
        if job not in _done:
            _done[job] = _wait(job, where)
        if _done[job] is not None:
            return _done[job]
    return None
