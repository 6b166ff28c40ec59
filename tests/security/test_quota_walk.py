"""The disk-quota walk (``producers.sandbox.base.tree_bytes``) runs as the worker, often root, over a tree the rollout
owns and can change while it is walked. A rollout that swaps a shut (mode 000) directory for a symlink between the
walk's look at it and its ``chmod`` must not make the worker change a host file; the walk measures honest trees as
before and stops at its bounds (a deep or huge tree is over the quota, not a stalled worker)."""

from __future__ import annotations

import ctypes
import os
import stat
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from producers.sandbox import base
from producers.sandbox.base import over_quota, tree_bytes

MIB = 1 << 20


def _layout(tmp_path: Path) -> tuple[Path, Path, Path]:
    """A sandbox root with a shut directory ``shut``, and a host file (0644) and host directory outside it."""
    box, host = tmp_path / "sandbox", tmp_path / "host"
    (box / "shut").mkdir(parents=True)
    (box / "shut" / "data.bin").write_bytes(b"z" * 4096)
    (box / "shut").chmod(0)
    host.mkdir()
    secret = host / "secret.txt"
    secret.write_text("host file\n")
    secret.chmod(0o644)
    host_dir = host / "closed"
    host_dir.mkdir()
    host_dir.chmod(0o500)
    return box, secret, host_dir


class _SwappingEntry:
    """A ``DirEntry`` that, right after the walk first looks at it, becomes a symlink to ``target`` on disk: what a
    rollout racing the walk with ``renameat2(RENAME_EXCHANGE)`` achieves, here every time."""

    def __init__(self, entry: Any, box: Path, target: Path, swapped: list[str]) -> None:
        self._entry, self._box, self._target, self._swapped = entry, box, target, swapped

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self._entry, name)
        if name not in ("stat", "is_dir", "is_file", "is_symlink", "inode"):
            return attr

        def look(*args: Any, **kwargs: Any) -> Any:
            result = attr(*args, **kwargs)
            if not self._swapped:
                (self._box / "shut").rename(self._box / "shut.was")
                (self._box / "shut").symlink_to(self._target)
                self._swapped.append("shut")
            return result

        return look


def _swap_after_first_look(monkeypatch: pytest.MonkeyPatch, box: Path, target: Path) -> list[str]:
    """Every ``os.scandir`` listing hands the walk the shut directory's entry as a :class:`_SwappingEntry`."""
    swapped: list[str] = []
    real_scandir = os.scandir

    class Listing:
        def __init__(self, where: Any) -> None:
            self._it = real_scandir(where)

        def __enter__(self) -> Listing:
            return self

        def __exit__(self, *exc: object) -> None:
            self._it.close()

        def close(self) -> None:
            self._it.close()

        def __iter__(self) -> Iterator[Any]:
            for entry in self._it:
                yield _SwappingEntry(entry, box, target, swapped) if entry.name == "shut" and not swapped else entry

    monkeypatch.setattr(os, "scandir", Listing)
    return swapped


@pytest.mark.parametrize("kind", ["file", "directory"])
def test_a_shut_directory_swapped_for_a_symlink_mid_walk_never_changes_the_host(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, kind: str
) -> None:
    box, secret, host_dir = _layout(tmp_path)
    target = secret if kind == "file" else host_dir
    before = {p: stat.S_IMODE(p.lstat().st_mode) for p in (secret, host_dir)}
    swapped = _swap_after_first_look(monkeypatch, box, target)
    try:
        tree_bytes(box)
    finally:
        monkeypatch.undo()
    assert swapped, "the walk never looked at the shut directory: the attack did not run"
    after = {p: stat.S_IMODE(p.lstat().st_mode) for p in (secret, host_dir)}
    assert after == before, f"the quota walk changed host modes: {before} -> {after}"


def _exchange() -> Any:
    libc = ctypes.CDLL(None, use_errno=True)
    fn = getattr(libc, "renameat2", None)
    if fn is None:
        pytest.skip("no renameat2 in this libc")
    return fn


