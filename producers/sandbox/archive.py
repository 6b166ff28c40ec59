"""Copying a sandbox's directories in and out of a container as tar streams (pure: no Docker client).

:func:`pack` makes the tar ``put_archive`` puts at ``/``; :func:`unpack_into` replaces a host copy with a
``get_archive`` tar through the PEP 706 ``data`` filter (no absolute paths, links out of the tree or device files
from a hostile harness); :func:`fingerprint` tells whether a host copy changed since the last copy.
"""

from __future__ import annotations

import io
import shutil
import tarfile
import tempfile
from collections.abc import Mapping
from pathlib import Path

if not hasattr(tarfile, "data_filter"):  # Python < 3.11.4 (Debian bookworm's 3.11.2): PEP 706's filters backported
    try:
        from backports import tarfile  # type: ignore[no-redef]
    except ImportError as _exc:
        raise ImportError(
            "this Python's tarfile has no extraction filters; pip install 'backports.tarfile>=1.2' "
            "(the `docker` extra of clawstream)"
        ) from _exc


def fingerprint(dirs: Mapping[str, Path]) -> tuple:
    """What the host copy holds (paths, sizes, mtimes, modes): unchanged fingerprint → no push needed."""
    seen = []
    for inside, host in sorted(dirs.items()):
        for path in sorted(host.rglob("*")):
            st = path.lstat()
            seen.append((inside, str(path.relative_to(host)), st.st_size, st.st_mtime_ns, st.st_mode))
    return tuple(seen)


def pack(dirs: Mapping[str, Path]) -> bytes:
    """One tar of the host copies, named by their paths inside the container relative to ``/`` (put at ``/``)."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        for inside, host in dirs.items():
            tar.add(host, arcname=inside.lstrip("/"), recursive=True)
    return buf.getvalue()


def unpack_into(stream: bytes, name: str, dest: Path) -> list[str]:
    """Replace ``dest``'s content with a ``get_archive`` tar of a directory called ``name``; the members skipped."""
    staging = Path(tempfile.mkdtemp(prefix=".pull-", dir=dest.parent))
    skipped: list[str] = []
    try:
        with tarfile.open(fileobj=io.BytesIO(stream)) as tar:
            for member in tar:
                try:
                    tar.extract(member, staging, filter="data")
                except (tarfile.FilterError, OSError) as exc:
                    skipped.append(f"{member.name}: {exc}")
        shutil.rmtree(dest, ignore_errors=True)
        (staging / name).rename(dest) if (staging / name).is_dir() else dest.mkdir()
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return skipped
