"""The study loop: ask -> evaluate (isolated trial process) -> tell, then declare a winner.

Each trial's measurements, SLO constraint values, gate results and failure reason are stored
as Optuna user attributes, so the study storage alone (SQLite or PostgreSQL) holds the whole
record: a killed `tune run` resumes where it stopped, and several `--worker` processes on
several machines share one study.
"""

from __future__ import annotations

import json
import os
import socket
from pathlib import Path
from typing import Any

from slotune.tuner.objective import Objective, TrialFailure, measure, omp_wait_policy, trial_constraints
from slotune.tuner.spec import TuningSpec

DEFAULT_TAG, BASELINE_TAG = "default", "baseline"
# The naive server every result is compared with: static batches, no levers.
BASELINE_UPDATES = {"scheduling": "static", "enable_prefix_caching": False, "quantization": "none",
                    "speculative.method": "none", "kv_dtype": "auto"}


def make_sampler(spec: TuningSpec):
    """The spec's sampler, constraint-aware: SLO misses inform the search instead of vanishing."""
    import warnings

    import optuna

    # Optuna >= 5 reads constraints set on the trial (`Trial.set_constraint`, see objective.py);
    # older versions need `constraints_func`.
    con = {} if hasattr(optuna.trial.Trial, "set_constraint") else {"constraints_func": trial_constraints}
    s, seed = spec.sampler, spec.seed
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
        if s == "random":
            return optuna.samplers.RandomSampler(seed=seed)
        if s == "nsga2":
            return optuna.samplers.NSGAIISampler(seed=seed, population_size=max(4, min(50, spec.budget.n_trials // 2)), **con)
        if s == "gp":
            return optuna.samplers.GPSampler(seed=seed, **con)
        if s == "grid":
            return optuna.samplers.GridSampler(spec.space().grid(), seed=seed)
        return optuna.samplers.TPESampler(seed=seed, multivariate=True, group=True, n_startup_trials=4, **con)


def open_study(spec: TuningSpec, storage: str | None = None):
    """Create or load the spec's study (same name + storage = same study, for resume and workers)."""
    import warnings

    import optuna

    warnings.filterwarnings("ignore", category=optuna.exceptions.ExperimentalWarning)
    url = storage or spec.resolved_storage()
    if url.startswith("sqlite:///"):
        Path(url[len("sqlite:///"):]).parent.mkdir(parents=True, exist_ok=True)
    rdb = optuna.storages.RDBStorage(url, heartbeat_interval=10, grace_period=60,
                                     engine_kwargs={"pool_pre_ping": True} if not url.startswith("sqlite") else {})
    directions = [spec.objective.direction(m) for m in spec.objective.metrics]
    return optuna.create_study(study_name=spec.name, storage=rdb, sampler=make_sampler(spec),
                               directions=directions, load_if_exists=True)


def fail_orphaned_trials(study) -> int:
    """Mark RUNNING trials whose owning process on this host is gone as FAIL (after SIGKILL)."""
    from optuna.trial import TrialState

    n = 0
    host = socket.gethostname()
    for t in study.get_trials(deepcopy=False, states=(TrialState.RUNNING,)):
        if t.user_attrs.get("host") != host:
            continue  # another machine's worker: its heartbeat decides
        pid = t.user_attrs.get("pid")
        alive = False
        if pid:
            try:
                os.kill(pid, 0)
                alive = pid != os.getpid()
            except OSError:
                alive = False
        if not alive:
            study._storage.set_trial_user_attr(t._trial_id, "fail_reason", "orphaned: its tune run process was killed")
            study._storage.set_trial_state_values(t._trial_id, TrialState.FAIL)
            n += 1
    return n


def enqueue_reference_trials(study, spec: TuningSpec) -> None:
    """Default and naive baseline first, so every result is a comparison.

    A reference the space cannot express exactly (say the default max_num_seqs=16 in a space
    of 1..8) is not enqueued: `finalize` measures it beside the study instead, so a trial
    tagged `default` is always the true default config. A grid covers them on its own.
    """
    if study.trials or spec.sampler == "grid":
        return
    space = spec.space()
    base = spec.base_config()
    for tag, cfg in ((DEFAULT_TAG, base), (BASELINE_TAG, base.with_updates(BASELINE_UPDATES))):
        params = _params_of(space, cfg, base)
        if params is not None and (tag == DEFAULT_TAG or cfg != base):
            study.enqueue_trial(params, user_attrs={"tag": tag}, skip_if_exists=True)


def _params_of(space, cfg, base) -> dict[str, Any] | None:
    """The space's parameters that turn `base` into exactly `cfg` (as a trial would), or None."""
    params: dict[str, Any] = {}
    for k in space.knobs:
        if not all(params.get(f) in vals for f, vals in k.when.items()):
            continue  # an inactive conditional knob
        v = cfg
        for part in k.name.split("."):
            v = getattr(v, part)
        if not _representable(k, v):
            return None
        params[k.name] = v
    return params if base.with_updates(params) == cfg else None


def _representable(knob, value) -> bool:
    if knob.type == "categorical":
        return value in knob.choices
    return isinstance(value, (int, float)) and not isinstance(value, bool) and knob.low <= value <= knob.high


def best_trial(study, spec: TuningSpec):
    """Best feasible completed trial (first objective), or None."""
    from optuna.trial import TrialState

    done = [t for t in study.get_trials(states=(TrialState.COMPLETE,)) if t.user_attrs.get("feasible")]
    if not done:
        return None
    sign = 1 if spec.objective.direction() == "minimize" else -1
    return min(done, key=lambda t: sign * t.values[0])


def run_command(spec_path: Path | None, n_trials: int | None = None, storage: str | None = None,
                output_dir: Path | None = None, worker: bool = False, progress: bool = True) -> dict[str, Any] | None:
    """`tune run`: run (or resume) the study, then re-measure the winner and write best.yaml + report.

    Args:
        spec_path: tuning spec YAML; None = the built-in quickstart spec.
        n_trials: overrides budget.n_trials (the total over all runs and workers of this study).
        storage: Optuna storage URL override (e.g. a PostgreSQL URL shared by several workers).
        output_dir: overrides the spec's output_dir.
        worker: join an existing study: run trials only (no reference trials, no report).
        progress: live display (True) or plain log lines (False).

    Returns:
        The winner summary (also written to best_metrics.json), or None for a worker or when
        no trial met the SLO and the gates.
    """
    import optuna

    from slotune.tuner.progress import Progress
    from slotune.tuner.spec import default_spec_path

    spec = TuningSpec.from_yaml(spec_path if spec_path is not None else default_spec_path())
    if output_dir is not None:
        spec.output_dir = str(output_dir)
    if storage:
        spec.storage = storage
    if n_trials is not None:
        spec.budget.n_trials = n_trials
    spec.resolved_output_dir().mkdir(parents=True, exist_ok=True)
    optuna.logging.set_verbosity(optuna.logging.ERROR)  # our progress lines report failed trials
    study = open_study(spec)
    if not worker:
        fail_orphaned_trials(study)
        enqueue_reference_trials(study, spec)
    total = spec.budget.n_trials
    # Resolve "auto" (and a user's OMP_WAIT_POLICY) now: every trial of this run, the progress
    # line and the MLflow tag then show the one policy the trials really ran with.
    spec.budget.trial_omp_wait_policy = omp_wait_policy(spec.budget.trial_omp_wait_policy)
    tracker = None
    if not worker or spec.mlflow_tracking_uri:
        from slotune.tuner.tracking import MLflowTracker

        tracker = MLflowTracker(spec, study)
    with Progress(spec, total, enabled=progress) as prog:
        prog.seed_rows(study)
        prog.say(f"trials run with OMP_WAIT_POLICY={spec.budget.trial_omp_wait_policy}"
                 f" (budget.trial_omp_wait_policy; {os.cpu_count()} cores)")
        # The budget counts every finished trial of the study (resumed runs and all workers
        # together) except forbidden combinations, which are rejected before any measurement.
        budget = TrialBudget(total)
        callbacks = [c for c in (tracker, prog.callback) if c is not None] + [budget]
        if not budget.exhausted(study):
            study.optimize(Objective(spec, prog), n_trials=None, timeout=spec.budget.timeout_s,
                           callbacks=callbacks, catch=(TrialFailure,), gc_after_trial=True)
        if worker:
            return None
        prog.phase(None, "re-measuring the winner on a fresh workload seed")
        return finalize(spec, study, tracker, prog)


class TrialBudget:
    """Optuna callback: stop every worker once the study holds `total` measured trials.

    Like optuna's MaxTrialsCallback, but trials pruned as forbidden combinations are not
    counted (TPE proposes them again and again on small spaces; they cost no measurement).
    A sampler stuck on forbidden points still stops, after `forbidden_factor` x total of them.
    """

    def __init__(self, total: int, forbidden_factor: int = 5) -> None:
        self.total, self.forbidden_factor = total, forbidden_factor

    def counts(self, study) -> tuple[int, int]:
        """(measured trials finished, forbidden trials)."""
        from optuna.trial import TrialState

        done = study.get_trials(deepcopy=False, states=(TrialState.COMPLETE, TrialState.FAIL, TrialState.PRUNED))
        forbidden = sum(bool(t.user_attrs.get("forbidden")) for t in done)
        return len(done) - forbidden, forbidden

    def exhausted(self, study) -> bool:
        measured, forbidden = self.counts(study)
        return measured >= self.total or forbidden >= self.forbidden_factor * self.total

    def __call__(self, study, trial) -> None:
        if self.exhausted(study):
            study.stop()


def finalize(spec: TuningSpec, study, tracker=None, prog=None) -> dict[str, Any] | None:
    """Re-measure the winner on a fresh workload seed, write best.yaml, best_metrics.json, report."""
    from slotune.engine.config import EngineConfig
    from slotune.tuner.report import write_report

    out = spec.resolved_output_dir()
    say = prog.say if prog is not None else print
    best = best_trial(study, spec)
    _measure_references_if_missing(spec, study)
    if best is None:
        for stale in ("best.yaml", "best_metrics.json"):  # never leave an older winner behind
            (out / stale).unlink(missing_ok=True)
        report = write_report(spec, study, None, None, out)
        if tracker is not None:
            tracker.log_study_end(None, None, report, out)
        if prog is not None:
            prog.finish()
        say("no trial met the SLO and the quality gates; see the report for why: " + str(report["md"]))
        return None
    config = EngineConfig.model_validate(best.user_attrs["config"])
    key = f"remeasure_{best.number}"
    remeasure = study.user_attrs.get(key)
    if remeasure is None:  # stored, so a resumed finalize does not measure twice
        try:
            r = measure(spec, config, seed=spec.robustness_seed, early_stop=False)
            remeasure = {"seed": spec.robustness_seed, "metrics": r["metrics"], "violations": r["violations"]}
        except TrialFailure as exc:
            remeasure = {"seed": spec.robustness_seed, "error": exc.reason}
        study.set_user_attr(key, remeasure)
    obj = spec.objective
    (out / "best.yaml").write_text(
        f"# slotune best config for study '{spec.name}' (trial {best.number}); "
        f"{obj.metric_key()} = {best.values[0]:.6g}, re-measured on seed {spec.robustness_seed}: "
        f"{_fmt_metric(remeasure, obj.metric_key())}; metrics in best_metrics.json\n" + config.to_yaml())
    summary = {"study": spec.name, "trial": best.number, "objective": obj.metric_key(),
               "direction": obj.direction(), "value": best.values[0], "metrics": best.user_attrs["metrics"],
               "remeasured": remeasure, "params": best.params, "references": reference_metrics(study),
               "mlflow_run_id": tracker.parent_run_id if tracker is not None else None}
    (out / "best_metrics.json").write_text(json.dumps(summary, indent=1))
    report = write_report(spec, study, best, remeasure, out)
    if tracker is not None:
        tracker.log_study_end(best, config, report, out)
    if prog is not None:
        prog.summary(best, remeasure, summary["references"], out)
    return summary


def _fmt_metric(remeasure: dict, key: str) -> str:
    v = (remeasure.get("metrics") or {}).get(key)
    return f"{v:.6g}" if v is not None else f"failed ({remeasure.get('error', 'not measured')})"


def _measure_references_if_missing(spec: TuningSpec, study) -> None:
    """Measure the default / baseline config beside the study when no trial is tagged with it."""
    tagged = {t.user_attrs.get("tag") for t in study.trials if t.state.name == "COMPLETE"}
    base = spec.base_config()
    for tag, cfg in ((DEFAULT_TAG, base), (BASELINE_TAG, base.with_updates(BASELINE_UPDATES))):
        if tag in tagged or tag in study.user_attrs:
            continue
        try:
            r = measure(spec, cfg, early_stop=False)
            study.set_user_attr(tag, {"metrics": r["metrics"], "config": cfg.model_dump(mode="json")})
        except TrialFailure as exc:
            study.set_user_attr(tag, {"error": exc.reason})


def reference_metrics(study) -> dict[str, dict | None]:
    """Metrics of the default-config and naive-baseline trials (or the side measurement)."""
    refs: dict[str, dict | None] = {DEFAULT_TAG: None, BASELINE_TAG: None}
    for t in study.trials:
        tag = t.user_attrs.get("tag")
        if tag in refs and t.state.name == "COMPLETE" and refs[tag] is None:
            refs[tag] = t.user_attrs.get("metrics")
    for tag in refs:
        if refs[tag] is None:
            refs[tag] = (study.user_attrs.get(tag) or {}).get("metrics")
    return refs
