"""A weight version's files in the learner's store: saved under the attempt's own name, loaded back verified, linked
once published, and the files of attempts no committed version names removed.

Mixed into ``learner.train.Learner`` (it reads the learner's settings, model, optimizer and value head). Saving writes
the trainer state and value head first and records their sha256 in the weights file's header, so that the published
sha256 vouches for all three (``policy.weight_store``); loading verifies the weights against the published sha256
and each companion against the header. ``vNNNNNN`` becomes a link to the published attempt only after its
transaction commits. Attempts killed or fenced before their commit leave ``vNNNNNN-<attempt>`` files that nothing
will read: :meth:`VersionFiles._remove_unpublished` deletes them (after the fence is taken at start, and after each
commit), never those of a published version (``learner.attempts.remove_unpublished``).
"""

from __future__ import annotations

import logging
import urllib.parse
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import torch

from learner.attempts import remove_unpublished
from learner.lora import LoRA
from learner.precision import load_policy
from learner.settings import LearnerSettings
from learner.value import ValueHead
from learner.weights_http import local_copy
from policy.weight_store import (
    SavedWeights,
    attempt_of,
    checked_companion,
    copy_into,
    link_published,
    load_checked,
    new_attempt,
    resolve_uri,
    save_companion,
    save_state_dict,
    sha256_file,
    trainer_state_path,
    value_head_path,
    verify_file,
)
from schemas.events import WeightVersion

log = logging.getLogger("clawstream.learner")


def attempt_name(version: WeightVersion) -> str:
    """``vNNNNNN-<attempt>`` (or ``vNNNNNN`` for versions written before attempts): the directory its URI names."""
    return Path(urllib.parse.urlparse(version.uri).path).parent.name


class VersionFiles:
    """Save, load, link and clean a version's files (needs the learner's attributes below)."""

    settings: LearnerSettings
    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    value_head: ValueHead | None
    lora: LoRA | None  # adapters on a frozen base: the version is the merged weights, the adapters in the trainer state
    device: torch.device
    _initial_state: dict[str, Any]
    _initial_head: dict[str, Any]

    def _save_version(self, version: int) -> SavedWeights:
        """The version's files under this attempt's own name (policy.weight_store): trainer state and value head
        first, their sha256 in the weights file's header, so that the published sha256 vouches for all three."""
        store, name, attempt = self.settings.weight_store, self.settings.model_name, new_attempt()
        state = {"optimizer": self.optimizer.state_dict(), "torch_rng": torch.get_rng_state()}
        if self.lora is not None:
            state["lora"] = self.lora.state()
        sums = {"trainer_state_sha256": save_companion(state, trainer_state_path(store, name, version, attempt))}
        if self.value_head is not None:  # kept for resuming; inference never needs it
            head = value_head_path(store, name, version, attempt)
            self.value_head.save(head)
            sums["value_head_sha256"] = sha256_file(head)
        tensors = self.lora.merged_state_dict(self.model) if self.lora is not None else self.model.state_dict()
        return save_state_dict(tensors, store, name, version, attempt, sums)

    def _load(self, version: WeightVersion | None) -> None:
        """Weights (sha256 verified), value head, optimizer and RNG state saved with ``version``; None: as started."""
        store = self.settings.weight_store
        state: dict | None = self._initial_state
        weights = Path()
        if version is None:
            initial = load_policy(self.settings.model_dir)
            self.model.load_state_dict(initial.state_dict())
            if self.lora is not None:
                self.lora.load_state(self._initial_state["lora"])
        else:
            weights = verify_file(local_copy(version, store))
            tensors = load_checked(weights, self.model)
            state_file = self._companion(weights, version.policy_version, trainer_state_path, "trainer_state_sha256")
            state = torch.load(state_file, map_location=self.device, weights_only=True) if state_file else None
            if self.lora is not None:  # the adapters from the trainer state; the targets keep model_dir's base
                tensors = self.lora.adopt(tensors, state, version.policy_version)
            copy_into(self.model, tensors)
            if state is None:
                log.warning("no optimizer state for v%d (%s): fresh AdamW moments", version.policy_version, weights)
            elif self.lora is None and "lora" in state:  # its AdamW state is the adapters': nothing to load here
                log.warning("v%d was trained with adapters, now merged: fresh AdamW moments", version.policy_version)
                state = {**state, "optimizer": None}
        if self.value_head is not None:
            head_file = None
            if version is not None:
                head_file = self._companion(weights, version.policy_version, value_head_path, "value_head_sha256")
            if head_file is not None:
                self.value_head.load(head_file)
            else:
                self.value_head.load_state_dict(self._initial_head)
        if state is None or state["optimizer"] is None:
            self.optimizer.state.clear()
        else:
            self.optimizer.load_state_dict(state["optimizer"])
        if state is not None:
            torch.set_rng_state(state["torch_rng"].cpu())

    def _companion(self, weights: Path, version: int, path_of: Callable[..., Path], key: str) -> Path | None:
        """The trainer state or value head saved with the verified ``weights``, checked against its sha256 there."""
        attempt = attempt_of(weights)
        path = path_of(self.settings.weight_store, self.settings.model_name, version, attempt)
        if attempt is None:  # written before versions had attempts: no sha256 recorded to check against
            log.warning("%s predates checksummed trainer state: loaded unchecked", path)
            return path if path.exists() else None
        return checked_companion(weights, path, key)

    def _link(self, version: WeightVersion | None) -> None:
        if version is not None:
            link_published(resolve_uri(local_copy(version, self.settings.weight_store).uri))

    def _remove_unpublished(self, published: Iterable[str]) -> None:
        """Delete the files of every attempt not in ``published`` (the :func:`attempt_name` of every committed one)."""
        model_dir = self.settings.weight_store / self.settings.model_name
        removed = remove_unpublished(model_dir, published)
        if removed:
            log.info("removed %d file(s) of unpublished attempts: %s", len(removed), [p.name for p in removed])
