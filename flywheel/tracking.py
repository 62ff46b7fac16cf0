"""MLflow tracking: a parent run per flywheel run, a nested run per round, a nested run per stage
artifact, and every policy checkpoint in the model registry.

What a flow logs (``Tracker.begin``, ``log_stage`` for every artifact, ``finish``):

- The experiment carries the tag ``mlflow.experimentKind = custom_model_development``, set when
  it is created and added to an existing one that lacks it: MLflow 3 UIs that pick the landing
  page from it open on the runs table rather than the GenAI overview. MLflow 3.17's UI decides
  from its own "GenAI / Model training" switch instead (remembered by the browser, GenAI until
  switched), so the links we print (``ui_url``) carry ``workflowType=machine_learning``.
- The parent run is named after the config and the start time (``default 2026-11-23 08:15``);
  params = the whole resolved config. It carries the learning curve as metric series with
  step = round: ``<env>/success_rate``, ``<env>/avg_reward`` and ``<env>/efficiency`` of the
  round's evaluated policy (round 0: the SFT policy), and the reference policies (the untrained
  ``init`` policy and the baselines ``sft_more``, ``rft``) as ``<env>/<policy>/<metric>``,
  logged at every step 0..rounds so they draw as flat lines beside the curve.
- A round run (``round-<r>``) carries every metric of its round's policy evaluation (the eval
  artifact's summary: ``<env>/success_rate``, per-difficulty success, tool calls, ...), so
  MLflow's compare-runs page lines rounds up side by side.
- A stage run per artifact: params = the stage's resolved config, metrics = the artifact's
  summary, tags = artifact id, inputs, round, kind, store; the manifest (and any plots the
  stage left in its folder) as artifacts; training curves from the checkpoint's
  ``train_log.jsonl`` as ``train/*`` series.
- Every checkpoint (init, sft, dpo, grpo, sft_more, rft) is a version of the registered model
  ``flywheel-<run.name>``: source = the checkpoint folder, tags = artifact id, stage, round,
  and, once it is evaluated, its eval id and ``<env>/<metric>`` values.

Cached reruns make no duplicates. One MLflow run per artifact: a stage run is looked up by its
``artifact_id`` tag (and store) and reused when it exists, whichever flywheel run made it. The
parent run is created lazily, at the first stage run that did not exist yet; a flywheel run
whose every artifact already has its run creates no run at all and reports the parent run that
logged its last artifact (``finish`` returns it, so the flow can log its report there). Why
reuse rather than tag-and-hide: the runs table stays one row per distinct result, an
artifact's run (and its model version) is found from its id alone, and nothing is filtered out
of sight. A run that fails before it logs anything new still gets a parent run, marked FAILED.
Model versions follow the same rule (looked up by ``artifact_id`` before registering).

The client API with explicit run ids is used rather than MLflow's thread-local "active run",
because Prefect may run stages on worker threads. The default store is a SQLite file in the work
folder, with the run artifacts beside it (``mlartifacts/``; set when the experiment is created);
``make ui`` opens the UI on it.

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
import sys
import tempfile
import time
import urllib.parse
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

from flywheel.checkpoint import TRAIN_LOG
from flywheel.config import BASELINES
from flywheel.store import ArtifactRef, Store, flatten_config

if TYPE_CHECKING:
    from mlflow.entities import Metric, Run
    from mlflow.tracking import MlflowClient

SECRET_NAME = re.compile(r"TOKEN|KEY|SECRET|PASSWORD|PASSWD|CREDENTIAL|AUTH|SESSION|PRIVATE", re.I)
_URL_PASSWORD = re.compile(r"(?P<head>[a-z][a-z0-9+.-]*://[^/\s:@]*:)[^/\s@]+@", re.I)
MASK = "***"

EXPERIMENT_KIND_TAG = "mlflow.experimentKind"
EXPERIMENT_KIND = "custom_model_development"
UI_URL = "http://127.0.0.1:5000"  # where `make ui` serves a SQLite store
ML_VIEW = "workflowType=machine_learning"  # MLflow 3.17's "Model training" view of the UI
HEADLINE = ("success_rate", "avg_reward", "efficiency")  # per env, on parent and round runs
REFERENCES = ("init", *BASELINES)  # evaluated policies drawn as flat lines, not as the curve
PARENT_TAG = "mlflow.parentRunId"


def _environ(environ: Mapping[str, str] = os.environ, tries: int = 10) -> dict[str, str]:
    """A copy of the environment variables. MLflow's telemetry thread sets and deletes one
    (``_MLFLOW_TELEMETRY_SESSION_ID``) while a run logs, and a key deleted between listing the
    keys and reading its value raises ``KeyError`` mid-copy; copying again gets a consistent one."""
    for _ in range(tries - 1):
        try:
            return dict(environ)
        except (KeyError, RuntimeError):  # RuntimeError: the dict changed size while copied
            continue
    return dict(environ)


def redact(text: str) -> str:
    """``text`` with URL passwords and the values of secret-named environment variables masked
    (values shorter than 6 characters are too common to mask without hiding ordinary text)."""
    text = _URL_PASSWORD.sub(lambda m: f"{m['head']}{MASK}@", text)
    for name, value in _environ().items():
        if len(value) >= 6 and SECRET_NAME.search(name) and value in text:
            text = text.replace(value, MASK)
    return text


def model_name(run: str) -> str:
    """The registered model holding every checkpoint of the flywheel run ``run``."""
    return f"flywheel-{run}"


def headline(ref: ArtifactRef) -> dict[str, float]:
    """``<env>/<metric>`` -> value of an eval artifact's headline metrics."""
    out = {}
    for key, value in ref.summary.items():
        env, _, metric = key.partition("/")
        if metric in HEADLINE and isinstance(value, (int, float)) and not isinstance(value, bool):
            out[f"{env}/{metric}"] = float(value)
    return out


