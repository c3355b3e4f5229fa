"""SLOTuning: one state machine, advanced one step per timer tick.

    Pending -> Tuning -> (AwaitingApproval ->) Canary -> Promoted | RolledBack
                     \\-> Failed
                     \\-> Skipped (spec.traffic: the recorded traffic has not drifted)

Every fact lives in the API (status, the run's Job and result ConfigMap, the target SLOServing's
`spec.canary`), every child has a deterministic name and creation is idempotent: an operator
restarted at any step recomputes the same next step, and a step that ran twice creates nothing twice.
A run ends with its Job (a retry that publishes a result wins); a refused spec fails the run with the
`Valid` condition and creates nothing. Schedules, retries and drift skips: docs/design/operator-tuning.md.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any, Callable

import yaml

from slotune.operator import admission, api, children, conditions, metrics, rollout, schedule, traffic
from slotune.operator.serving import ensure

TERMINAL = ("Promoted", "RolledBack", "Failed", "Skipped")


def now() -> datetime:
    return datetime.now(timezone.utc)


def stamp(t: datetime) -> str:
    return t.strftime("%Y-%m-%dT%H:%M:%SZ")


def parse_stamp(s: str | None) -> datetime | None:
    return datetime.strptime(s, "%Y-%m-%dT%H:%M:%SZ").replace(tzinfo=timezone.utc) if s else None


@dataclass
class Step:
    """What one tick sees and changes: the status patch it builds and the events it posts."""

    name: str
    namespace: str
    spec: dict[str, Any]
    status: dict[str, Any]
    body: Any
    admission: admission.Admission = field(default_factory=admission.Admission)
    patch: dict[str, Any] = field(default_factory=dict)
    events: list[tuple[str, str, str]] = field(default_factory=list)  # (type, reason, message)

    @property
    def run(self) -> int:
        return int(self.get("run") or 0)

    def get(self, key: str) -> Any:
        return self.patch[key] if key in self.patch else self.status.get(key)

    def set(self, **values: Any) -> None:
        self.patch.update(values)

    def replace(self, key: str, value: dict[str, Any] | None) -> None:
        """Set a mapping whole: status is merge-patched, so keys it no longer has are nulled."""
        old = self.status.get(key)
        if isinstance(old, dict) and value is not None:
            value = {**{k: None for k in old if k not in value}, **value}
        self.patch[key] = value

    def condition(self, type_: str, ok: bool, reason: str, message: str) -> None:
        old = [dict(c) for c in self.get("conditions") or []]
        new = conditions.with_condition(old, type_, ok, reason, message, stamp(now()))
        if new != old:
            self.set(conditions=new)

    def event(self, type_: str, reason: str, message: str) -> None:
        self.events.append((type_, reason, message))

    @property
    def policy(self) -> rollout.Policy:
        return rollout.Policy.from_spec(self.spec.get("rollout"))

    @property
    def serving(self) -> str:
        return self.spec["target"]["servingName"]


# --- the tick ------------------------------------------------------------------------------


def advance(s: Step) -> None:
    """One step of the state machine (dispatch on phase)."""
    phase = s.status.get("phase") or "Pending"
    STEPS.get(phase, lambda _: None)(s)


def pending(s: Step) -> None:
    start_run(s, s.run + 1)


def tuning(s: Step) -> None:
    # the Job before its result: a Job seen finished has published all it will publish
    job = api.read("Job", s.namespace, children.job_name(s.name, s.run))
    data = ((api.read("ConfigMap", s.namespace, children.result_name(s.name, s.run)) or {}).get("data")) or {}
    data = {k: v for k, v in data.items() if v}  # an empty value is no value
    if "traffic.json" in data:
        note_traffic(s, data)
    if "skipped" in data:
        return skip(s, data)
    if "best.yaml" in data:
        return take_result(s, data)
    ended = {
        c.get("type")
        for c in ((job or {}).get("status") or {}).get("conditions") or []
        if c.get("type") in ("Complete", "Failed") and c.get("status") == "True"
    }
    if "error" in data:
        if job is None or ended:
            reason, _, message = data["error"].partition(": ")
            return finish(s, "Failed", reason or "TuningFailed", message or data["error"])
        # an attempt failed and the Job retries (backoffLimit): its final status decides
        s.condition(
            "Tuned",
            False,
            "Retrying",
            f"run {s.run}: an attempt failed ({data['error'][:200]}); job {children.job_name(s.name, s.run)} retries",
        )
        return
    if job is None:  # deleted under us (or lost before a restart): recreate, same name
        rejection, plan = admit_run(s)
        return reject(s, rejection) if rejection else create_run_children(s, s.run, plan)
    if "Failed" in ended:
        c = next(c for c in job["status"]["conditions"] if c.get("type") == "Failed")
        return finish(s, "Failed", "JobFailed", c.get("message") or c.get("reason") or "the tuning Job failed")
    if "Complete" in ended:
        return finish(
            s,
            "Failed",
            "NoResult",
            f"job {children.job_name(s.name, s.run)} completed without "
            f"publishing to ConfigMap {children.result_name(s.name, s.run)}",
        )


def awaiting_approval(s: Step) -> None:
    if str((s.spec.get("rollout") or {}).get("approvedRun", "")) == str(s.run):
        return start_canary(s)
    reschedule(s)


def canary(s: Step) -> None:
    c = dict(s.get("canary") or {})
    t = now()
    dep = api.read("Deployment", s.namespace, f"{s.serving}-canary") or {}
    wanted = int((dep.get("spec") or {}).get("replicas") or 0)
    is_ready = bool(dep) and wanted > 0 and int((dep.get("status") or {}).get("readyReplicas") or 0) >= wanted
    if is_ready and not c.get("readySince"):
        c["readySince"] = stamp(t)
        s.set(canary=c)
    since_start = (t - parse_stamp(c["startedAt"])).total_seconds()
    ready_since = parse_stamp(c.get("readySince"))
    since_ready = (t - ready_since).total_seconds() if ready_since else None
    policy = s.policy
    histograms, errors = None, []
    if since_ready is not None and since_ready >= policy.canary_duration_s:
        histograms, errors = metrics.scrape(canary_metric_urls(s))
    verdict = rollout.judge(policy, since_start_s=since_start, since_ready_s=since_ready, histograms=histograms)
    if verdict.action == "promote":
        promote(s, verdict)
    elif verdict.action == "rollback":
        roll_back(s, verdict)
    else:
        unreachable = f" ({len(errors)} canary pod(s) not scraped)" if histograms is not None and errors else ""
        s.condition("RolledOut", False, verdict.reason, verdict.message + unreachable)


def finished(s: Step) -> None:
    reschedule(s)


STEPS: dict[str, Callable[[Step], None]] = {
    "Pending": pending,
    "Tuning": tuning,
    "AwaitingApproval": awaiting_approval,
    "Canary": canary,
    "Promoted": finished,
    "RolledBack": finished,
    "Failed": finished,
    "Skipped": finished,
}


# --- actions -------------------------------------------------------------------------------


def admit_run(s: Step) -> tuple[admission.Rejection | None, traffic.Plan | None]:
    """Why the run cannot start, or None and its traffic plan (None without spec.traffic)."""
    rejection = admission.check_tuning(s.spec, s.namespace, s.admission)
    if rejection is not None or traffic.settings(s.spec) is None:
        return rejection, None
    name = traffic.settings(s.spec)["fromServing"]
    serving = api.read_serving(s.namespace, name)
    if serving is None:
        return admission.Rejection(
            "spec.traffic.fromServing",
            "TrafficNotRecorded",
            f"spec.traffic.fromServing: SLOServing '{name}' does not exist",
        ), None
    record = serving.get("spec", {}).get("recordTraffic")
    if record is None or admission.check_serving(serving["spec"]) is not None:
        return admission.Rejection(
            "spec.traffic.fromServing",
            "TrafficNotRecorded",
            f"spec.traffic.fromServing: SLOServing '{name}' records no traffic: set its spec.recordTraffic.claimName",
        ), None
    return None, traffic.make_plan(s.spec, record["claimName"], tuned_traffic(s))


def tuned_traffic(s: Step) -> dict[str, Any] | None:
    """The traffic the last result was tuned on; `baselineTraffic` is its name in objects written by
    operators before 0.2 (read once, replaced by `tunedTraffic` at the next result)."""
    return s.get("tunedTraffic") or s.get("baselineTraffic")


def start_run(s: Step, run: int) -> None:
    rejection, plan = admit_run(s)
    if rejection is not None:
        s.set(run=run)
        return reject(s, rejection)
    s.condition(conditions.VALID, True, "Valid", "the spec is valid")
    warning = admission.storage_warning(s.spec)
    s.condition(
        conditions.PERSISTENT_STORAGE,
        warning is None,
        "EphemeralStorage" if warning else "Persistent",
        warning or "the study and the MLflow runs outlive the Job's pods",
    )
    create_run_children(s, run, plan)
    # the summary comes with the Job's result; the source it is comparable with is known now
    s.replace("traffic", {"run": run, "sourceHash": plan.source_hash} if plan else None)
    t = now()
    due = next_time(s, t)
    s.set(run=run, phase="Tuning", lastTuningTime=stamp(t), canary=None, nextTuningTime=stamp(due) if due else None)
    s.condition("Tuned", False, "Tuning", f"run {run}: job {children.job_name(s.name, run)}")
    s.event("Normal", "TuningStarted", f"run {run}: started job {children.job_name(s.name, run)}")
    prune(s, run)


def reject(s: Step, rejection: admission.Rejection) -> None:
    s.condition(conditions.VALID, False, rejection.reason, rejection.message)
    finish(s, "Failed", rejection.reason, rejection.message)


def create_run_children(s: Step, run: int, plan: traffic.Plan | None) -> None:
    spec = s.admission.admit("SLOTuning", s.namespace, s.spec)  # image, service account: checked, filled in
    owner = api.owner_reference(s.body)
    labels = {api.LABEL_TUNING: s.name}
    spec_cm = children.config_map(
        f"{s.name}-spec",
        owner,
        labels,
        {"spec.yaml": yaml.safe_dump(children.tuning_spec(s.spec, plan, run), sort_keys=False)},
    )
    ensure("ConfigMap", s.namespace, spec_cm)
    api.create(
        "ConfigMap",
        s.namespace,
        children.config_map(children.result_name(s.name, run), owner, {**labels, api.LABEL_RUN: str(run)}, {}),
    )
    for obj in children.publish_rbac(s.name, spec, owner, run, s.namespace):
        api.create(obj["kind"], s.namespace, obj)
    for job in children.tuning_jobs(s.name, spec, owner, run, s.namespace, plan):
        api.create("Job", s.namespace, job)


def note_traffic(s: Step, data: dict[str, str]) -> None:
    """Copy the run's traffic summary (and the Job's drift verdict) into status.traffic."""
    old = dict(s.get("traffic") or {})
    if old.get("run") != s.run:  # not started with spec.traffic (changed since): compare with nothing
        old = {"run": s.run}
    # null is no value (a merge patch deletes the key): drift stays unset without tuned-on traffic
    new = {k: v for k, v in {**old, **json.loads(data["traffic.json"])}.items() if v is not None}
    if new == s.get("traffic"):
        return
    s.replace("traffic", new)
    threshold = float(new.get("driftThreshold") or 0.0)
    if "skipped" in data:
        return  # skip() says why
    if new.get("drift") is None:
        s.condition(
            conditions.RETUNED,
            True,
            "NoBaseline",
            f"run {s.run}: no earlier result was tuned on this traffic source and spec: tuning",
        )
    else:
        d = traffic.Drift(float(new["drift"]), str(new.get("driftField")))
        s.condition(
            conditions.RETUNED,
            True,
            "TrafficDrifted",
            f"run {s.run}: {traffic.describe(d, threshold, new.get('driftFrom'))}: tuning",
        )


def skip(s: Step, data: dict[str, str]) -> None:
    reason, _, message = data["skipped"].partition(": ")
    reason, message = (reason, message) if message else ("NoDrift", data["skipped"])
    s.condition(conditions.RETUNED, False, reason, f"run {s.run}: {message}")
    s.condition(
        "Tuned",
        True,
        reason,
        f"run {s.run} skipped: {message}; the result of run {(s.get('best') or {}).get('run', '-')} stands",
    )
    s.event("Normal", "Skipped", f"run {s.run}: {message}")
    finish(s, "Skipped", reason, message)


def take_result(s: Step, data: dict[str, str]) -> None:
    config = yaml.safe_load(data["best.yaml"]) or {}
    summary = json.loads(data.get("best_metrics.json") or "{}")
    best = {
        "run": s.run,
        "config": config,
        "configHash": children.config_hash(config),
        "objective": summary.get("objective"),
        "value": summary.get("value"),
        "metrics": {k: v for k, v in (summary.get("metrics") or {}).items() if isinstance(v, (int, float))},
        "summary": _summary(summary),
    }
    s.set(best=best, mlflowRunId=data.get("mlflow_run_id"))
    run_traffic = s.get("traffic") or {}
    if run_traffic.get("run") == s.run and run_traffic.get("requests"):
        s.replace("tunedTraffic", run_traffic)  # what the next run's traffic is compared with
        s.set(baselineTraffic=None)  # its pre-rename name, written by operators before 0.2
    s.condition("Tuned", True, "ResultReady", f"run {s.run}: {best['summary']}")
    s.event("Normal", "ResultReady", f"run {s.run}: {best['summary']}")
    if s.policy.mode == "manual":
        s.set(phase="AwaitingApproval")
        s.condition("RolledOut", False, "AwaitingApproval", f"set spec.rollout.approvedRun={s.run} to roll it out")
    else:
        start_canary(s)


def _summary(summary: dict[str, Any]) -> str:
    if summary.get("objective") and isinstance(summary.get("value"), (int, float)):
        return f"{summary['objective']}={summary['value']:.4g}"
    return "config ready"


def start_canary(s: Step) -> None:
    serving = api.read_serving(s.namespace, s.serving)
    if serving is None:
        s.condition("RolledOut", False, "TargetNotFound", f"SLOServing '{s.serving}' does not exist")
        return
    replicas = s.policy.canary_replicas(int(serving["spec"].get("replicas", 1)))
    api.patch_serving(
        s.namespace,
        s.serving,
        {"spec": {"canary": {"config": s.get("best")["config"], "replicas": replicas, "run": s.run}}},
    )
    s.set(phase="Canary", canary={"run": s.run, "startedAt": stamp(now()), "readySince": None})
    s.condition("RolledOut", False, "CanaryStarting", f"run {s.run}: canary {s.serving}-canary x{replicas}")
    s.event("Normal", "CanaryStarted", f"run {s.run}: canary {s.serving}-canary with {replicas} replica(s)")


def canary_metric_urls(s: Step) -> list[str]:
    selector = f"{api.LABEL_SERVING}={s.serving},{api.LABEL_TRACK}=canary"
    urls = []
    for pod in api.core().list_namespaced_pod(s.namespace, label_selector=selector).items:
        is_ready = any(c.type == "Ready" and c.status == "True" for c in (pod.status.conditions or []))
        if not (pod.status.pod_ip and is_ready):
            continue
        ann = pod.metadata.annotations or {}
        port = ann.get("prometheus.io/port") or "8000"
        urls.append(f"http://{pod.status.pod_ip}:{port}{ann.get('prometheus.io/path', '/metrics')}")
    return urls


def promote(s: Step, verdict: rollout.Verdict) -> None:
    config = s.get("best")["config"]
    api.patch_serving(s.namespace, s.serving, {"spec": {"config": config, "canary": None}})
    s.set(applied={"run": s.run, "configHash": children.config_hash(config), "at": stamp(now())})
    s.condition("RolledOut", True, "Promoted", f"run {s.run}: {verdict.message}")
    s.event("Normal", "Promoted", f"run {s.run}: {verdict.message}")
    finish(s, "Promoted", verdict.reason, verdict.message, verdict.measured, config)


def roll_back(s: Step, verdict: rollout.Verdict) -> None:
    api.patch_serving(s.namespace, s.serving, {"spec": {"canary": None}})
    s.set(tunedTraffic=None, baselineTraffic=None)  # a result that failed in production: the next run re-tunes
    s.condition("RolledOut", False, verdict.reason, f"run {s.run} rolled back: {verdict.message}")
    s.event("Warning", "RolledBack", f"run {s.run}: {verdict.reason}: {verdict.message}")
    finish(s, "RolledBack", verdict.reason, verdict.message, verdict.measured)


def finish(
    s: Step, phase: str, reason: str, message: str, measured: dict | None = None, config: dict | None = None
) -> None:
    entry = {"run": s.run, "outcome": phase, "reason": reason, "message": message[:500], "at": stamp(now())}
    best = s.get("best") or {}
    if best.get("run") == s.run:
        entry["configHash"] = best.get("configHash")
    if measured:
        entry["measured"] = measured
    run_traffic = s.get("traffic") or {}
    if run_traffic.get("run") == s.run and run_traffic.get("requests"):
        entry["traffic"] = {k: run_traffic.get(k) for k in ("requests", "drift", "driftField")}
    if config is not None:
        entry["config"] = config
    record(s, entry)
    s.set(phase=phase, canary=None)
    if phase == "Failed":
        s.condition("Tuned", False, reason, message[:500])
        s.event("Warning", reason, message[:500])


def record(s: Step, entry: dict[str, Any]) -> None:
    limit = int(s.spec.get("historyLimit", 10))
    history = [h for h in (s.get("history") or []) if h.get("run") != entry["run"]] + [entry]
    s.set(history=history[-limit:])


def reschedule(s: Step) -> None:
    expr = s.spec.get("schedule")
    if not expr:
        if s.get("nextTuningTime"):
            s.set(nextTuningTime=None)
        return
    last = parse_stamp(s.get("lastTuningTime")) or now()
    due = next_time(s, last)
    if due is None:
        if s.get("nextTuningTime"):
            s.set(nextTuningTime=None)
        return
    if stamp(due) != s.get("nextTuningTime"):
        s.set(nextTuningTime=stamp(due))
    if now() < due:
        return
    if s.status.get("phase") == "AwaitingApproval":
        record(
            s,
            {
                "run": s.run,
                "outcome": "Superseded",
                "reason": "Scheduled",
                "message": "a scheduled run started before approval",
                "at": stamp(now()),
                "configHash": (s.get("best") or {}).get("configHash"),
            },
        )
        s.set(tunedTraffic=None, baselineTraffic=None)  # a result never rolled out: the next run re-tunes
    start_run(s, s.run + 1)


def next_time(s: Step, after: datetime) -> datetime | None:
    """The schedule's next time after `after`; None (and the `Scheduled` condition) if none."""
    expr = s.spec.get("schedule")
    if not expr:
        return None
    try:
        due = schedule.next_after(expr, after)
    except schedule.ScheduleError as exc:  # changed to a bad schedule after the run started
        s.condition(conditions.SCHEDULED, False, "InvalidSchedule", str(exc))
        return None
    if any(c.get("type") == conditions.SCHEDULED for c in s.get("conditions") or []):
        s.condition(conditions.SCHEDULED, True, "Scheduled", "the schedule is valid")
    return due


def prune(s: Step, run: int) -> None:
    """Keep the Jobs and result ConfigMaps of the last `historyLimit` runs."""
    keep = max(1, int(s.spec.get("historyLimit", 10)))
    selector = f"{api.LABEL_TUNING}={s.name},{api.LABEL_RUN}"
    for job in api.batch().list_namespaced_job(s.namespace, label_selector=selector).items:
        if int(job.metadata.labels[api.LABEL_RUN]) <= run - keep:
            api.delete("Job", s.namespace, job.metadata.name)
    for cm in api.core().list_namespaced_config_map(s.namespace, label_selector=selector).items:
        if int(cm.metadata.labels[api.LABEL_RUN]) <= run - keep:
            api.delete("ConfigMap", s.namespace, cm.metadata.name)
    for kind, items in (
        ("Role", api.rbac().list_namespaced_role(s.namespace, label_selector=selector).items),
        ("RoleBinding", api.rbac().list_namespaced_role_binding(s.namespace, label_selector=selector).items),
    ):
        for obj in items:
            if int(obj.metadata.labels[api.LABEL_RUN]) <= run - keep:
                api.delete(kind, s.namespace, obj.metadata.name)
