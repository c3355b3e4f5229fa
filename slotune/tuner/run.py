"""`tune run`: open or resume the study, run trials until the budget is spent, then `finalize`: confirm and
declare the winner, write best.yaml, best_metrics.json and the report, close the MLflow run."""

from __future__ import annotations

import json
import os
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

from slotune.tuner.decide.confirm import candidates, run_confirmation
from slotune.tuner.decide.standings import standings
from slotune.tuner.measure.measurement import Measurement
from slotune.tuner.measure.trial_process import (
    DEFAULT_TRIAL_RUNNER,
    TrialFailure,
    measure,
    omp_wait_policy,
    trials_die_with_this_process,
)
from slotune.tuner.report.confirmation import best_yaml_header, confirmation_section, progress_line, shootout_section
from slotune.tuner.report.markdown import write_atomic, write_report
from slotune.tuner.report.progress import Progress
from slotune.tuner.search.budget import TrialBudget
from slotune.tuner.search.objective import TrialObjective
from slotune.tuner.search.records import TrialRecord, store_side_measurement, store_winner
from slotune.tuner.search.references import (
    reference_configs,
    reference_metrics,
    side_measurement,
    trial_tag,
)
from slotune.tuner.search.retry import retry_if_infrastructure
from slotune.tuner.search.starts import StartRepairs, enqueue_reference_trials
from slotune.tuner.search.study import (
    HEARTBEAT_GRACE_S,
    HEARTBEAT_INTERVAL_S,
    FailedTrialCallback,
    StorageUnreachable,
    fail_orphaned_trials,
    open_study,
)
from slotune.tuner.spec.server import parse_config
from slotune.tuner.spec.tuning_spec import TuningSpec, default_spec_path
from slotune.tuner.sweep import sweep_after_study
from slotune.tuner.tracking import MLflowTracker


def run_command(
    spec_path: Path | None,
    n_trials: int | None = None,
    storage: str | None = None,
    output_dir: Path | None = None,
    worker: bool = False,
    progress: bool = True,
    force_new: bool = False,
    resume_anyway: bool = False,
    trial_runner: tuple[str, ...] = DEFAULT_TRIAL_RUNNER,
    tracking: bool = True,
) -> dict[str, Any] | None:
    """`tune run`: run (or resume) the study, then confirm the best trials and write best.yaml + report.

    Args:
        spec_path: tuning spec YAML; None = the built-in quickstart spec.
        n_trials: overrides budget.n_trials (the total over all runs and workers of this study).
        storage: Optuna storage URL override (e.g. a PostgreSQL URL shared by several workers).
        output_dir: overrides the spec's output_dir.
        worker: join an existing study: run trials only (no reference trials, no report).
        progress: live display (True) or plain log lines (False).
        force_new: `--force-new`: start a fresh study under the spec's name (see `open_study`).
        resume_anyway: `--resume-anyway`: continue a study made for a different spec.
        trial_runner: the trial process's command (tests supply a stand-in; see
            `trial_process.run_trial_process`).
        tracking: `--no-tracking` (False): no MLflow; the study database and the report still hold
            every trial.

    Returns:
        The winner summary (also written to best_metrics.json), or None for a worker or when
        no trial met the SLO and the gates.

    Raises:
        StudySpecChanged: the stored study was made for a different spec (see `open_study`).
    """
    import optuna

    if worker and force_new:
        raise ValueError("--force-new replaces the study, which a --worker only joins: run it without --worker")
    spec = TuningSpec.from_yaml(spec_path if spec_path is not None else default_spec_path())
    if output_dir is not None:
        spec.output_dir = str(output_dir)
    if storage:
        spec.storage = storage
    if n_trials is not None:
        spec.budget.n_trials = n_trials
    spec.resolved_output_dir().mkdir(parents=True, exist_ok=True)
    optuna.logging.set_verbosity(optuna.logging.ERROR)  # our progress lines report failed trials
    retry = _Retry()
    on_failed = _Relay([retry])  # trials failed for a dead process (heartbeat or pid) -> retry, MLflow
    study, is_new = open_study(spec, force_new=force_new, resume_anyway=resume_anyway, failed_trial_callback=on_failed)
    if is_new and not worker:
        enqueue_reference_trials(study, spec)
    total = spec.budget.n_trials
    # Resolve "auto" (and a user's OMP_WAIT_POLICY) now: every trial of this run, the progress
    # line and the MLflow tag then show the one policy the trials really ran with.
    spec.budget.trial_omp_wait_policy = omp_wait_policy(spec.budget.trial_omp_wait_policy)
    tracker = None
    if tracking and (not worker or spec.mlflow_tracking_uri):
        try:
            tracker = MLflowTracker(spec, study)
            on_failed.targets.append(tracker)
        except Exception as exc:  # tracking is evidence, not control: a study never waits for MLflow
            warnings.warn(
                f"MLflow at {spec.resolved_tracking_uri()} did not answer ({type(exc).__name__}: {str(exc)[:200]}); "
                f"the study runs without it, and `tune run` of this spec again logs every trial",
                stacklevel=1,
            )
    if not worker:
        fail_orphaned_trials(study, on_failed)
    with Progress(spec, total, enabled=progress) as prog, trials_die_with_this_process():
        prog.seed_rows(study)
        if not spec.is_external:
            prog.say(
                f"trials run with OMP_WAIT_POLICY={spec.budget.trial_omp_wait_policy}"
                f" (budget.trial_omp_wait_policy; {os.cpu_count()} cores)"
            )
        # The budget counts every measured trial of the study (resumed runs and all processes
        # together), not forbidden combinations or invalid configs, rejected before any measurement.
        budget = TrialBudget(total)
        objective = TrialObjective(spec, prog, budget, runner=trial_runner)
        # The retry first: the budget then knows the failed attempt is replaced.
        retry.say = prog.say
        callbacks = [retry, *(c for c in (tracker, prog.callback) if c is not None)]
        callbacks += [budget, StartRepairs(spec)]

        def optimize() -> None:
            if budget.exhausted(study):
                return
            try:
                study.optimize(
                    objective,
                    n_trials=None,
                    timeout=spec.budget.timeout_s,
                    callbacks=callbacks,
                    catch=(TrialFailure,),
                    gc_after_trial=True,
                )
            except KeyboardInterrupt:  # Optuna failed the trial and skipped the callbacks
                _on_interrupted(study, objective.current, retry, tracker)
                raise
            except UnboundLocalError as exc:
                # Optuna's _run_trial hides a storage error in its tell under this one (optuna#5280)
                if isinstance(exc.__context__, StorageUnreachable):
                    raise exc.__context__ from None
                raise

        optimize()
        if worker:
            return None
        wait_for_running_trials(study, spec, prog.say, on_failed)
        while _waiting_retries(study) and not budget.exhausted(study):  # another process's trials, retried here
            optimize()
            wait_for_running_trials(study, spec, prog.say, on_failed)
        prog.phase(None, "confirming the best trials on fresh workload seeds")
        return finalize(spec, study, tracker, prog, runner=trial_runner)


