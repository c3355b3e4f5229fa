"""Restarting the operator at any step converges: no duplicate children, lost children come
back, and a converged state is left untouched (no writes at all)."""

from __future__ import annotations

import json
import threading
import time
from collections import Counter

import kubernetes
import pytest

from slotune.operator import api
from slotune.operator.children import config_hash

from .conftest import running_operator
from .kubelet import free_port, get, get_cr, run_job, serve_metrics, start_pods, wait_for
from tests.faults import processes_left

from .resources import create, events, serving, tuning

pytestmark = pytest.mark.k8s


def _status(client, ns, name) -> dict:
    return get_cr(client, api.TUNINGS, ns, name).get("status") or {}


def _phase(client, ns, name):
    return _status(client, ns, name).get("phase")


def _versions(client, ns):
    """resourceVersion of every child and custom resource in the namespace."""
    out = {}
    for kind, items in (
        ("Deployment", kubernetes.client.AppsV1Api(client).list_namespaced_deployment(ns).items),
        ("Job", kubernetes.client.BatchV1Api(client).list_namespaced_job(ns).items),
        ("Service", kubernetes.client.CoreV1Api(client).list_namespaced_service(ns).items),
        ("ConfigMap", kubernetes.client.CoreV1Api(client).list_namespaced_config_map(ns).items),
    ):
        out.update({(kind, o.metadata.name): o.metadata.resource_version for o in items})
    custom = kubernetes.client.CustomObjectsApi(client)
    for plural in (api.TUNINGS, api.SERVINGS):
        for o in custom.list_namespaced_custom_object(api.GROUP, api.VERSION, ns, plural)["items"]:
            out[(plural, o["metadata"]["name"])] = o["metadata"]["resourceVersion"]
    return out


def _kept(before: dict) -> tuple[str, ...]:
    """The rollout's state: the run, when it started tuning, and its canary."""
    return (str(before.get("run")), str(before.get("lastTuningTime")), json.dumps(before.get("canary"), sort_keys=True))


def _reasons(client, ns, name) -> Counter:
    return Counter(reason for _, reason, _ in events(client, ns, name))


def _operator_fault_row(fault, client, ns, kept_before, kept_after, canary_uids, happened):
    jobs = kubernetes.client.BatchV1Api(client).list_namespaced_job(ns).items
    reasons = _reasons(client, ns, "rs-tune")
    # Events are posted best-effort (kopf queues them), so one can be missing after a quick stop:
    # only an extra one counts as a duplicate.
    extra_events = sum(max(reasons[r] - 1, 0) for r in ("TuningStarted", "CanaryStarted"))
    duplicated = len(jobs) - 1 + len(set(canary_uids)) - 1 + extra_events
    print("jobs", [j.metadata.name for j in jobs], "canaries", canary_uids, "events", reasons)  # shown on a failure
    return fault.record(
        happened,
        lost=sum(a != b for a, b in zip(kept_before, kept_after)),
        duplicated=duplicated,
        stuck=int(_phase(client, ns, "rs-tune") != "Promoted"),
        processes_left=len(processes_left(fault.tag)),
    )


