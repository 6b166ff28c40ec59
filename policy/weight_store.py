"""Weight store: save a policy version as one safetensors file with its sha256; verify and load one back.

Weights never travel through Kafka; ``clawstream.weights`` carries only the file's URI and sha256. Pure (torch +
safetensors, no Kafka). The learner writes each training attempt of version N under a path of its own,
``<store>/<model_name>/vNNNNNN-<attempt>/model.safetensors`` (one directory per version, because vLLM's reload loads
every ``*.safetensors`` of a directory: consumers/inference/vllm_adapter.py), with its trainer state and value head
under the same ``vNNNNNN-<attempt>`` name; the version's transaction publishes that path, and only then does
``vNNNNNN`` become a link to it (:func:`link_published`, for readers that know only the number). A fenced learner's
writes therefore land under its own attempt's name and can never change a published version. The weights file's
metadata carries the trainer state's and value head's sha256, so the sha256 in the published event vouches for
them too (:func:`checked_companion`). Writes are atomic (temp file + rename). Verification (:func:`verify_file`,
:func:`load_checked`) raises :class:`WeightsRejected` whose ``kind`` names the reason (missing_file,
checksum_mismatch, shape_mismatch, ...): inference workers dead-letter with it, the learner refuses to resume.
"""

from __future__ import annotations

import hashlib
import os
import secrets
import urllib.parse
import urllib.request
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import save_file

from clawbase.errors import ClawstreamError
from schemas.events import WeightVersion


@dataclass(frozen=True)
class SavedWeights:
    path: Path
    sha256: str
    size_bytes: int

    @property
    def uri(self) -> str:
        return self.path.resolve().as_uri()


def _name(version: int, attempt: str | None) -> str:
    return f"v{version:06d}" if attempt is None else f"v{version:06d}-{attempt}"


def version_path(store: Path, model_name: str, version: int, attempt: str | None = None) -> Path:
    """The weights of ``version`` (its published link without ``attempt``; one attempt's own file with it)."""
    return store / model_name / _name(version, attempt) / "model.safetensors"


def value_head_path(store: Path, model_name: str, version: int, attempt: str | None = None) -> Path:
    """PPO's value head of a version: outside the version directory, so vLLM never tries to load it."""
    return store / model_name / "value-heads" / f"{_name(version, attempt)}.safetensors"


def trainer_state_path(store: Path, model_name: str, version: int, attempt: str | None = None) -> Path:
    """The learner's optimizer and RNG state after a version (for an exact resume); beside the value heads."""
    return store / model_name / "trainer-state" / f"{_name(version, attempt)}.pt"


def new_attempt() -> str:
    """A name no other training attempt of any version has (this process and a random part)."""
    return f"{os.getpid()}-{secrets.token_hex(4)}"


def attempt_of(weights: Path) -> str | None:
    """The attempt a weights file was written by (its directory's ``vNNNNNN-<attempt>``); None for the old layout."""
    _, _, attempt = weights.parent.name.partition("-")
    return attempt or None


def save_companion(value: object, path: Path) -> str:
    """``torch.save`` of a version's trainer state (or any companion file), atomically; its sha256."""
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(path.name + ".partial")
    torch.save(value, partial)
    partial.replace(path)
    return sha256_file(path)


def checked_companion(weights: Path, path: Path, key: str) -> Path | None:
    """``path`` (a trainer state or value head of the version whose verified weights are ``weights``), after
    checking it against the sha256 the weights file's metadata ``key`` records; None when it does not exist."""
    from safetensors import safe_open

    with safe_open(str(weights), framework="pt") as f:
        expected = (f.metadata() or {}).get(key)
    if not path.exists():
        return None
    if expected is None:
        raise WeightsRejected("missing_checksum", f"{weights} records no {key} to check {path} against")
    actual = sha256_file(path)
    if actual != expected:
        raise WeightsRejected(
            "checksum_mismatch",
            f"{path} has sha256 {actual}, but the published weights {weights} record {expected}: the file was "
            "changed after its version was published. Restore it from a backup, or delete it to resume with fresh "
            "optimizer moments",
        )
    return path


def link_published(weights: Path) -> Path:
    """Point ``vNNNNNN`` at the published attempt's directory (atomically; again after a restart is harmless)."""
    directory = weights.parent
    name, _, attempt = directory.name.partition("-")
    link = directory.with_name(name)
    if not attempt or (link.is_symlink() and os.readlink(link) == directory.name):
        return link
    partial = directory.with_name(f"{name}.link{os.getpid()}")
    partial.unlink(missing_ok=True)
    partial.symlink_to(directory.name, target_is_directory=True)
    partial.replace(link)
    return link


def save_weights(
    model: torch.nn.Module,
    store: Path,
    model_name: str,
    version: int,
    attempt: str | None = None,
    metadata: Mapping[str, str] | None = None,
) -> SavedWeights:
    """Write the model's state dict (tied weights once) atomically and return path + sha256."""
    return save_state_dict(model.state_dict(), store, model_name, version, attempt, metadata)


