"""The loop on a real kube-apiserver: a SLOServing records its traffic on a claim, a scheduled
SLOTuning tunes on the last window of it, status shows each run's traffic and its drift, and a
run whose traffic has not drifted is skipped. The Job's own command reads the recordings from
the claim (mapped to a local folder, as a kubelet mounts it) and snapshots, summarizes and
decides; nothing about traffic is faked."""

from __future__ import annotations

import pytest
import yaml

from slotune.operator import api, children

from .kubelet import free_port, get, get_cr, run_job, serve_metrics, start_pods, wait_for
from .resources import create, patch, serving, tuning
from .test_traffic import T0, record

pytestmark = pytest.mark.k8s


def condition(client, plural, ns, name, type_):
    status = get_cr(client, plural, ns, name).get("status") or {}
    return next((c for c in status.get("conditions") or [] if c["type"] == type_), None)


def tuning_status(client, ns, name, check):
    status = get_cr(client, api.TUNINGS, ns, name).get("status") or {}
    return status if check(status) else None


def test_recording_renders_a_folder_per_pod_and_bad_claims_are_refused(cluster, operator, ns):
    client = cluster.client()
    create(client, ns, serving("rec", free_port(), recordTraffic={"claimName": "rec-traffic", "maxMiB": 64}))
    create(client, ns, serving("empty", free_port(), recordTraffic={"maxMiB": 64}))  # no claim
    create(client, ns, serving("plain", free_port()))
    dep = wait_for("the Deployment", lambda: get(client, "Deployment", ns, "rec"))
    pod = dep["spec"]["template"]["spec"]
    c = pod["containers"][0]
    i = c["command"].index("--record-traffic")
    assert c["command"][i : i + 4] == [
        "--record-traffic",
        "/traffic/rec/$(SLOTUNE_POD_NAME)",
        "--record-traffic-max-mib",
        "64",
    ]
    assert {
        "name": "SLOTUNE_POD_NAME",
        "valueFrom": {"fieldRef": {"apiVersion": "v1", "fieldPath": "metadata.name"}},
    } in c["env"]
    assert {"name": "traffic", "mountPath": "/traffic"} in c["volumeMounts"]
    assert {"name": "traffic", "persistentVolumeClaim": {"claimName": "rec-traffic"}} in pod["volumes"]
    assert pod["securityContext"]["fsGroup"] == 10001
    cond = wait_for(
        "Valid=False",
        lambda: (lambda c: c if c and c["status"] == "False" else None)(
            condition(client, api.SERVINGS, ns, "empty", "Valid")
        ),
    )
    assert cond["reason"] == "InvalidRecording" and "spec.recordTraffic.claimName is empty" in cond["message"]
    assert get(client, "Deployment", ns, "empty") is None
    # a SLOTuning cannot tune on traffic a SLOServing does not record: refused, nothing created
    create(client, ns, tuning("plain-tune", "plain", traffic={"window": "1h"}))
    cond = wait_for(
        "Valid=False",
        lambda: (lambda c: c if c and c["status"] == "False" else None)(
            condition(client, api.TUNINGS, ns, "plain-tune", "Valid")
        ),
    )
    assert cond["reason"] == "TrafficNotRecorded" and "SLOServing 'plain' records no traffic" in cond["message"]
    assert get(client, "Job", ns, "plain-tune-run-1") is None
    # fixed: the pods record
    patch(client, ns, api.SERVINGS, "empty", {"spec": {"recordTraffic": {"claimName": "empty-traffic"}}})
    dep = wait_for("the Deployment", lambda: get(client, "Deployment", ns, "empty"))
    assert "/traffic/empty/$(SLOTUNE_POD_NAME)" in dep["spec"]["template"]["spec"]["containers"][0]["command"]


