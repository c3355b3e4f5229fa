"""The one reader and writer of the Optuna user attributes the tuner stores, per trial and per study.

A trial is read once into a `TrialRecord` (`TrialRecord.of(frozen_trial)`); the objective writes a
live trial through the `set_*` functions; the study's own records (the confirmation, the winner, the
spec fingerprint, the MLflow parent run, the sweeps, the references measured beside it) through the
`stored_*` / `store_*` pairs. The attribute keys are the stored format: studies made before the
tuner's redesign load unchanged (tests/tuner_tests/test_pre_redesign_study.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from slotune.tuner.measure import failures
from slotune.tuner.measure.measurement import Measurement

# Why a trial with no outcome ended: set when the trial starts, replaced by the real outcome
# (slotune/tuner/measure/failures.py).
ORPHANED_REASON = failures.ORPHANED

# Optuna's retry callback links a retry to the attempts it replaces through these system attributes.
RETRY_OF_ATTR, RETRY_HISTORY_ATTR = "failed_trial", "retry_history"

# Attribute `unmeasured`: why a trial cost no measurement, so the budget does not count it.
UNMEASURED_FORBIDDEN, UNMEASURED_INVALID, UNMEASURED_OVER_BUDGET = "forbidden", "invalid_config", "over_budget"
UNMEASURED_REPEAT = "repeat"  # a config the sampler proposed again: the earlier measurement's values

# What a repeat trial copies from the trial that measured its config (not `latencies`: per-request
# arrays, kept once, on the trial that measured them).
REPEAT_ATTRS = ("config", "metrics", "violations", "feasible", "early_stopped", "gates", "screen", "screened_out")

# The study's attributes.
CONFIRM_ATTR = "confirm"  # the confirmation's measurements (decide/confirm.py `run_confirmation`)
WINNER_ATTR = "winner_trial"  # the trial `finalize` declared the winner
FINGERPRINT_ATTR = "spec_fingerprint"  # the spec the study was made for (search/study.py)
REPLACED_ATTR = "spec_fingerprints_replaced"  # fingerprints a --resume-anyway replaced
PARENT_ATTR = "mlflow_parent_run_id"  # the study's MLflow parent run (tracking/tracker.py)
SWEEP_PREFIX = "sweep_"  # sweep_<trial>: the load sweep after the study (sweep.py)
# A reference config measured beside the study is kept under its tag ("default", "naive").


@dataclass(frozen=True)
class TrialRecord:
    """One trial as the tuner stored it: Optuna's own fields and every user attribute, typed.

    Absent attributes are None (False for the flags); `state` is Optuna's TrialState (None for a
    record built by hand).
    """

    number: int
    state: Any = None
    params: dict[str, Any] = field(default_factory=dict)
    values: tuple[float, ...] | None = None
    intermediate_values: dict[int, float] = field(default_factory=dict)
    config: dict[str, Any] | None = None  # the EngineConfig measured, as JSON
    metrics: Measurement | None = None
    violations: dict[str, float] | None = None  # SLO constraint values (slotune/tuner/spec/slo.py)
    feasible: bool | None = None
    early_stopped: bool | None = None
    gates: dict[str, Any] | None = None  # the gate report (slotune/evals/gate_spec.py GateReport.to_dict())
    latencies: dict[str, list[float]] | None = None  # per-request seconds, {"ttft": [...], "tpot": [...]}
    fail_reason: str | None = None
    screen: dict[str, Any] | None = None  # the short replay: num_requests, of, share, value, early_stopped
    screened_out: bool = False
    unmeasured: str | None = None  # UNMEASURED_*
    forbidden: bool = False
    repeat_of: int | None = None  # the trial whose measurement a repeat took
    tag: str | None = None  # a reference trial's tag as stored ("baseline" in old studies)
    start: str | None = None  # the start (or warm start, or EXPLORE_START) that enqueued it
    rung: int = 0  # which repair of its start (`Start.then`)
    host: str | None = None
    pid: int | None = None
    machine: str | None = None  # measure/machine.py `words()`
    measure: str | None = None  # budget.measure: how it was measured
    retry_of: int | None = None  # the failed trial this one measures again (slotune/tuner/search/retry.py)
    retry_history: tuple[int, ...] = ()  # every earlier attempt of this config, the first one first

    @classmethod
    def of(cls, trial) -> "TrialRecord":
        """The record of an Optuna FrozenTrial (a live Trial too: no state or values yet); a record as it is."""
        if isinstance(trial, TrialRecord):
            return trial
        ua = trial.user_attrs
        sa = getattr(trial, "system_attrs", None) or {}
        values = getattr(trial, "values", None)
        return cls(
            number=trial.number,
            state=getattr(trial, "state", None),
            params=dict(trial.params),
            values=tuple(values) if values is not None else None,
            intermediate_values=dict(getattr(trial, "intermediate_values", None) or {}),
            config=ua.get("config"),
            metrics=Measurement.from_dict(ua["metrics"]) if ua.get("metrics") is not None else None,
            violations=ua.get("violations"),
            feasible=ua.get("feasible"),
            early_stopped=ua.get("early_stopped"),
            gates=ua.get("gates"),
            latencies=ua.get("latencies"),
            fail_reason=ua.get("fail_reason"),
            screen=ua.get("screen"),
            screened_out=bool(ua.get("screened_out")),
            unmeasured=ua.get("unmeasured"),
            forbidden=bool(ua.get("forbidden")),
            repeat_of=ua.get("repeat_of"),
            tag=ua.get("tag"),
            start=ua.get("start"),
            rung=ua.get("rung", 0),
            host=ua.get("host"),
            pid=ua.get("pid"),
            machine=ua.get("machine"),
            measure=ua.get("measure"),
            retry_of=sa.get(RETRY_OF_ATTR),
            retry_history=tuple(sa.get(RETRY_HISTORY_ATTR) or ()),
        )

    @property
    def is_complete(self) -> bool:
        return self.state is not None and self.state.name == "COMPLETE"

    @property
    def is_measured(self) -> bool:
        """Whether it holds a slot of the budget (forbidden, invalid and surplus trials do not)."""
        return not (self.forbidden or self.unmeasured)

    @property
    def budget_share(self) -> float:
        """How much of a budget slot it holds: 0 unmeasured, its short replay's share when it was
        screened out (`Screening.share`), else 1 (a running trial too: it may go on to the full replay)."""
        if not self.is_measured:
            return 0.0
        return float((self.screen or {}).get("share", 1.0)) if self.screened_out else 1.0


# --- writing a live trial (the objective) ---------------------------------------------------------


def set_fail_reason(trial, reason: str | None) -> None:
    trial.set_user_attr("fail_reason", reason)


def set_origin(trial, *, host: str, machine: str, pid: int, measure: str) -> None:
    """Where and how the trial runs: its host and process (orphan detection), the machine's words, `budget.measure`."""
    trial.set_user_attr("host", host)
    trial.set_user_attr("machine", machine)
    trial.set_user_attr("pid", pid)
    trial.set_user_attr("measure", measure)


