"""The MLflow client edge: the one MLflow run of a clawstream run, what it already holds, and the writes into it.

The run is found by its tag ``clawstream.prefix`` (the topic prefix) in the experiment, or created. At start
:meth:`TrackedRun.ledger` reads back from MLflow what the run holds — every metric's history (its steps), the
artifact paths under ``trajectories/`` and ``weights/``, the model versions registered from this run — so the
tracker never writes one twice (``consumers.tracker.writes``). A weight version is a small pointer artifact
``weights/vNNNNNN/version.json`` (URI, sha256, size, step, batch; the weights are not copied) and a model version
of the registered model whose source is that artifact, tagged with the sha256 and URI. Errors of the MLflow server
or client become :class:`TrackerError` naming the server.
"""

from __future__ import annotations

import json
import logging
import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import Any

from clawbase.errors import ClawstreamError
from consumers.tracker.settings import TrackerSettings
from consumers.tracker.trajectory_json import Decode, trajectory_document
from consumers.tracker.writes import Ledger, MetricWrite, TrajectoryWrite, VersionWrite, Write

log = logging.getLogger("clawstream.tracker")
PREFIX_TAG = "clawstream.prefix"
REPORT_FILES = ("before_after.md", "learning.png", "timeline.md", "summary.json")  # clawstream/demo/report.py
MAX_BATCH = 1000  # metrics per log_batch (MLflow's limit)


class TrackerError(ClawstreamError):
    """The MLflow server refused or could not be reached."""


def _mlflow() -> Any:
    try:
        import mlflow
    except ImportError as exc:
        raise TrackerError("the tracker needs MLflow: pip install 'clawstream[track]'") from exc
    return mlflow