def test_scheduled_runs_tune_on_recorded_traffic_and_skip_without_drift(cluster, operator, ns, tmp_path):
    client = cluster.client()
    port = free_port()
    claim = tmp_path / "claim"  # what PVC rec-traffic holds: one folder per serving pod
    record(claim / "rec" / "rec-0", T0 - 7200, 80, 1.0, 2000, 50)  # two hours old: outside the 1 h window
    record(claim / "rec" / "rec-0", T0, 100, 0.2, 400, 60, name="requests-001.jsonl")
    record(claim / "rec" / "rec-1", T0 + 2, 100, 0.2, 400, 60)
    create(client, ns, serving("rec", port, recordTraffic={"claimName": "rec-traffic"}))
    create(
        client,
        ns,
        tuning(
            "rec-tune",
            "rec",
            schedule="@every 2s",
            workVolumeClaim="rec-work",
            traffic={"fromServing": "rec", "window": "1h", "driftThreshold": 0.15},
        ),
    )
    claims = {"rec-traffic": claim}

    # run 1: no tuned-on traffic yet -- tunes on the window, which becomes the tuned-on traffic
    job = wait_for("job run 1", lambda: get(client, "Job", ns, "rec-tune-run-1"))
    pod = job["spec"]["template"]["spec"]
    assert {"name": "traffic", "mountPath": "/traffic", "readOnly": True} in pod["containers"][0]["volumeMounts"]
    assert {"name": "traffic", "persistentVolumeClaim": {"claimName": "rec-traffic", "readOnly": True}} in pod[
        "volumes"
    ]
    assert "--tuned-traffic" not in pod["containers"][0]["command"]
    spec = yaml.safe_load(get(client, "ConfigMap", ns, "rec-tune-spec")["data"]["spec.yaml"])
    assert spec["workload"]["trace"] == {"path": children.TRAFFIC_SNAPSHOT, "format": "recorded", "time_scale": 1.0}
    proc = run_job(cluster, ns, "rec-tune-run-1", tmp_path / "job1", best_config={"max_num_seqs": 4}, claims=claims)
    assert proc.returncode == 0, proc.stderr
    assert len((tmp_path / "job1" / "out" / "traffic.jsonl").read_text().splitlines()) == 200  # the snapshot
    status = wait_for(
        "run 1's result", lambda: tuning_status(client, ns, "rec-tune", lambda s: (s.get("best") or {}).get("run") == 1)
    )
    t = status["traffic"]
    assert (t["run"], t["requests"], t["window"]["seconds"]) == (
        1,
        200,
        3600,
    ) and "drift" not in t  # nothing to compare with
    assert t["meanRate"] == pytest.approx(0.4, rel=0.05) and 400 <= t["promptP50"] <= 430
    assert status["tunedTraffic"]["run"] == 1
    cond = condition(client, api.TUNINGS, ns, "rec-tune", "Retuned")
    assert (cond["status"], cond["reason"]) == ("True", "NoBaseline")
    # run 1 goes out through a canary that holds the SLO
    metrics = serve_metrics(port, ttft_s=0.1, tpot_s=0.02)
    try:
        wait_for("the canary Deployment", lambda: get(client, "Deployment", ns, "rec-canary"))
        start_pods(cluster, ns, "rec-canary")
        wait_for(
            "run 1 promoted",
            lambda: tuning_status(
                client,
                ns,
                "rec-tune",
                lambda s: any(h["run"] == 1 and h["outcome"] == "Promoted" for h in s.get("history") or []),
            ),
        )
    finally:
        metrics.terminate()

    # run 2: the same traffic -- the Job publishes `skipped`, `tune run` never starts
    job = wait_for("job run 2", lambda: get(client, "Job", ns, "rec-tune-run-2"))
    cmd = job["spec"]["template"]["spec"]["containers"][0]["command"]
    assert '"run": 1' in cmd[cmd.index("--tuned-traffic") + 1]
    proc = run_job(cluster, ns, "rec-tune-run-2", tmp_path / "job2", best_config={"max_num_seqs": 2}, claims=claims)
    assert proc.returncode == 0, proc.stderr
    assert not (tmp_path / "job2" / "out" / "best.yaml").exists()
    data = get(client, "ConfigMap", ns, "rec-tune-run-2-result")["data"]
    assert data["skipped"].startswith("NoDrift: traffic drift 0% < threshold 15%") and "best.yaml" not in data
    status = wait_for(
        "run 2 skipped",
        lambda: tuning_status(client, ns, "rec-tune", lambda s: any(h["run"] == 2 for h in s.get("history") or [])),
    )
    entry = next(h for h in status["history"] if h["run"] == 2)
    assert (entry["outcome"], entry["reason"], entry["traffic"]["drift"]) == ("Skipped", "NoDrift", 0.0)
    assert status["best"]["run"] == 1 and status["tunedTraffic"]["run"] == 1  # the tuned-on traffic stays
    cond = condition(client, api.TUNINGS, ns, "rec-tune", "Retuned")
    assert (cond["status"], cond["reason"]) == ("False", "NoDrift")
    assert cond["message"].startswith("run 2: traffic drift 0% < threshold 15%") and "vs run 1" in cond["message"]
    assert get_cr(client, api.SERVINGS, ns, "rec")["spec"]["config"] == {"max_num_seqs": 4}  # untouched

    # run 3: busier traffic with longer prompts was recorded since -- drifted, so it tunes
    wait_for("job run 3", lambda: get(client, "Job", ns, "rec-tune-run-3"))
    patch(client, ns, api.TUNINGS, "rec-tune", {"spec": {"schedule": None}})
    record(claim / "rec" / "rec-1", T0 + 600, 300, 1.0, 1200, 60, name="requests-001.jsonl")
    proc = run_job(cluster, ns, "rec-tune-run-3", tmp_path / "job3", best_config={"max_num_seqs": 6}, claims=claims)
    assert proc.returncode == 0, proc.stderr
    status = wait_for(
        "run 3's result", lambda: tuning_status(client, ns, "rec-tune", lambda s: (s.get("best") or {}).get("run") == 3)
    )
    t = status["traffic"]
    assert t["run"] == 3 and t["requests"] == 500 and t["drift"] >= 0.15 and t["driftFrom"] == 1
    assert status["tunedTraffic"]["run"] == 3
    cond = condition(client, api.TUNINGS, ns, "rec-tune", "Retuned")
    assert (cond["status"], cond["reason"]) == ("True", "TrafficDrifted")
    assert f"largest: {t['driftField']}, vs run 1" in cond["message"]
    wait_for(
        "run 3's canary", lambda: (get_cr(client, api.SERVINGS, ns, "rec")["spec"].get("canary") or {}).get("run") == 3
    )
