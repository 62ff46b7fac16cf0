"""MLflow tracking: one run per flywheel run, a nested run per round, a nested run per stage.

Stage runs get params = the stage's resolved config, metrics = the artifact's summary (the same
names every round, so the UI compares rounds), tags = artifact ids, and the manifest (plus any
plots the stage left in its folder) as artifacts. Training curves come from the checkpoint's
``train_log.jsonl``. The client API with explicit parent ids is used rather than MLflow's
thread-local "active run", because Prefect may run stages on worker threads.

The default store is a SQLite file in the work folder; ``make ui`` opens the UI on it.

Secrets never reach MLflow through us: every param value and tag passes ``redact``, which
masks the password of a URL (``s3://key:secret@bucket`` -> ``s3://key:***@bucket``) and any
occurrence of the value of an environment variable whose name says it is a secret (``*TOKEN*``,
``*KEY*``, ``*SECRET*``, ``*PASSWORD*``, ...). Nothing here reads the environment into a param.
"""

from __future__ import annotations

import json
import logging
import os
import re
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from flywheel.checkpoint import TRAIN_LOG
from flywheel.store import ArtifactRef, Store

if TYPE_CHECKING:
    from mlflow.tracking import MlflowClient

SECRET_NAME = re.compile(r"TOKEN|KEY|SECRET|PASSWORD|PASSWD|CREDENTIAL|AUTH|SESSION|PRIVATE", re.I)
_URL_PASSWORD = re.compile(r"(?P<head>[a-z][a-z0-9+.-]*://[^/\s:@]*:)[^/\s@]+@", re.I)
MASK = "***"


def redact(text: str) -> str:
    """``text`` with URL passwords and the values of secret-named environment variables masked
    (values shorter than 6 characters are too common to mask without hiding ordinary text)."""
    text = _URL_PASSWORD.sub(lambda m: f"{m['head']}{MASK}@", text)
    for name, value in os.environ.items():
        if len(value) >= 6 and SECRET_NAME.search(name) and value in text:
            text = text.replace(value, MASK)
    return text


