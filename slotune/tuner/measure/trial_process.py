"""A trial's child process: started in its own process group under a timeout and a memory cap, killed
with `tune run`; a crash, hang or OOM becomes a `TrialFailure` with its reason, never a crashed study."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from slotune.tuner.measure import failures
from slotune.tuner.measure.measurement import Measurement
from slotune.tuner.measure.metrics import cost_metrics


class TrialFailure(Exception):
    """A trial that produced no measurement; `reason` is recorded on the trial."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


@dataclass(frozen=True)
class TrialResult:
    """What a trial process measured, parsed once from its JSON (`measure`)."""

    metrics: Measurement
    violations: dict[str, float]  # SLO constraint values as the trial process judged them
    early_stopped: bool
    gates: dict[str, Any] | None = (
        None  # the gate report (slotune/evals/gate_spec.py GateReport.to_dict()); None: not run
    )
    latencies: dict[str, list[float]] | None = None  # per-request seconds, {"ttft": [...], "tpot": [...]}
    measure: str | None = None  # how it was measured: "served" or "in_process"

    @classmethod
    def from_json(cls, result: dict[str, Any]) -> "TrialResult":
        """Raises TrialFailure when the result lacks a measurement (a custom `--trial-runner`'s bug)."""
        missing = [k for k in ("metrics", "violations", "early_stopped") if k not in result]
        if missing:
            raise TrialFailure(f"the trial process's result lacks {', '.join(missing)}")
        return cls(
            metrics=Measurement.from_dict(result["metrics"]),
            violations=dict(result["violations"]),
            early_stopped=bool(result["early_stopped"]),
            gates=result.get("gates"),
            latencies=result.get("latencies"),
            measure=result.get("measure"),
        )


class Interrupted(KeyboardInterrupt):
    """`tune run` got SIGTERM or SIGINT. A KeyboardInterrupt, so Optuna records the running
    trial as FAIL before it re-raises, as it does for Ctrl-C."""


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


def trial_env(threads: int | None = None, wait_policy: str | None = "auto") -> dict[str, str]:
    """Environment of a trial process.

    The OpenMP wait policy decides what idle worker threads do between torch ops. Spinning
    (active) is fastest on a dedicated
    machine: passive costs a thread wake-up per op, measured on the 2-core Xeon as 59.8 ->
    88.7 ms p95 TPOT (fp32, chat-small). But spinning threads collapse when the CPU is shared
    (other trials, workers, CI jobs): under load one trial ran at 2.8 tokens/s spinning and 28
    tokens/s passive. Hence `budget.trial_omp_wait_policy` (auto: passive only on a loaded
    machine). A user's own OMP_WAIT_POLICY wins. Note: `tune serve` sets no policy, so it runs
    with libgomp's default (spin briefly, then sleep), which is neither of the two. `wait_policy`
    None: the environment as the user has it (an external server, launched as the user launches it).
    """
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    if wait_policy is None:
        return env
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
    wait_policy: str | None = "auto",
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
                raise TrialFailure(failures.process_ended(proc.returncode, log.read()[-800:].strip()))
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
            return failures.timeout(timeout_s), last_phase
        if _rss_bytes(proc.pid) > limit:
            return failures.out_of_memory(memory_gb), last_phase
        if on_phase is not None and phase_file.exists():
            phase = phase_file.read_text().strip()
            if phase and phase != last_phase:
                on_phase(phase)
                last_phase = phase
        with contextlib.suppress(subprocess.TimeoutExpired):  # returns as soon as the child exits
            proc.wait(timeout=0.2)
    return None, last_phase