class _Relay:
    """One (study, FrozenTrial) callback handed to the storage before all its targets exist."""

    def __init__(self, targets: list[FailedTrialCallback]) -> None:
        self.targets = targets

    def __call__(self, study, trial) -> None:
        for target in self.targets:
            target(study, trial)


class _Retry:
    """`retry_if_infrastructure` as a (study, FrozenTrial) callback that says what it enqueued."""

    def __init__(self) -> None:
        self.say: Callable[[str], None] = print

    def __call__(self, study, trial) -> None:
        number = retry_if_infrastructure(study, trial)
        if number is not None:
            reason = TrialRecord.of(trial).fail_reason or ""
            self.say(
                f"trial {trial.number} is measured again as trial {number}: {reason.split(':')[0]}, not its config"
            )


def _waiting_retries(study) -> bool:
    from optuna.trial import TrialState

    return any(
        TrialRecord.of(t).retry_of is not None for t in study.get_trials(deepcopy=False, states=(TrialState.WAITING,))
    )


def _on_interrupted(study, number: int | None, retry: _Retry, tracker) -> None:
    """Optuna failed the interrupted trial and skipped the callbacks: the retry and MLflow still see it."""
    if number is None:
        return
    for t in study.get_trials(deepcopy=False):
        if t.number == number and t.state.name == "FAIL":
            retry(study, t)
            if tracker is not None:
                tracker(study, t)


def wait_for_running_trials(
    study,
    spec: TuningSpec,
    say: Callable[[str], None],
    on_failed: FailedTrialCallback | None = None,
    poll_s: float = 1.0,
) -> list[int]:
    """Block until no trial of the study is running, so the winner is declared over all of them.

    Other processes' trials end within budget.trial_timeout_s while their process lives (it kills
    a trial past that); a trial whose process died is failed here (same host, at once) or by
    Optuna's heartbeat (after HEARTBEAT_GRACE_S). Past both, waiting stops.

    Returns:
        The numbers of trials still running when waiting stopped (normally none).
    """
    import optuna
    from optuna.trial import TrialState

    deadline = time.monotonic() + spec.budget.trial_timeout_s + HEARTBEAT_GRACE_S + 2 * HEARTBEAT_INTERVAL_S
    is_announced = False
    while True:
        fail_orphaned_trials(study, on_failed)
        optuna.storages.fail_stale_trials(study)
        running = [t.number for t in study.get_trials(deepcopy=False, states=(TrialState.RUNNING,))]
        if not running:
            return []
        if time.monotonic() > deadline:
            say(f"trials {running} are still running past budget.trial_timeout_s: the winner is declared without them")
            return running
        if not is_announced:
            say(
                f"waiting for {len(running)} running trial(s) of other processes ({running}) before declaring the winner"
            )
            is_announced = True
        time.sleep(poll_s)