@pytest.mark.fault("the operator restarted during a canary")
def test_restarts_converge(cluster, ns, tmp_path, fault):
    client = cluster.client()
    port = free_port()
    create(client, ns, serving("rs", port))
    create(client, ns, tuning("rs-tune", "rs"))
    with running_operator(cluster):
        wait_for("the tuning Job", lambda: get(client, "Job", ns, "rs-tune-run-1"))
        wait_for("the stable Deployment", lambda: get(client, "Deployment", ns, "rs"))
    # Operator down: the Job finishes and someone deletes the stable Deployment.
    run_job(cluster, ns, "rs-tune-run-1", tmp_path / "job", best_config={"max_num_seqs": 6})
    kubernetes.client.AppsV1Api(client).delete_namespaced_deployment("rs", ns)
    wait_for("the Deployment to go", lambda: get(client, "Deployment", ns, "rs") is None)

    with running_operator(cluster):
        wait_for("phase Canary", lambda: _phase(client, ns, "rs-tune") == "Canary")
        wait_for("the canary Deployment", lambda: get(client, "Deployment", ns, "rs-canary"))
        wait_for("the stable Deployment back", lambda: get(client, "Deployment", ns, "rs"))
    jobs = kubernetes.client.BatchV1Api(client).list_namespaced_job(ns).items
    assert [j.metadata.name for j in jobs] == ["rs-tune-run-1"]  # the restart started no second run

    # Operator restarted mid-canary (its pods not ready yet): it takes the rollout up where it was.
    kept = _kept(_status(client, ns, "rs-tune"))
    uids = [get(client, "Deployment", ns, "rs-canary")["metadata"]["uid"]]
    with running_operator(cluster):
        time.sleep(3)  # several timer ticks
        kept_after = _kept(_status(client, ns, "rs-tune"))
        uids.append(get(client, "Deployment", ns, "rs-canary")["metadata"]["uid"])

    metrics = serve_metrics(port, ttft_s=0.05, tpot_s=0.01)
    try:
        start_pods(cluster, ns, "rs-canary")
        with running_operator(cluster):
            wait_for("phase Promoted", lambda: _phase(client, ns, "rs-tune") in ("Promoted", "RolledBack"))
            wait_for("the canary to go", lambda: get(client, "Deployment", ns, "rs-canary") is None)
            final_hash = config_hash({"max_num_seqs": 6, "model": "smollm2-135m"})
            wait_for(
                "the final serving status",
                lambda: (
                    lambda st: (
                        st.get("configHash") == final_hash and st.get("phase") != "Canary" and not st.get("canary")
                    )
                )(get_cr(client, api.SERVINGS, ns, "rs").get("status") or {}),
            )
    finally:
        metrics.terminate()
    _operator_fault_row(
        fault,
        client,
        ns,
        kept,
        kept_after,
        uids,
        "the restarted operator kept the canary and its status, then promoted",
    ).assert_clean()
    assert _phase(client, ns, "rs-tune") == "Promoted"
    assert get_cr(client, api.SERVINGS, ns, "rs")["spec"]["config"] == {"max_num_seqs": 6}

    # Converged: another restart finds nothing to do, and writes nothing.
    before = _versions(client, ns)
    with running_operator(cluster):
        time.sleep(3)  # several timer ticks (0.5 s) and the resume handlers
    assert _versions(client, ns) == before
    assert len(kubernetes.client.AppsV1Api(client).list_namespaced_deployment(ns).items) == 1


@pytest.mark.fault("the kube-apiserver killed during a tuning Job, started again 8 s later")
def test_an_api_server_restart_during_the_tuning_job_loses_nothing(cluster, ns, tmp_path, fault):
    """kill -9 of the kube-apiserver while the tuning Job runs; its study ends and publishes during
    the outage. The Job's publish waits for the API server, the operator reconnects, and the rollout
    goes on: one Job, one canary, promoted, nothing in the status lost."""
    client = cluster.client()
    port = free_port()
    create(client, ns, serving("rs", port))
    create(client, ns, tuning("rs-tune", "rs"))
    metrics = serve_metrics(port, ttft_s=0.05, tpot_s=0.01)
    try:
        with running_operator(cluster):
            wait_for("the tuning Job", lambda: get(client, "Job", ns, "rs-tune-run-1"))
            wait_for("phase Tuning", lambda: _phase(client, ns, "rs-tune") == "Tuning")
            kept = _kept(_status(client, ns, "rs-tune"))
            ran = []
            job = threading.Thread(
                target=lambda: ran.append(
                    run_job(cluster, ns, "rs-tune-run-1", tmp_path / "job", best_config={"max_num_seqs": 6}, tune_s=2)
                )
            )
            job.start()  # reads its Job, then tunes for 2 s: it publishes while the API server is down
            wait_for("the Job's pod to start", lambda: (tmp_path / "job" / "spec.yaml").exists())
            cluster.restart_apiserver(down_s=8)
            job.join(timeout=120)
            assert ran and ran[0].returncode == 0 and "publish: the API server did not answer" in ran[0].stderr
            wait_for("phase Canary", lambda: _phase(client, ns, "rs-tune") == "Canary", timeout=120)
            kept_after = _kept(_status(client, ns, "rs-tune"))[:2] + kept[2:]  # the canary is new by design
            uid = wait_for("the canary Deployment", lambda: get(client, "Deployment", ns, "rs-canary"))["metadata"]
            start_pods(cluster, ns, "rs-canary")
            wait_for("phase Promoted", lambda: _phase(client, ns, "rs-tune") in ("Promoted", "RolledBack"))
            wait_for("the canary to go", lambda: get(client, "Deployment", ns, "rs-canary") is None)
    finally:
        metrics.terminate()
    _operator_fault_row(
        fault,
        client,
        ns,
        kept,
        kept_after,
        [uid["uid"]],
        "the Job's result waited for the API server; the operator reconnected, canaried once and promoted",
    ).assert_clean()
    assert get_cr(client, api.SERVINGS, ns, "rs")["spec"]["config"] == {"max_num_seqs": 6}