def trial_request(
    spec, config, seed: int | None = None, early_stop: bool = True, gates: bool = True, workload=None
) -> dict[str, Any]:
    """Everything the child needs, as JSON: config, workload (the spec's unless given: a screening
    replay's), objective, gates (none with `gates=False`), early stop, and how to measure
    (`budget.measure`: served over HTTP or in process)."""
    es = spec.early_stop.model_dump(mode="json")
    es["enabled"] = es["enabled"] and early_stop
    reference = {"reference": spec.base_config().model_dump(mode="json")} if spec.is_external and gates else {}
    return {
        **reference,  # an external server's gates compare its answers with the default launch's
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
) -> TrialResult:
    """Measure `config` on the spec's workload in a child process; raises TrialFailure.

    Args:
        spec: the TuningSpec (workload, objective, gates, budget limits, price).
        config: the EngineConfig to measure.
        seed: workload seed override (the confirmation's fresh requests).
        on_phase: progress callback, see `run_trial_process`.
        early_stop: allow the cheap early stop (off for reference measurements, which must be
            complete to compare against).
        runner: the trial process's command (see `run_trial_process`).
        gates: run the quality gates (off for a re-measurement: they do not depend on the workload).
        workload: replay this WorkloadSpec instead of the spec's (a screening replay).

    Returns:
        The child's result (see `run_trial_process`), parsed; with a price (`spec.cost`), its metrics
        carry the cost per 1M tokens (`metrics.cost_metrics`, intervals included).
    """
    result = _run(spec, trial_request(spec, config, seed, early_stop, gates, workload), runner, on_phase)
    return TrialResult.from_json(_priced(spec, result))


def measure_seeds(
    spec,
    config,
    seeds: list[int],
    runner: tuple[str, ...] = DEFAULT_TRIAL_RUNNER,
    on_phase=None,
    stop_after_miss: bool = False,
) -> list[TrialResult | TrialFailure | None]:
    """Measure `config` on each of `seeds` in one trial process: started once, replayed on each seed in
    turn, without gates or early stop (re-measurements). Per seed its TrialResult, the TrialFailure
    that ended it, or with `stop_after_miss` None: not replayed, as an earlier seed missed the SLO. A
    process that fails fails every seed. The time limit is `trial_timeout_s` per seed."""
    request = {
        **trial_request(spec, config, None, early_stop=False, gates=False),
        "seeds": list(seeds),
        "stop_after_miss": stop_after_miss,
    }
    try:
        result = _run(spec, request, runner, on_phase, timeout_s=spec.budget.trial_timeout_s * len(seeds))
    except TrialFailure as exc:
        return [exc] * len(seeds)
    by_seed = result.get("by_seed")
    if not isinstance(by_seed, list) or len(by_seed) != len(seeds):
        return [TrialFailure("the trial process's result lacks by_seed: one result per seed it was asked")] * len(seeds)
    out: list[TrialResult | TrialFailure | None] = []
    for r in by_seed:
        if r.get("skipped"):
            out.append(None)
            continue
        try:
            if "error" in r:
                raise TrialFailure(r["error"])
            out.append(TrialResult.from_json(_priced(spec, r)))
        except TrialFailure as exc:
            out.append(exc)
    return out


def _run(spec, request: dict[str, Any], runner, on_phase, timeout_s: float | None = None) -> dict[str, Any]:
    """`run_trial_process` under the spec's limits."""
    b = spec.budget
    return run_trial_process(
        request,
        timeout_s=timeout_s or b.trial_timeout_s,
        memory_gb=b.trial_memory_gb,
        on_phase=on_phase,
        # an external server's threads are its knobs; the OpenMP settings are the bundled engine's
        threads=None if spec.is_external else b.trial_threads,
        wait_policy=None if spec.is_external else b.trial_omp_wait_policy,
        runner=runner,
    )


def _priced(spec, result: dict[str, Any]) -> dict[str, Any]:
    """With a price (`spec.cost`), the metrics carry the cost per 1M tokens (`metrics.cost_metrics`,
    intervals included): priced here, after any trial process, so every measurement has the same price."""
    if spec.cost is not None and isinstance(result.get("metrics"), dict):
        result["metrics"].update(cost_metrics(result["metrics"], spec.cost.usd_per_hour))
    return result