def finalize(
    spec: TuningSpec, study, tracker=None, prog=None, runner: tuple[str, ...] = DEFAULT_TRIAL_RUNNER
) -> dict[str, Any] | None:
    """Confirm the best trials on fresh workload seeds (slotune/tuner/decide/confirm.py), declare the winner on
    those numbers, write best.yaml, best_metrics.json and the report."""
    out = spec.resolved_output_dir()
    say = prog.say if prog is not None else print
    trials = candidates(study, spec)
    _measure_references_if_missing(spec, study, runner)
    if not trials:
        for stale in ("best.yaml", "best_metrics.json"):  # never leave an older winner behind
            (out / stale).unlink(missing_ok=True)
        report = write_report(spec, study, None, None, out)
        if tracker is not None:
            tracker.log_study_end(None, None, report, out)
        if prog is not None:
            prog.finish()
        say("no trial met the SLO and the quality gates; see the report for why: " + str(report["md"]))
        return None
    started = time.perf_counter()
    confirmation = run_confirmation(
        spec,
        study,
        trials,
        runner=runner,
        on_run=lambda r, i, n: say(progress_line(r, i, n, spec.objective.metric_key())),
    )
    confirm_s = time.perf_counter() - started
    best = next(t for t in trials if t.number == confirmation.winner)
    store_winner(study, best.number)  # the declared winner, for later studies' warm starts
    remeasure = confirmation.declared()
    config = parse_config(best.config)
    write_atomic(out / "best.yaml", best_yaml_header(spec, best, confirmation, remeasure) + config.to_yaml())
    refs = reference_metrics(study)
    summary = {
        "study": spec.name,
        "trial": best.number,
        "objective": spec.objective.metric_key(),
        "direction": spec.objective.direction(),
        "value": best.values[0],
        "metrics": best.metrics.to_dict(),
        "remeasured": _stored(remeasure),
        "confirmed": confirmation.confirmed,
        "best_by_trial": confirmation.candidates[0],
        "confirm": confirmation.to_json(),
        "confirm_s": round(confirm_s, 1),  # this run's seconds in the confirmation (a resume measures what is missing)
        "params": best.params,
        "machine": best.machine,
        "references": _stored(refs),
        "mlflow_run_id": tracker.parent_run_id if tracker is not None else None,
    }
    servers = standings([s.label for s in spec.servers or []], confirmation, {t.number: t.config for t in trials})
    if spec.servers:
        summary["servers"] = [s.to_dict() for s in servers]
    write_atomic(out / "best_metrics.json", json.dumps(summary, indent=1))
    report = write_report(
        spec,
        study,
        best,
        remeasure,
        out,
        sections=[
            confirmation_section(confirmation, {t.number: t.values[0] for t in trials}, spec.workload.seed),
            *([shootout_section(servers, confirmation.key)] if spec.servers else []),
            *sweep_after_study(spec, study, best, runner=runner, say=say),
        ],
    )
    if tracker is not None:
        tracker.log_study_end(best, config, report, out, confirmation=confirmation, servers=servers)
    if prog is not None:
        prog.summary(best, remeasure, refs, out)
    if tracker is not None:
        say(tracker.ui_hint())
    return summary


def _stored(d: dict[str, Any]) -> dict[str, Any]:
    """`d` with its Measurements in their stored form (best_metrics.json)."""
    return {k: v.to_dict() if isinstance(v, Measurement) else v for k, v in d.items()}


def _measure_references_if_missing(spec: TuningSpec, study, runner: tuple[str, ...] = DEFAULT_TRIAL_RUNNER) -> None:
    """Measure the default / naive config beside the study when no trial is tagged with it."""
    tagged = {trial_tag(t) for t in study.trials if t.state.name == "COMPLETE"}
    base = spec.base_config()
    for tag, cfg in reference_configs(base):
        if tag in tagged or side_measurement(study, tag) is not None:
            continue
        try:
            r = measure(spec, cfg, early_stop=False, runner=runner)
            store_side_measurement(
                study,
                tag,
                {"metrics": r.metrics.to_dict(), "latencies": r.latencies, "config": cfg.model_dump(mode="json")},
            )
        except TrialFailure as exc:
            store_side_measurement(study, tag, {"error": exc.reason})
