"""On a real node (node.sh: kubelet + containerd + runc, CNI bridge, kube-proxy): the operator's
pods run from the slotune image, the kubelet's probes decide Ready, requests reach `tune serve`
through the Service, a tuning Job's pod runs a real study, and canaries are judged on their own
pods' /metrics. No stand-in: nothing here writes a status the cluster would write. The operator
runs in-process beside the cluster, as the RBAC-limited user.

Root only; the first run builds the node binaries and the image (cached under
~/.cache/slotune-k8s). Marked `node`: `pytest -m node tests/operator_tests/test_node.py`.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest
import yaml

from slotune.operator import api

from .conftest import MANIFESTS, local_cluster, running_operator
from .kubelet import get, wait_for
from .kubelet import get_cr
from .resources import create, tuning

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
    with local_cluster(NODE_SH, d) as c:
        _node("image", image, str(d))
        yield c


@pytest.fixture
def node_ns(node):
    import kubernetes

    name = f"n-{os.urandom(4).hex()}"
    core = kubernetes.client.CoreV1Api(node.client())
    core.create_namespace({"metadata": {"name": name}})
    # The pods' identities, as a user applies them (operator/manifests/tuner).
    for doc in yaml.safe_load_all((MANIFESTS / "tuner" / "tuner.yaml").read_text()):
        core.create_namespaced_service_account(name, doc)
    yield name
    core.delete_namespace(name)


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
        dep = wait_for(
            "the Deployment's ready replica (the kubelet's readiness probe)",
            lambda: (
                (d := get(client, "Deployment", node_ns, "chat")) and (d.get("status") or {}).get("readyReplicas") and d
            ),
            timeout=600,
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


def _serving(replicas: int = 1) -> dict:
    return {
        "apiVersion": "slotune.dev/v1alpha1",
        "kind": "SLOServing",
        "metadata": {"name": "chat"},
        "spec": {
            "model": "smollm2-135m",
            "replicas": replicas,
            "port": 8000,
            "config": {"max_num_seqs": 2},
            "resources": {"requests": {"cpu": "100m", "memory": "1Gi"}},
        },
    }


class _Load(threading.Thread):
    """Completions sent to the Service one after another until stopped (a client outside the pods)."""

    def __init__(self, url: str):
        super().__init__(daemon=True)
        self.url, self.stop, self.sent, self.errors = url, threading.Event(), 0, 0

    def run(self):
        body = {"model": "smollm2-135m", "prompt": "Write one sentence about rivers.", "max_tokens": 16}
        # A connection per request: kube-proxy balances connections, so one kept alive would pin
        # every request to whichever pod it reached first.
        with httpx.Client(timeout=60, limits=httpx.Limits(max_keepalive_connections=0)) as c:
            while not self.stop.is_set():
                try:
                    c.post(f"{self.url}/v1/completions", json=body).raise_for_status()
                    self.sent += 1
                except httpx.HTTPError:
                    self.errors += 1
                    time.sleep(0.5)


def _tune_and_judge(node, ns: str, slo: dict) -> tuple[dict, "_Load"]:
    """Serve `chat` (one pod), send it requests through the Service, and run an SLOTuning whose
    canary is judged against `slo`; the tuning's status at its verdict, and the load sent."""
    client = node.client()
    with running_operator(node):
        create(client, ns, _serving())
        wait_for(
            "the stable pod Ready",
            lambda: ((get(client, "Deployment", ns, "chat") or {}).get("status") or {}).get("readyReplicas"),
            600,
        )
        svc = get(client, "Service", ns, "chat")
        load = _Load(f"http://{svc['spec']['clusterIP']}:8000")
        load.start()
        try:
            rollout = {"canaryFraction": 0.5, "canaryDurationSeconds": 20, "readyDeadlineSeconds": 600, "slo": slo}
            spec = tuning("chat-tune", "chat", rollout)
            spec["spec"]["resources"] = {"requests": {"cpu": "100m", "memory": "2Gi"}}
            create(client, ns, spec)
            status = wait_for(
                "a verdict",
                lambda: (
                    (st := (get_cr(client, api.TUNINGS, ns, "chat-tune").get("status") or {})).get("phase")
                    in ("Promoted", "RolledBack", "Failed")
                    and st
                ),
                timeout=1500,
                interval=5,
            )
        finally:
            load.stop.set()
            load.join(timeout=90)
    return status, load


def test_a_tuning_job_runs_in_a_pod_and_its_canary_is_promoted_on_real_traffic(node, node_ns):
    """The SLOTuning's Job runs a one-trial `tune run` in a pod that publishes its result through
    the per-run Role; the operator starts the canary, judges it on the canary pod's own /metrics
    while requests reach both tracks through the Service, and promotes it."""
    status, load = _tune_and_judge(node, node_ns, {"ttftSeconds": 10.0, "tpotSeconds": 1.0, "minRequests": 5})
    assert status["phase"] == "Promoted", status
    assert status["history"][-1]["measured"]["requests"] >= 5 and load.sent > 0
    stable = get(node.client(), "ConfigMap", node_ns, "chat-config")
    promoted = {k: v for k, v in yaml.safe_load(stable["data"]["config.yaml"]).items() if k != "model"}
    assert promoted == {k: v for k, v in status["best"]["config"].items() if k != "model"}


def test_a_canary_that_misses_the_slo_is_rolled_back_and_none_of_its_pods_serves(node, node_ns):
    """The same flow against a TTFT limit no pod can hold (1 ms): the canary is judged on real
    requests, rolled back, and no pod of the canary's config is left running."""
    import kubernetes

    status, _ = _tune_and_judge(node, node_ns, {"ttftSeconds": 0.001, "tpotSeconds": 1.0, "minRequests": 5})
    assert status["phase"] == "RolledBack", status
    assert status["history"][-1]["measured"]["requests"] >= 5
    core = kubernetes.client.CoreV1Api(node.client())

    def canary_pods():
        return core.list_namespaced_pod(node_ns, label_selector=f"{api.LABEL_TRACK}=canary").items

    wait_for("the canary's pods gone", lambda: not canary_pods() or None, timeout=120)
    assert get(node.client(), "Deployment", node_ns, "chat-canary") is None
    stable = core.list_namespaced_pod(node_ns, label_selector=f"{api.LABEL_TRACK}=stable").items
    assert [p.status.phase for p in stable] == ["Running"]
