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

from slotune.tuner.objective import TrialFailure, run_trial_process
from slotune.tuner.spec import TuningSpec

DEFAULT_TAG, BASELINE_TAG = "default", "baseline"
# The naive server every result is compared with: static batches, no levers.
BASELINE_UPDATES = {"scheduling": "static", "enable_prefix_caching": False, "quantization": "none",
                    "speculative.method": "none", "kv_dtype": "auto"}


def _constraints(trial) -> list[float]:
    v = trial.user_attrs.get("violations")
    return list(v.values()) if v else [0.0]


def make_sampler(spec: TuningSpec):
    import optuna

    s, seed = spec.sampler, spec.seed
    if s == "random":
        return optuna.samplers.RandomSampler(seed=seed)
    if s == "nsga2":
        return optuna.samplers.NSGAIISampler(seed=seed, constraints_func=_constraints)
    if s == "gp":
        return optuna.samplers.GPSampler(seed=seed, constraints_func=_constraints)
    if s == "grid":
        return optuna.samplers.GridSampler(spec.space().grid(), seed=seed)
    return optuna.samplers.TPESampler(seed=seed, constraints_func=_constraints, multivariate=True, group=True,
                                      n_startup_trials=4)


def open_study(spec: TuningSpec, storage: str | None = None):
    import optuna

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
    """Default and naive baseline first, so every result is a comparison (a grid covers them)."""
    if study.trials or spec.sampler == "grid":
        return
    space = spec.space()
    base = spec.base_config()
    default_params: dict[str, Any] = {}
    for k in space.knobs:
        if all(default_params.get(f) in vals for f, vals in k.when.items()):
            v = base
            for part in k.name.split("."):
                v = getattr(v, part)
            if _representable(k, v):
                default_params[k.name] = v  # else (e.g. dtype 'auto' vs [float32, bfloat16]) the sampler picks
    baseline = dict(default_params)
    for name, value in BASELINE_UPDATES.items():
        if name in baseline:
            baseline[name] = value
    for k in space.knobs:  # drop conditional knobs whose condition the baseline no longer meets
        if k.name in baseline and not all(baseline.get(f) in vals for f, vals in k.when.items()):
            baseline.pop(k.name)
    study.enqueue_trial(default_params, user_attrs={"tag": DEFAULT_TAG}, skip_if_exists=True)
    if baseline != default_params:
        study.enqueue_trial(baseline, user_attrs={"tag": BASELINE_TAG}, skip_if_exists=True)


def _representable(knob, value) -> bool:
    if knob.type == "categorical":
        return value in knob.choices
    return isinstance(value, (int, float)) and not isinstance(value, bool) and knob.low <= value <= knob.high


def trial_request(spec: TuningSpec, config, seed: int | None = None) -> dict[str, Any]:
    return {
        "config": config.model_dump(mode="json"),
        "workload": spec.workload_spec().model_dump(mode="json"),
        "objective": spec.objective.model_dump(mode="json"),
        "gates": spec.quality_gates,
        "early_stop": spec.early_stop.model_dump(mode="json"),
        "seed": seed,
        "cache_dir": str(spec.resolved_output_dir() / "cache"),
    }


