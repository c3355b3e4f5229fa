"""Parent side of a trial: sample a config, measure it in an isolated child process, score it.

The lifecycle of one trial (`Objective.__call__`):
  sample -> build EngineConfig -> run `slotune.tuner.trial_runner` in a child process under a
  timeout and a memory cap -> record metrics, SLO constraints, gates as user attributes ->
  return the objective value(s).
A child that crashes, hangs, runs out of memory or raises is recorded as a FAIL trial with the
reason (`TrialFailure`); the study goes on. The memory cap watches the child's resident set:
RLIMIT_AS would also count torch's large virtual reservations and kill healthy trials.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from slotune.tuner.slo import CONSTRAINT_KEYS, constraint_values, is_feasible


class TrialFailure(Exception):
    """A trial that produced no measurement; `reason` is recorded on the trial."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


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


def run_trial_process(request: dict[str, Any], *, timeout_s: float, memory_gb: float,
                      on_phase: Callable[[str], None] | None = None, threads: int | None = None,
                      wait_policy: str = "auto") -> dict[str, Any]:
    """Run `python -m slotune.tuner.trial_runner` on `request`; raise TrialFailure on any fault.

    Args:
        request: JSON-able trial request (see `trial_request`).
        timeout_s: wall-clock limit; the child is killed past it.
        memory_gb: resident-set limit of the child (and its children); killed past it.
        on_phase: called with the child's current phase ("loading model", "replay 5/48", ...).
        threads: CPU threads of the child (OMP_NUM_THREADS); None = torch's default.

    Returns:
        The child's result dict: metrics, violations, early_stopped, gates, latencies, measure.
    """
    with tempfile.TemporaryDirectory(prefix="slotune-trial-") as d:
        src, dst, phase_file = Path(d) / "in.json", Path(d) / "out.json", Path(d) / "phase.txt"
        src.write_text(json.dumps({**request, "phase_file": str(phase_file)}))
        with open(Path(d) / "log.txt", "w+") as log:
            proc = subprocess.Popen([sys.executable, "-m", "slotune.tuner.trial_runner", str(src), str(dst)],
                                    stdout=log, stderr=subprocess.STDOUT, env=trial_env(threads, wait_policy))
            deadline = time.monotonic() + timeout_s
            limit = memory_gb * 2**30
            reason, last_phase = None, ""
            while proc.poll() is None:
                if time.monotonic() > deadline:
                    reason = f"timeout: trial exceeded budget.trial_timeout_s={timeout_s:g}"
                elif _rss_bytes(proc.pid) > limit:
                    reason = f"out of memory: trial exceeded budget.trial_memory_gb={memory_gb:g}"
                if reason:
                    proc.kill()
                    proc.wait()
                    break
                if on_phase is not None and phase_file.exists():
                    phase = phase_file.read_text().strip()
                    if phase and phase != last_phase:
                        on_phase(phase)
                        last_phase = phase
                time.sleep(0.2)
            if reason:
                raise TrialFailure(f"{reason} (during: {last_phase})" if last_phase else reason)
            if proc.returncode != 0 or not dst.exists():
                log.seek(0)
                tail = log.read()[-800:].strip()
                how = f"killed by signal {-proc.returncode}" if proc.returncode < 0 else f"exited with code {proc.returncode}"
                raise TrialFailure(f"trial process {how}" + (f": {tail}" if tail else ""))
        result = json.loads(dst.read_text())
        if result.get("status") != "ok":
            raise TrialFailure(result.get("error", "unknown error"))
        return result


def trial_request(spec, config, seed: int | None = None, early_stop: bool = True) -> dict[str, Any]:
    """Everything the child needs, as JSON: config, workload, objective, gates, early stop, and
    how to measure (`budget.measure`: served over HTTP or in process)."""
    es = spec.early_stop.model_dump(mode="json")
    es["enabled"] = es["enabled"] and early_stop
    return {
        "config": config.model_dump(mode="json"),
        "workload": spec.workload_spec().model_dump(mode="json"),
        "objective": spec.objective.model_dump(mode="json"),
        "gates": spec.quality_gates,
        "early_stop": es,
        "seed": seed,
        "cache_dir": str(spec.resolved_output_dir() / "cache"),
        "measure": spec.budget.measure,
    }


def measure(spec, config, seed: int | None = None, on_phase=None, early_stop: bool = True) -> dict[str, Any]:
    """Measure `config` on the spec's workload in a child process; raises TrialFailure.

    Args:
        spec: the TuningSpec (workload, objective, gates, budget limits).
        config: the EngineConfig to measure.
        seed: workload seed override (the winner's robustness re-measurement).
        on_phase: progress callback, see `run_trial_process`.
        early_stop: allow the cheap early stop (off for reference measurements, which must be
            complete to compare against).
    """
    b = spec.budget
    return run_trial_process(trial_request(spec, config, seed, early_stop), timeout_s=b.trial_timeout_s,
                             memory_gb=b.trial_memory_gb, on_phase=on_phase, threads=b.trial_threads,
                             wait_policy=b.trial_omp_wait_policy)


def trial_constraints(trial) -> list[float]:
    """Optuna < 5 `constraints_func`: the constraint values stored on the trial."""
    v = trial.user_attrs.get("violations") or {}
    return list(constraint_values(v).values())


class Objective:
    """The Optuna objective: sample -> build config -> measure in a child process -> score."""

    def __init__(self, spec, progress=None) -> None:
        self.spec = spec
        self.space = spec.space()
        self.base = spec.base_config()
        self.progress = progress

    def _phase(self, number: int, text: str) -> None:
        if self.progress is not None:
            self.progress.phase(number, text)

    def __call__(self, trial) -> float | list[float]:
        import optuna

        trial.set_user_attr("host", socket.gethostname())
        trial.set_user_attr("pid", os.getpid())
        trial.set_user_attr("measure", self.spec.budget.measure)
        params = self.space.sample(trial)
        reason = self.space.forbidden_reason(params)
        if reason:  # costs nothing to measure, so it does not count against the budget
            trial.set_user_attr("fail_reason", reason)
            trial.set_user_attr("forbidden", True)
            raise optuna.TrialPruned(reason)
        try:
            config = self.base.with_updates(params)
        except ValueError as exc:
            raise self._fail(trial, f"invalid config: {str(exc).splitlines()[0]}") from None
        trial.set_user_attr("config", config.model_dump(mode="json"))
        self._phase(trial.number, "starting trial process")
        try:
            # The default and baseline trials are the yardsticks: measured in full, never cut short.
            result = measure(self.spec, config, on_phase=lambda p: self._phase(trial.number, p),
                             early_stop=not trial.user_attrs.get("tag"))
        except TrialFailure as exc:
            raise self._fail(trial, exc.reason) from None
        return self._record(trial, result)

    def _fail(self, trial, reason: str) -> TrialFailure:
        trial.set_user_attr("fail_reason", reason)
        return TrialFailure(reason)

    def _record(self, trial, result: dict[str, Any]) -> float | list[float]:
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
        obj = self.spec.objective
        values = []
        for metric in obj.metrics:
            key = obj.metric_key(metric)
            if key not in m:
                if result["early_stopped"]:  # stopped before any request finished: the SLO was
                    import optuna        # hopeless; constraints above still inform the sampler

                    trial.set_user_attr("fail_reason", f"early stop before {key} could be measured")
                    raise optuna.TrialPruned(f"early stop before {key} could be measured")
                raise self._fail(trial, f"metric {key} was not measured (no request finished)")
            values.append(float(m[key]))
        return values if len(values) > 1 else values[0]
