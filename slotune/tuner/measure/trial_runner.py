"""One trial in its own process: build the engine, replay the workload, check the SLO, run the gates.

Run as `python -m slotune.tuner.measure.trial_runner IN.json OUT.json`. A crash, an OOM kill or a
hang takes down only this process; the parent (slotune/tuner/measure/trial_process.py) records it as a
failed trial with the reason. Progress goes to the request's `phase_file`. `budget.measure`:
served (default) serves the engine as `tune serve` does and replays from a client process
(slotune/tuner/measure/replay_client.py), the two hand-shaking so engine counters and peak memory cover the
measured requests only; in_process drives the engine directly (`run_in_process_replay`: quicker, no serving cost).
"""

from __future__ import annotations

import contextlib
import json
import os
import pickle
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

from slotune.evals.baseline import default_cache_dir
from slotune.evals.gate_spec import GateSpec
from slotune.evals.gates import evaluate_gates
from slotune.tuner.measure import external_trial
from slotune.tuner.measure.external_server import ServerFailure
from slotune.tuner.measure.in_process_replay import run_in_process_replay
from slotune.tuner.measure.intervals import bootstrap_intervals
from slotune.tuner.measure.metrics import CI_PERCENTILES, ReplayResult, breaks_slo_so_far
from slotune.tuner.measure.server import BundledServer, InFlightWatchdog, TrialServer
from slotune.tuner.measure.tied import die_with_parent
from slotune.tuner.spec.server import ServerConfig, parse_config
from slotune.tuner.spec.slo import is_feasible, slo_violations
from slotune.tuner.spec.workload_spec import WorkloadSpec


def run_trial(req: dict[str, Any]) -> dict[str, Any]:
    """Measure one config. Returns metrics (with their intervals: `bootstrap_intervals`), SLO
    violations, early_stopped, gates, latencies, measure. With `seeds` (a list; no gates, no early
    stop), the config is started once and replayed on each seed in turn: {"by_seed": [that result,
    or {"error": reason}, per seed]}; with `stop_after_miss` too, the seeds after one whose replay missed
    the SLO are not replayed ({"skipped": true})."""
    phase_file = req.get("phase_file")

    def phase(text: str) -> None:
        if phase_file:
            tmp = f"{phase_file}.tmp"
            Path(tmp).write_text(text)
            os.replace(tmp, phase_file)

    cfg = parse_config(req["config"])
    objective = req["objective"]
    measure = req.get("measure", "served")  # validated as budget.measure (slotune/tuner/spec/sections.py)
    seeds = req.get("seeds")
    if seeds is not None and (req.get("gates") or (req.get("early_stop") or {}).get("enabled")):
        raise ValueError("a request with several seeds measures without gates and without early stop")
    replays = [{**req, "seed": s} for s in seeds] if seeds is not None else [req]
    until = (lambda res: _missed(res, objective)) if seeds is not None and req.get("stop_after_miss") else None
    from slotune.engine import LLM  # imports torch (the trial process's own import; the parent never loads it)

    phase("loading model")
    t0 = time.perf_counter()
    gate_specs = [GateSpec.model_validate(g) for g in req.get("gates") or []]
    judged: list[tuple[dict[str, float], dict[str, float]]] = []  # the first replay's metrics and violations
    if isinstance(cfg, ServerConfig):  # served only (TuningSpec._check_server)
        with tempfile.TemporaryDirectory(prefix="slotune-server-") as d:
            server = external_trial.external_server(cfg, Path(d) / "server.log")
            answers: dict[str, Any] = {}

            def take_answers(res: ReplayResult) -> None:  # while it serves: its gates judge its own answers
                if judged:
                    return
                judged.append(_judged(res, objective, server.load_time_s))
                if gate_specs and is_feasible(judged[0][1]):
                    phase("quality gates: answers")
                    answers.update(external_trial.answers(server, gate_specs))

            got, load_s = _replay_served(server, replays, phase, after=take_answers, until=until)
        llm = None
    elif measure == "served":
        server = BundledServer(cfg, objective, req.get("early_stop") or {})
        got, load_s = _replay_served(server, replays, phase, until=until)
        llm = server.llm
    else:
        llm = LLM(cfg)
        load_s = time.perf_counter() - t0
        got = _each(replays, lambda r: _replay_in_process(llm, r, phase), until)
    if seeds is not None:
        return {
            "by_seed": [
                res if isinstance(res, dict) else _result(res, *_judged(res, objective, load_s), measure) for res in got
            ]
        }
    res = got[0]
    metrics, violations = judged[0] if judged else _judged(res, objective, load_s)
    gates = None
    if req.get("gates") and is_feasible(violations):  # cheap first: gates only for SLO-meeting trials
        phase("quality gates")  # served: the server has stopped (the bundled engine stays loaded, idle)
        if isinstance(cfg, ServerConfig):
            reference = ServerConfig.model_validate(req["reference"])
            cache = Path(req.get("cache_dir") or default_cache_dir())
            report = external_trial.judge_gates(cfg, reference, gate_specs, answers, server.tokenizer, cache)
        else:
            report = evaluate_gates(cfg, gate_specs, llm=llm, cache_dir=req.get("cache_dir"))
        gates = report.to_dict()
        violations["quality_gates"] = 0.0 if report.passed else 1.0
    return {**_result(res, metrics, violations, measure), "gates": gates}


