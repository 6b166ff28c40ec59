"""Container images and a Docker engine for tests: skip (or, in CI, fail) when there is none; build images once.

``require_engine()`` / ``require_compose()``: a Docker engine (``docker info``) / Compose v2 (``docker compose
version``) must answer. Without one the test is skipped with the reason printed, unless ``CI`` is set to a true value
(``.ci/run`` installs and starts the engine, ``make docker`` does it by hand): then it fails, so CI never silently
skips a container test.

``ensure_images(*names)``: the images ``clawstream/<name>:latest`` (runtime, harnesses, trainer, kafka, haproxy)
exist and match the working tree. ``compose/build-images.sh`` runs once per test session for the names not built yet
in this session (Docker's layer cache makes a run with nothing changed take seconds; a changed source file rebuilds
only the source layer); a file lock keeps parallel test processes from building at the same time. A failed build
fails the test (it is a bug, not a missing engine). ``CLAWSTREAM_TEST_IMAGES=prebuilt`` uses the images as they are
(each must exist) instead of running the build script.
"""

from __future__ import annotations

import fcntl
import os
import subprocess
import tempfile
import time
from pathlib import Path
from typing import NoReturn

import pytest

ROOT = Path(__file__).resolve().parents[2]
BUILD_SCRIPT = ROOT / "compose" / "build-images.sh"
IMAGES = ("runtime", "harnesses", "trainer", "kafka", "haproxy")  # the script's dependency order
BUILD_TIMEOUT_S = 3 * 3600  # a first build downloads torch's CUDA wheels (several GB)

_built: set[str] = set()


def in_ci() -> bool:
    return os.environ.get("CI", "").strip().lower() in {"1", "true", "yes", "on"}


def unavailable(reason: str) -> NoReturn:
    """Skip with ``reason`` (printed, so it shows with -s and in the log), or fail when running in CI."""
    if in_ci():
        pytest.fail(f"CI is set, so this must not be skipped: {reason}")
    print(f"SKIP: {reason}")
    pytest.skip(reason)


def _answers(argv: list[str], timeout: float = 30.0) -> tuple[bool, str]:
    try:
        proc = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, check=False)
    except FileNotFoundError:
        return False, f"`{argv[0]}` is not installed"
    except subprocess.TimeoutExpired:
        return False, f"`{' '.join(argv)}` did not answer within {timeout:.0f} s"
    return proc.returncode == 0, (proc.stderr or proc.stdout).strip()[-400:]


def require_engine() -> None:
    ok, why = _answers(["docker", "info", "--format", "{{.ServerVersion}}"])
    if not ok:
        unavailable(f"no Docker engine answers (`docker info`: {why}); start one with `make docker`")


def require_compose() -> None:
    require_engine()
    ok, why = _answers(["docker", "compose", "version"])
    if not ok:
        unavailable(f"Docker Compose v2 is not available (`docker compose version`: {why}); `make docker` builds it")


def image_tag(name: str) -> str:
    return f"clawstream/{name}:latest"


def image_exists(name: str) -> bool:
    return _answers(["docker", "image", "inspect", image_tag(name)])[0]


def ensure_images(*names: str) -> dict[str, str]:
    """``{name: tag}`` of images built from the working tree (see the module docstring); needs an engine."""
    unknown = [n for n in names if n not in IMAGES]
    if unknown:
        raise ValueError(f"unknown image(s) {unknown}: one of {IMAGES}")
    require_engine()
    if os.environ.get("CLAWSTREAM_TEST_IMAGES") == "prebuilt":
        missing = [n for n in names if not image_exists(n)]
        if missing:
            pytest.fail(f"CLAWSTREAM_TEST_IMAGES=prebuilt but {[image_tag(n) for n in missing]} do not exist")
        return {n: image_tag(n) for n in names}
    todo = [n for n in IMAGES if n in names and n not in _built]
    if todo:
        lock_path = Path(tempfile.gettempdir()) / "clawstream-build-images.lock"
        with open(lock_path, "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            t0 = time.monotonic()
            try:
                proc = subprocess.run(
                    [str(BUILD_SCRIPT), *todo], capture_output=True, text=True, timeout=BUILD_TIMEOUT_S, check=False
                )
            except subprocess.TimeoutExpired:
                pytest.fail(f"{BUILD_SCRIPT.name} {' '.join(todo)} took longer than {BUILD_TIMEOUT_S} s")
        if proc.returncode != 0:
            pytest.fail(
                f"{BUILD_SCRIPT.name} {' '.join(todo)} failed (exit {proc.returncode}):\n"
                f"{(proc.stdout + proc.stderr)[-6000:]}"
            )
        summary = [line for line in proc.stdout.splitlines() if line.startswith("  clawstream/")]
        print(f"images built in {time.monotonic() - t0:.0f} s:\n" + "\n".join(summary))
        _built.update(todo)
    return {n: image_tag(n) for n in names}
