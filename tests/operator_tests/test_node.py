"""On a real node (node.sh: kubelet + containerd + runc, CNI bridge, kube-proxy): the operator's
pods run from the slotune image, the kubelet's probes decide Ready, requests reach `tune serve`
through the Service, a tuning Job's pod runs a real study, and canaries are judged on their own
pods' /metrics. No stand-in: nothing here writes a status the cluster would write. The first
tests run the operator in-process beside the cluster, as the RBAC-limited user; the last one
applies slotune/operator/manifests and examples/04-kubernetes as a user would, the operator in its own pod
with its service account's token.

Root only; the first run builds the node binaries and the image (cached under
~/.cache/slotune-k8s). Marked `node`: `pytest -m node tests/operator_tests/test_node.py`.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest
import yaml

from slotune.operator import api

from .conftest import MANIFESTS, ROOT, apply_objects, local_cluster, running_operator
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
    images = [
        _node(f"{name}-image", stdout=subprocess.PIPE).stdout.strip().splitlines()[-1]
        for name in ("slotune", "operator")
    ]
    d = tmp_path_factory.mktemp("node")
    with local_cluster(NODE_SH, d) as c:
        for image in images:
            _node("image", image, str(d))
        yield c


@pytest.fixture
def node_ns(node):
    import kubernetes

    name = f"n-{os.urandom(4).hex()}"
    core = kubernetes.client.CoreV1Api(node.client())
    core.create_namespace({"metadata": {"name": name}})
    # The pods' identities, as a user applies them (slotune/operator/manifests/tuner).
    for doc in yaml.safe_load_all((MANIFESTS / "tuner" / "tuner.yaml").read_text()):
        core.create_namespaced_service_account(name, doc)
    yield name
    core.delete_namespace(name)


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


def _ready_replicas(client, ns: str, name: str) -> int | None:
    """The Deployment's ready replicas, as its status says (the kubelet's readiness probes)."""
    return ((get(client, "Deployment", ns, name) or {}).get("status") or {}).get("readyReplicas")


def _without_model(config: dict) -> dict:
    return {k: v for k, v in config.items() if k != "model"}


def test_serving_pods_start_pass_their_probes_and_answer_through_the_service(node, node_ns):
    """An SLOServing of one replica: the kubelet pulls nothing (the image is in containerd's
    store), starts `tune serve` with the rendered command, volumes and env, marks it Ready from
    its own readiness probe, and a request from outside the pods reaches it at the Service's
    cluster IP (kube-proxy's rules)."""
    client = node.client()
    with running_operator(node):
        create(client, node_ns, _serving())
        ready = wait_for(
            "the Deployment's ready replica (the kubelet's readiness probe)",
            lambda: _ready_replicas(client, node_ns, "chat"),
            timeout=600,
        )
        assert ready == 1
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
            lambda: _ready_replicas(client, ns, "chat"),
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
    assert _without_model(yaml.safe_load(stable["data"]["config.yaml"])) == _without_model(status["best"]["config"])


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


EXAMPLE = ROOT / "examples" / "04-kubernetes"
_CLUSTER_SCOPED = {"Namespace", "ClusterRole", "ClusterRoleBinding", "CustomResourceDefinition", "PersistentVolume"}


def _kustomize(path: Path) -> list[dict]:
    """The objects `kubectl apply -k path` applies: its resources (folders recursively), with the
    kustomization's namespace. (slotune/operator/manifests' `images:` entry matches no container image of
    these files: nothing to rewrite.)"""
    k = yaml.safe_load((path / "kustomization.yaml").read_text())
    docs = []
    for res in k["resources"]:
        p = path / res
        sub = _kustomize(p) if p.is_dir() else [d for d in yaml.safe_load_all(p.read_text()) if d]
        for d in sub:
            if k.get("namespace") and d["kind"] not in _CLUSTER_SCOPED:
                d["metadata"]["namespace"] = k["namespace"]
        docs += sub
    return docs


def _readme_claims() -> list[dict]:
    """The two PersistentVolumeClaims examples/04-kubernetes/README.md tells the user to apply."""
    text = (EXAMPLE / "README.md").read_text()
    body = re.search(r"kubectl apply -f - <<'EOF'.*?\n(.*?)\nEOF\n", text, re.S).group(1)
    return [d for d in yaml.safe_load_all(body) if d]


def _host_volumes(claims: list[dict], root: Path) -> list[dict]:
    """A hostPath PersistentVolume bound to each claim: this node has no storage provisioner."""
    volumes = []
    for c in claims:
        path = root / c["metadata"]["name"]
        path.mkdir()
        path.chmod(0o777)  # the pods run as user 10001
        volumes.append(
            {
                "apiVersion": "v1",
                "kind": "PersistentVolume",
                "metadata": {"name": f"{c['metadata']['name']}-host"},
                "spec": {
                    "capacity": c["spec"]["resources"]["requests"],
                    "accessModes": c["spec"]["accessModes"],
                    "hostPath": {"path": str(path)},
                    "claimRef": {"namespace": c["metadata"]["namespace"], "name": c["metadata"]["name"]},
                    "persistentVolumeReclaimPolicy": "Retain",
                },
            }
        )
    return volumes


def _example(name: str) -> dict:
    return yaml.safe_load((EXAMPLE / name).read_text())


@pytest.fixture
def operator_pod(node) -> str:
    """slotune/operator/manifests applied as `kubectl apply -k` would: the operator runs in its pod, from its
    image, as its service account, until the test ends. Yields the pod's name."""
    import kubernetes

    client = node.client()
    apply_objects(client, _kustomize(MANIFESTS))
    core = kubernetes.client.CoreV1Api(client)
    pod = wait_for(
        "the operator's pod Ready",
        lambda: next(
            (
                p
                for p in core.list_namespaced_pod("slotune-system").items
                if p.status.container_statuses and p.status.container_statuses[0].ready
            ),
            None,
        ),
        timeout=300,
    )
    yield pod.metadata.name
    kubernetes.client.AppsV1Api(client).delete_namespaced_deployment("slotune-operator", "slotune-system")


@pytest.mark.timeout(2700)
def test_the_example_applied_as_a_user_would_with_the_operator_in_its_pod(node, operator_pod, tmp_path):
    """slotune/operator/manifests (CRDs, RBAC, the operator's Deployment) and examples/04-kubernetes, applied
    as the example's README says, into `default`. The operator runs in its pod from its own image with
    its service account's token; the SLOServing's four pods record the requests a client sends through
    the Service; the SLOTuning's Job tunes on that recorded traffic with the study on the work claim,
    its canary is judged on its pod's /metrics against the example's SLO and promoted, and the
    schedule fires run 2. What a 2-vCPU node cannot hold as written is scaled down (each line says
    from what)."""
    import kubernetes

    client = node.client()
    core = kubernetes.client.CoreV1Api(client)
    claims = _readme_claims()
    apply_objects(client, _host_volumes(claims, tmp_path) + claims)
    serving = _example("sloserving.yaml")
    serving["spec"]["resources"]["requests"]["cpu"] = "100m"  # 4 pods x 2 CPUs
    tuning_cr = _example("slotuning.yaml")
    spec = tuning_cr["spec"]
    spec["resources"]["requests"]["cpu"] = "100m"  # 4 CPUs
    spec["tuning"]["budget"]["n_trials"] = 1  # 10 trials of a recorded trace: about an hour here
    spec["rollout"].update(canaryDurationSeconds=30)  # 10 minutes
    spec["rollout"]["slo"]["minRequests"] = 5  # 50: a sequential client reaches the one canary pod ~1 in 5
    spec["traffic"]["window"] = "1m"  # 24h: every measurement replays the whole window
    spec["schedule"] = "* * * * *"  # Mondays 03:00
    load = None
    try:
        create(client, "default", serving)
        wait_for(
            "the four serving pods Ready",
            lambda: _ready_replicas(client, "default", "chat") == 4 or None,
            timeout=900,
            interval=5,
        )
        load = _Load(f"http://{get(client, 'Service', 'default', 'chat')['spec']['clusterIP']}:8000")
        load.start()
        recorded = tmp_path / "chat-traffic" / "chat"
        wait_for(
            "20 requests recorded on the traffic claim",
            lambda: sum(len(f.read_text().splitlines()) for f in recorded.rglob("*.jsonl")) >= 20 or None,
            timeout=120,
        )
        create(client, "default", tuning_cr)

        def history() -> list[dict]:
            return (get_cr(client, api.TUNINGS, "default", "chat-k8s").get("status") or {}).get("history") or []

        wait_for("run 2's outcome (the schedule)", lambda: len(history()) >= 2 or None, timeout=2400, interval=10)
    finally:
        if load is not None:
            load.stop.set()
            load.join(timeout=90)
    status = get_cr(client, api.TUNINGS, "default", "chat-k8s")["status"]
    print(yaml.safe_dump(status["history"], sort_keys=False))  # for the results file (pytest -rP)
    first, second = status["history"][:2]
    assert (first["run"], first["outcome"]) == (1, "Promoted"), status
    assert second["run"] == 2 and second["outcome"] in ("Skipped", "Promoted", "RolledBack"), status
    assert load.sent > 0
    # Run 1 tuned on the recorded requests, the study on the work claim, and its winner serves.
    assert first["traffic"]["requests"] >= 20, first
    assert list((tmp_path / "chat-k8s-work").rglob("*.db")), "no study on the work claim"
    stable = yaml.safe_load(get(client, "ConfigMap", "default", "chat-config")["data"]["config.yaml"])
    promoted = [h for h in status["history"] if h["outcome"] == "Promoted"][-1]["config"]
    assert _without_model(stable) == _without_model(promoted)
    assert get_cr(client, api.SERVINGS, "default", "chat")["spec"].get("canary") is None
    wait_for(
        "no canary pod",
        lambda: not core.list_namespaced_pod("default", label_selector=f"{api.LABEL_TRACK}=canary").items or None,
        timeout=120,
    )
    # All of it with the operator's service account token and the shipped ClusterRole: no request
    # refused, no restart.
    op = core.read_namespaced_pod(operator_pod, "slotune-system")
    assert op.status.container_statuses[0].restart_count == 0
    log = core.read_namespaced_pod_log(operator_pod, "slotune-system")
    assert "Forbidden" not in log and " 403" not in log, log[-4000:]
