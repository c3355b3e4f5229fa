"""MLflow tracking as an Optuna study callback: one parent run per study, one child run per trial
(what each holds: `values.py`).

The parent run id is kept in the study's user attributes, so a resumed study (or a second
worker) logs into the same parent run.
"""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import yaml
from slotune.tuner.search.records import TrialRecord, store_parent_run, stored_parent_run
from slotune.tuner.tracking.values import study_end_values, trial_values

# MLflow 3 opens an experiment on the view its kind names (mlflow/server/js `ExperimentKind`); without
# the tag a study's experiment may open on the GenAI traces overview instead of the runs table.
EXPERIMENT_KIND_TAG, EXPERIMENT_KIND = "mlflow.experimentKind", "custom_model_development"
# The metric the runs table sorts by and charts first (mlflow.utils.mlflow_tags).
PRIMARY_METRIC_TAG = "mlflow.experiment.primaryMetric.name"
PRIMARY_METRIC_GREATER_IS_BETTER_TAG = "mlflow.experiment.primaryMetric.greaterIsBetter"
# MLflow's client retries an unreachable server for minutes by default (7 retries, backoff factor 2,
# 120 s timeout per request): a tracking outage must cost a trial seconds. Set unless the user did.
OUTAGE_LIMITS = {
    "MLFLOW_HTTP_REQUEST_MAX_RETRIES": "1",
    "MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR": "1",
    "MLFLOW_HTTP_REQUEST_TIMEOUT": "10",
}
LOGGING_SETTLES_S = 120  # a finished trial is logged by its own process within this (or it never will be)


