"""Restarting the operator at any step converges: no duplicate children, lost children come
back, and a converged state is left untouched (no writes at all)."""

from __future__ import annotations

import time

import kubernetes
import pytest

from slotune.operator import api
from slotune.operator.children import config_hash

from .conftest import running_operator
from .kubelet import free_port, get, get_cr, run_job, serve_metrics, start_pods, wait_for
from .resources import create, serving, tuning

pytestmark = pytest.mark.k8s


def _phase(client, ns, name):
    return (get_cr(client, api.TUNINGS, ns, name).get("status") or {}).get("phase")


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


def test_restarts_converge(cluster, ns, tmp_path):
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
    assert _phase(client, ns, "rs-tune") == "Promoted"
    assert get_cr(client, api.SERVINGS, ns, "rs")["spec"]["config"] == {"max_num_seqs": 6}

    # Converged: another restart finds nothing to do, and writes nothing.
    before = _versions(client, ns)
    with running_operator(cluster):
        time.sleep(3)  # several timer ticks (0.5 s) and the resume handlers
    assert _versions(client, ns) == before
    assert len(kubernetes.client.AppsV1Api(client).list_namespaced_deployment(ns).items) == 1