def test_a_rollout_racing_the_walk_with_rename_exchange_never_changes_the_host(tmp_path: Path) -> None:
    """The real race, bounded: an attacker thread swaps the shut directory and a symlink to the host file
    (``RENAME_EXCHANGE``) as fast as it can while the walk runs again and again."""
    box, secret, _ = _layout(tmp_path)
    (box / "link").symlink_to(secret)
    renameat2, at_fdcwd, exchange = _exchange(), -100, 2
    a, b = bytes(box / "shut"), bytes(box / "link")
    stop, swaps = threading.Event(), [0]

    def attack() -> None:
        while not stop.is_set():
            if renameat2(at_fdcwd, a, at_fdcwd, b, exchange) == 0:
                swaps[0] += 1

    thread = threading.Thread(target=attack, daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 2.0
        walks = 0
        while time.monotonic() < deadline and walks < 3000:
            tree_bytes(box)
            walks += 1
            assert stat.S_IMODE(secret.lstat().st_mode) == 0o644, f"host file chmod'ed on walk {walks}"
            for p in (box / "shut", box / "link"):  # the directory shut again, wherever it is now (by fd: racing)
                try:
                    fd = os.open(p, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
                except OSError:
                    continue
                os.fchmod(fd, 0)
                os.close(fd)
    finally:
        stop.set()
        thread.join()
    assert swaps[0] > 0
    assert stat.S_IMODE(secret.lstat().st_mode) == 0o644


def _reference(root: Path) -> int:
    """The measure, path-based and unbounded (fine on a tree nobody changes): each inode once, links not followed."""
    total, seen = 0, set()
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            st = os.lstat(os.path.join(dirpath, name))
            if (st.st_dev, st.st_ino) in seen:
                continue
            seen.add((st.st_dev, st.st_ino))
            blocks = st.st_blocks * 512
            total += max(st.st_size, blocks) if stat.S_ISREG(st.st_mode) else blocks
    return total


def test_an_honest_tree_measures_as_before(tmp_path: Path) -> None:
    root = tmp_path / "box"
    for i in range(4):
        d = root / f"pkg{i}" / "node_modules" / f"dep{i}" / "lib"
        d.mkdir(parents=True)
        for j in range(5):
            (d / f"f{j}.js").write_bytes(b"x" * (1000 * j + 17))
    (root / "big.bin").write_bytes(b"y" * MIB)
    os.link(root / "big.bin", root / "pkg0" / "hard.bin")
    with open(root / "sparse.bin", "wb") as f:
        f.truncate(3 * MIB)
    (root / "up").symlink_to("/usr")
    (root / "loop").symlink_to(root)
    shut = root / "pkg1" / "shut"
    shut.mkdir()
    (shut / "x.bin").write_bytes(b"s" * 8192)
    expected = _reference(root)  # before shutting: the reference walks by path
    shut.chmod(0)
    try:
        assert tree_bytes(root) == expected
        assert stat.S_IMODE(shut.lstat().st_mode) & 0o700 == 0o700  # opened again for the next measurement
        assert 4 * MIB <= expected < 5 * MIB
    finally:
        shut.chmod(0o700)


def test_a_tree_past_the_walks_bounds_is_over_any_quota_not_a_stalled_worker(tmp_path: Path) -> None:
    deep = tmp_path / "deep"
    fd = os.open(tmp_path, os.O_RDONLY | os.O_DIRECTORY)
    try:  # deeper than PATH_MAX allows by path: built fd-relative, as a rollout could
        os.mkdir("deep", dir_fd=fd)
        cur = os.open("deep", os.O_RDONLY | os.O_DIRECTORY, dir_fd=fd)
        for _ in range(base.WALK_MAX_DEPTH + 10):
            os.mkdir("d" * 60, dir_fd=cur)
            nxt = os.open("d" * 60, os.O_RDONLY | os.O_DIRECTORY, dir_fd=cur)
            os.close(cur)
            cur = nxt
        os.close(cur)
    finally:
        os.close(fd)
    start = time.monotonic()
    used = tree_bytes(deep)
    assert used == base.UNMEASURED and time.monotonic() - start < 5
    why = over_quota(used, 1 << 30)
    assert why is not None and "too many" in why and "max_workspace_bytes" in why
    wide = tmp_path / "wide"
    wide.mkdir()
    for i in range(300):
        (wide / str(i)).touch()
    assert tree_bytes(wide, max_entries=1000) < (1 << 30)
    assert tree_bytes(wide, max_entries=200) == base.UNMEASURED
    assert over_quota(tree_bytes(wide, max_entries=200), 0) is None  # no quota: nothing to exceed
