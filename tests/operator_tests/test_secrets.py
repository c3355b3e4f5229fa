"""Credentials reach pods only through secretKeyRef; the operator never reads or logs them
(it has no RBAC on Secrets at all)."""

from __future__ import annotations

import kubernetes
import pytest

from .conftest import running_operator
from .kubelet import free_port, get, wait_for
from .resources import create, serving, tuning

pytestmark = pytest.mark.k8s


def test_secrets_reach_pods_only_by_reference(cluster, ns):
    client = cluster.client()
    secret_value = "s3cr3t-do-not-log-4711"
    kubernetes.client.CoreV1Api(client).create_namespaced_secret(
        ns,
        {
            "metadata": {"name": "creds"},
            "stringData": {"url": f"postgresql://u:{secret_value}@db/optuna", "api-key": secret_value},
        },
    )
    create(client, ns, serving("sec", free_port(), apiKeySecret={"name": "creds"}))
    create(client, ns, tuning("sec-tune", "sec", workers=3, storageSecret={"name": "creds"}))
    with running_operator(cluster, verbose=True) as runner:
        dep = wait_for("the Deployment", lambda: get(client, "Deployment", ns, "sec"))
        workers = wait_for("the workers Job", lambda: get(client, "Job", ns, "sec-tune-run-1-workers"))
    assert (
        workers["spec"]["parallelism"] == 2
        and "--worker" in workers["spec"]["template"]["spec"]["containers"][0]["command"]
    )
    env = dep["spec"]["template"]["spec"]["containers"][0]["env"]
    assert env == [{"name": "SLOTUNE_API_KEY", "valueFrom": {"secretKeyRef": {"name": "creds", "key": "api-key"}}}]
    job = get(client, "Job", ns, "sec-tune-run-1")
    assert {"name": "SLOTUNE_STORAGE", "valueFrom": {"secretKeyRef": {"name": "creds", "key": "url"}}} in job["spec"][
        "template"
    ]["spec"]["containers"][0]["env"]
    assert secret_value not in runner.output  # debug logs included
    assert 'User "slotune-operator" cannot' not in runner.output  # the shipped ClusterRole suffices
