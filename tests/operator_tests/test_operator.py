"""End to end against a real kube-apiserver: tune -> Job -> result -> canary -> promote or
roll back; never-ready canaries; scheduled re-tuning with bounded history; garbage
collection; invalid specs. No kubelet runs: see kubelet.py for what stands in for it."""

from __future__ import annotations

import kubernetes
import pytest
import yaml

from slotune.operator import api

from .kubelet import free_port, get, get_cr, run_job, serve_metrics, start_pods, wait_for
from .resources import create, events, patch, serving, tuning

pytestmark = pytest.mark.k8s


def phase_of(client, ns, name, *phases):
    status = get_cr(client, api.TUNINGS, ns, name).get("status") or {}
    return status if status.get("phase") in phases else None


def tune_to_canary(cluster, ns, tmp_path, name="chat", rollout=None, best=None):
    """Create a SLOServing + SLOTuning, run the tuning Job; returns (client, port)."""
    client = cluster.client()
    port = free_port()
    create(client, ns, serving(name, port))
    wait_for("the stable Deployment", lambda: get(client, "Deployment", ns, name))
    create(client, ns, tuning(f"{name}-tune", name, rollout))
    job = wait_for("the tuning Job", lambda: get(client, "Job", ns, f"{name}-tune-run-1"))
    assert job["spec"]["template"]["spec"]["containers"][0]["command"][-6:-4] == ["tune", "run"]
    assert job["metadata"]["ownerReferences"][0]["kind"] == "SLOTuning"
    proc = run_job(cluster, ns, f"{name}-tune-run-1", tmp_path / "job", best_config=best or {"max_num_seqs": 4})
    assert proc.returncode == 0, proc.stderr
    wait_for("phase Canary", lambda: phase_of(client, ns, f"{name}-tune", "Canary"))
    return client, port


def judge_canary(cluster, client, ns, port, name, ttft_s, tpot_s):
    """Serve canary metrics with these latencies, start the canary's pods, wait for the verdict."""
    metrics = serve_metrics(port, ttft_s=ttft_s, tpot_s=tpot_s)
    try:
        start_pods(cluster, ns, f"{name}-canary")
        return wait_for("a verdict", lambda: phase_of(client, ns, f"{name}-tune", "Promoted", "RolledBack"))
    finally:
        metrics.terminate()


def test_tune_then_promote_on_good_metrics(cluster, operator, ns, tmp_path):
    client, port = tune_to_canary(cluster, ns, tmp_path)
    canary = wait_for("the canary Deployment", lambda: get(client, "Deployment", ns, "chat-canary"))
    assert canary["spec"]["replicas"] == 1  # canaryFraction 0.1 of 2 replicas rounds up to one pod
    cm = get(client, "ConfigMap", ns, "chat-canary-config")
    assert yaml.safe_load(cm["data"]["config.yaml"]) == {"max_num_seqs": 4, "model": "smollm2-135m"}
    status = judge_canary(cluster, client, ns, port, "chat", ttft_s=0.1, tpot_s=0.02)
    assert status["phase"] == "Promoted", status
    assert status["best"]["summary"] == "tpot_p95=0.0123" and status["mlflowRunId"] == "0123456789abcdef"
    assert status["history"][-1]["outcome"] == "Promoted"
    assert status["history"][-1]["measured"]["requests"] == 50
    slos = get_cr(client, api.SERVINGS, ns, "chat")
    assert slos["spec"]["config"] == {"max_num_seqs": 4} and not slos["spec"].get("canary")
    wait_for("the canary to go", lambda: get(client, "Deployment", ns, "chat-canary") is None)
    stable = wait_for(
        "the stable ConfigMap to update",
        lambda: (lambda c: c if "max_num_seqs: 4" in c["data"]["config.yaml"] else None)(
            get(client, "ConfigMap", ns, "chat-config")
        ),
    )
    assert stable["metadata"]["ownerReferences"][0]["name"] == "chat"
    dep = get(client, "Deployment", ns, "chat")
    pod = dep["spec"]["template"]
    assert pod["metadata"]["annotations"]["prometheus.io/scrape"] == "true"
    from slotune.operator.children import config_hash

    assert pod["metadata"]["annotations"][api.ANNOTATION_CONFIG_HASH] == config_hash(
        {"max_num_seqs": 4, "model": "smollm2-135m"}
    )
    c = pod["spec"]["containers"][0]
    assert c["command"][:3] == ["tune", "serve", "/etc/slotune/config.yaml"] and "0.0.0.0" in c["command"]
    assert c["readinessProbe"]["httpGet"]["path"] == "/ready" and c["livenessProbe"]["httpGet"]["path"] == "/health"
    assert get(client, "Service", ns, "chat")["spec"]["selector"] == {api.LABEL_SERVING: "chat"}
    assert ("Normal", "Promoted") in [
        (t, r)
        for t, r, _ in wait_for(
            "the Promoted event", lambda: [e for e in events(client, ns, "chat-tune") if e[1] == "Promoted"]
        )
    ]