class Objective:
    """The Optuna objective: sample -> build config -> measure in a child process -> score."""

    def __init__(self, spec: TuningSpec, progress=None) -> None:
        self.spec = spec
        self.space = spec.space()
        self.base = spec.base_config()
        self.progress = progress

    def __call__(self, trial) -> float | list[float]:
        import optuna

        trial.set_user_attr("host", socket.gethostname())
        trial.set_user_attr("pid", os.getpid())
        params = self.space.sample(trial)
        reason = self.space.forbidden_reason(params)
        if reason:
            trial.set_user_attr("fail_reason", reason)
            raise optuna.TrialPruned(reason)
        try:
            config = self.base.with_updates(params)
        except ValueError as exc:
            trial.set_user_attr("fail_reason", f"invalid config: {str(exc).splitlines()[0]}")
            raise TrialFailure(f"invalid config: {exc}") from None
        trial.set_user_attr("config", config.model_dump(mode="json"))
        if self.progress:
            self.progress.phase(trial.number, "measuring")
        b = self.spec.budget
        try:
            result = run_trial_process(trial_request(self.spec, config), timeout_s=b.trial_timeout_s, memory_gb=b.trial_memory_gb)
        except TrialFailure as exc:
            trial.set_user_attr("fail_reason", exc.reason)
            raise
        m = result["metrics"]
        trial.set_user_attr("metrics", m)
        trial.set_user_attr("violations", result["violations"] or {"none": 0.0})
        trial.set_user_attr("feasible", all(v <= 0 for v in result["violations"].values()))
        trial.set_user_attr("early_stopped", result["early_stopped"])
        if result.get("gates") is not None:
            trial.set_user_attr("gates", result["gates"])
        if result.get("latencies"):
            trial.set_user_attr("latencies", result["latencies"])
        obj = self.spec.objective
        values = []
        for metric in obj.metrics:
            key = obj.metric_key(metric)
            if key not in m:
                raise TrialFailure(f"metric {key} was not measured")
            values.append(float(m[key]))
        return values if len(values) > 1 else values[0]


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
    """`tune run`: run (or resume) the study, then re-measure and write the winner and report."""
    import optuna

    from slotune.tuner.progress import Progress
    from slotune.tuner.spec import default_spec_path

    spec_path = spec_path if spec_path is not None else default_spec_path()
    spec = TuningSpec.from_yaml(spec_path)
    if output_dir is not None:
        spec.output_dir = str(output_dir)
    if storage:
        spec.storage = storage
    out = spec.resolved_output_dir()
    out.mkdir(parents=True, exist_ok=True)
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    study = open_study(spec)
    if not worker:
        fail_orphaned_trials(study)
        enqueue_reference_trials(study, spec)
    from optuna.trial import TrialState

    total = n_trials or spec.budget.n_trials
    finished_states = (TrialState.COMPLETE, TrialState.FAIL, TrialState.PRUNED)
    callbacks = []
    tracker = None
    if not worker or spec.mlflow_tracking_uri:
        from slotune.tuner.tracking import MLflowTracker

        tracker = MLflowTracker(spec, study)
        callbacks.append(tracker)
    with Progress(spec, total, enabled=progress) as prog:
        callbacks.append(prog.callback)
        objective = Objective(spec, prog)
        # The budget counts every finished trial of the study, so a resumed or shared study
        # runs only what is left: MaxTrialsCallback stops all workers at the same total.
        callbacks.append(optuna.study.MaxTrialsCallback(total, states=finished_states))
        remaining = total - len(study.get_trials(states=finished_states))
        if remaining > 0:
            study.optimize(objective, n_trials=remaining, timeout=spec.budget.timeout_s,
                           callbacks=callbacks, catch=(TrialFailure,), gc_after_trial=True)
    if worker:
        return None
    return finalize(spec, study, tracker)


def finalize(spec: TuningSpec, study, tracker=None) -> dict[str, Any] | None:
    """Re-measure the winner on a fresh workload seed, write best.yaml + report."""
    from rich.console import Console

    from slotune.engine.config import EngineConfig
    from slotune.tuner.report import write_report

    out = spec.resolved_output_dir()
    console = Console()
    best = best_trial(study, spec)
    if best is None:
        console.print("[red]no trial met the SLO and the gates[/red]; see the report for why")
        write_report(spec, study, None, None, out)
        return None
    config = EngineConfig.model_validate(best.user_attrs["config"])
    remeasure = study.user_attrs.get(f"remeasure_{best.number}")
    if remeasure is None:
        try:
            r = run_trial_process(trial_request(spec, config, seed=spec.robustness_seed),
                                  timeout_s=spec.budget.trial_timeout_s, memory_gb=spec.budget.trial_memory_gb)
            remeasure = {"metrics": r["metrics"], "violations": r["violations"]}
        except TrialFailure as exc:
            remeasure = {"error": exc.reason}
        study.set_user_attr(f"remeasure_{best.number}", remeasure)
    if not any(t.user_attrs.get("tag") == BASELINE_TAG for t in study.trials) and "baseline" not in study.user_attrs:
        # The space cannot express the naive baseline: measure it once beside the study.
        base_cfg = spec.base_config().with_updates(BASELINE_UPDATES)
        try:
            r = run_trial_process(trial_request(spec, base_cfg), timeout_s=spec.budget.trial_timeout_s,
                                  memory_gb=spec.budget.trial_memory_gb)
            study.set_user_attr("baseline", {"metrics": r["metrics"], "config": base_cfg.model_dump(mode="json")})
        except TrialFailure as exc:
            study.set_user_attr("baseline", {"error": exc.reason})
    (out / "best.yaml").write_text(
        f"# slotune best config for study '{spec.name}' (trial {best.number}); "
        f"{spec.objective.metric_key()} = {best.values[0]:.6g}\n" + config.to_yaml())
    summary = {"study": spec.name, "trial": best.number, "objective": spec.objective.metric_key(),
               "value": best.values[0], "metrics": best.user_attrs["metrics"], "remeasured": remeasure,
               "params": best.params}
    (out / "best_metrics.json").write_text(json.dumps(summary, indent=1))
    report = write_report(spec, study, best, remeasure, out)
    if tracker is not None:
        tracker.log_winner(best, config, report, out)
    console.print(f"[green]best[/green]: trial {best.number}, {spec.objective.metric_key()} = {best.values[0]:.4g} "
                  f"-> {out / 'best.yaml'}")
    return summary
