"""The grader of a docker sandbox in a container of its own, out of the rollout's reach.

The rollout's container ran the harness as the image's user, able to rewrite anything in its writable layer (the
``bash`` or ``python3`` first on a grader's PATH included), so the grader never runs there. Once the rollout's
processes are all dead (``DockerSandbox.end_leftovers``) and its directories copied out, a fresh container of the
same image — no network, no capabilities, as :data:`GRADER_UID` — gets the host copy (:func:`grader_archive`: the
workspace as the rollout left it plus the grader's files, HOME, and the grader directory, mode 0700, every entry
the grader's), runs the grader under ``timeout``, and only its grader directory is copied back (the capture files
``run_grader`` reads). The container is removed after, whatever happened; it carries the sandbox's labels, so
``destroy`` and the sweep see one left behind.
"""

from __future__ import annotations

import asyncio
import contextlib
import io
import tarfile
import time
from collections.abc import Mapping
from pathlib import Path, PurePosixPath
from typing import Any

from producers.sandbox.archive import unpack_into
from producers.sandbox.base import MARKER, RunResult, SandboxError

GRADER_UID = 10001  # never the rollout's: the image's user (root) runs the harness


def grader_archive(dirs: Mapping[str, Path], uid: int, private: str) -> bytes:
    """One tar of the host copies for ``put_archive`` at ``/``: every entry owned by ``uid``, ``private`` (the
    grader directory) mode 0700, and the mount paths' ancestors traversable (mode 0755)."""

    def own(info: tarfile.TarInfo) -> tarfile.TarInfo:
        info.uid = info.gid = uid
        info.uname = info.gname = ""
        if info.name == private.lstrip("/"):
            info.mode = 0o700
        return info

    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        for inside, host in dirs.items():
            parts = PurePosixPath(inside.lstrip("/")).parts
            for i in range(1, len(parts)):
                parent = tarfile.TarInfo("/".join(parts[:i]))
                parent.type, parent.mode = tarfile.DIRTYPE, 0o755
                tar.addfile(parent)
            tar.add(host, arcname=inside.lstrip("/"), recursive=True, filter=own)
    return buf.getvalue()


def grader_spec(rollout_spec: dict[str, Any], name: str, labels: Mapping[str, str]) -> dict[str, Any]:
    """The grader container's ``containers.run`` kwargs from the rollout's: no network, the grader's uid."""
    spec = {k: v for k, v in rollout_spec.items() if k != "network"}
    return {**spec, "name": name, "labels": dict(labels), "network_mode": "none", "user": f"{GRADER_UID}:{GRADER_UID}"}


async def run_in_grader_container(
    box: Any, spec: dict[str, Any], argv: list[str], env: Mapping[str, str], cwd: str, timeout_s: float
) -> RunResult:
    """Run ``argv`` (already wrapped in ``timeout``) in a fresh grader container for ``box``; its grader directory
    copied back to the host; the container removed."""
    client, container = box.client, None
    grader_dir = box.grader_dir

    def start() -> Any:
        made = client.containers.run(**spec)
        if not made.put_archive("/", grader_archive(box._mounts, GRADER_UID, grader_dir)):
            raise SandboxError(f"copying files into the grader container of {box.sandbox_id} failed")
        return made

    def work(made: Any) -> tuple[int | None, bytes, bytes]:
        api = client.api
        full_env = {MARKER: box.sandbox_id, **env}
        exec_id = api.exec_create(made.id, argv, environment=full_env, workdir=cwd, stdin=False)["Id"]
        out, err = api.exec_start(exec_id, demux=True)
        return api.exec_inspect(exec_id).get("ExitCode"), out or b"", err or b""

    def pull(made: Any) -> None:
        stream, _stat = made.get_archive(grader_dir)
        unpack_into(b"".join(stream), PurePosixPath(grader_dir).name, box.host_path(grader_dir))

    t0 = time.monotonic()
    try:
        container = await asyncio.to_thread(start)
        try:
            code, out, err = await asyncio.wait_for(asyncio.to_thread(work, container), timeout_s + 30)
        except TimeoutError:
            return RunResult(None, True, time.monotonic() - t0, killed=["SIGKILL"])
        duration = time.monotonic() - t0
        await asyncio.to_thread(pull, container)
    except SandboxError:
        raise
    except Exception as exc:  # docker.errors.APIError and friends: the docker package is optional
        raise SandboxError(f"the grader container of {box.sandbox_id} failed: {exc}") from exc
    finally:
        if container is not None:  # one left behind (the engine refused) is reported by destroy: it has the labels
            with contextlib.suppress(Exception):
                await asyncio.to_thread(container.remove, force=True)
    timed_out = code in (124, 137) and duration >= timeout_s
    stdout, stderr = out.decode(errors="replace")[-16000:], err.decode(errors="replace")[-16000:]
    return RunResult(None if timed_out else code, timed_out, duration, stdout, stderr, ["SIGTERM"] if timed_out else [])