def _result(res: ReplayResult, metrics: dict[str, float], violations: dict[str, float], measure: str) -> dict[str, Any]:
    """One replay's part of the trial result."""
    return {
        "measure": measure,
        "metrics": metrics,
        "violations": violations,
        "early_stopped": res.early_stopped,
        "latencies": {
            "ttft": [r.ttft for r in res.records if r.ttft is not None],
            "tpot": [r.tpot for r in res.records if r.tpot is not None],
        },
    }


def error_text(exc: BaseException) -> str:
    """A failed measurement's reason, as the parent records it."""
    return exc.reason if isinstance(exc, ServerFailure) else f"{type(exc).__name__}: {exc}"


def _each(
    replays: list[dict[str, Any]],
    replay: Callable[[dict[str, Any]], ReplayResult],
    until: Callable[[ReplayResult], bool] | None,
) -> list[ReplayResult | dict[str, Any]]:
    """`replay(req)` for each request in turn (`_caught`); once `until(result)` holds, the requests after
    it are not replayed: {"skipped": true}."""
    got: list[ReplayResult | dict[str, Any]] = []
    done = False
    for req in replays:
        res = {"skipped": True} if done else _caught(lambda req=req: replay(req), several=len(replays) > 1)
        done = done or (until is not None and isinstance(res, ReplayResult) and until(res))
        got.append(res)
    return got


def _missed(res: ReplayResult, objective: dict[str, Any]) -> bool:
    """The replay missed the SLO (or was stopped early for it)."""
    return res.early_stopped or not is_feasible(slo_violations(res.metrics, objective))


def _caught(replay: Callable[[], ReplayResult], several: bool) -> ReplayResult | dict[str, str]:
    """`replay()`; when it is one of several seeds, its failure as {"error": reason} instead of raised,
    so the seeds after it are still measured."""
    if not several:
        return replay()
    try:
        return replay()
    except Exception as exc:  # noqa: BLE001 - recorded for this seed; the parent sees it per seed
        return {"error": error_text(exc)}


def _judged(res: ReplayResult, objective: dict[str, Any], load_s: float) -> tuple[dict[str, float], dict[str, float]]:
    """A replay's metrics with their intervals (how sure each number is: over the requests, at the
    objective's percentile too), and its SLO violations."""
    intervals = bootstrap_intervals(
        res.records,
        res.metrics["duration_s"],
        ttft_limit_s=objective.get("ttft_limit_s"),
        tpot_limit_s=objective.get("tpot_limit_s"),
        percentiles=(*CI_PERCENTILES, objective["percentile"]),
    )
    metrics = {**res.metrics, **intervals, "load_time_s": load_s}
    violations = slo_violations(metrics, objective)
    violations["early_stop"] = 1.0 if res.early_stopped else 0.0
    return metrics, violations


def _replay_in_process(llm, req: dict[str, Any], phase: Callable[[str], None]):
    """`run_in_process_replay` on the loaded engine (budget.measure: in_process)."""
    objective, es = req["objective"], req.get("early_stop") or {}
    watchdog = InFlightWatchdog(llm.engine, objective, es) if es.get("enabled") else None

    def should_stop(records) -> bool:
        if not es.get("enabled"):
            return False
        return (watchdog is not None and watchdog.is_hopeless) or breaks_slo_so_far(records, objective, es)

    phase("warm-up + replay")
    if watchdog is not None:
        watchdog.install()
    try:
        return run_in_process_replay(
            llm.config,
            WorkloadSpec.model_validate(req["workload"]),
            llm=llm,
            ttft_limit_s=objective.get("ttft_limit_s"),
            tpot_limit_s=objective.get("tpot_limit_s"),
            seed=req.get("seed"),
            percentiles=(objective["percentile"],),
            should_stop=should_stop,
            on_progress=lambda done, total: phase(f"replay {done}/{total}"),
        )
    finally:
        if watchdog is not None:
            watchdog.uninstall()


def _replay_served(
    server: TrialServer,
    replays: list[dict[str, Any]],
    phase: Callable[[str], None],
    after: Callable[[ReplayResult], None] = lambda res: None,
    until: Callable[[ReplayResult], bool] | None = None,
) -> tuple[list[ReplayResult | dict[str, Any]], float]:
    """Start `server`, replay each request's workload (seed) in turn from a client process over HTTP
    (the rest skipped once `until` holds for a result: `_each`), run `after` on each result while the
    server still runs, stop it.

    Latency and throughput metrics (and the records) are the client's; what the server saw over
    the client's measured run (engine counters, peak memory) is `server.window_metrics()`, as
    `run_in_process_replay` takes it in process. With several replays, one that fails is returned as
    {"error": reason} and the next is measured while the server lives. Returns (results, seconds
    from start to ready).
    """
    phase("starting server")
    several = len(replays) > 1
    with server:
        got = _each(replays, lambda req: _replay_once(server, req, after), until)
    if not several:  # with several, a death while serving is each later seed's error
        server.check()
    return got, server.load_time_s


