"""Job side: run the tuning command, then publish its result into a ConfigMap via the API.

    python -m slotune.operator.publish --configmap NAME [--namespace NS] --result-dir DIR
        [--traffic-dir DIR --traffic-window-s S --traffic-snapshot FILE --drift-threshold X
         [--tuned-traffic JSON]] -- tune run ...

Fills the operator's pre-created result ConfigMap with `best.yaml`, `best_metrics.json` and, when the
study logged one, `mlflow_run_id` -- or with `error` when the command failed or found no config meeting
the SLO; each write replaces what an earlier attempt published. Exit status: the command's own. With
`--traffic-dir` (spec.traffic, traffic.py) the recorded window is first snapshotted and summarized
(`traffic.json`): without drift the command does not run and `skipped` is published (exit 0); an empty
window publishes `error` (exit 1). The details: docs/design/operator-tuning.md.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from pydantic import ValidationError

from slotune.operator import traffic
from slotune.tuner.spec.traces import RecordedRequest, TraceSource
from slotune.tuner.spec.trace_reader import load_trace
from slotune.tuner.workload.fit import TraceSummary, summarize

RESULT_KEYS = ("best.yaml", "best_metrics.json", "mlflow_run_id", "error", "traffic.json", "skipped")
RESULT_FILES = ("best.yaml", "best_metrics.json")
API_OUTAGE_S = 600.0  # how long a finished run waits for the API server to publish its result


def report_result(
    configmap: str,
    namespace: str,
    result_dir: Path | None = None,
    *,
    error: str | None = None,
    traffic_summary: dict | None = None,
    skipped: str | None = None,
    api_client=None,
) -> dict[str, str]:
    """Write the tuning result (or an error, or why the run was skipped) into the ConfigMap `configmap`.

    Args:
        configmap: the result ConfigMap the operator created for this run.
        result_dir: where `tune run` wrote best.yaml and best_metrics.json.
        error: a failure message, published instead of a result.
        traffic_summary: the summary of the recorded traffic the run tuned on (`traffic_summary`).
        skipped: "Reason: message" when the run did not tune, published instead of a result.
    Returns:
        the data written.
    """
    data: dict[str, str | None] = dict.fromkeys(RESULT_KEYS)  # null deletes: no key of an earlier attempt stays
    if traffic_summary is not None:
        data["traffic.json"] = json.dumps(traffic_summary, sort_keys=True)
    best = result_dir / "best.yaml" if result_dir is not None else None
    if skipped is not None and error is None:
        data["skipped"] = skipped[:2000]
        _patch(configmap, namespace, data, api_client)
        return {k: v for k, v in data.items() if v is not None}
    if error is None and (best is None or not best.exists()):
        error = "NoFeasibleConfig: no trial met the SLO and the quality gates (see the study report)"
    if error is None:
        data["best.yaml"] = best.read_text()
        metrics_path = result_dir / "best_metrics.json"
        if metrics_path.exists():
            text = metrics_path.read_text()
            data["best_metrics.json"] = text
            run_id = json.loads(text).get("mlflow_run_id")
            if run_id:
                data["mlflow_run_id"] = str(run_id)
    else:
        data["error"] = error[:2000]
    _patch(configmap, namespace, data, api_client)
    return {k: v for k, v in data.items() if v is not None}


def _patch(configmap: str, namespace: str, data: dict[str, str | None], api_client=None) -> None:
    """Merge `data` into the ConfigMap, riding out an API server that does not answer (a control-plane
    restart) for up to API_OUTAGE_S: a finished study is not thrown away for want of one write."""
    import urllib3
    from kubernetes.client.rest import ApiException

    core, delay, deadline = _core(api_client), 0.5, time.monotonic() + API_OUTAGE_S
    while True:
        try:
            # a JSON merge patch: `null` deletes the key (a strategic merge patch leaves "" behind)
            core.patch_namespaced_config_map(
                configmap, namespace, {"data": data}, _content_type="application/merge-patch+json"
            )
            return
        except (ApiException, urllib3.exceptions.HTTPError, OSError) as exc:
            status = getattr(exc, "status", None)
            if isinstance(exc, ApiException) and status and status < 500 and status != 429:
                raise  # refused (403, 404, 422): waiting does not change the answer
            if time.monotonic() + delay > deadline:
                raise
            if delay == 0.5:
                first = str(exc).splitlines()[0][:200]
                print(
                    f"publish: the API server did not answer ({first}); retrying for up to {API_OUTAGE_S:g} s",
                    file=sys.stderr,
                    flush=True,
                )
            time.sleep(delay)
            delay = min(2 * delay, 8.0)


# --- recorded traffic ------------------------------------------------------------------------


class NoTraffic(ValueError):
    """No recorded request to tune on; the message names the folder (and the window)."""


@dataclass(frozen=True, slots=True)
class Window:
    """The span of recorded traffic a run tunes on, in unix seconds: (end - seconds, end]."""

    seconds: float
    end: float  # the newest request's arrival, over all pods
    num_requests: int
    num_files: int
    num_invalid: int  # lines left out: not a RecordedRequest

    @property
    def start(self) -> float:
        return self.end - self.seconds


def snapshot_traffic(root: Path, window_s: float, out: Path) -> Window:
    """Copy the last `window_s` seconds of every recording under `root` into `out`, in arrival order.

    Two passes (the newest arrival, then the lines inside the window), so that only the window
    is held in memory, not the whole recording of every pod.
    """
    files = sorted(root.rglob("*.jsonl")) if root.is_dir() else []
    if not files:
        raise NoTraffic(f"no recording (*.jsonl) under {root}: is the SLOServing recording, and its pods serving?")
    end, num_invalid = None, 0
    for _, rec in _records(files):
        if rec is None:
            num_invalid += 1
        elif end is None or rec.arrival > end:
            end = rec.arrival
    if end is None:
        raise NoTraffic(f"{len(files)} recording file(s) under {root}, but no valid request line in them")
    start = end - window_s
    kept = sorted(
        ((rec.arrival, line) for line, rec in _records(files) if rec is not None and rec.arrival > start),
        key=lambda x: x[0],
    )
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".tmp")
    tmp.write_text("".join(line + "\n" for _, line in kept), encoding="utf-8")
    tmp.replace(out)  # a trial never reads half a snapshot
    return Window(float(window_s), end, len(kept), len(files), num_invalid)


def _records(files: list[Path]):
    """(line, RecordedRequest or None when the line is not one) for every non-empty line."""
    for f in files:
        with f.open(encoding="utf-8", errors="replace") as fh:
            for line in fh:
                line = line.strip()
                if not line:
                    continue
                try:
                    yield line, RecordedRequest.model_validate_json(line)
                except ValidationError:
                    yield line, None


def traffic_summary(s: TraceSummary, w: Window) -> dict:
    """status.traffic of a run: the numbers drift compares (traffic.SUMMARY_FIELDS), and the window."""
    return {
        "requests": s.num_requests,
        "meanRate": _sig(s.mean_rate),
        "promptP50": _sig(s.prompt_tokens.p50),
        "promptP95": _sig(s.prompt_tokens.p95),
        "outputP50": _sig(s.output_tokens.p50),
        "outputP95": _sig(s.output_tokens.p95),
        "cv": _sig(s.interarrival_cv),
        "cacheableShare": _sig(s.cacheable_share),
        "peakConcurrency": s.peak_concurrency,
        "window": {"seconds": w.seconds, "start": _stamp(w.start), "end": _stamp(w.end)},
        "files": w.num_files,
        "invalidLines": w.num_invalid,
    }


def prepare_traffic(
    root: Path, window_s: float, snapshot: Path, threshold: float, tuned_traffic: dict | None
) -> tuple[dict, str | None]:
    """Snapshot and summarize the window; returns (status.traffic summary with the drift verdict,
    "NoDrift: ..." when the run should not tune, else None). Raises NoTraffic, ValueError."""
    window = snapshot_traffic(root, window_s, snapshot)
    if window.num_requests == 0:
        raise NoTraffic(f"no request recorded under {root} in the {window_s:g} s before the newest one")
    summary = traffic_summary(summarize(load_trace(TraceSource(path=str(snapshot), format="recorded"))), window)
    summary.update(driftThreshold=threshold, drift=None, driftField=None, driftFrom=None)
    if tuned_traffic is None:
        return summary, None
    d = traffic.drift(summary, tuned_traffic)
    summary.update(drift=_sig(d.value), driftField=d.field, driftFrom=tuned_traffic.get("run"))
    if traffic.is_skipped(d, threshold):
        return summary, f"NoDrift: {traffic.describe(d, threshold, tuned_traffic.get('run'))}"
    return summary, None


def _sig(x: float | None) -> float | None:
    return None if x is None else float(f"{x:.4g}")


def _stamp(t: float) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(t))


def clear_stale_results(result_dir: Path) -> None:
    """Remove result files an earlier run left (a persistent /work): never publish them as ours."""
    for name in RESULT_FILES:
        (result_dir / name).unlink(missing_ok=True)


def _core(api_client=None):
    import kubernetes

    if api_client is None:
        from slotune.operator.api import load_configuration  # imports kubernetes, as _core does: only to publish

        api_client = kubernetes.client.ApiClient(load_configuration())
    return kubernetes.client.CoreV1Api(api_client)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    command: list[str] = []
    if "--" in argv:
        i = argv.index("--")
        argv, command = argv[:i], argv[i + 1 :]
    p = argparse.ArgumentParser(prog="python -m slotune.operator.publish", description=__doc__.split("\n\n")[0])
    p.add_argument("--configmap", required=True)
    p.add_argument("--namespace", default=None, help="default: the pod's namespace")
    p.add_argument("--result-dir", type=Path, required=True)
    p.add_argument("--traffic-dir", type=Path, default=None, help="the recordings to tune on (one folder per pod)")
    p.add_argument("--traffic-window-s", type=float, default=86400.0)
    p.add_argument(
        "--traffic-snapshot", type=Path, default=None, help="where the window is copied (the workload's trace)"
    )
    p.add_argument("--drift-threshold", type=float, default=0.0)
    p.add_argument(
        "--tuned-traffic",
        "--baseline-traffic",
        dest="tuned_traffic",
        type=json.loads,
        default=None,
        help="JSON: the traffic summary the last result was tuned on",
    )
    args = p.parse_args(argv)
    namespace = args.namespace or _pod_namespace()
    rc = 0
    error = summary = None
    if command:
        clear_stale_results(args.result_dir)
        if args.traffic_dir is not None:
            snapshot = args.traffic_snapshot or args.result_dir / "traffic.jsonl"
            try:
                summary, skipped = prepare_traffic(
                    args.traffic_dir, args.traffic_window_s, snapshot, args.drift_threshold, args.tuned_traffic
                )
            except NoTraffic as exc:
                report_result(args.configmap, namespace, error=f"NoTraffic: {exc}")
                return 1
            except ValueError as exc:  # SpecError of the snapshot (e.g. two pods' block sizes differ)
                report_result(args.configmap, namespace, error=f"InvalidTraffic: {exc}")
                return 1
            if skipped is not None:
                report_result(args.configmap, namespace, traffic_summary=summary, skipped=skipped)
                return 0
            _patch(args.configmap, namespace, {"traffic.json": json.dumps(summary, sort_keys=True)})
        rc = subprocess.call(command)
        if rc != 0:
            error = f"TuningFailed: `{' '.join(command[:2])}` exited with status {rc}"
    report_result(args.configmap, namespace, args.result_dir, error=error, traffic_summary=summary)
    return rc


def _pod_namespace() -> str:
    path = Path("/var/run/secrets/kubernetes.io/serviceaccount/namespace")
    return path.read_text().strip() if path.exists() else "default"


if __name__ == "__main__":
    sys.exit(main())