class MLflowTracker:
    """Optuna study callback logging each finished trial as an MLflow child run.

    Lifecycle: created before `study.optimize` (creates or re-opens the experiment named after
    the study and its parent run), called once per finished trial, and closed by
    `log_study_end` after the winner is declared.

    Several processes may start one study at once. On one machine (a local SQLite tracking
    store) they take turns under a file lock to create the store (MLflow's schema migrations
    corrupt it when two run at once), the experiment and the parent run. Across machines (a
    tracking server) the loser of the experiment race retries and finds it, and the parent run
    stored last in the study becomes everyone's (`parent_run_id`).
    """

    def __init__(self, spec, study) -> None:
        import mlflow

        self.mlflow = mlflow
        self.spec = spec
        self.study = study
        uri = spec.resolved_tracking_uri()
        if uri.startswith(("http://", "https://")):
            for k, v in OUTAGE_LIMITS.items():
                os.environ.setdefault(k, v)
        self._pending: list[int] = []  # finished trials not logged yet (the server was unreachable), oldest first
        self._partial: set[int] = set()  # of those, trials whose logging broke off: a partial run may exist
        mlflow.set_tracking_uri(uri)
        self._own_parent: str | None = None
        with _local_store_lock(uri):
            self.client = _retry(mlflow.tracking.MlflowClient)  # creates (and migrates) the store
            self.experiment_id = _retry(self._experiment)
            parent = stored_parent_run(study)
            if parent is None:
                run = self.client.create_run(
                    self.experiment_id,
                    run_name=f"study-{spec.name}",
                    tags={"slotune.study": spec.name, "slotune.role": "study"},
                )
                parent = self._own_parent = run.info.run_id
                store_parent_run(study, parent)
                self.client.log_param(parent, "objective", spec.objective.metric_key())
                self.client.log_param(parent, "sampler", spec.sampler)
                self.client.log_param(parent, "search_space", spec.search_space.name)
                if spec.cost is not None:  # the price every trial's usd_per_1m_* metrics are at
                    self.client.log_param(parent, "usd_per_hour", spec.cost.usd_per_hour)
        self._parent = parent
        self.client.set_tag(parent, "slotune.omp_wait_policy", spec.budget.trial_omp_wait_policy)
        self.client.set_tag(parent, "slotune.measure", spec.budget.measure)
        self._pending = self._unlogged(study)  # none has a child run: nothing partial to delete
        self.flush(study)

    def _unlogged(self, study) -> list[int]:
        """Finished trials with no child run (a tracking outage, a killed process), finished long
        enough ago that the process that finished them is not logging them now."""
        have = set()
        runs = self.client.search_runs(
            [self.experiment_id], filter_string=f"tags.mlflow.parentRunId = '{self._parent}'"
        )
        for run in runs:
            have.add(run.data.tags.get("slotune.trial"))
        settled = time.time() - LOGGING_SETTLES_S
        return [
            t.number
            for t in study.get_trials(deepcopy=False)
            if t.state.is_finished()
            and str(t.number) not in have
            and t.datetime_complete is not None
            and t.datetime_complete.timestamp() < settled
        ]

    def _experiment(self) -> str:
        """The study's experiment, created if missing, tagged to open on its runs table (also one
        made by an older slotune)."""
        exp = self.client.get_experiment_by_name(self.spec.name)
        if exp is not None:
            eid = exp.experiment_id
        else:
            eid = self.client.create_experiment(
                self.spec.name,
                artifact_location=str((self.spec.resolved_output_dir() / "mlartifacts").resolve().as_uri()),
            )
        obj = self.spec.objective
        tags = {
            EXPERIMENT_KIND_TAG: EXPERIMENT_KIND,
            PRIMARY_METRIC_TAG: obj.metric_key(),
            PRIMARY_METRIC_GREATER_IS_BETTER_TAG: str(obj.direction() == "maximize"),
        }
        have = exp.tags if exp is not None else {}
        for k, v in tags.items():
            if have.get(k) != v:
                self.client.set_experiment_tag(eid, k, v)
        return eid

    @property
    def parent_run_id(self) -> str:
        """The study's parent run: the one stored in the study (another process starting the
        same study at once may have stored its own last; a parent of ours that lost is deleted
        while still empty)."""
        stored = stored_parent_run(self.study)
        if stored and stored != self._parent:
            lost, self._parent = self._own_parent, stored
            self._own_parent = None
            if lost is not None and not self.client.search_runs(
                [self.experiment_id], filter_string=f"tags.mlflow.parentRunId = '{lost}'", max_results=1
            ):
                self.client.delete_run(lost)
        return self._parent

    def __call__(self, study, trial) -> None:
        self._pending.append(trial.number)
        self.flush(study)

    def flush(self, study) -> bool:
        """Log the trials waiting for MLflow, oldest first, from the study database; at the first
        failure keep them for the next call. Tracking is evidence, not control: a failure never
        stops the study. Returns whether none is left."""
        import warnings

        if not self._pending:
            return True
        trials = {t.number: t for t in study.get_trials(deepcopy=False)}
        while self._pending:
            number = self._pending[0]
            try:
                if number in self._partial:
                    self._delete_partial_run(number)
                self.log_trial(trials[number])
            except Exception as exc:
                if number not in self._partial:
                    warnings.warn(
                        f"MLflow logging of trial {number} failed ({type(exc).__name__}: {str(exc)[:200]}); "
                        f"it is logged from the study database once MLflow answers",
                        stacklevel=1,
                    )
                self._partial.add(number)
                return False
            self._pending.pop(0)
            self._partial.discard(number)
        return True

    def _delete_partial_run(self, number: int) -> None:
        """Remove the child run a broken-off logging of trial `number` may have left."""
        runs = self.client.search_runs(
            [self.experiment_id],
            filter_string=f"tags.mlflow.parentRunId = '{self.parent_run_id}' and tags.`slotune.trial` = '{number}'",
        )
        for run in runs:
            self.client.delete_run(run.info.run_id)

    def log_trial(self, trial) -> None:
        """One child run: params, `trial_values`, config, gates and latency histogram. Params, metrics
        and tags go in one `log_batch` (one request to a tracking server, not one each)."""
        c = self.client
        tags = {
            "mlflow.parentRunId": self.parent_run_id,
            "slotune.trial": str(trial.number),
            "slotune.state": trial.state.name,
            "slotune.study": self.spec.name,
        }
        run = c.create_run(self.experiment_id, run_name=f"trial-{trial.number}", tags=tags)
        rid = run.info.run_id
        r = TrialRecord.of(trial)
        values = trial_values(r, trial.state.name, self.spec)
        _log_batch(c, rid, metrics=values.metrics, params=trial.params, tags=values.tags)
        with tempfile.TemporaryDirectory() as d:
            if r.config:
                (Path(d) / "config.yaml").write_text(yaml.safe_dump(r.config, sort_keys=False))
            if r.gates:
                (Path(d) / "gates.json").write_text(json.dumps(r.gates, indent=1))
            lat = r.latencies
            if lat:
                _histogram(lat, Path(d) / "latency_histogram.png")
            if any(Path(d).iterdir()):
                c.log_artifacts(rid, d)
        c.set_terminated(rid, status="FINISHED" if trial.state.name == "COMPLETE" else "FAILED")

    def ui_hint(self) -> str:
        """How to open this study's runs table. MLflow 3.17's UI opens every experiment on its
        GenAI overview unless the link asks for the model-training view (its `workflowType`
        switch, kept in the browser); the `mlflow.experimentKind` tag alone no longer decides."""
        uri = self.spec.resolved_tracking_uri()
        serve = f"mlflow ui --backend-store-uri {uri}" if not uri.startswith("http") else uri
        return (
            f"MLflow: {serve}, then open #/experiments/{self.experiment_id}?workflowType=machine_learning "
            f"(the runs table)"
        )

    def log_study_end(self, best, config, report_paths: dict[str, Path], out: Path, **end) -> None:
        """The trials still waiting, then the parent run (`_log_study_end`); with MLflow unreachable,
        a warning: the study database and the output folder hold everything, and the next `tune run`
        of the study logs what is missing. `end`: `_log_study_end`'s confirmation and servers."""
        import warnings

        try:
            if self.flush(self.study):
                self._log_study_end(best, config, report_paths, out, **end)
                return
        except Exception as exc:
            warnings.warn(
                f"MLflow logging of the study's end failed: {type(exc).__name__}: {str(exc)[:200]}", stacklevel=1
            )
        warnings.warn(
            f"MLflow did not answer at the end of the study: {len(self._pending)} trial(s) and the parent run's "
            f"results are not logged; `tune run` of this spec again logs them from the study database",
            stacklevel=1,
        )

    def _log_study_end(self, best, config, report_paths: dict, out: Path, *, confirmation=None, servers=()) -> None:
        """Parent run: `study_end_values`, the winner's config (best.yaml, best_metrics.json) and the
        report; then close it."""
        c, rid = self.client, self.parent_run_id
        values = study_end_values(best, confirmation, servers)
        _log_batch(c, rid, metrics=values.metrics, tags=values.tags)
        if best is not None:
            for name in ("best.yaml", "best_metrics.json"):
                if (out / name).exists():
                    c.log_artifact(rid, str(out / name))
        for p in [*report_paths.values(), out / "sweep.json"]:  # sweep.json: the load curves, when swept
            if Path(p).exists():
                c.log_artifact(rid, str(p))
        c.set_terminated(rid, status="FINISHED")


