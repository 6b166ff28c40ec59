"""Step attempts that outlive the learner: how often a batch's training was started and the process died in it.

An out-of-memory kill is a SIGKILL: no exception, no ``finally``, nothing the learner could dead-letter. So before a
batch's training (packing dry run, step, rollback) the learner records an attempt in a small JSON file beside its
trainer state (``<weight store>/<model>/trainer-state/step-attempts.json``), and forgets the batch when the training
returns or raises. Each write goes to a temporary file, is fsynced and renamed over the old one: a kill at any
instant leaves the old or the new file, never half of one. A count that reaches ``max_step_attempts`` means the
learner died in this batch's training that many times in a row; the next start dead-letters it untrained.

Keys name the batch's seal record and id (``topic[partition]@offset batch-id``): the same batch re-read after a
restart finds its count; another batch, or the same id under another topic prefix, never does. Pure: no Kafka, no
torch. Why a file and not a topic: docs/method.md#exactly-once-dead-letters-resume.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from clawbase.errors import ClawstreamError

FILE_NAME = "step-attempts.json"


class StepAttempts:
    """Counts per batch key in one small file, every change durable before the call returns."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.counts: dict[str, int] = {}
        if path.exists():
            try:
                loaded = json.loads(path.read_text())
                self.counts = {str(k): int(v) for k, v in loaded.items()}
            except (ValueError, AttributeError, TypeError) as exc:
                raise ClawstreamError(
                    f"{path} is not a JSON object of step attempt counts ({exc}); delete it to forget every count"
                ) from exc

    def count(self, key: str) -> int:
        return self.counts.get(key, 0)

    def start(self, key: str) -> int:
        """One more attempt of ``key``, on disk before this returns; the count now."""
        self.counts[key] = self.count(key) + 1
        self._write()
        return self.counts[key]

    def forget(self, key: str) -> None:
        """The training of ``key`` ended (returned, raised, or the batch is dead-lettered): its count goes."""
        if self.counts.pop(key, None) is not None:
            self._write()

    def _write(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        partial = self.path.with_name(self.path.name + ".partial")
        with partial.open("w") as f:
            json.dump(self.counts, f, sort_keys=True)
            f.flush()
            os.fsync(f.fileno())
        partial.replace(self.path)
        directory = os.open(self.path.parent, os.O_RDONLY)
        try:  # the rename itself durable too (a SIGKILL alone would not need it; a power cut would)
            os.fsync(directory)
        finally:
            os.close(directory)