class Tracker:
    """Thin wrapper over ``MlflowClient``; every method is a no-op when tracking is off."""

    def __init__(self, uri: str | None, experiment: str, enabled: bool = True):
        self.enabled = enabled and uri is not None
        self.client: MlflowClient | None = None
        self._rounds: dict[tuple[str | None, int], str] = {}  # (parent, round) -> round run
        if not self.enabled:
            return
        assert uri is not None  # enabled implies a uri
        os.environ.setdefault("MLFLOW_ENABLE_ASYNC_LOGGING", "false")
        logging.getLogger("alembic").setLevel(logging.WARNING)
        from mlflow.tracking import MlflowClient

        if uri.startswith("sqlite:///"):
            Path(uri[len("sqlite:///") :]).parent.mkdir(parents=True, exist_ok=True)
        self.client = MlflowClient(tracking_uri=uri)
        found = self.client.get_experiment_by_name(experiment)
        self.experiment_id = (
            found.experiment_id if found else self.client.create_experiment(experiment)
        )

    def start(
        self, name: str, parent: str | None = None, tags: dict[str, str] | None = None
    ) -> str | None:
        if not self.enabled:
            return None
        return self._create_run(name, parent, tags)

    @property
    def _mlflow(self) -> MlflowClient:
        """The client of an enabled tracker (the only kind that calls it)."""
        assert self.client is not None, "tracking is off"
        return self.client

    def _create_run(
        self, name: str, parent: str | None = None, tags: dict[str, str] | None = None
    ) -> str:
        all_tags = {k: redact(str(v)) for k, v in (tags or {}).items()}
        if parent:
            all_tags["mlflow.parentRunId"] = parent
        run = self._mlflow.create_run(self.experiment_id, run_name=name, tags=all_tags)
        return run.info.run_id

    def end(self, run_id: str | None, status: str = "FINISHED") -> None:
        """End a run, and the round runs nested under it."""
        if self.enabled and run_id:
            for key in [k for k in self._rounds if k[0] == run_id]:
                self._mlflow.set_terminated(self._rounds.pop(key), status=status)
            self._mlflow.set_terminated(run_id, status=status)

    def round_run(self, parent: str | None, round: int) -> str | None:
        """The run of one round nested under ``parent``, started when its first stage logs."""
        if not self.enabled:
            return None
        key = (parent, round)
        if key not in self._rounds:
            self._rounds[key] = self._create_run(
                f"round-{round}", parent, tags={"round": str(round)}
            )
        return self._rounds[key]

    def log_params(self, run_id: str | None, params: dict[str, Any]) -> None:
        if not (self.enabled and run_id):
            return
        from mlflow.entities import Param

        flat = _flatten(params)
        items = [Param(k[:250], redact(str(v))[:6000]) for k, v in flat.items()]
        for i in range(0, len(items), 100):
            self._mlflow.log_batch(run_id, params=items[i : i + 100])

    def log_metrics(self, run_id: str | None, metrics: dict[str, Any], step: int = 0) -> None:
        if not (self.enabled and run_id):
            return
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        items = [
            Metric(k, float(v), now, step)
            for k, v in metrics.items()
            if isinstance(v, (int, float)) and not isinstance(v, bool)
        ]
        for i in range(0, len(items), 500):
            self._mlflow.log_batch(run_id, metrics=items[i : i + 500])

    def log_stage(self, parent: str | None, store: Store, ref: ArtifactRef, cached: bool) -> None:
        """A run for one stage's artifact, nested in its round's run under ``parent``."""
        if not self.enabled:
            return
        run_id = self._create_run(
            ref.stage,
            self.round_run(parent, ref.round),
            tags={
                "artifact_id": ref.id,
                "inputs": ",".join(ref.inputs),
                "cached": str(cached).lower(),
                "round": str(ref.round),
                "kind": ref.kind,
            },
        )
        self.log_params(run_id, ref.manifest.get("config", {}))
        self.log_metrics(run_id, ref.summary, step=ref.round)
        folder = store.local_path(ref) if ref.kind == "checkpoints" or store.local else None
        if folder is not None and (folder / TRAIN_LOG).exists():
            self._log_curve(run_id, folder / TRAIN_LOG)
        with tempfile.TemporaryDirectory() as tmp:
            path = Path(tmp) / "manifest.json"
            path.write_text(json.dumps(ref.manifest, indent=2, default=str))
            self._mlflow.log_artifact(run_id, str(path))
        if folder is not None:
            for png in sorted(folder.glob("*.png")):
                self._mlflow.log_artifact(run_id, str(png))
        self.end(run_id)

    def _log_curve(self, run_id: str, path: Path) -> None:
        from mlflow.entities import Metric

        items = []
        now = int(time.time() * 1000)
        for line in path.read_text().splitlines():
            entry = json.loads(line)
            step = int(entry.get("step", 0))
            for key in (
                "loss",
                "lr",
                "accuracy",
                "chosen_reward",
                "rejected_reward",
                "clip_fraction",
                "ratio",
                "kl",
                "chosen_nll",
                "expert_nll",
            ):
                if isinstance(entry.get(key), (int, float)):
                    items.append(Metric(f"train/{key}", float(entry[key]), now, step))
        for i in range(0, len(items), 500):
            self._mlflow.log_batch(run_id, metrics=items[i : i + 500])


def _flatten(data: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(data, dict):
        out: dict[str, Any] = {}
        for k, v in data.items():
            out.update(_flatten(v, f"{prefix}{k}."))
        return out
    if isinstance(data, list) and data and all(isinstance(x, dict) for x in data):
        out = {}
        for i, v in enumerate(data):
            key = v.get("name", str(i)) if isinstance(v, dict) else str(i)
            out.update(_flatten(v, f"{prefix}{key}."))
        return out
    return {prefix.rstrip("."): data}