@dataclass
class _Flywheel:
    """The parent run of one flow invocation, created on demand (see the module docstring)."""

    name: str
    run: str  # run.name: the registered model is model_name(run)
    rounds: int
    params: dict[str, Any]
    tags: dict[str, str]
    start_ms: int
    run_id: str | None = None
    pending: list[Metric] = field(default_factory=list)  # curve points logged before run_id
    last_reused: Run | None = None  # the existing stage run of the latest artifact
    versions: dict[str, str] = field(default_factory=dict)  # checkpoint id -> model version


class Tracker:
    """Thin wrapper over ``MlflowClient``; every method is a no-op when tracking is off."""

    def __init__(self, uri: str | None, experiment: str, enabled: bool = True):
        self.enabled = enabled and uri is not None
        self.uri = uri
        self.client: MlflowClient | None = None
        self._rounds: dict[tuple[str | None, int], str] = {}  # (parent, round) -> round run
        self._flywheel: _Flywheel | None = None
        self._warned_registry = False
        if not self.enabled:
            return
        assert uri is not None  # enabled implies a uri
        os.environ.setdefault("MLFLOW_ENABLE_ASYNC_LOGGING", "false")
        # Migration chatter ("Creating initial MLflow database tables...") on a new database;
        # a run's stderr carries only its own lines (an error stays one line).
        for name in ("alembic", "mlflow.store.db.utils"):
            logging.getLogger(name).setLevel(logging.WARNING)
        from mlflow.tracking import MlflowClient

        artifacts = None  # a server decides; else MLflow's default, ./mlruns under the cwd
        if uri.startswith("sqlite:///"):
            db = Path(uri[len("sqlite:///") :]).resolve()
            db.parent.mkdir(parents=True, exist_ok=True)
            artifacts = (db.parent / "mlartifacts").as_uri()  # beside the database
        self.client = MlflowClient(tracking_uri=uri, registry_uri=uri)
        found = self.client.get_experiment_by_name(experiment)
        if found is None:
            self.experiment_id = self.client.create_experiment(
                experiment,
                artifact_location=artifacts,
                tags={EXPERIMENT_KIND_TAG: EXPERIMENT_KIND},
            )
        else:
            self.experiment_id = found.experiment_id
            if EXPERIMENT_KIND_TAG not in found.tags:
                self.client.set_experiment_tag(
                    self.experiment_id, EXPERIMENT_KIND_TAG, EXPERIMENT_KIND
                )

    @property
    def _mlflow(self) -> MlflowClient:
        """The client of an enabled tracker (the only kind that calls it)."""
        assert self.client is not None, "tracking is off"
        return self.client

    def ui_url(self, run_id: str | None = None) -> str:
        """The MLflow UI page of the experiment (it lands on the runs table) or of one run, in
        the UI's "Model training" view: on the tracking server itself, or on ``make ui`` for a
        SQLite store."""
        page = f"/runs/{run_id}" if run_id else ""
        return f"{self._ui_base()}/#/experiments/{self._experiment()}{page}?{ML_VIEW}"

    def chart_url(self, run_ids: list[str], keys: list[str]) -> str:
        """MLflow's metric page plotting ``keys`` of ``run_ids`` on one chart against the step,
        with a table of their values: the learning curve is ``chart_url([parent],
        ["arith/success_rate", "arith/sft_more/success_rate", ...])``."""
        query = {
            "runs": _compact(run_ids),
            "metric": _compact(keys[0]),
            "experiments": _compact([self._experiment()]),
            "plot_metric_keys": _compact(keys),
            "plot_layout": "{}",
            "x_axis": "step",
            "y_axis_scale": "linear",
            "line_smoothness": "1",
            "show_point": "true",
            "deselected_curves": "[]",
            "last_linear_y_axis_range": "[]",
        }
        return f"{self._ui_base()}/#/metric?{urllib.parse.urlencode(query)}&{ML_VIEW}"

    def compare_url(self, run_ids: list[str]) -> str:
        """MLflow's compare-runs page of ``run_ids`` (e.g. two round runs)."""
        query = {"runs": _compact(run_ids), "experiments": _compact([self._experiment()])}
        return f"{self._ui_base()}/#/compare-runs?{urllib.parse.urlencode(query)}&{ML_VIEW}"

    def _ui_base(self) -> str:
        base = self.uri if self.uri and self.uri.startswith("http") else UI_URL
        return base.rstrip("/")

    def _experiment(self) -> str:
        return str(getattr(self, "experiment_id", "0"))

    # -- the run tree of one flow invocation ---------------------------------------------------
    def begin(
        self,
        name: str,
        *,
        run: str,
        rounds: int,
        params: dict[str, Any] | None = None,
        tags: dict[str, str] | None = None,
    ) -> None:
        """Start a flow's run tree: nothing is created until a stage logs something new. The
        parent run will be named ``<name> <start time>``; ``rounds`` is how far the reference
        lines reach."""
        if not self.enabled:
            return
        now = datetime.now()
        self._flywheel = _Flywheel(
            name=f"{name} {now:%Y-%m-%d %H:%M}",
            run=run,
            rounds=rounds,
            params=params or {},
            tags={"run": run, "rounds": str(rounds), **(tags or {})},
            start_ms=int(now.timestamp() * 1000),
        )

    def finish(self, status: str = "FINISHED") -> str | None:
        """End the flow's run tree; return its parent run: the one created, or, when every
        artifact already had its run, the existing parent run of the latest one (None when
        tracking is off)."""
        fw, self._flywheel = self._flywheel, None
        if not self.enabled or fw is None:
            return None
        if fw.run_id is None and status != "FINISHED":
            self._parent(fw)  # a failure is worth a run even when nothing new was logged
        if fw.run_id is not None:
            self.end(fw.run_id, status)
            return fw.run_id
        return self._top(fw.last_reused)

    def _parent(self, fw: _Flywheel) -> str:
        """The parent run of ``fw``, created (with its params and pending curve) on first use."""
        if fw.run_id is None:
            tags = {k: redact(str(v)) for k, v in fw.tags.items()}
            run = self._mlflow.create_run(
                self.experiment_id, start_time=fw.start_ms, run_name=fw.name, tags=tags
            )
            fw.run_id = run.info.run_id
            self.log_params(fw.run_id, fw.params)
            self._log_batch(fw.run_id, fw.pending)
            fw.pending = []
        return fw.run_id

    def _top(self, run: Run | None) -> str | None:
        """The top-level run above a stage run (stage -> round -> parent)."""
        while run is not None and PARENT_TAG in run.data.tags:
            run = self._mlflow.get_run(run.data.tags[PARENT_TAG])
        return run.info.run_id if run is not None else None

    # -- generic runs --------------------------------------------------------------------------
    def start(
        self, name: str, parent: str | None = None, tags: dict[str, str] | None = None
    ) -> str | None:
        if not self.enabled:
            return None
        return self._create_run(name, parent, tags)

    def _create_run(
        self, name: str, parent: str | None = None, tags: dict[str, str] | None = None
    ) -> str:
        all_tags = {k: redact(str(v)) for k, v in (tags or {}).items()}
        if parent:
            all_tags[PARENT_TAG] = parent
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

        flat = flatten_config(params)
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
        self._log_batch(run_id, items)

    def _log_batch(self, run_id: str, items: list[Metric]) -> None:
        for i in range(0, len(items), 500):
            self._mlflow.log_batch(run_id, metrics=items[i : i + 500])

    def log_file(
        self, run_id: str | None, path: str | Path, artifact_path: str | None = None
    ) -> None:
        """Attach a file, or a folder's files (e.g. the HTML report), to a run as artifacts; a
        later call with a file of the same name replaces it."""
        if self.enabled and run_id:
            if Path(path).is_dir():
                self._mlflow.log_artifacts(run_id, str(path), artifact_path)
            else:
                self._mlflow.log_artifact(run_id, str(path), artifact_path)

    # -- stages ----------------------------------------------------------------------------------
    def log_stage(self, store: Store, ref: ArtifactRef, cached: bool, repeat: bool = False) -> None:
        """Log one stage's artifact into the run tree begun by ``begin``: reuse its run when one
        exists, else create it under its round's run; register checkpoints; add evaluations to
        the learning curve and to their checkpoint's model version. ``repeat``: a stage of a
        repeat of the last round (iteration.repeats), whose evaluation is a point of its own
        series (``arith/repeat/success_rate``), leaving the curve and the round's run the
        run's own."""
        if not self.enabled:
            return
        fw = self._flywheel
        assert fw is not None, "Tracker.log_stage before Tracker.begin"
        existing = self._stage_run(store, ref)
        if existing is not None:
            run_id = existing.info.run_id
            fw.last_reused = existing
        else:
            run_id = self._new_stage_run(fw, store, ref, cached, repeat)
        if ref.kind == "checkpoints":
            self._register(fw, store, ref, run_id)
        if ref.kind == "eval":
            self._log_evaluation(fw, ref, repeat)

    def _stage_run(self, store: Store, ref: ArtifactRef) -> Run | None:
        """The run an earlier flow made for this artifact of this store, if any (not deleted)."""
        runs = self._mlflow.search_runs(
            [self.experiment_id], filter_string=f"tags.artifact_id = '{ref.id}'", max_results=100
        )
        mine = [r for r in runs if r.data.tags.get("store") == _store_key(store)]
        return min(mine, key=lambda r: r.info.start_time) if mine else None

    def _new_stage_run(
        self, fw: _Flywheel, store: Store, ref: ArtifactRef, cached: bool, repeat: bool = False
    ) -> str:
        round_run = self.round_run(self._parent(fw), ref.round)
        run_id = self._create_run(
            ref.stage,
            round_run,
            tags={
                "artifact_id": ref.id,
                "inputs": ",".join(ref.inputs),
                "cached": str(cached).lower(),
                "round": str(ref.round),
                "kind": ref.kind,
                "store": _store_key(store),
                **({"repeat": "true"} if repeat else {}),
            },
        )
        self.log_params(run_id, ref.manifest.get("config", {}))
        # the summary and the stage's own time (flywheel/store.py; not MLflow's), in one batch
        timed = {"stage_seconds": ref.manifest["seconds"]} if "seconds" in ref.manifest else {}
        self.log_metrics(run_id, {**ref.summary, **timed}, step=ref.round)
        if ref.kind == "eval" and ref.manifest.get("policy_stage") not in REFERENCES and not repeat:
            self.log_metrics(round_run, ref.summary, step=ref.round)
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
        return run_id

    def _log_evaluation(self, fw: _Flywheel, ref: ArtifactRef, repeat: bool = False) -> None:
        """The eval's headline metrics: a point of the parent's curve (a repeat's: of the
        ``ENV/repeat/METRIC`` series; init and the baselines: a flat reference line), and tags
        on the evaluated checkpoint's model version."""
        from mlflow.entities import Metric

        values = headline(ref)
        policy = str(ref.manifest.get("policy_stage", ""))
        now = int(time.time() * 1000)

        def series(key: str, name: str) -> str:  # ENV/METRIC -> ENV/name/METRIC
            env, metric = key.split("/", 1)
            return f"{env}/{name}/{metric}"

        if policy in REFERENCES:
            points = [
                Metric(series(k, policy), v, now, step)
                for k, v in values.items()
                for step in range(fw.rounds + 1)
            ]
        elif repeat:
            points = [Metric(series(k, "repeat"), v, now, ref.round) for k, v in values.items()]
        else:
            points = [Metric(k, v, now, ref.round) for k, v in values.items()]
        if fw.run_id is None:
            fw.pending.extend(points)
        else:
            self._log_batch(fw.run_id, points)
        version = fw.versions.get(str(ref.manifest.get("policy", "")))
        if version is not None:
            name = model_name(fw.run)
            for key, value in {"eval_id": ref.id, **values}.items():
                self._mlflow.set_model_version_tag(name, version, key, str(value))

    def _register(self, fw: _Flywheel, store: Store, ref: ArtifactRef, run_id: str) -> None:
        """A model version for a checkpoint, unless one with its artifact id exists."""
        from mlflow.exceptions import MlflowException

        name = model_name(fw.run)
        found = self._mlflow.search_model_versions(
            f"name = '{name}' and tags.artifact_id = '{ref.id}'"
        )
        if found:
            fw.versions[ref.id] = str(found[0].version)
            return
        source = str(store.local_path(ref)) if store.local else ref.path
        try:
            try:
                self._mlflow.get_registered_model(name)
            except MlflowException:
                self._mlflow.create_registered_model(
                    name, tags={"run": fw.run}, description=f"Policy checkpoints of {fw.run}."
                )
            version = self._mlflow.create_model_version(
                name,
                redact(source),
                run_id=run_id,
                tags={"artifact_id": ref.id, "stage": ref.stage, "round": str(ref.round)},
                description=f"{ref.stage} policy, round {ref.round}",
            )
        except MlflowException as err:
            # A tracking server refuses a source path on this machine's disk (it cannot read it).
            if not self._warned_registry:
                print(f"mlflow: checkpoints not registered: {err.message}", file=sys.stderr)
                self._warned_registry = True
            return
        fw.versions[ref.id] = str(version.version)

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
        self._log_batch(run_id, items)


def _compact(value: Any) -> str:
    """JSON without spaces: the UI reads its query values as JSON and a space would be a '+'."""
    return json.dumps(value, separators=(",", ":"))


def _store_key(store: Store) -> str:
    """Which store an artifact lives in (ids are equal across stores with equal configs)."""
    return redact(f"{store.root_url.rstrip('/')}/{store.run}")