def set_unmeasured(trial, why: str) -> None:
    trial.set_user_attr("unmeasured", why)


def set_forbidden(trial, reason: str) -> None:
    """A combination the space forbids: never measured, not counted against the budget."""
    trial.set_user_attr("fail_reason", reason)
    trial.set_user_attr("forbidden", True)
    trial.set_user_attr("unmeasured", UNMEASURED_FORBIDDEN)


def set_config(trial, config: dict[str, Any]) -> None:
    trial.set_user_attr("config", config)


def set_screen(trial, screen: dict[str, Any]) -> None:
    trial.set_user_attr("screen", screen)


def set_measurement(
    trial,
    *,
    metrics: Measurement,
    violations: dict[str, float],
    feasible: bool,
    early_stopped: bool,
    gates: dict[str, Any] | None = None,
    latencies: dict[str, list[float]] | None = None,
) -> None:
    """A measurement's metrics, SLO constraint values, verdict, gates and latencies (gates and
    latencies only when there are some)."""
    trial.set_user_attr("metrics", metrics.to_dict())
    trial.set_user_attr("violations", violations)
    trial.set_user_attr("feasible", feasible)
    trial.set_user_attr("early_stopped", early_stopped)
    if gates is not None:
        trial.set_user_attr("gates", gates)
    if latencies:
        trial.set_user_attr("latencies", latencies)