def test_rollback_on_bad_metrics(cluster, operator, ns, tmp_path):
    client, port = tune_to_canary(cluster, ns, tmp_path, name="slow")
    wait_for("the canary Deployment", lambda: get(client, "Deployment", ns, "slow-canary"))
    status = judge_canary(cluster, client, ns, port, "slow", ttft_s=2.0, tpot_s=0.2)
    assert status["phase"] == "RolledBack" and status["history"][-1]["reason"] == "SLOViolated"
    cond = next(c for c in status["conditions"] if c["type"] == "RolledOut")
    assert cond["status"] == "False" and cond["reason"] == "SLOViolated" and "p95 TTFT" in cond["message"]
    slos = get_cr(client, api.SERVINGS, ns, "slow")
    assert slos["spec"]["config"] == {"max_num_seqs": 8} and not slos["spec"].get("canary")  # last good config
    wait_for("the canary to go", lambda: get(client, "Deployment", ns, "slow-canary") is None)
    assert "max_num_seqs: 8" in get(client, "ConfigMap", ns, "slow-config")["data"]["config.yaml"]
    evs = wait_for("the RolledBack event", lambda: [e for e in events(client, ns, "slow-tune") if e[1] == "RolledBack"])
    assert evs[0][0] == "Warning" and "SLOViolated" in evs[0][2]


def test_never_ready_canary_rolls_back(cluster, operator, ns, tmp_path):
    client, _ = tune_to_canary(cluster, ns, tmp_path, name="stuck", rollout={"readyDeadlineSeconds": 2})
    wait_for("the canary Deployment", lambda: get(client, "Deployment", ns, "stuck-canary"))
    start_pods(cluster, ns, "stuck-canary", ready=False)
    status = wait_for("a verdict", lambda: phase_of(client, ns, "stuck-tune", "Promoted", "RolledBack"))
    assert status["phase"] == "RolledBack" and status["history"][-1]["reason"] == "NeverReady"
    assert get_cr(client, api.SERVINGS, ns, "stuck")["spec"]["config"] == {"max_num_seqs": 8}


def test_schedule_retunes_with_bounded_history(cluster, operator, ns, tmp_path):
    client = cluster.client()
    create(client, ns, serving("sched", free_port()))
    # a schedule needs a store that outlives the pods (here a claim; no volume is bound locally)
    create(
        client,
        ns,
        tuning(
            "sched-tune",
            "sched",
            {"mode": "manual"},
            schedule="@every 2s",
            historyLimit=2,
            workVolumeClaim="sched-work",
        ),
    )
    for run in (1, 2, 3):
        wait_for(f"job run {run}", lambda: get(client, "Job", ns, f"sched-tune-run-{run}"))
        if run == 3:  # stop the schedule: run 3 is the last, and waits for approval
            patch(client, ns, api.TUNINGS, "sched-tune", {"spec": {"schedule": None}})
        run_job(cluster, ns, f"sched-tune-run-{run}", tmp_path / f"job{run}", best_config={"max_num_seqs": 2 + run})
        status = wait_for(
            f"run {run}'s result",
            lambda: (lambda s: s if (s.get("best") or {}).get("run") == run else None)(
                get_cr(client, api.TUNINGS, ns, "sched-tune").get("status") or {}
            ),
        )
        if run < 3:
            assert status["nextTuningTime"] > status["lastTuningTime"]
    status = wait_for(
        "AwaitingApproval, nothing scheduled",
        lambda: (lambda s: s if s and not s.get("nextTuningTime") else None)(
            phase_of(client, ns, "sched-tune", "AwaitingApproval")
        ),
    )
    assert status["run"] == 3
    # run 3 started: runs older than historyLimit=2 lost their Job and result ConfigMap
    assert get(client, "Job", ns, "sched-tune-run-1") is None
    assert get(client, "ConfigMap", ns, "sched-tune-run-1-result") is None
    jobs = kubernetes.client.BatchV1Api(client).list_namespaced_job(ns).items
    assert sorted(j.metadata.name for j in jobs) == ["sched-tune-run-2", "sched-tune-run-3"]
    assert [(h["run"], h["outcome"]) for h in status["history"]] == [(1, "Superseded"), (2, "Superseded")]
    # approve run 3: its result goes to a canary
    patch(client, ns, api.TUNINGS, "sched-tune", {"spec": {"rollout": {"approvedRun": 3}}})
    wait_for("phase Canary", lambda: phase_of(client, ns, "sched-tune", "Canary"))
    assert get_cr(client, api.SERVINGS, ns, "sched")["spec"]["canary"]["config"] == {"max_num_seqs": 5}


