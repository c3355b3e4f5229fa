"""Parent side of a trial: sample a config, measure it in an isolated child process, score it.

The lifecycle of one trial (`Objective.__call__`):
  sample -> build EngineConfig -> run `slotune.tuner.measure.trial_runner` in a child process under a
  timeout and a memory cap -> record metrics, SLO constraints, gates as user attributes ->
  return the objective value(s).
With `screening` on, a searched trial first measures a short replay (`Objective._screen`) and
goes on to the full one only when Optuna's pruner finds it promising; else it ends PRUNED,
"screened out", holding its share of a budget slot (`budget_share`).
A child that crashes, hangs, runs out of memory or raises is recorded as a FAIL trial with the
reason (`TrialFailure`); the study goes on. The memory cap watches the child's resident set:
RLIMIT_AS would also count torch's large virtual reservations and kill healthy trials.

Trial processes die with `tune run`: each runs in its own process group (its HTTP client with
it), which is killed when the trial ends, fails, or when `tune run` gets SIGTERM/SIGINT (see
`trials_die_with_this_process`); a SIGKILL of `tune run` reaches the child through its
parent-death signal (set by the child, `trial_runner.die_with_parent`).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from slotune.tuner.measure import machine
from slotune.tuner.spec.yaml_reader import format_error
from slotune.tuner.measure.metrics import cost_metrics
from slotune.tuner.spec.slo import CONSTRAINT_KEYS, constraint_values, is_feasible


class TrialFailure(Exception):
    """A trial that produced no measurement; `reason` is recorded on the trial."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


class Interrupted(KeyboardInterrupt):
    """`tune run` got SIGTERM or SIGINT. A KeyboardInterrupt, so Optuna records the running
    trial as FAIL before it re-raises, as it does for Ctrl-C."""


# Why a trial with no outcome ended: set when the trial starts, replaced by the real outcome.
# A trial left RUNNING by a killed process is failed later by another (`fail_orphaned_trials`,
# Optuna's heartbeat), and Optuna has no public API to set a user attribute on another
# process's trial, so the reason is written in advance.
ORPHANED_REASON = "orphaned: its tune run process stopped before the trial finished"

# User attribute `unmeasured`: why a trial cost no measurement, so the budget does not count it.
UNMEASURED_FORBIDDEN, UNMEASURED_INVALID, UNMEASURED_OVER_BUDGET = "forbidden", "invalid_config", "over_budget"
# A config the sampler proposed again: it gets the earlier measurement's values, not a new one.
UNMEASURED_REPEAT = "repeat"
# The `start` label of a config enqueued because the sampler repeated itself (see `unexplored_params`).
EXPLORE_START = "explore"
# What a repeat trial copies from the trial that measured its config (not `latencies`: per-request
# arrays, kept once, on the trial that measured them).
REPEAT_ATTRS = ("config", "metrics", "violations", "feasible", "early_stopped", "gates", "screen", "screened_out")


def is_measured(trial) -> bool:
    """Whether a trial holds a slot of the budget (forbidden, invalid and surplus trials do not)."""
    ua = trial.user_attrs
    return not (ua.get("forbidden") or ua.get("unmeasured"))


def budget_share(trial) -> float:
    """How much of a budget slot `trial` holds: 0 unmeasured, its short replay's share when it was
    screened out (`Screening.share`), else 1 (a running trial too: it may go on to the full replay)."""
    if not is_measured(trial):
        return 0.0
    return float(trial.user_attrs.get("screen", {}).get("share", 1.0)) if is_screened_out(trial) else 1.0


def is_screened_out(trial) -> bool:
    """A trial ended on its short replay (`Objective._screen`)."""
    return bool(trial.user_attrs.get("screened_out"))


def earlier_measurement(study, params: dict[str, Any], before: int | None = None, screened_out: bool = False):
    """The first measured trial of `study` (numbered below `before`) with exactly these params,
    complete (or, with `screened_out`, screened out: the study screens now), or None. Samplers
    re-propose configs on small spaces (TPE on a 30-config grid proposed a measured config in about
    one trial of three): a repeat takes this trial's outcome instead of a measurement, and does not
    count against the budget."""
    from optuna.trial import TrialState  # optuna: the [tune] extra, imported where a study exists

    for t in study.get_trials(deepcopy=False, states=(TrialState.COMPLETE, TrialState.PRUNED)):
        if (
            (before is None or t.number < before)
            and is_measured(t)
            and t.params == params
            and (t.state == TrialState.COMPLETE or (screened_out and is_screened_out(t)))
        ):
            return t
    return None


