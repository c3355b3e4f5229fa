"""The study loop: ask -> evaluate (isolated trial process) -> tell, then declare a winner.

Each trial's measurements, SLO constraint values, gate results and failure reason are stored
as Optuna user attributes, so the study storage alone (SQLite or PostgreSQL) holds the whole
record: a killed `tune run` resumes where it stopped, and several `tune run` (or `--worker`)
processes on several machines share one study.

Sharing rules, all through the storage: the process that creates the study enqueues the
reference trials; a trial is measured only if fewer than `budget.n_trials` measured trials
precede it (`TrialBudget.admits`, decided after Optuna numbered it, so no two processes take the
same slot); the winner is declared only once no trial of any process is running. A study
remembers the fingerprint of the spec that defines its objective and refuses a changed one.
"""

from __future__ import annotations

import hashlib
import inspect
import json
import os
import socket
import time
from collections.abc import Callable
from datetime import datetime
from pathlib import Path
from typing import Any

from slotune.engine.config import EngineConfig
from slotune.tuner.decide.confirm import candidates, confirm_round, run_declaration, run_round
from slotune.tuner.search.objective import (
    DEFAULT_TRIAL_RUNNER,
    UNMEASURED_OVER_BUDGET,
    Objective,
    TrialFailure,
    best_trial,
    budget_share,
    is_measured,
    measure,
    omp_wait_policy,
    trial_constraints,
    trials_die_with_this_process,
)
from slotune.tuner.report.progress import Progress
from slotune.tuner.search.references import DEFAULT_TAG, reference_configs, reference_metrics, side_measurement, trial_tag
from slotune.tuner.report.markdown import write_atomic, write_report
from slotune.tuner.spec.slo import SLO_KEYS
from slotune.tuner.spec.tuning_spec import TuningSpec, default_spec_path
from slotune.tuner.sweep import sweep_after_study
from slotune.tuner.tracking import MLflowTracker
from slotune.tuner.measure.units import seeds_words

# Optuna heartbeat: a running trial whose process has not written for GRACE_S is failed by the
# next process that asks for a trial (`optuna.storages.fail_stale_trials`).
HEARTBEAT_INTERVAL_S, HEARTBEAT_GRACE_S = 10, 60
FINGERPRINT_ATTR = "spec_fingerprint"
MAX_WARM_STARTS = 2  # earlier studies' winners enqueued at the start of a new study
WINNER_ATTR = "winner_trial"  # the trial `finalize` declared the winner

FailedTrialCallback = Callable[[Any, Any], None]  # (study, FrozenTrial), as Optuna's callbacks


