"""Parent side of a trial: sample a config, measure it in an isolated child process, score it.

The lifecycle of one trial (`TrialObjective.__call__`):
  sample -> build EngineConfig -> run `slotune.tuner.measure.trial_runner` in a child process under a
  timeout and a memory cap -> record metrics, SLO constraints, gates as user attributes ->
  return the objective value(s).
With `screening` on, a searched trial first measures a short replay (`TrialObjective._screen`) and
goes on to the full one only when Optuna's pruner finds it promising; else it ends PRUNED,
"screened out", holding its share of a budget slot (`budget_share`).
A child that crashes, hangs, runs out of memory or raises is recorded as a FAIL trial with the
reason (`TrialFailure`); the study goes on. How trial processes are capped and die with `tune run`:
docs/design/tuner-search.md.
"""

from __future__ import annotations

import os
import socket

from slotune.tuner.measure import failures, machine
from slotune.tuner.measure.trial_process import DEFAULT_TRIAL_RUNNER, TrialFailure, TrialResult, measure
from slotune.tuner.measure.units import format_value, metric_label
from slotune.tuner.search import records
from slotune.tuner.search.records import (
    ORPHANED_REASON,
    UNMEASURED_INVALID,
    UNMEASURED_OVER_BUDGET,
    TrialRecord,
)
from slotune.tuner.search.references import DEFAULT_TAG, default_is_base
from slotune.tuner.search.trials import earlier_measurement, enqueue_unexplored
from slotune.tuner.spec.server import SERVER_KNOB
from slotune.tuner.spec.shootout import server_of_tag
from slotune.tuner.spec.slo import CONSTRAINT_KEYS, constraint_values, is_feasible
from slotune.tuner.spec.yaml_reader import format_error


def trial_constraints(trial) -> list[float]:
    """Optuna < 5 `constraints_func`: the constraint values stored on the trial."""
    v = TrialRecord.of(trial).violations or {}
    return list(constraint_values(v).values())