def unexplored_params(space, study, seed: int | None = None, tries: int = 64) -> dict[str, Any] | None:
    """Params of a random config of `space` that no trial of `study` has taken and no `forbidden`
    rule refuses, or None (after `tries` draws: the space is about exhausted). Enqueued after a
    sampler repeats itself, so the next trial measures something new."""
    import optuna

    taken = [t.params for t in study.get_trials(deepcopy=False)]
    draw = optuna.create_study(sampler=optuna.samplers.RandomSampler(seed=seed))
    for _ in range(tries):
        params = space.sample(draw.ask())
        if params not in taken and space.forbidden_reason(params) is None:
            return params
    return None


def enqueue_unexplored(space, study, seed: int | None = None) -> dict[str, Any] | None:
    """After a repeat: enqueue `unexplored_params` (labelled `EXPLORE_START`); returns them, or None."""
    params = unexplored_params(space, study, seed)
    if params is not None:
        study.enqueue_trial(params, user_attrs={"start": EXPLORE_START}, skip_if_exists=True)
    return params


def by_first_objective(spec) -> Callable[[Any], tuple[float, int]]:
    """The sort key that puts completed trials best first on the first objective (ties: the earlier trial)."""
    sign = 1 if spec.objective.direction() == "minimize" else -1
    return lambda t: (sign * t.values[0], t.number)


def ranked_feasible(study, spec) -> list:
    """The feasible completed trials, best first on the first objective (`by_first_objective`)."""
    from optuna.trial import TrialState  # optuna: the [tune] extra, imported where a study exists

    return sorted(
        (t for t in study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,)) if t.user_attrs.get("feasible")),
        key=by_first_objective(spec),
    )


def best_trial(study, spec):
    """Best feasible completed trial (first objective), or None."""
    ranked = ranked_feasible(study, spec)
    return ranked[0] if ranked else None


# Process groups (pgid == the trial process's pid) of the trial processes running now.
_live_groups: set[int] = set()


def kill_trial_processes() -> None:
    """SIGKILL every running trial process group (the trial process and its HTTP client)."""
    for pgid in list(_live_groups):
        _kill_group(pgid)


def _kill_group(pgid: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, signal.SIGKILL)