@contextlib.contextmanager
def _local_store_lock(uri: str) -> Iterator[None]:
    """Hold an exclusive lock on `<db>.lock` beside a local SQLite store (no-op for other URIs)."""
    if not uri.startswith("sqlite:///"):
        yield
        return
    import fcntl

    path = Path(uri[len("sqlite:///") :] + ".lock")
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _retry(fn, attempts: int = 6):
    """`fn()`, tried again while another process creates the same MLflow tables or experiment."""
    for attempt in range(attempts):
        try:
            return fn()
        except Exception:
            if attempt == attempts - 1:
                raise
            time.sleep(0.3 * (attempt + 1))


def _log_batch(client, run_id: str, *, metrics: dict[str, float], params=None, tags=None) -> None:
    """Metrics, params and tags of a run in one `log_batch` call (MLflow splits it past its limits)."""
    from mlflow.entities import Metric, Param, RunTag

    now = int(time.time() * 1000)
    client.log_batch(
        run_id,
        metrics=[Metric(k, v, now, 0) for k, v in metrics.items()],
        params=[Param(k, str(v)) for k, v in (params or {}).items()],
        tags=[RunTag(k, v) for k, v in (tags or {}).items()],
    )


def _histogram(lat: dict[str, list[float]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(8, 3))
    for ax, key in zip(axes, ("ttft", "tpot")):
        vals = [v * 1e3 for v in lat.get(key, [])]
        if vals:
            ax.hist(vals, bins=20)
        ax.set_title(f"{key} (ms)")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def tracking_summary(tracking_uri: str, experiment: str) -> list[dict[str, Any]]:
    """Runs of an experiment as plain dicts (used by tests and scripts)."""
    import mlflow

    mlflow.set_tracking_uri(tracking_uri)
    exp = mlflow.get_experiment_by_name(experiment)
    if exp is None:
        return []
    runs = mlflow.tracking.MlflowClient().search_runs([exp.experiment_id], max_results=1000)
    return [
        {
            "run_id": r.info.run_id,
            "name": r.info.run_name,
            "tags": r.data.tags,
            "metrics": r.data.metrics,
            "params": r.data.params,
        }
        for r in runs
    ]