def save_state_dict(
    tensors: Mapping[str, torch.Tensor],
    store: Path,
    model_name: str,
    version: int,
    attempt: str | None = None,
    metadata: Mapping[str, str] | None = None,
) -> SavedWeights:
    """:func:`save_weights` of a state dict (e.g. the full weights a sharded learner gathers on its rank 0);
    ``metadata`` (e.g. the companion files' sha256) goes into the file's header."""
    path = version_path(store, model_name, version, attempt)
    path.parent.mkdir(parents=True, exist_ok=True)
    state: dict[str, torch.Tensor] = {}
    seen: set[int] = set()
    for name, tensor in tensors.items():
        # Tied embeddings share storage; safetensors refuses shared tensors, and the loader re-ties them.
        key = tensor.untyped_storage().data_ptr()
        if key in seen:
            continue
        seen.add(key)
        state[name] = tensor.detach().to("cpu").contiguous()
    tmp = path.with_suffix(f".tmp{os.getpid()}")
    save_file(state, str(tmp), metadata={**(metadata or {}), "model_name": model_name, "version": str(version)})
    os.replace(tmp, path)
    return SavedWeights(path=path, sha256=sha256_file(path), size_bytes=path.stat().st_size)


class WeightsRejected(ClawstreamError):
    """A weight version that must not be applied; ``kind`` groups reasons (becomes ``DeadLetter.error_type``)."""

    def __init__(self, kind: str, reason: str) -> None:
        super().__init__(reason)
        self.kind = kind
        self.reason = reason


# ---- verification (used by the learner on resume and by inference workers before a swap) ---------------------------
def resolve_uri(uri: str) -> Path:
    """``file:///abs/path`` (or a bare absolute path) → Path; other schemes are rejected."""
    parsed = urllib.parse.urlparse(uri)
    if parsed.scheme == "file":
        if parsed.netloc not in ("", "localhost"):
            raise WeightsRejected("unsupported_uri", f"file URI with a remote host is not supported: {uri}")
        return Path(urllib.request.url2pathname(parsed.path))
    if parsed.scheme == "" and uri.startswith("/"):
        return Path(uri)
    raise WeightsRejected(
        "unsupported_uri",
        f"unsupported weights URI scheme '{parsed.scheme}': {uri} (use file:// or http(s)://: policy.weight_fetch)",
    )


def sha256_file(path: Path, chunk: int = 1 << 20) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while block := handle.read(chunk):
            digest.update(block)
    return digest.hexdigest()


def verify_file(event: WeightVersion) -> Path:
    """The weights file of ``event``, after checking it exists, its size (when given) and its sha256."""
    path = resolve_uri(event.uri)
    if not path.is_file():
        raise WeightsRejected("missing_file", f"weights file not found: {path}")
    size = path.stat().st_size
    if event.size_bytes and size != event.size_bytes:
        raise WeightsRejected("size_mismatch", f"{path} has {size} bytes, the event says {event.size_bytes}")
    actual = sha256_file(path)
    if actual != event.sha256.lower():
        raise WeightsRejected("checksum_mismatch", f"sha256 of {path} is {actual}, the event says {event.sha256}")
    return path


def tied_groups(model: torch.nn.Module) -> list[list[str]]:
    """State-dict names grouped by shared storage (tied weights, e.g. embeddings = lm_head, form one group)."""
    groups: dict[tuple[int, int], list[str]] = {}
    for name, tensor in model.state_dict(keep_vars=True).items():
        groups.setdefault((tensor.untyped_storage().data_ptr(), tensor.storage_offset()), []).append(name)
    return list(groups.values())


def load_checked(path: Path, model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Load a safetensors file and check it against ``model``: same names (a tied group once is enough), same
    shapes; returns the tensors cast to the model's dtypes and device, ready to copy in."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    try:
        tensors = load_file(str(path))
    except (SafetensorError, OSError, ValueError) as exc:
        raise WeightsRejected("bad_file", f"{path} is not a readable safetensors file: {exc}") from exc
    reference = model.state_dict()
    unknown = sorted(set(tensors) - set(reference))
    if unknown:
        raise WeightsRejected("unexpected_tensor", f"{path} has tensors the model lacks: {', '.join(unknown[:5])}")
    for name, tensor in tensors.items():
        if tuple(tensor.shape) != tuple(reference[name].shape):
            raise WeightsRejected(
                "shape_mismatch",
                f"{name}: file has shape {tuple(tensor.shape)}, model has {tuple(reference[name].shape)}",
            )
    for group in tied_groups(model):
        present = [n for n in group if n in tensors]
        if not present:
            raise WeightsRejected("missing_tensor", f"{path} lacks tensor {group[0]}")
        if any(not torch.equal(tensors[present[0]], tensors[n]) for n in present[1:]):
            raise WeightsRejected("tied_mismatch", f"tied tensors {', '.join(present)} differ in {path}")
    return {n: t.to(dtype=reference[n].dtype, device=reference[n].device) for n, t in tensors.items()}


def copy_into(model: torch.nn.Module, tensors: dict[str, torch.Tensor]) -> None:
    """Copy checked tensors into the model's parameters and buffers in place (no reallocation)."""
    live = model.state_dict(keep_vars=True)
    with torch.no_grad():
        for name, tensor in tensors.items():
            live[name].copy_(tensor)
