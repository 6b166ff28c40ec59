"""Weight store: save a policy version as one safetensors file with its sha256, load and verify it back.

Weights never travel through Kafka; ``clawstream.weights`` carries only the file's URI and sha256. Pure (torch +
safetensors, no Kafka). The layout is ``<store>/<model_name>/v<version:06d>/model.safetensors`` — one directory per
version, because vLLM's reload loads every ``*.safetensors`` of a directory (consumers/vllm_adapter.py); writes are
atomic (temp file + rename) so a reader never sees half a file, and re-saving a version (after a learner crash
before the version was published) overwrites the unpublished file.
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import unquote, urlparse

import torch
from safetensors.torch import load_file, save_file

from clawstream.errors import ClawstreamError


class WeightStoreError(ClawstreamError):
    """A weight file is missing, unreadable, fails its checksum or does not fit the model."""


@dataclass(frozen=True)
class SavedWeights:
    path: Path
    sha256: str
    size_bytes: int

    @property
    def uri(self) -> str:
        return self.path.resolve().as_uri()


def sha256_file(path: Path, chunk: int = 1 << 20) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while block := handle.read(chunk):
            digest.update(block)
    return digest.hexdigest()


def version_path(store: Path, model_name: str, version: int) -> Path:
    return store / model_name / f"v{version:06d}" / "model.safetensors"


def value_head_path(store: Path, model_name: str, version: int) -> Path:
    """PPO's value head of a version: outside the version directory, so vLLM never tries to load it."""
    return store / model_name / "value-heads" / f"v{version:06d}.safetensors"


def save_weights(model: torch.nn.Module, store: Path, model_name: str, version: int) -> SavedWeights:
    """Write the model's state dict (tied weights once) atomically and return path + sha256."""
    path = version_path(store, model_name, version)
    path.parent.mkdir(parents=True, exist_ok=True)
    state: dict[str, torch.Tensor] = {}
    seen: set[int] = set()
    for name, tensor in model.state_dict().items():
        # Tied embeddings share storage; safetensors refuses shared tensors, and the loader re-ties them.
        key = tensor.untyped_storage().data_ptr()
        if key in seen:
            continue
        seen.add(key)
        state[name] = tensor.detach().to("cpu").contiguous()
    tmp = path.with_suffix(f".tmp{os.getpid()}")
    save_file(state, str(tmp), metadata={"model_name": model_name, "version": str(version)})
    os.replace(tmp, path)
    return SavedWeights(path=path, sha256=sha256_file(path), size_bytes=path.stat().st_size)


def path_from_uri(uri: str) -> Path:
    parsed = urlparse(uri)
    if parsed.scheme not in ("file", ""):
        raise WeightStoreError(f"unsupported weight URI scheme {parsed.scheme!r} in {uri} (only file:// for now)")
    return Path(unquote(parsed.path))


def load_verified(uri: str, sha256: str) -> dict[str, torch.Tensor]:
    """Read a weight file after checking its sha256; typed errors for missing files and checksum mismatches."""
    path = path_from_uri(uri)
    if not path.exists():
        raise WeightStoreError(f"weight file {path} does not exist")
    actual = sha256_file(path)
    if actual != sha256:
        raise WeightStoreError(f"sha256 mismatch for {path}: expected {sha256}, file has {actual}")
    try:
        return load_file(str(path))
    except Exception as exc:  # safetensors raises SafetensorError / OSError on corrupt headers
        raise WeightStoreError(f"cannot read {path}: {exc}") from exc


def apply_state(model: torch.nn.Module, state: dict[str, torch.Tensor]) -> None:
    """Load ``state`` into ``model`` strictly: every tensor must exist with the same shape (tied ones may be absent)."""
    own = model.state_dict()
    unknown = sorted(set(state) - set(own))
    if unknown:
        raise WeightStoreError(f"weights have tensors the model lacks: {unknown[:5]}")
    for name, tensor in state.items():
        if own[name].shape != tensor.shape:
            raise WeightStoreError(
                f"shape mismatch for {name}: model {tuple(own[name].shape)}, file {tuple(tensor.shape)}"
            )
    missing = [n for n in own if n not in state and not _tied(model, n, state)]
    if missing:
        raise WeightStoreError(f"weights lack tensors the model has: {missing[:5]}")
    with torch.no_grad():
        for name, tensor in state.items():
            own[name].copy_(tensor.to(own[name].dtype))


def _tied(model: torch.nn.Module, name: str, state: dict[str, torch.Tensor]) -> bool:
    own = model.state_dict()
    ptr = own[name].untyped_storage().data_ptr()
    return any(own[other].untyped_storage().data_ptr() == ptr for other in state if other in own)
