"""The Optuna study: storage (SQLite or PostgreSQL), sampler, pruner, and the spec it was made for.

The storage alone holds the whole record (trial attributes through `records`), so a killed
`tune run` resumes where it stopped and several processes share one study. A study remembers the
fingerprint of the spec that defines its objective and refuses a changed one; trials a dead
process left running are failed (`fail_orphaned_trials`). Sharing rules: docs/design/tuner-search.md.
"""

from __future__ import annotations

import functools
import hashlib
import inspect
import json
import os
import socket
import threading
import time
from collections.abc import Callable
from datetime import datetime
from pathlib import Path
from typing import Any

from slotune.tuner.search.objective import trial_constraints
from slotune.tuner.search.records import (
    TrialRecord,
    store_fingerprint,
    stored_fingerprint,
)
from slotune.tuner.spec.tuning_spec import TuningSpec

# Optuna heartbeat: a running trial whose process has not written for GRACE_S is failed by the
# next process that asks for a trial (`optuna.storages.fail_stale_trials`).
HEARTBEAT_INTERVAL_S, HEARTBEAT_GRACE_S = 10, 60

FailedTrialCallback = Callable[[Any, Any], None]  # (study, FrozenTrial), as Optuna's callbacks
# How long a process waits for an unreachable study database, retrying with backoff, before it
# stops: shorter than the heartbeat's grace, so its running trial is failed (and retried) only
# after this process has given up on it.
DB_OUTAGE_S = 30.0


class StorageUnreachable(ConnectionError):
    """The study database did not answer for DB_OUTAGE_S."""


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
            return _riding_out_outages(optuna.storages.RDBStorage)(url, engine_kwargs=engine, **kwargs)
        except (sqlalchemy.exc.IntegrityError, sqlalchemy.exc.OperationalError):
            if attempt == 5:
                raise
            time.sleep(0.2 * (attempt + 1))


def _is_connection_error(exc: BaseException) -> bool:
    """A lost or refused database connection (directly, or under Optuna's StorageInternalError)."""
    import sqlalchemy.exc

    while exc is not None:
        if isinstance(exc, sqlalchemy.exc.DBAPIError) and (
            exc.connection_invalidated or any(p in str(exc).lower() for p in _CONNECTION_PHRASES)
        ):
            return True
        exc = exc.__cause__ or exc.__context__  # Optuna re-raises as StorageInternalError; a session then refuses
    return False


# PostgreSQL's (libpq's) words for a connection that broke, was refused, or a server not ready yet.
_CONNECTION_PHRASES = (
    "server closed the connection",
    "could not connect",
    "connection refused",
    "terminating connection",
    "the database system is starting up",
    "the database system is shutting down",
    "the database system is in recovery mode",
    "the database system is not yet accepting connections",  # crash recovery after an immediate stop
    "connection already closed",
    "ssl connection has been closed",
    "no connection to the server",
)
_in_call = threading.local()
_gave_up = threading.Event()  # set once a call gave up: later calls try once, not for another bound


def _committed_before(method: str, exc: BaseException) -> bool:
    """A retried `set_trial_state_values` finds the trial finished: the first attempt committed
    before its connection dropped (Optuna's cache, not updated, would still say RUNNING)."""
    import optuna

    return method == "set_trial_state_values" and isinstance(exc, optuna.exceptions.UpdateFinishedTrialError)


def _riding_out_outages(storage_cls: type) -> type:
    """A subclass of Optuna's RDBStorage whose methods (the private ones too: Optuna's cache calls
    them) retry a lost connection with backoff for up to DB_OUTAGE_S (a database restart), then
    raise StorageUnreachable. Nested calls are retried once, at the outermost; once a call has given
    up, the next ones (Optuna's own clean-up) fail at once until one succeeds, so the process stops
    within the bound."""

    def wrap(fn):
        @functools.wraps(fn)
        def call(self, *args, **kwargs):
            if getattr(_in_call, "active", False):
                return fn(self, *args, **kwargs)
            _in_call.active = True
            try:
                deadline, delay = None, 0.25
                while True:
                    try:
                        result = fn(self, *args, **kwargs)
                        _gave_up.clear()
                        return result
                    except Exception as exc:
                        if deadline is not None and _committed_before(fn.__name__, exc):
                            return True  # the attempt the connection dropped under had committed
                        if not _is_connection_error(exc):
                            raise
                        now = time.monotonic()
                        deadline = deadline or now + DB_OUTAGE_S
                        if now >= deadline or _gave_up.is_set():
                            _gave_up.set()
                            raise StorageUnreachable(
                                f"the study database did not answer for {DB_OUTAGE_S:g} s "
                                f"({type(exc).__name__}: {str(exc).splitlines()[0][:200]}); this process stops, and "
                                f"its running trial is measured again by the next `tune run` of this spec"
                            ) from exc
                        time.sleep(min(delay, deadline - now))
                        delay = min(2 * delay, 4.0)
            finally:
                _in_call.active = False

        return call

    methods = {
        name: wrap(getattr(storage_cls, name))
        for name in dir(storage_cls)
        if not name.startswith("__") and inspect.isfunction(inspect.getattr_static(storage_cls, name))
    }
    return type("RetryingRDBStorage", (storage_cls,), methods)


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
    stored = stored_fingerprint(study)
    if stored is None:  # a new study (or one from a slotune that kept none): it is this spec's now
        store_fingerprint(study, mine)
        return
    if stored["sha256"] == mine["sha256"]:
        return
    changed = sorted(k for k, v in mine["parts"].items() if stored.get("parts", {}).get(k) != v)
    stored_directions = [d.name.lower() for d in study.directions]
    if resume_anyway and stored_directions == directions:
        store_fingerprint(study, mine, replaces=stored["sha256"])
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
    trial wrote when it started (`ORPHANED_REASON`, slotune/tuner/search/records.py).

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
        r = TrialRecord.of(t)
        if r.host != host or _is_alive(r.pid):
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