def _replay_once(server: TrialServer, req: dict[str, Any], after: Callable[[ReplayResult], None]) -> ReplayResult:
    """One client run against the started `server` (see `_replay_served`)."""
    server.check()
    try:
        client = _run_client(server.url, req, server.tokenizer, server.begin_window, server.sample)
    except RuntimeError:
        server.check()  # a server that died is the cause of what its client saw
        raise
    server.check()
    num_broken = client.metrics.get("num_errors", 0.0)
    if num_broken and not server.is_hopeless:  # loopback to our own server: a bug, not a measurement
        causes = {k: v for k, v in client.metrics.items() if k.startswith("num_failed_") and not k[11:].isdigit()}
        raise RuntimeError(f"{num_broken:g} requests broke over HTTP without an early stop: {causes}")
    result = ReplayResult(
        config=req["config"],
        workload=client.workload,
        metrics={**client.metrics, **server.window_metrics()},  # _run_client raised unless the window began
        records=client.records,
        early_stopped=client.early_stopped or server.is_hopeless,
        device=client.device,
        started_at=client.started_at,
    )
    after(result)
    return result


def _run_client(
    url: str, req: dict[str, Any], tokenizer, on_measured_start: Callable[[], None], on_poll: Callable[[], None]
):
    """Run `python -m slotune.tuner.measure.replay_client` against `url` with the server's `tokenizer`;
    returns its ReplayResult.

    Handshake: the client creates its `warm_file` after its warm-up and waits for a line on its
    stdin; `on_measured_start` runs in between. `on_poll` runs about every 0.1 s while the
    client runs. The client exits by itself if this process dies (its stdin closes).
    """
    with tempfile.TemporaryDirectory(prefix="slotune-client-") as d:
        src, dst, warm, tok = (Path(d) / name for name in ("in.json", "out.json", "warm", "tokenizer.pkl"))
        tok.write_bytes(pickle.dumps(tokenizer))
        src.write_text(
            json.dumps(
                {
                    "url": url,
                    "workload": req["workload"],
                    "tokenizer_file": str(tok),
                    "seed": req.get("seed"),
                    "objective": req["objective"],
                    "early_stop": req.get("early_stop") or {},
                    "phase_file": req.get("phase_file"),
                    "warm_file": str(warm),
                }
            )
        )
        with open(Path(d) / "log.txt", "w+") as log:
            proc = subprocess.Popen(
                [sys.executable, "-m", "slotune.tuner.measure.replay_client", str(src), str(dst)],
                stdin=subprocess.PIPE,
                stdout=log,
                stderr=subprocess.STDOUT,
            )
            try:
                is_started = False
                while proc.poll() is None:
                    if not is_started and warm.exists():
                        on_measured_start()
                        is_started = True
                        with contextlib.suppress(OSError):  # the client died: poll() tells
                            proc.stdin.write(b"go\n")
                            proc.stdin.flush()
                    on_poll()
                    time.sleep(0.1 if is_started else 0.02)
            finally:
                if proc.poll() is None:
                    proc.kill()
                    proc.wait()
                with contextlib.suppress(OSError):
                    proc.stdin.close()
            if proc.returncode != 0 or not dst.exists():
                log.seek(0)
                tail = log.read()[-800:].strip()
                raise RuntimeError(
                    f"HTTP client process exited with code {proc.returncode}" + (f": {tail}" if tail else "")
                )
        out = json.loads(dst.read_text())
    if out["status"] != "ok":
        raise RuntimeError(f"HTTP client: {out['error']}")
    if not is_started:
        raise RuntimeError("HTTP client finished without starting its measured run")
    return ReplayResult.from_dict(out["result"])


def main(argv: list[str], run: Callable[[dict[str, Any]], dict[str, Any]] = run_trial) -> int:
    """`IN.json OUT.json`: run `run` (the measurement) on the request, write its result or the
    error. A stand-in trial process (tests) calls this with its own `run`."""
    src, dst = Path(argv[0]), Path(argv[1])
    req = json.loads(src.read_text())
    die_with_parent(req.get("parent_pid"))
    try:
        result = run(req)
        result["status"] = "ok"
    except Exception as exc:  # recorded by the parent as the trial's failure reason
        result = {
            "status": "error",
            "error": error_text(exc),
            "traceback": traceback.format_exc(limit=8),
        }
    try:
        dst.write_text(json.dumps(result))
    except OSError as exc:  # the parent shows this line (the tail of our log) as the failure reason
        print(f"could not write the trial result {dst}: {exc.strerror or exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":  # pragma: no cover - exercised through subprocesses
    sys.exit(main(sys.argv[1:]))
