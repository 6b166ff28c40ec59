"""Weight versions over HTTP: an engine on another host fetches a version's file by its ``http(s)://`` URI.

No shared filesystem is needed between the learner and the engines: the learner (or any HTTP server of the weight
store, e.g. nginx over the directory: docs/scaling.md) serves ``<model>/v<version:06d>/model.safetensors`` and
publishes that URL. :func:`fetch` streams it into a local cache (``<cache>/<model>/v<version>/model.safetensors``,
the store's own layout, so vLLM can reload the directory), hashing while it writes, and renames it into place only
when the size and sha256 match the event: a reader never sees a partial or wrong file. A file already cached with
the right size and hash is used as is. Only the ``keep`` newest versions of a model stay cached. Failures are
:class:`~policy.weight_store.WeightsRejected` (``fetch_failed``, ``size_mismatch``, ``checksum_mismatch``), so the
follower dead-letters them and keeps serving the old weights. Stdlib HTTP (urllib): the follower's own thread blocks.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path

from clawbase.settings import clawstream_home
from policy.weight_store import WeightsRejected, sha256_file, verify_file
from schemas.events import WeightVersion

CHUNK = 1 << 20
TIMEOUT_S = 60.0  # per socket operation, not the whole download: a 60 GB file takes minutes


def verified_file(event: WeightVersion, cache: Path | None = None) -> Path:
    """The checked local file of ``event``: fetched into ``cache`` (default ``$CLAWSTREAM_HOME/weights-cache``) when
    its URI is http(s), else the ``file://`` path itself after :func:`~policy.weight_store.verify_file`."""
    if not is_remote(event.uri):
        return verify_file(event)
    return fetch(event, cache if cache is not None else clawstream_home() / "weights-cache")


def is_remote(uri: str) -> bool:
    return urllib.parse.urlparse(uri).scheme in ("http", "https")


def cache_path(cache: Path, event: WeightVersion) -> Path:
    return cache / event.model_name / f"v{event.policy_version:06d}" / "model.safetensors"


def fetch(event: WeightVersion, cache: Path, *, keep: int = 2) -> Path:
    """The version's file in ``cache``, downloaded from ``event.uri`` unless a verified copy is there already."""
    path = cache_path(cache, event)
    if path.is_file() and _matches(path, event):
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".part{os.getpid()}")
    digest, size = hashlib.sha256(), 0
    try:
        with urllib.request.urlopen(event.uri, timeout=TIMEOUT_S) as response, open(tmp, "wb") as out:
            while block := response.read(CHUNK):
                digest.update(block)
                size += len(block)
                out.write(block)
    except (urllib.error.URLError, OSError, ValueError) as exc:
        tmp.unlink(missing_ok=True)
        raise WeightsRejected("fetch_failed", f"could not fetch weights from {event.uri}: {exc}") from exc
    if event.size_bytes and size != event.size_bytes:
        tmp.unlink(missing_ok=True)
        raise WeightsRejected("size_mismatch", f"{event.uri} sent {size} bytes, the event says {event.size_bytes}")
    if digest.hexdigest() != event.sha256.lower():
        tmp.unlink(missing_ok=True)
        raise WeightsRejected(
            "checksum_mismatch", f"sha256 of {event.uri} is {digest.hexdigest()}, the event says {event.sha256}"
        )
    os.replace(tmp, path)
    _prune(path.parent.parent, keep)
    return path


def _matches(path: Path, event: WeightVersion) -> bool:
    if event.size_bytes and path.stat().st_size != event.size_bytes:
        return False
    return sha256_file(path) == event.sha256.lower()


def _prune(model_dir: Path, keep: int) -> None:
    """Drop all but the ``keep`` newest version directories (names sort by version: zero-padded)."""
    versions = sorted(p for p in model_dir.iterdir() if p.is_dir() and p.name.startswith("v"))
    for old in versions[:-keep] if keep > 0 else []:
        shutil.rmtree(old, ignore_errors=True)