class TrackedRun:
    """The MLflow run of one clawstream run (its topic prefix), found or created at construction."""

    def __init__(self, settings: TrackerSettings, prefix: str) -> None:
        self.settings, self.prefix = settings, prefix
        self.client = _mlflow().MlflowClient(tracking_uri=settings.mlflow_uri, registry_uri=settings.mlflow_uri)
        self.run_id = self._call("open the run", self._find_or_create)

    def _call(self, what: str, fn: Callable[[], Any]) -> Any:
        try:
            return fn()
        except Exception as exc:  # MlflowException, requests' errors: the server's answer is in the message
            raise TrackerError(f"MLflow at {self.settings.mlflow_uri}: cannot {what}: {exc}") from exc

    def _find_or_create(self) -> str:
        name = self.settings.experiment
        experiment = self.client.get_experiment_by_name(name)
        experiment_id = experiment.experiment_id if experiment else self.client.create_experiment(name)
        found = self.client.search_runs([experiment_id], filter_string=f"tags.`{PREFIX_TAG}` = '{self.prefix}'")
        if found:
            return str(found[0].info.run_id)
        tags = {PREFIX_TAG: self.prefix, "mlflow.source.name": "clawstream"}
        return str(self.client.create_run(experiment_id, tags=tags, run_name=self.prefix.rstrip(".")).info.run_id)

    def ledger(self) -> Ledger:
        """What the run holds already, read back from MLflow."""
        return self._call("read what the run holds", self._ledger)

    def _ledger(self) -> Ledger:
        ledger = Ledger()
        for key in self.client.get_run(self.run_id).data.metrics:
            ledger.metrics |= {(key, m.step) for m in self.client.get_metric_history(self.run_id, key)}
        for top in self.client.list_artifacts(self.run_id, "trajectories"):
            ledger.artifacts |= {f.path for f in self.client.list_artifacts(self.run_id, top.path)}
        for mv in self.client.search_model_versions(f"run_id = '{self.run_id}'"):
            if mv.tags.get(PREFIX_TAG) == self.prefix and "policy_version" in mv.tags:
                ledger.versions.add(int(mv.tags["policy_version"]))
        return ledger

    def log_params(self, params: dict[str, str]) -> None:
        """Params not logged yet (MLflow's params are immutable: one logged with another value is kept, and said)."""

        def log_them() -> None:
            held = self.client.get_run(self.run_id).data.params
            for key, old in held.items():
                if key in params and params[key] != old:
                    log.warning("param %s: MLflow holds %r, this tracker has %r; kept %r", key, old, params[key], old)
            self.client.log_batch(self.run_id, params=[_param(k, v) for k, v in params.items() if k not in held])

        self._call("log the params", log_them)

    def write(self, writes: list[Write], decode: Decode | None) -> None:
        """Do ``writes`` (already filtered by the ledger): metrics in batches, then artifacts and versions."""
        metrics = [w for w in writes if isinstance(w, MetricWrite)]
        for start in range(0, len(metrics), MAX_BATCH):
            chunk = [_metric(w) for w in metrics[start : start + MAX_BATCH]]
            self._call("log metrics", lambda chunk=chunk: self.client.log_batch(self.run_id, metrics=chunk))
        for w in writes:
            if isinstance(w, TrajectoryWrite):
                doc = trajectory_document(w.trajectory, batch_id=w.batch_id, advantage=w.advantage, decode=decode)
                self._call(f"log {w.path}", lambda w=w, doc=doc: self.client.log_dict(self.run_id, doc, w.path))
            elif isinstance(w, VersionWrite):
                self._call(f"register {w.path}", lambda w=w: self._register(w))

    def _register(self, w: VersionWrite) -> None:
        pointer = {k: getattr(w, k) for k in ("policy_version", "step", "model_name", "uri", "sha256", "size_bytes")}
        self.client.log_dict(self.run_id, {**pointer, "batch_id": w.batch_id}, f"{w.path}/version.json")
        name = self.settings.registered_model or f"clawstream-{w.model_name}"
        if not self.client.search_registered_models(filter_string=f"name = '{name}'"):
            self.client.create_registered_model(name, description="clawstream weight versions (sha256 + URI)")
        tags = {PREFIX_TAG: self.prefix, "policy_version": str(w.policy_version), "step": str(w.step)}
        self.client.create_model_version(
            name,
            f"runs:/{self.run_id}/{w.path}",
            run_id=self.run_id,
            tags={**tags, "sha256": w.sha256, "uri": w.uri},
            description=f"policy v{w.policy_version} (step {w.step}): {w.uri} sha256 {w.sha256}",
            await_creation_for=0,  # its source is this run's pointer artifact: ready at once
        )

    def log_report(self, run_dir: Path) -> list[str]:
        """The demo's report files found in ``run_dir`` (the before/after table, the plot, ...), under ``report/``;
        the same file logged again replaces itself. Returns the names logged."""
        found = [run_dir / name for name in REPORT_FILES if (run_dir / name).is_file()]
        for path in found:
            self._call(f"log {path.name}", lambda p=path: self.client.log_artifact(self.run_id, str(p), "report"))
        return [p.name for p in found]

    def finish(self) -> None:
        self._call("end the run", lambda: self.client.set_terminated(self.run_id, "FINISHED"))


def run_params(settings: TrackerSettings, model_name: str | None = None) -> dict[str, str]:
    """The run's params: the demo's config (``run_dir/state.json``: recipe sizes, model, harness mix, learner
    hyperparameters) and its model's SFT recipe, the commit, and ``--param`` values (which win)."""
    params: dict[str, str] = {"commit": _commit()}
    state = settings.run_dir / "state.json" if settings.run_dir else None
    if state is not None and state.is_file():
        config = json.loads(state.read_text()).get("config", {})
        params |= {f"demo.{k}": _text(v) for k, v in config.items() if v is not None}
        model = config.get("model")
        sft = Path(model) / "sft_summary.json" if model else None
        if sft is not None and sft.is_file():
            recipe = json.loads(sft.read_text())
            params |= {"recipe": _text(recipe.get("recipe")), "model.sha256": str(recipe.get("sha256"))}
    if model_name:
        params["model_name"] = model_name
    return params | dict(settings.params)


def _commit() -> str:
    root = Path(__file__).resolve().parents[2]
    try:
        out = subprocess.run(["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return "unknown"
    return out.stdout.strip() if out.returncode == 0 else "unknown"


def _text(value: Any) -> str:
    text = value if isinstance(value, str) else json.dumps(value, sort_keys=True)
    return text[:6000]  # MLflow's limit on a param's value


def _metric(w: MetricWrite) -> Any:
    return _mlflow().entities.Metric(w.key, w.value, w.timestamp_ms, w.step)


def _param(key: str, value: str) -> Any:
    return _mlflow().entities.Param(key, value)