class StudySpecChanged(ValueError):
    """The stored study was made for a spec whose objective-defining parts differ."""


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
            return optuna.samplers.NSGAIISampler(
                seed=seed, population_size=max(4, min(50, spec.budget.n_trials // 2)), **con
            )
        if s == "gp":
            return optuna.samplers.GPSampler(seed=seed, **con)
        if s == "grid":
            return optuna.samplers.GridSampler(spec.search_space.grid(), seed=seed)
        return optuna.samplers.TPESampler(seed=seed, multivariate=True, group=True, n_startup_trials=4, **con)


def make_pruner(spec: TuningSpec):
    """The spec's pruner: with `screening`, `ScreeningPruner` on the short replay's value (step 0);
    else none."""
    import optuna

    from slotune.tuner.search.screening import ScreeningPruner

    s = spec.screening
    return ScreeningPruner(s.percentile, s.n_startup_trials) if s.enabled else optuna.pruners.NopPruner()


def spec_fingerprint(spec: TuningSpec) -> dict[str, Any]:
    """SHA-256 of the parts of `spec` that define what a trial's numbers mean.

    Resolved (a built-in workload by its content), in canonical JSON, without the fields left at
    their defaults (so a slotune that adds a field keeps the fingerprints of existing studies).
    Budget, sampler, seed and early-stop settings are left out: changing them continues a study.
    The price (`cost`) is a part only when set: the trials' $ numbers are at that price.

    Returns:
        {"sha256": hex digest of all parts, "parts": {part: first 16 hex digits of its own}}.
    """
    parts = {
        "workload": spec.workload.model_dump(mode="json", exclude_defaults=True),
        # `starts` only choose which trials run first, not what a trial measures: a built-in space
        # that gains a starting point keeps its studies
        "search_space": spec.search_space.model_dump(mode="json", exclude_defaults=True, exclude={"starts"}),
        "objective": spec.objective.model_dump(mode="json", exclude_defaults=True),
        "quality_gates": [g.model_dump(mode="json", exclude_defaults=True) for g in spec.quality_gates],
        "engine": spec.base_config().model_dump(mode="json", exclude_defaults=True),
        "measure": spec.budget.measure,
    }
    if spec.cost is not None:
        parts["cost"] = spec.cost.model_dump(mode="json")
    canon = {k: json.dumps(v, sort_keys=True, separators=(",", ":")) for k, v in parts.items()}
    whole = json.dumps(canon, sort_keys=True, separators=(",", ":"))
    return {
        "sha256": hashlib.sha256(whole.encode()).hexdigest(),
        "parts": {k: hashlib.sha256(v.encode()).hexdigest()[:16] for k, v in canon.items()},
    }


def _rdb_storage(url: str, failed_trial_callback: FailedTrialCallback | None):
    """Optuna's RDBStorage with heartbeats; retried while another process creates the same tables.

    Two processes starting on a fresh SQLite file both create the schema and both insert its
    version row: the loser gets an IntegrityError or OperationalError. The second try finds
    the tables made.
    """
    import optuna
    import sqlalchemy.exc

    kwargs: dict[str, Any] = {"heartbeat_interval": HEARTBEAT_INTERVAL_S, "grace_period": HEARTBEAT_GRACE_S}
    if failed_trial_callback is not None:  # renamed in Optuna 4.9
        name = (
            "heartbeat_stale_trial_callback"
            if "heartbeat_stale_trial_callback" in inspect.signature(optuna.storages.RDBStorage).parameters
            else "failed_trial_callback"
        )
        kwargs[name] = failed_trial_callback
    # SQLite: wait up to 30 s for another process's write lock instead of failing after 5 s.
    engine = {"connect_args": {"timeout": 30}} if url.startswith("sqlite") else {"pool_pre_ping": True}
    for attempt in range(6):
        try:
            return optuna.storages.RDBStorage(url, engine_kwargs=engine, **kwargs)
        except (sqlalchemy.exc.IntegrityError, sqlalchemy.exc.OperationalError):
            if attempt == 5:
                raise
            time.sleep(0.2 * (attempt + 1))


def open_study(
    spec: TuningSpec,
    storage: str | None = None,
    *,
    force_new: bool = False,
    resume_anyway: bool = False,
    failed_trial_callback: FailedTrialCallback | None = None,
    say: Callable[[str], None] = print,
):
    """Create or load the spec's study (same name + storage = same study, for resume and workers).

    Args:
        spec: the TuningSpec; its name names the study.
        storage: Optuna storage URL override; default `spec.resolved_storage()`.
        force_new: start a fresh study under the same name; an existing one is first copied to
            `<name>.replaced-<time>` in the same storage (nothing is lost), then deleted.
        resume_anyway: continue an existing study although its spec fingerprint differs (its
            finished trials were measured against the old spec and take part in the winner).
        failed_trial_callback: called with (study, FrozenTrial) for each running trial that
            Optuna's heartbeat fails in this process (its process died on another machine).
        say: where a notice goes (the archive name of a replaced study).

    Returns:
        (study, is_new): is_new is True for the one process that created the study.

    Raises:
        StudySpecChanged: the existing study was made for a different spec (see `spec_fingerprint`)
            and neither force_new nor resume_anyway was given.
    """
    import warnings

    import optuna

    warnings.filterwarnings("ignore", category=optuna.exceptions.ExperimentalWarning)
    url = storage or spec.resolved_storage()
    if url.startswith("sqlite:///"):
        Path(url[len("sqlite:///") :]).parent.mkdir(parents=True, exist_ok=True)
    rdb = _rdb_storage(url, failed_trial_callback)
    if force_new and spec.name in optuna.get_all_study_names(rdb):
        archive = f"{spec.name}.replaced-{datetime.now():%Y%m%dT%H%M%S}"
        optuna.copy_study(from_study_name=spec.name, from_storage=rdb, to_storage=rdb, to_study_name=archive)
        optuna.delete_study(study_name=spec.name, storage=rdb)
        say(f"--force-new: the previous study '{spec.name}' was kept as '{archive}' in {url}; starting afresh")
    directions = [spec.objective.direction(m) for m in spec.objective.metrics]
    try:
        study = optuna.create_study(
            study_name=spec.name,
            storage=rdb,
            sampler=make_sampler(spec),
            pruner=make_pruner(spec),
            directions=directions,
            load_if_exists=False,
        )
        is_new = True
    except optuna.exceptions.DuplicatedStudyError:
        study = optuna.load_study(
            study_name=spec.name, storage=rdb, sampler=make_sampler(spec), pruner=make_pruner(spec)
        )
        is_new = False
    _check_fingerprint(study, spec, url, directions, resume_anyway, say)
    return study, is_new


def _check_fingerprint(
    study, spec: TuningSpec, url: str, directions: list[str], resume_anyway: bool, say: Callable[[str], None]
) -> None:
    """Record the spec's fingerprint on a study that has none; refuse a study made for another spec."""
    mine = spec_fingerprint(spec)
    stored = study.user_attrs.get(FINGERPRINT_ATTR)
    if stored is None:  # a new study (or one from a slotune that kept none): it is this spec's now
        study.set_user_attr(FINGERPRINT_ATTR, mine)
        return
    if stored["sha256"] == mine["sha256"]:
        return
    changed = sorted(k for k, v in mine["parts"].items() if stored.get("parts", {}).get(k) != v)
    stored_directions = [d.name.lower() for d in study.directions]
    if resume_anyway and stored_directions == directions:
        study.set_user_attr(FINGERPRINT_ATTR, mine)
        study.set_user_attr(
            "spec_fingerprints_replaced", [*study.user_attrs.get("spec_fingerprints_replaced", []), stored["sha256"]]
        )
        say(
            f"--resume-anyway: study '{spec.name}' continues under a changed spec ({', '.join(changed)}); "
            f"its {len(study.trials)} earlier trials were measured against the old one"
        )
        return
    why = (
        f"study '{spec.name}' in {url} was made for a different spec: {', '.join(changed)} changed, so its "
        f"trials do not measure the new objective. Use a new study name, or rerun with --force-new (keeps "
        f"the old study as '{spec.name}.replaced-<time>' and starts afresh)"
    )
    if stored_directions != directions:
        why += f"; --resume-anyway cannot continue it: its directions {stored_directions} differ from {directions}"
    else:
        why += " or --resume-anyway (continues it, old trials included)"
    raise StudySpecChanged(why)


def fail_orphaned_trials(study, on_failed: FailedTrialCallback | None = None) -> int:
    """Fail RUNNING trials whose `tune run` process on this host is gone (killed), at once.

    Trials of other machines are left to Optuna's heartbeat. The reason recorded is the one the
    trial wrote when it started (`ORPHANED_REASON`, tuner/objective.py).

    Args:
        study: the study.
        on_failed: called with (study, FrozenTrial) for each trial this call failed (MLflow).

    Returns:
        The number of trials failed here (not those another process failed first).
    """
    from optuna.trial import TrialState

    n = 0
    host = socket.gethostname()
    for t in study.get_trials(deepcopy=False, states=(TrialState.RUNNING,)):
        if t.user_attrs.get("host") != host or _is_alive(t.user_attrs.get("pid")):
            continue
        try:
            frozen = study.tell(t.number, state=TrialState.FAIL)
        except (ValueError, RuntimeError):  # another process failed it first (or it just finished)
            continue
        n += 1
        if on_failed is not None:
            on_failed(study, frozen)
    return n


def _is_alive(pid: int | None) -> bool:
    """Whether `pid` is a live process other than this one (a zombie is dead)."""
    import psutil

    if not pid or pid == os.getpid():
        return False
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False
    except psutil.AccessDenied:  # another user's process: alive
        return True


def enqueue_reference_trials(study, spec: TuningSpec) -> None:
    """Default and naive reference configs first, so every result is a comparison; then the space's
    starting points for the objective's kind (`SearchSpace.starts`), each the base config with its
    params changed, and the winners of earlier studies of the same model and objective in the same
    storage (`warm_starts`), so the sampler starts from known-good corners.

    Only the process that created the study calls this, right after creating it (two processes
    starting together would each enqueue them otherwise; another may have started a trial
    already). A reference the space cannot express exactly (say the default max_num_seqs=16 in
    a space of 1..8) is not enqueued: `finalize` measures it beside the study instead, so a
    trial tagged `default` is always the true default config. A grid covers them on its own.
    """
    if spec.sampler == "grid" or any(t.user_attrs.get("tag") for t in study.get_trials(deepcopy=False)):
        return
    space = spec.search_space
    base = spec.base_config()
    for tag, cfg in reference_configs(base):
        params = _params_of(space, cfg, base)
        if params is not None and (tag == DEFAULT_TAG or cfg != base):
            study.enqueue_trial(params, user_attrs={"tag": tag}, skip_if_exists=True)
    for start in space.starts:
        if start.suits(spec.objective.kind, spec.objective.metric):
            params = _start_params(space, base, start.params)
            study.enqueue_trial(params, user_attrs={"start": start.name}, skip_if_exists=True)
    for name, params in warm_starts(spec, study.study_name):
        study.enqueue_trial(params, user_attrs={"start": name}, skip_if_exists=True)


class StartRepairs:
    """Optuna callback: a start (`SearchSpace.starts`) that missed an SLO limit on its trial is tried
    again with its next repair (`Start.then`, `Start.rung`), enqueued at once, as an expert who saw a
    batch-1 corner queue arrivals past the TTFT limit would try two sequences per step next, instead
    of leaving the neighbourhood of a good corner to the sampler's luck (example 01, 2026-11-27: both
    studies' batch-1 starts missed p95 TTFT by 3-15%, and int4 at 2 sequences, 20-30% faster than
    either study's winner, was never measured). A miss of the quality gates is not repaired (more sequences
    per step do not change the model's answers), nor a failed trial."""

    def __init__(self, spec: TuningSpec) -> None:
        self.spec = spec
        self.starts = {s.name: s for s in spec.search_space.starts if s.then}

    def __call__(self, study, trial) -> None:
        start, rung = self.starts.get(trial.user_attrs.get("start")), trial.user_attrs.get("rung", 0)
        if start is None or rung >= len(start.then) or not _missed_slo(trial.user_attrs):
            return
        params = _start_params(self.spec.search_space, self.spec.base_config(), start.rung(rung + 1))
        study.enqueue_trial(params, user_attrs={"start": start.name, "rung": rung + 1}, skip_if_exists=True)


def _missed_slo(user_attrs: dict[str, Any]) -> bool:
    """A measured trial that missed an SLO limit (or stopped early on one), its gates not failed."""
    v = user_attrs.get("violations") or {}
    return (
        not user_attrs.get("feasible")
        and not v.get("quality_gates")
        and any(v.get(k, 0) > 0 for k in (*SLO_KEYS, "early_stop"))
    )


def warm_starts(spec: TuningSpec, own_name: str) -> list[tuple[str, dict[str, Any]]]:
    """[(label, params)] of the winners of earlier studies in the spec's storage made for the same
    model, fixed engine config and objective (their fingerprints' `engine` and `objective` parts),
    newest first, at most MAX_WARM_STARTS: a re-tune on new traffic (the operator's schedule, a new
    workload) starts from what won before. Params are this space's, exact where the space can
    express the winner's config, else the knobs it can (the sampler fills the rest)."""
    import optuna

    mine = spec_fingerprint(spec)["parts"]
    space, base = spec.search_space, spec.base_config()
    url = spec.resolved_storage()
    found = []
    for s in sorted(
        optuna.get_all_study_summaries(url, include_best_trial=False),
        key=lambda s: s.datetime_start or datetime.min,
        reverse=True,
    ):
        parts = (s.user_attrs.get(FINGERPRINT_ATTR) or {}).get("parts", {})
        if s.study_name == own_name or any(parts.get(k) != mine[k] for k in ("engine", "objective")):
            continue
        earlier = optuna.load_study(study_name=s.study_name, storage=url)
        number = s.user_attrs.get(WINNER_ATTR)  # declared after its confirmation round; else its best trial
        best = (
            earlier.trials[number]
            if isinstance(number, int) and number < len(earlier.trials)
            else best_trial(earlier, spec)
        )
        if best is None or not best.user_attrs.get("config"):
            continue
        cfg = EngineConfig.model_validate(best.user_attrs["config"])
        knobs = {k.name: k for k in space.knobs}
        params = _params_of(space, cfg, base) or {
            k: v for k, v in best.params.items() if k in knobs and knobs[k].can_take(v)
        }
        if params:
            found.append((f"warm: {s.study_name} trial {best.number}", params))
        if len(found) == MAX_WARM_STARTS:
            break
    return found


def _start_params(space, base, params: dict[str, Any]) -> dict[str, Any]:
    """A start's (or a repair's) params as the trial to enqueue: the whole config the base with them
    makes, in this space's params, when the space can express it; else them alone (the rest sampled)."""
    return _params_of(space, base.with_updates(params), base) or params


def _params_of(space, cfg, base) -> dict[str, Any] | None:
    """The space's parameters that turn `base` into exactly `cfg` (as a trial would), or None."""
    params: dict[str, Any] = {}
    for k in space.knobs:
        if not all(params.get(f) in vals for f, vals in k.when.items()):
            continue  # an inactive conditional knob
        v = cfg.value_at(k.name)
        if not _representable(k, v):
            return None
        params[k.name] = v
    return params if base.with_updates(params) == cfg else None


def _representable(knob, value) -> bool:
    if knob.type == "categorical":
        return value in knob.choices
    return isinstance(value, (int, float)) and not isinstance(value, bool) and knob.low <= value <= knob.high


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
            `objective.run_trial_process`).

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
    on_failed = _Relay()  # trials failed for a dead process (heartbeat or pid) -> MLflow
    study, is_new = open_study(spec, force_new=force_new, resume_anyway=resume_anyway, failed_trial_callback=on_failed)
    if is_new and not worker:
        enqueue_reference_trials(study, spec)
    total = spec.budget.n_trials
    # Resolve "auto" (and a user's OMP_WAIT_POLICY) now: every trial of this run, the progress
    # line and the MLflow tag then show the one policy the trials really ran with.
    spec.budget.trial_omp_wait_policy = omp_wait_policy(spec.budget.trial_omp_wait_policy)
    tracker = None
    if not worker or spec.mlflow_tracking_uri:
        tracker = MLflowTracker(spec, study)
        on_failed.targets.append(tracker)
    if not worker:
        fail_orphaned_trials(study, on_failed)
    with Progress(spec, total, enabled=progress) as prog, trials_die_with_this_process():
        prog.seed_rows(study)
        prog.say(
            f"trials run with OMP_WAIT_POLICY={spec.budget.trial_omp_wait_policy}"
            f" (budget.trial_omp_wait_policy; {os.cpu_count()} cores)"
        )
        # The budget counts every measured trial of the study (resumed runs and all processes
        # together), not forbidden combinations or invalid configs, rejected before any measurement.
        budget = TrialBudget(total)
        objective = Objective(spec, prog, budget, runner=trial_runner)
        callbacks = [c for c in (tracker, prog.callback) if c is not None] + [budget, StartRepairs(spec)]
        if not budget.exhausted(study):
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
                _log_interrupted_trial(study, objective.current, tracker)
                raise
        if worker:
            return None
        wait_for_running_trials(study, spec, prog.say, on_failed)
        prog.phase(None, "confirming the best trials on a fresh workload seed")
        return finalize(spec, study, tracker, prog, runner=trial_runner)


class _Relay:
    """One (study, FrozenTrial) callback handed to the storage before its targets exist."""

    def __init__(self) -> None:
        self.targets: list[FailedTrialCallback] = []

    def __call__(self, study, trial) -> None:
        for target in self.targets:
            target(study, trial)


def _log_interrupted_trial(study, number: int | None, tracker) -> None:
    if tracker is None or number is None:
        return
    for t in study.get_trials(deepcopy=False):
        if t.number == number and t.state.name == "FAIL":
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


class TrialBudget:
    """The study's trial budget, shared by every process that runs the study.

    Counts measured trials, each by its `budget_share` (a trial screened out on its short replay
    holds that share of a slot). Trials pruned as forbidden combinations or failed as invalid configs
    are not counted (TPE proposes them again and again on small spaces; they cost no
    measurement); a sampler stuck on them still stops, after `unmeasured_factor` x total.

    Two uses. `admits` is the rule: the Objective asks it once Optuna has numbered a new trial,
    and trial n is measured only if fewer than `total` measured trials precede it, so processes
    racing for the last slot cannot both take it (trial numbers are unique in the storage).
    As an Optuna callback it stops this process's loop once finished and running trials fill
    the budget, so a process rarely asks for a trial it will not measure.
    """

    def __init__(self, total: int, unmeasured_factor: int = 5) -> None:
        self.total, self.unmeasured_factor = total, unmeasured_factor

    def counts(self, study) -> tuple[float, int]:
        """(budget slots held by measured trials finished, forbidden or invalid trials)."""
        from optuna.trial import TrialState

        done = study.get_trials(deepcopy=False, states=(TrialState.COMPLETE, TrialState.FAIL, TrialState.PRUNED))
        rejected = sum(not is_measured(t) and t.user_attrs.get("unmeasured") != UNMEASURED_OVER_BUDGET for t in done)
        return round(sum(budget_share(t) for t in done), 9), rejected

    def exhausted(self, study) -> bool:
        from optuna.trial import TrialState

        measured, rejected = self.counts(study)
        running = sum(budget_share(t) for t in study.get_trials(deepcopy=False, states=(TrialState.RUNNING,)))  # 1 each
        return measured + running >= self.total or rejected >= self.unmeasured_factor * self.total

    def admits(self, study, number: int) -> bool:
        """Whether trial `number` may be measured: the trials before it hold fewer than `total` slots."""
        return sum(budget_share(t) for t in study.get_trials(deepcopy=False) if t.number < number) < self.total - 1e-9

    def __call__(self, study, trial) -> None:
        if self.exhausted(study):
            study.stop()


def finalize(
    spec: TuningSpec, study, tracker=None, prog=None, runner: tuple[str, ...] = DEFAULT_TRIAL_RUNNER
) -> dict[str, Any] | None:
    """Confirm the best trials on a fresh workload seed (tuner/confirm.py), declare the winner on
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
    confirmation = confirm_round(spec, run_round(spec, study, trials, runner=runner, say=say), trials)
    best = next(t for t in trials if t.number == confirmation.winner)
    if spec.budget.declare_repeats:
        confirmation = confirmation.with_declaration(run_declaration(spec, study, best, runner=runner, say=say))
    study.set_user_attr(WINNER_ATTR, best.number)  # the declared winner, for later studies' warm starts
    remeasure = confirmation.remeasure()
    config = EngineConfig.model_validate(best.user_attrs["config"])
    obj = spec.objective
    how = ("confirmed" if confirmation.is_confirmed else "unconfirmed") + (
        f" among the best {len(trials)} re-measured" if confirmation.is_round else ""
    )
    if remeasure["reasons"]:
        how += "; its declared numbers miss the SLO"
    header = (
        f"# slotune best config for study '{spec.name}' (trial {best.number}, {how}); "
        f"{obj.metric_key()} = {best.values[0]:.6g}, re-measured on "
        f"{seeds_words(remeasure.get('seeds') or [spec.robustness_seed])}: "
        f"{_fmt_metric(remeasure, obj.metric_key())}; metrics in best_metrics.json\n"
    )
    write_atomic(out / "best.yaml", header + config.to_yaml())
    summary = {
        "study": spec.name,
        "trial": best.number,
        "objective": obj.metric_key(),
        "direction": obj.direction(),
        "value": best.values[0],
        "metrics": best.user_attrs["metrics"],
        "remeasured": remeasure,
        "confirmed": confirmation.is_confirmed,
        "best_by_trial": confirmation.best_by_trial,
        "confirm": confirmation.to_json(),
        "declared": list(confirmation.declared),
        "params": best.params,
        "machine": best.user_attrs.get("machine"),
        "references": reference_metrics(study),
        "mlflow_run_id": tracker.parent_run_id if tracker is not None else None,
    }
    write_atomic(out / "best_metrics.json", json.dumps(summary, indent=1))
    report = write_report(
        spec,
        study,
        best,
        remeasure,
        out,
        sections=[
            confirmation.section({t.number: t.values[0] for t in trials}),
            *sweep_after_study(spec, study, best, runner=runner, say=say),
        ],
    )
    if tracker is not None:
        tracker.log_study_end(best, config, report, out, confirmation=confirmation)
    if prog is not None:
        prog.summary(best, remeasure, summary["references"], out)
    if tracker is not None:
        say(tracker.ui_hint())
    return summary


def _fmt_metric(remeasure: dict, key: str) -> str:
    v = (remeasure.get("metrics") or {}).get(key)
    return f"{v:.6g}" if v is not None else f"failed ({remeasure.get('error', 'not measured')})"


def _measure_references_if_missing(spec: TuningSpec, study, runner: tuple[str, ...] = DEFAULT_TRIAL_RUNNER) -> None:
    """Measure the default / naive config beside the study when no trial is tagged with it."""
    tagged = {trial_tag(t) for t in study.trials if t.state.name == "COMPLETE"}
    base = spec.base_config()
    for tag, cfg in reference_configs(base):
        if tag in tagged or side_measurement(study, tag) is not None:
            continue
        try:
            r = measure(spec, cfg, early_stop=False, runner=runner)
            study.set_user_attr(
                tag, {"metrics": r["metrics"], "latencies": r.get("latencies"), "config": cfg.model_dump(mode="json")}
            )
        except TrialFailure as exc:
            study.set_user_attr(tag, {"error": exc.reason})