class TrialObjective:
    """The Optuna objective: claim a budget slot -> sample -> build config -> measure in a child
    process -> score.

    Args:
        spec: the TuningSpec.
        progress: the live display (`Progress`), or None.
        budget: decides whether a new trial may be measured (`TrialBudget.admits`, slotune/tuner/search/budget.py);
            None = always. Asked after the trial exists, so several processes sharing a study
            never measure more than the budget between them.
        runner: the trial process's command (see `run_trial_process`).
    """

    def __init__(self, spec, progress=None, budget=None, runner: tuple[str, ...] = DEFAULT_TRIAL_RUNNER) -> None:
        self.spec = spec
        self.runner = runner
        self.space = spec.search_space
        self.base = spec.base_config()
        self.search = spec.search_base()  # a shoot-out's params pick a server, then its knobs
        self.progress = progress
        self.budget = budget
        self.current: int | None = None  # the number of the trial being run by this process

    def _phase(self, number: int, text: str) -> None:
        if self.progress is not None:
            self.progress.phase(number, text)

    def __call__(self, trial) -> float | list[float]:
        self.current = trial.number
        records.set_fail_reason(trial, ORPHANED_REASON)
        try:
            return self._run(trial)
        except KeyboardInterrupt as exc:  # Optuna records the trial as FAIL and re-raises
            records.set_fail_reason(trial, failures.interrupted(str(exc) or "SIGINT"))
            raise

    def _run(self, trial) -> float | list[float]:
        import optuna

        records.set_origin(  # the trial process runs on this machine too
            trial, host=socket.gethostname(), machine=machine.words(), pid=os.getpid(), measure=self.spec.budget.measure
        )
        if self.budget is not None and not self.budget.admits(trial.study, trial.number):
            reason = f"not run: the study's {self.budget.total} trials were already taken (other processes share it)"
            records.set_unmeasured(trial, UNMEASURED_OVER_BUDGET)
            records.set_fail_reason(trial, reason)
            trial.study.stop()
            raise optuna.TrialPruned(reason)
        tag = TrialRecord.of(trial).tag
        if tag == DEFAULT_TAG and default_is_base(self.base):
            params = {}
        elif server_of_tag(tag) is not None:  # another server's default launch: no knob of its own sampled
            params = {SERVER_KNOB: trial.suggest_categorical(SERVER_KNOB, self.space.knobs[0].choices)}
        else:
            params = self.space.sample(trial)
        reason = self.space.forbidden_reason(params)
        if reason:  # costs nothing to measure, so it does not count against the budget
            records.set_forbidden(trial, reason)
            raise optuna.TrialPruned(reason)
        try:
            config = self.search.with_updates(params)
        except ValueError as exc:  # rejected before any measurement: not counted either
            records.set_unmeasured(trial, UNMEASURED_INVALID)
            raise self._fail(trial, f"invalid config: {_config_problems(exc)}") from None
        earlier = earlier_measurement(
            trial.study, trial.params, before=trial.number, screened_out=self.spec.screening.enabled
        )
        if earlier is not None:
            return self._repeat(trial, earlier)
        records.set_config(trial, config.model_dump(mode="json"))
        is_reference = TrialRecord.of(trial).tag is not None
        if self.spec.screening.enabled and not is_reference:
            self._screen(trial, config)  # raises TrialPruned when screened out
        self._phase(trial.number, "starting trial process")
        try:
            # The default and naive trials are the yardsticks: measured in full, never cut short.
            result = measure(
                self.spec,
                config,
                on_phase=lambda p: self._phase(trial.number, p),
                early_stop=not is_reference,
                runner=self.runner,
            )
        except TrialFailure as exc:
            raise self._fail(trial, exc.reason) from None
        return self._record(trial, result)

    def _screen(self, trial, config) -> None:
        """The short replay (`Screening`): report its value to Optuna (step 0) and go on when the
        study's pruner (`screening.ScreeningPruner`) finds it promising; else end the trial PRUNED,
        screened out. A short replay that stops early (the SLO out of reach) screens the trial out
        whatever the others did."""
        import optuna

        screen, wl = self.spec.screening, self.spec.workload
        short = screen.short_workload(wl)
        try:
            result = measure(
                self.spec,
                config,
                on_phase=lambda p: self._phase(trial.number, f"screening: {p}"),
                early_stop=True,
                runner=self.runner,
                gates=False,
                workload=short,
            )
        except TrialFailure as exc:  # a config that cannot run fails before the full replay is spent
            raise self._fail(trial, f"{exc.reason} (screening replay)") from None
        key = self.spec.objective.metric_key()
        value = result.metrics.get(key)
        share = screen.share(wl)
        records.set_screen(
            trial,
            {
                "num_requests": short.num_requests,
                "of": wl.num_requests,
                "share": share,
                "value": value,
                "early_stopped": result.early_stopped,
            },
        )
        if value is None and not result.early_stopped:
            raise self._fail(trial, f"metric {key} was not measured in the screening replay (no request finished)")
        if value is not None:
            trial.report(float(value), 0)
        if not result.early_stopped and not trial.should_prune():  # the study's ScreeningPruner decides
            return
        reason = self._screen_reason(trial, key, value, result.early_stopped, wl)
        self._store(trial, result)
        records.set_screened_out(trial, reason)  # not measured in full, gates not run
        raise optuna.TrialPruned(reason)

    def _screen_reason(self, trial, key: str, value, early_stopped: bool, wl) -> str:
        """Why the study's pruner screened `trial` out, with the bar and peers it decided on."""
        screen = self.spec.screening
        n = screen.describe(wl)
        if early_stopped:
            return f"screened out after {n}: the short replay stopped early (the SLO out of reach)"
        b, num_peers = trial.study.pruner.bar(trial.study, trial.number)
        which = "median" if screen.percentile == 50 else f"best {screen.percentile:g}% bar"
        return (
            f"screened out after {n}: {metric_label(key)} {format_value(key, value)}, worse than the {which} "
            f"({format_value(key, b)}) of the {num_peers} trials measured in full that met the SLO"
        )

    def _repeat(self, trial, earlier: TrialRecord) -> float | list[float]:
        """Trial `earlier` measured these params: copy its outcome (TPE learns the same as from a
        re-measurement, at no cost) and enqueue an unexplored config, so the budget goes to new ones.
        A screened-out config stays screened out (PRUNED, with the same reason)."""
        import optuna

        records.set_repeat(trial, earlier)
        if hasattr(trial, "set_constraint"):
            for k in CONSTRAINT_KEYS:
                trial.set_constraint(k, earlier.violations.get(k, 0.0))
        enqueue_unexplored(
            self.space, trial.study, seed=None if self.spec.seed is None else self.spec.seed + trial.number
        )
        if earlier.screened_out:
            if 0 in earlier.intermediate_values:
                trial.report(earlier.intermediate_values[0], 0)
            records.set_fail_reason(trial, earlier.fail_reason)
            raise optuna.TrialPruned(earlier.fail_reason)
        values = list(earlier.values)
        return values if len(values) > 1 else values[0]

    def _fail(self, trial, reason: str) -> TrialFailure:
        records.set_fail_reason(trial, reason)
        return TrialFailure(reason)

    def _store(self, trial, result: TrialResult) -> None:
        """A measurement's metrics, SLO constraints, gates and latencies as the trial's attributes."""
        m = result.metrics
        violations = constraint_values(result.violations)
        records.set_measurement(
            trial,
            metrics=m,
            violations=violations,
            feasible=is_feasible(violations),
            early_stopped=result.early_stopped,
            gates=result.gates,
            latencies=result.latencies,
        )
        if hasattr(trial, "set_constraint"):  # Optuna >= 5: samplers read these directly
            for k in CONSTRAINT_KEYS:
                trial.set_constraint(k, violations[k])

    def _record(self, trial, result: TrialResult) -> float | list[float]:
        """`_store` the measurement; returns the objective value(s)."""
        self._store(trial, result)
        m = result.metrics
        obj = self.spec.objective
        values = []
        for metric in obj.metrics:
            key = obj.metric_key(metric)
            if key not in m:
                if result.early_stopped:  # stopped before any request finished: the SLO was
                    import optuna  # hopeless; constraints above still inform the sampler

                    records.set_fail_reason(trial, f"early stop before {key} could be measured")
                    raise optuna.TrialPruned(f"early stop before {key} could be measured")
                raise self._fail(trial, f"metric {key} was not measured (no request finished)")
            values.append(float(m[key]))
        records.set_fail_reason(trial, None)  # measured: the advance ORPHANED_REASON no longer applies
        return values if len(values) > 1 else values[0]


def _config_problems(exc: ValueError) -> str:
    """`field: message` for each problem, on one line (a pydantic error's first line names no field)."""
    lines = format_error(exc).splitlines()
    return "; ".join(line.strip().removeprefix("(root): ") for line in (lines[1:] or lines))