def set_screened_out(trial, reason: str) -> None:
    """Ended on its short replay: not measured in full, gates not run."""
    trial.set_user_attr("feasible", False)
    trial.set_user_attr("screened_out", True)
    trial.set_user_attr("fail_reason", reason)


def set_repeat(trial, earlier: TrialRecord) -> None:
    """`trial` proposed `earlier`'s params again: it takes `earlier`'s outcome (`REPEAT_ATTRS`)."""
    for k in REPEAT_ATTRS:
        v = getattr(earlier, k)
        v = v.to_dict() if isinstance(v, Measurement) else v
        if v is not None and not (k == "screened_out" and not v):
            trial.set_user_attr(k, v)
    trial.set_user_attr("unmeasured", UNMEASURED_REPEAT)
    trial.set_user_attr("repeat_of", earlier.number)
    trial.set_user_attr("fail_reason", None)


def enqueue(study, params: dict[str, Any], *, tag: str | None = None, start: str | None = None, rung: int = 0) -> None:
    """Enqueue `params` as a reference trial (`tag`) or a start's (`start`, its repair `rung`), once."""
    attrs: dict[str, Any] = {"tag": tag} if tag is not None else {"start": start}
    if rung:
        attrs["rung"] = rung
    study.enqueue_trial(params, user_attrs=attrs, skip_if_exists=True)


# --- the study's records --------------------------------------------------------------------------


def stored_confirmation(study) -> dict[str, Any] | None:
    """The confirmation's measurements ({seeds, runs}; decide/confirm.py), None before any."""
    return study.user_attrs.get(CONFIRM_ATTR)


def store_confirmation(study, record: dict[str, Any]) -> None:
    study.set_user_attr(CONFIRM_ATTR, record)


def stored_winner(study) -> int | None:
    """The declared winner's trial number (a study or a StudySummary), or None."""
    number = study.user_attrs.get(WINNER_ATTR)
    return number if isinstance(number, int) else None


def store_winner(study, number: int) -> None:
    study.set_user_attr(WINNER_ATTR, number)


def stored_fingerprint(study) -> dict[str, Any] | None:
    """The spec fingerprint (a study or a StudySummary): {"sha256", "parts"}, or None."""
    return study.user_attrs.get(FINGERPRINT_ATTR)


def store_fingerprint(study, fingerprint: dict[str, Any], replaces: str | None = None) -> None:
    """Record `fingerprint`; with `replaces`, the sha256 of the one it replaces is kept too."""
    study.set_user_attr(FINGERPRINT_ATTR, fingerprint)
    if replaces is not None:
        study.set_user_attr(REPLACED_ATTR, [*study.user_attrs.get(REPLACED_ATTR, []), replaces])


def stored_parent_run(study) -> str | None:
    return study.user_attrs.get(PARENT_ATTR)


def store_parent_run(study, run_id: str) -> None:
    study.set_user_attr(PARENT_ATTR, run_id)


def stored_sweep(study, number: int) -> dict[str, Any] | None:
    return study.user_attrs.get(f"{SWEEP_PREFIX}{number}")


def store_sweep(study, number: int, doc: dict[str, Any]) -> None:
    study.set_user_attr(f"{SWEEP_PREFIX}{number}", doc)


def stored_side_measurement(study, tag: str) -> dict[str, Any] | None:
    """A reference measured beside the study under `tag`: {metrics, latencies, config} or {error}; None if none."""
    return study.user_attrs.get(tag) or None


def store_side_measurement(study, tag: str, doc: dict[str, Any]) -> None:
    study.set_user_attr(tag, doc)
