"""On a real node (node.sh: kubelet + containerd + runc, CNI bridge, kube-proxy): the operator's
pods run from the slotune image, the kubelet's probes decide Ready, and requests reach `tune serve`
through the Service. No stand-in: nothing here writes a status the cluster would write.

Root only; the first run builds the node binaries and the image (cached under
~/.cache/slotune-k8s). Marked `node`: `pytest -m node tests/operator_tests/test_node.py`.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from slotune.operator import children

from .conftest import Cluster, _apply, _install_crds, _operator_rbac_for_user, running_operator
from .kubelet import get
from .resources import create

pytestmark = pytest.mark.node

NODE_SH = Path(__file__).with_name("node.sh")


def _node(*args: str, **kw) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHON": sys.executable}  # builds the project's wheel
    return subprocess.run(["bash", str(NODE_SH), *args], check=True, text=True, env=env, **kw)


@pytest.fixture(scope="module")
def node(tmp_path_factory):
    if os.geteuid() != 0:
        pytest.skip("a real node needs root (containerd, runc, network namespaces)")
    _node("build")
    image = _node("slotune-image", stdout=subprocess.PIPE).stdout.strip().splitlines()[-1]
    d = tmp_path_factory.mktemp("node")
    _node("up", str(d), str(os.getpid()), stdout=subprocess.DEVNULL)
    try:
        _node("image", image, str(d))
        c = Cluster(str(d / "kubeconfig"), str(d / "operator.kubeconfig"), is_local=True)
        client = c.client()
        _install_crds(client)
        _apply(client, _operator_rbac_for_user())
        yield c
    finally:
        subprocess.run(["bash", str(NODE_SH), "down", str(d)], check=False)


@pytest.fixture
def node_ns(node):
    import kubernetes

    name = f"n-{os.urandom(4).hex()}"
    core = kubernetes.client.CoreV1Api(node.client())
    core.create_namespace({"metadata": {"name": name}})
    account = {"metadata": {"name": children.SERVING_SERVICE_ACCOUNT}}
    core.create_namespaced_service_account(name, account)
    yield name
    core.delete_namespace(name)


def _wait(what: str, probe, timeout_s: float = 300.0, every_s: float = 1.0):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        got = probe()
        if got:
            return got
        time.sleep(every_s)
    raise AssertionError(f"timed out after {timeout_s:.0f} s waiting for {what}")


def test_serving_pods_start_pass_their_probes_and_answer_through_the_service(node, node_ns):
    """An SLOServing of one replica: the kubelet pulls nothing (the image is in containerd's
    store), starts `tune serve` with the rendered command, volumes and env, marks it Ready from
    its own readiness probe, and a request from outside the pods reaches it at the Service's
    cluster IP (kube-proxy's rules)."""
    client = node.client()
    serving = {
        "apiVersion": "slotune.dev/v1alpha1",
        "kind": "SLOServing",
        "metadata": {"name": "chat"},
        "spec": {
            "model": "smollm2-135m",
            "replicas": 1,
            "port": 8000,
            "config": {"max_num_seqs": 2},
            "resources": {"requests": {"cpu": "100m", "memory": "1Gi"}},
        },
    }
    with running_operator(node):
        create(client, node_ns, serving)
        dep = _wait(
            "the Deployment's ready replica (the kubelet's readiness probe)",
            lambda: (
                (d := get(client, "Deployment", node_ns, "chat")) and (d.get("status") or {}).get("readyReplicas") and d
            ),
            timeout_s=600,
        )
        assert dep["status"]["readyReplicas"] == 1
        svc = get(client, "Service", node_ns, "chat")
        url = f"http://{svc['spec']['clusterIP']}:8000"
        r = httpx.post(
            f"{url}/v1/completions",
            json={"model": "smollm2-135m", "prompt": "The capital of France is", "max_tokens": 8, "temperature": 0},
            timeout=60,
        )
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] == 8
        metrics = httpx.get(f"{url}/metrics", timeout=10).text
        assert "slotune_time_to_first_token_seconds_count" in metrics