def test_invalid_tuning_spec_fails_then_recovers(cluster, operator, ns):
    client = cluster.client()
    create(client, ns, serving("inv", free_port()))
    bad = tuning("inv-tune", "inv", tuning={"objective": {"kind": "throughput", "metric": "tpot"}})
    create(client, ns, bad)
    status = wait_for("phase Failed", lambda: phase_of(client, ns, "inv-tune", "Failed"))
    cond = next(c for c in status["conditions"] if c["type"] == "Valid")
    assert cond["status"] == "False" and "tuning.objective" in cond["message"]
    assert get(client, "Job", ns, "inv-tune-run-1") is None
    patch(client, ns, api.TUNINGS, "inv-tune", {"spec": {"tuning": {"objective": {"kind": "latency"}}}})
    wait_for("a fresh run", lambda: get(client, "Job", ns, "inv-tune-run-2"))


def test_failed_tuning_command_fails_the_run(cluster, operator, ns, tmp_path):
    client = cluster.client()
    create(client, ns, serving("fail", free_port()))
    create(client, ns, tuning("fail-tune", "fail"))
    wait_for("the tuning Job", lambda: get(client, "Job", ns, "fail-tune-run-1"))
    proc = run_job(cluster, ns, "fail-tune-run-1", tmp_path, inner=["sh", "-c", "exit 3"])
    assert proc.returncode == 3
    status = wait_for("phase Failed", lambda: phase_of(client, ns, "fail-tune", "Failed"))
    assert status["history"][-1]["reason"] == "TuningFailed" and "status 3" in status["history"][-1]["message"]
    assert not get_cr(client, api.SERVINGS, ns, "fail")["spec"].get("canary")


def test_invalid_serving_config_is_reported_not_rendered(cluster, operator, ns):
    client = cluster.client()
    create(client, ns, serving("badcfg", free_port(), config={"max_num_seqs": "lots"}))
    status = wait_for(
        "phase Invalid",
        lambda: (
            (get_cr(client, api.SERVINGS, ns, "badcfg").get("status") or {})
            if (get_cr(client, api.SERVINGS, ns, "badcfg").get("status") or {}).get("phase") == "Invalid"
            else None
        ),
    )
    assert "max_num_seqs" in status["message"]
    assert get(client, "Deployment", ns, "badcfg") is None


@pytest.mark.slow
def test_real_tune_run_in_the_job(cluster, operator, ns, tmp_path):
    """The Job's real command end to end: a 1-trial `tune run` on the bundled model (slow)."""
    client = cluster.client()
    create(client, ns, serving("real", free_port()))
    spec = {
        "workload": {
            "arrivals": "closed_loop",
            "concurrency": 2,
            "num_requests": 2,
            "warmup_requests": 0,
            "prompt_len": {"kind": "fixed", "value": 16},
            "output_len": {"kind": "fixed", "value": 4},
        },
        "budget": {"n_trials": 1, "trial_timeout_s": 300},
    }
    create(client, ns, tuning("real-tune", "real", tuning=spec))
    wait_for("the tuning Job", lambda: get(client, "Job", ns, "real-tune-run-1"))
    proc = run_job(cluster, ns, "real-tune-run-1", tmp_path, real_tune=True)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    status = wait_for("the result", lambda: phase_of(client, ns, "real-tune", "Canary", "Failed"), timeout=60)
    assert status["phase"] == "Canary" and status["best"]["config"]["model"]
    assert get_cr(client, api.SERVINGS, ns, "real")["spec"]["canary"]["run"] == 1


def test_deleting_the_resource_collects_its_children(cluster, operator, ns):
    if cluster.is_local and not _has_gc(cluster):
        pytest.skip("kube-controller-manager (garbage collector) not built")
    client = cluster.client()
    create(client, ns, serving("gc", free_port()))
    create(client, ns, tuning("gc-tune", "gc"))
    wait_for("the Job", lambda: get(client, "Job", ns, "gc-tune-run-1"))
    wait_for("the Service", lambda: get(client, "Service", ns, "gc"))
    custom = kubernetes.client.CustomObjectsApi(client)
    custom.delete_namespaced_custom_object(api.GROUP, api.VERSION, ns, api.TUNINGS, "gc-tune")
    custom.delete_namespaced_custom_object(api.GROUP, api.VERSION, ns, api.SERVINGS, "gc")
    # The garbage collector rediscovers resource types every 30 s; allow for a loaded machine.
    wait_for("the Job to be collected", lambda: get(client, "Job", ns, "gc-tune-run-1") is None, timeout=150)
    wait_for("the Deployment to be collected", lambda: get(client, "Deployment", ns, "gc") is None, timeout=150)
    assert get(client, "ConfigMap", ns, "gc-tune-spec") is None and get(client, "Service", ns, "gc") is None


def _has_gc(cluster) -> bool:
    from .conftest import CACHE

    return (CACHE / "bin" / "kube-controller-manager").exists()