@contextlib.contextmanager
def trials_die_with_this_process() -> Iterator[None]:
    """While inside: SIGTERM or SIGINT kills the trial processes, then raises `Interrupted`.

    Trial processes run in their own process group (so a terminal's Ctrl-C reaches only this
    process); this handler is what stops them. Only the main thread can set signal handlers:
    elsewhere this does nothing.
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def on_signal(signum, frame) -> None:
        kill_trial_processes()
        raise Interrupted(signal.Signals(signum).name)

    previous = {s: signal.signal(s, on_signal) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        yield
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)


def _rss_bytes(pid: int) -> int:
    try:
        import psutil

        p = psutil.Process(pid)
        return p.memory_info().rss + sum(c.memory_info().rss for c in p.children(recursive=True))
    except Exception:
        return 0


_AUTO_POLICY: str | None = None


def machine_busy_fraction(interval_s: float = 0.5) -> float:
    """Fraction of all cores busy right now (any process), 0..1."""
    import psutil

    return psutil.cpu_percent(interval=interval_s) / 100.0


def omp_wait_policy(setting: str = "auto") -> str:
    """The OpenMP wait policy trials run with ("active" or "passive"); see `trial_env`.

    A user's own OMP_WAIT_POLICY wins over `setting`. "auto" is decided once per process,
    from the CPU use of the whole machine over half a second before the first trial (not the
    load average, which still remembers the previous run for minutes), so every trial of a
    run is measured under the same policy.
    """
    global _AUTO_POLICY
    if os.environ.get("OMP_WAIT_POLICY"):
        return os.environ["OMP_WAIT_POLICY"].lower()
    if setting != "auto":
        return setting
    if _AUTO_POLICY is None:
        _AUTO_POLICY = "passive" if machine_busy_fraction() > 0.5 else "active"
    return _AUTO_POLICY


def trial_env(threads: int | None = None, wait_policy: str = "auto") -> dict[str, str]:
    """Environment of a trial process.

    The OpenMP wait policy decides what idle worker threads do between torch ops. Spinning
    (active) is fastest on a dedicated
    machine: passive costs a thread wake-up per op, measured on the 2-core Xeon as 59.8 ->
    88.7 ms p95 TPOT (fp32, chat-small). But spinning threads collapse when the CPU is shared
    (other trials, workers, CI jobs): under load one trial ran at 2.8 tokens/s spinning and 28
    tokens/s passive. Hence `budget.trial_omp_wait_policy` (auto: passive only on a loaded
    machine). A user's own OMP_WAIT_POLICY wins. Note: `tune serve` sets no policy, so it runs
    with libgomp's default (spin briefly, then sleep), which is neither of the two.
    """
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    env["OMP_WAIT_POLICY"] = omp_wait_policy(wait_policy).upper()
    if threads is not None:
        env["OMP_NUM_THREADS"] = str(threads)
    return env


# The trial process: `python -m slotune.tuner.measure.trial_runner IN.json OUT.json`. Tests of study
# mechanics supply another command with the same contract (tests/tuner_tests/fake_trial_runner.py,
# a cheap stand-in measurement) through `runner=` / `tune run --trial-runner`.
DEFAULT_TRIAL_RUNNER: tuple[str, ...] = (sys.executable, "-m", "slotune.tuner.measure.trial_runner")


def trial_runner_command(runner: str | None) -> tuple[str, ...]:
    """`tune run --trial-runner`'s value -> the command: a .py file runs as a script, anything
    else as a module (`python -m`); None = DEFAULT_TRIAL_RUNNER."""
    if not runner:
        return DEFAULT_TRIAL_RUNNER
    return (sys.executable, str(Path(runner).resolve())) if runner.endswith(".py") else (sys.executable, "-m", runner)


def run_trial_process(
    request: dict[str, Any],
    *,
    timeout_s: float,
    memory_gb: float,
    on_phase: Callable[[str], None] | None = None,
    threads: int | None = None,
    wait_policy: str = "auto",
    runner: tuple[str, ...] = DEFAULT_TRIAL_RUNNER,
) -> dict[str, Any]:
    """Run the trial process (`runner IN.json OUT.json`) on `request`; raise TrialFailure on any fault.

    Args:
        request: JSON-able trial request (see `trial_request`).
        timeout_s: wall-clock limit; the child is killed past it.
        memory_gb: resident-set limit of the child (and its children); killed past it.
        on_phase: called with the child's current phase ("loading model", "replay 5/48", ...).
        threads: CPU threads of the child (OMP_NUM_THREADS); None = torch's default.
        runner: the trial process's command, before IN.json OUT.json.

    Returns:
        The child's result dict: metrics, violations, early_stopped, gates, latencies, measure.
    """
    try:
        tmp = tempfile.TemporaryDirectory(prefix="slotune-trial-")
    except OSError as exc:  # a full disk fails the trial with a reason, not the study with a traceback
        raise TrialFailure(
            f"could not create a trial directory in {tempfile.gettempdir()}: {exc.strerror or exc}"
        ) from None
    with tmp as d:
        src, dst, phase_file = Path(d) / "in.json", Path(d) / "out.json", Path(d) / "phase.txt"
        try:
            src.write_text(json.dumps({**request, "phase_file": str(phase_file), "parent_pid": os.getpid()}))
        except OSError as exc:
            raise TrialFailure(f"could not write the trial input {src}: {exc.strerror or exc}") from None
        with open(Path(d) / "log.txt", "w+") as log:
            # Its own process group (session): killed as a whole, and out of reach of a
            # terminal's Ctrl-C, which `trials_die_with_this_process` handles for it.
            proc = subprocess.Popen(
                [*runner, str(src), str(dst)],
                stdout=log,
                stderr=subprocess.STDOUT,
                env=trial_env(threads, wait_policy),
                start_new_session=True,
            )
            _live_groups.add(proc.pid)
            try:
                reason, last_phase = _watch(proc, phase_file, timeout_s, memory_gb, on_phase)
            finally:  # any exit (done, limit, Ctrl-C, SIGTERM): nothing of the trial outlives it
                _kill_group(proc.pid)
                proc.wait()
                _live_groups.discard(proc.pid)
            if reason:
                raise TrialFailure(f"{reason} (during: {last_phase})" if last_phase else reason)
            if proc.returncode != 0 or not dst.exists():
                log.seek(0)
                tail = log.read()[-800:].strip()
                how = (
                    f"killed by signal {-proc.returncode}"
                    if proc.returncode < 0
                    else f"exited with code {proc.returncode}"
                )
                raise TrialFailure(f"trial process {how}" + (f": {tail}" if tail else ""))
        result = json.loads(dst.read_text())
        if result.get("status") != "ok":
            raise TrialFailure(result.get("error", "unknown error"))
        return result


def _watch(
    proc: subprocess.Popen, phase_file: Path, timeout_s: float, memory_gb: float, on_phase: Callable[[str], None] | None
) -> tuple[str | None, str]:
    """Poll the trial process until it exits or breaks a limit. Returns (limit broken or None, last phase)."""
    deadline = time.monotonic() + timeout_s
    limit = memory_gb * 2**30
    last_phase = ""
    while proc.poll() is None:
        if time.monotonic() > deadline:
            return f"timeout: trial exceeded budget.trial_timeout_s={timeout_s:g}", last_phase
        if _rss_bytes(proc.pid) > limit:
            return f"out of memory: trial exceeded budget.trial_memory_gb={memory_gb:g}", last_phase
        if on_phase is not None and phase_file.exists():
            phase = phase_file.read_text().strip()
            if phase and phase != last_phase:
                on_phase(phase)
                last_phase = phase
        time.sleep(0.2)
    return None, last_phase


def trial_request(
    spec, config, seed: int | None = None, early_stop: bool = True, gates: bool = True, workload=None
) -> dict[str, Any]:
    """Everything the child needs, as JSON: config, workload (the spec's unless given: a screening
    replay's), objective, gates (none with `gates=False`), early stop, and how to measure
    (`budget.measure`: served over HTTP or in process)."""
    es = spec.early_stop.model_dump(mode="json")
    es["enabled"] = es["enabled"] and early_stop
    return {
        "config": config.model_dump(mode="json"),
        "workload": (workload or spec.workload).model_dump(mode="json"),
        "objective": spec.objective.model_dump(mode="json"),
        "gates": [g.model_dump(mode="json") for g in spec.quality_gates] if gates else [],
        "early_stop": es,
        "seed": seed,
        "cache_dir": str(spec.resolved_output_dir() / "cache"),
        "measure": spec.budget.measure,
    }


def measure(
    spec,
    config,
    seed: int | None = None,
    on_phase=None,
    early_stop: bool = True,
    runner: tuple[str, ...] = DEFAULT_TRIAL_RUNNER,
    gates: bool = True,
    workload=None,
) -> dict[str, Any]:
    """Measure `config` on the spec's workload in a child process; raises TrialFailure.

    Args:
        spec: the TuningSpec (workload, objective, gates, budget limits, price).
        config: the EngineConfig to measure.
        seed: workload seed override (the confirmation round's fresh requests).
        on_phase: progress callback, see `run_trial_process`.
        early_stop: allow the cheap early stop (off for reference measurements, which must be
            complete to compare against).
        runner: the trial process's command (see `run_trial_process`).
        gates: run the quality gates (off for a re-measurement: they do not depend on the workload).
        workload: replay this WorkloadSpec instead of the spec's (a screening replay).

    Returns:
        The child's result (see `run_trial_process`); with a price (`spec.cost`), its metrics
        carry the cost per 1M tokens (`metrics.cost_metrics`, intervals included).
    """
    b = spec.budget
    result = run_trial_process(
        trial_request(spec, config, seed, early_stop, gates, workload),
        timeout_s=b.trial_timeout_s,
        memory_gb=b.trial_memory_gb,
        on_phase=on_phase,
        threads=b.trial_threads,
        wait_policy=b.trial_omp_wait_policy,
        runner=runner,
    )
    if spec.cost is not None:  # priced here, after any trial process: the same price for every measurement
        result["metrics"].update(cost_metrics(result["metrics"], spec.cost.usd_per_hour))
    return result


def trial_constraints(trial) -> list[float]:
    """Optuna < 5 `constraints_func`: the constraint values stored on the trial."""
    v = trial.user_attrs.get("violations") or {}
    return list(constraint_values(v).values())


class Objective:
    """The Optuna objective: claim a budget slot -> sample -> build config -> measure in a child
    process -> score.

    Args:
        spec: the TuningSpec.
        progress: the live display (`Progress`), or None.
        budget: decides whether a new trial may be measured (`TrialBudget.admits`, tuner/study.py);
            None = always. Asked after the trial exists, so several processes sharing a study
            never measure more than the budget between them.
        runner: the trial process's command (see `run_trial_process`).
    """

    def __init__(self, spec, progress=None, budget=None, runner: tuple[str, ...] = DEFAULT_TRIAL_RUNNER) -> None:
        self.spec = spec
        self.runner = runner
        self.space = spec.search_space
        self.base = spec.base_config()
        self.progress = progress
        self.budget = budget
        self.current: int | None = None  # the number of the trial being run by this process

    def _phase(self, number: int, text: str) -> None:
        if self.progress is not None:
            self.progress.phase(number, text)

    def __call__(self, trial) -> float | list[float]:
        self.current = trial.number
        trial.set_user_attr("fail_reason", ORPHANED_REASON)
        try:
            return self._run(trial)
        except KeyboardInterrupt as exc:  # Optuna records the trial as FAIL and re-raises
            trial.set_user_attr("fail_reason", f"interrupted: tune run got {exc or 'SIGINT'}")
            raise

    def _run(self, trial) -> float | list[float]:
        import optuna

        trial.set_user_attr("host", socket.gethostname())
        trial.set_user_attr("machine", machine.words())  # the trial process runs here too
        trial.set_user_attr("pid", os.getpid())
        trial.set_user_attr("measure", self.spec.budget.measure)
        if self.budget is not None and not self.budget.admits(trial.study, trial.number):
            reason = f"not run: the study's {self.budget.total} trials were already taken (other processes share it)"
            trial.set_user_attr("unmeasured", UNMEASURED_OVER_BUDGET)
            trial.set_user_attr("fail_reason", reason)
            trial.study.stop()
            raise optuna.TrialPruned(reason)
        params = self.space.sample(trial)
        reason = self.space.forbidden_reason(params)
        if reason:  # costs nothing to measure, so it does not count against the budget
            trial.set_user_attr("fail_reason", reason)
            trial.set_user_attr("forbidden", True)
            trial.set_user_attr("unmeasured", UNMEASURED_FORBIDDEN)
            raise optuna.TrialPruned(reason)
        try:
            config = self.base.with_updates(params)
        except ValueError as exc:  # rejected before any measurement: not counted either
            trial.set_user_attr("unmeasured", UNMEASURED_INVALID)
            raise self._fail(trial, f"invalid config: {_config_problems(exc)}") from None
        earlier = earlier_measurement(
            trial.study, trial.params, before=trial.number, screened_out=self.spec.screening.enabled
        )
        if earlier is not None:
            return self._repeat(trial, earlier)
        trial.set_user_attr("config", config.model_dump(mode="json"))
        if self.spec.screening.enabled and not trial.user_attrs.get("tag"):
            self._screen(trial, config)  # raises TrialPruned when screened out
        self._phase(trial.number, "starting trial process")
        try:
            # The default and naive trials are the yardsticks: measured in full, never cut short.
            result = measure(
                self.spec,
                config,
                on_phase=lambda p: self._phase(trial.number, p),
                early_stop=not trial.user_attrs.get("tag"),
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
        value = result["metrics"].get(key)
        share = screen.share(wl)
        trial.set_user_attr(
            "screen",
            {
                "num_requests": short.num_requests,
                "of": wl.num_requests,
                "share": share,
                "value": value,
                "early_stopped": result["early_stopped"],
            },
        )
        if value is None and not result["early_stopped"]:
            raise self._fail(trial, f"metric {key} was not measured in the screening replay (no request finished)")
        if value is not None:
            trial.report(float(value), 0)
        if not result["early_stopped"] and not trial.should_prune():  # the study's ScreeningPruner decides
            return
        reason = self._screen_reason(trial, key, value, result["early_stopped"], wl)
        self._store(trial, result)
        trial.set_user_attr("feasible", False)  # not measured in full, gates not run
        trial.set_user_attr("screened_out", True)
        trial.set_user_attr("fail_reason", reason)
        raise optuna.TrialPruned(reason)

    def _screen_reason(self, trial, key: str, value, early_stopped: bool, wl) -> str:
        """Why the study's pruner screened `trial` out, with the bar and peers it decided on."""
        from slotune.tuner.measure.units import format_value, metric_label

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

    def _repeat(self, trial, earlier) -> float | list[float]:
        """Trial `earlier` measured these params: copy its outcome (TPE learns the same as from a
        re-measurement, at no cost) and enqueue an unexplored config, so the budget goes to new ones.
        A screened-out config stays screened out (PRUNED, with the same reason)."""
        import optuna

        for k in REPEAT_ATTRS:
            if k in earlier.user_attrs:
                trial.set_user_attr(k, earlier.user_attrs[k])
        if hasattr(trial, "set_constraint"):
            for k in CONSTRAINT_KEYS:
                trial.set_constraint(k, earlier.user_attrs["violations"].get(k, 0.0))
        trial.set_user_attr("unmeasured", UNMEASURED_REPEAT)
        trial.set_user_attr("repeat_of", earlier.number)
        trial.set_user_attr("fail_reason", None)
        enqueue_unexplored(
            self.space, trial.study, seed=None if self.spec.seed is None else self.spec.seed + trial.number
        )
        if is_screened_out(earlier):
            if 0 in earlier.intermediate_values:
                trial.report(earlier.intermediate_values[0], 0)
            trial.set_user_attr("fail_reason", earlier.user_attrs.get("fail_reason"))
            raise optuna.TrialPruned(earlier.user_attrs.get("fail_reason"))
        values = list(earlier.values)
        return values if len(values) > 1 else values[0]

    def _fail(self, trial, reason: str) -> TrialFailure:
        trial.set_user_attr("fail_reason", reason)
        return TrialFailure(reason)

    def _store(self, trial, result: dict[str, Any]) -> None:
        """A measurement's metrics, SLO constraints, gates and latencies as the trial's attributes."""
        m = result["metrics"]
        violations = constraint_values(result["violations"])
        trial.set_user_attr("metrics", m)
        trial.set_user_attr("violations", violations)
        trial.set_user_attr("feasible", is_feasible(violations))
        trial.set_user_attr("early_stopped", result["early_stopped"])
        if hasattr(trial, "set_constraint"):  # Optuna >= 5: samplers read these directly
            for k in CONSTRAINT_KEYS:
                trial.set_constraint(k, violations[k])
        if result.get("gates") is not None:
            trial.set_user_attr("gates", result["gates"])
        if result.get("latencies"):
            trial.set_user_attr("latencies", result["latencies"])

    def _record(self, trial, result: dict[str, Any]) -> float | list[float]:
        """`_store` the measurement; returns the objective value(s)."""
        self._store(trial, result)
        m = result["metrics"]
        obj = self.spec.objective
        values = []
        for metric in obj.metrics:
            key = obj.metric_key(metric)
            if key not in m:
                if result["early_stopped"]:  # stopped before any request finished: the SLO was
                    import optuna  # hopeless; constraints above still inform the sampler

                    trial.set_user_attr("fail_reason", f"early stop before {key} could be measured")
                    raise optuna.TrialPruned(f"early stop before {key} could be measured")
                raise self._fail(trial, f"metric {key} was not measured (no request finished)")
            values.append(float(m[key]))
        trial.set_user_attr("fail_reason", None)  # measured: the advance ORPHANED_REASON no longer applies
        return values if len(values) > 1 else values[0]


def _config_problems(exc: ValueError) -> str:
    """`field: message` for each problem, on one line (a pydantic error's first line names no field)."""
    lines = format_error(exc).splitlines()
    return "; ".join(line.strip().removeprefix("(root): ") for line in (lines[1:] or lines))
