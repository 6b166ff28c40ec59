"""The workspace disk quota's pure parts: its setting (validated, the error naming the field), the file size limit
it caps, how a sandbox directory is measured (sparse files, hard links, unlistable directories) and the reason."""

from __future__ import annotations

import os
from pathlib import Path

import pydantic
import pytest

from producers.sandbox.base import file_size_limit, over_quota, tree_bytes
from producers.sandbox.docker_backend import container_spec
from producers.sandbox.settings import SandboxSettings
from producers.tasks.cpu import cpu_suite

MIB = 1 << 20


def test_the_quota_defaults_to_1_gib_and_a_bad_one_is_refused_naming_the_field() -> None:
    assert SandboxSettings().max_workspace_bytes == 1 << 30
    assert SandboxSettings(max_workspace_bytes=0).max_workspace_bytes == 0  # no quota
    for bad in (-1, 1, MIB - 1):
        with pytest.raises(pydantic.ValidationError, match="max_workspace_bytes"):
            SandboxSettings(max_workspace_bytes=bad)
    with pytest.raises(pydantic.ValidationError, match="disk_check_interval_s"):
        SandboxSettings(disk_check_interval_s=0)
    with pytest.raises(pydantic.ValidationError):  # frozen
        SandboxSettings().max_workspace_bytes = 5  # type: ignore[misc]


def test_the_file_size_limit_never_exceeds_the_quota() -> None:
    assert file_size_limit(SandboxSettings()) == 1024 * MIB
    assert file_size_limit(SandboxSettings(max_workspace_bytes=8 * MIB)) == 8 * MIB
    assert file_size_limit(SandboxSettings(max_workspace_bytes=0, limit_file_size_mb=3)) == 3 * MIB
    assert file_size_limit(SandboxSettings(max_workspace_bytes=0, limit_file_size_mb=0)) == 0
    task = cpu_suite().split("train")[0]
    spec = container_spec(SandboxSettings(max_workspace_bytes=8 * MIB), "sbx", task, "w")
    assert {"Name": "fsize", "Soft": 8 * MIB, "Hard": 8 * MIB} in spec["ulimits"]


def test_over_quota_names_the_quota_and_what_the_sandbox_holds() -> None:
    assert over_quota(8 * MIB, 8 * MIB) is None and over_quota(10**12, 0) is None
    why = over_quota(8 * MIB + 1, 8 * MIB)
    assert (
        why == f"rollout quota exceeded: max_workspace_bytes {8 * MIB} (its sandbox holds {8 * MIB + 1} bytes on disk)"
    )


def test_tree_bytes_counts_sparse_files_whole_links_once_and_unlistable_dirs(tmp_path: Path) -> None:
    (tmp_path / "a.bin").write_bytes(b"x" * 3 * MIB)
    os.link(tmp_path / "a.bin", tmp_path / "same.bin")  # one inode: counted once
    with open(tmp_path / "sparse.bin", "wb") as f:  # 5 MiB of size, hardly any blocks: a copy writes it whole
        f.truncate(5 * MIB)
    (tmp_path / "link").symlink_to("/usr")  # not followed
    hidden = tmp_path / "d" / "hidden"
    hidden.mkdir(parents=True)
    (hidden / "b.bin").write_bytes(b"y" * 2 * MIB)
    hidden.chmod(0o300)  # writable and searchable, not listable: its bytes still count
    try:
        total = tree_bytes(tmp_path)
        assert 10 * MIB <= total < 10 * MIB + 64 * 1024, total
        hidden.chmod(0)
        assert tree_bytes(tmp_path) == total
    finally:
        hidden.chmod(0o700)


HIDING = """
import os, sys
from pathlib import Path
from producers.sandbox.base import tree_bytes
root = Path(sys.argv[1])
hidden = root / "hidden"
hidden.mkdir(mode=0o300)  # writable and searchable by its owner, not listable
(hidden / "b.bin").write_bytes(b"y" * (2 << 20))
print(tree_bytes(root))
"""


def test_a_directory_its_owner_made_unlistable_still_counts_for_a_non_root_worker(tmp_path: Path) -> None:
    """Root reads any directory: the hiding only works against a worker that is not root, so as root the check runs
    as ``nobody`` (setpriv)."""
    import shutil
    import subprocess
    import sys
    import tempfile

    root = Path(tempfile.mkdtemp(prefix="cs-hide-"))
    try:
        argv = [sys.executable, "-c", HIDING, str(root)]
        if os.geteuid() == 0:
            if shutil.which("setpriv") is None:
                pytest.skip("root without setpriv: cannot run as a user that an unlistable directory stops")
            os.chown(root, 65534, 65534)
            argv = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", "--", *argv]
        repo = Path(__file__).resolve().parents[2]
        if os.geteuid() == 0 and any(d.stat().st_mode & 0o005 != 0o005 for d in (repo, *repo.parents)):
            pytest.skip(
                f"nobody cannot read the checkout ({repo} lies under a directory closed to others, e.g. mktemp -d)"
            )
        done = subprocess.run(argv, capture_output=True, text=True, cwd=repo, timeout=60, env={"PYTHONPATH": str(repo)})
        assert done.returncode == 0, done.stderr
        assert int(done.stdout) >= 2 << 20, done.stdout
    finally:
        subprocess.run(["chmod", "-R", "u+rwX", str(root)], check=False)
        shutil.rmtree(root, ignore_errors=True)
