"""Fixtures for the operator tests: a REAL kube-apiserver, never a mock of the API.

`cluster` (session): $KUBECONFIG when set (any real cluster; the operator then runs with those
credentials), else etcd + kube-apiserver + kube-controller-manager (garbage collector only)
started on loopback by `cluster.sh up`, from binaries cached by `cluster.sh build` (built on
first use). Locally the operator runs as the token user `slotune-operator`, bound to the
ClusterRole in slotune/operator/manifests/rbac/operator.yaml: the tests exercise the shipped RBAC.

`operator` runs slotune.operator.handlers in-process with kopf.testing.KopfRunner.

Against a real cluster ($KUBECONFIG) the kubelet stand-ins (kubelet.py) still write Pod, Job
and Deployment status themselves, so use one whose controllers will not run those objects
(an API server without nodes); the slotune image need not exist there.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml

# Fast timers for the tests; read when slotune.operator.handlers is first imported.
os.environ.setdefault("SLOTUNE_OPERATOR_POLL_SECONDS", "0.5")

ROOT = Path(__file__).resolve().parents[2]
CLUSTER_SH = Path(__file__).with_name("cluster.sh")
MANIFESTS = ROOT / "slotune" / "operator" / "manifests"
CACHE = Path(os.environ.get("SLOTUNE_K8S_CACHE", Path.home() / ".cache" / "slotune-k8s"))


@dataclass
class Cluster:
    kubeconfig: str  # admin: what the tests (and the stand-in kubelet) use
    operator_kubeconfig: str  # what the operator uses
    is_local: bool

    def client(self):
        import kubernetes

        return kubernetes.config.new_client_from_config(self.kubeconfig)

    def restart_apiserver(self, down_s: float) -> None:
        """kill -9 the local kube-apiserver and start it again `down_s` later (a control-plane crash)."""
        if not self.is_local:
            pytest.skip("restarts only the local kube-apiserver (cluster.sh), not $KUBECONFIG's")
        d = str(Path(self.kubeconfig).parent)
        subprocess.run(["bash", str(CLUSTER_SH), "restart-apiserver", d, str(down_s)], check=True)


def apply_objects(client, docs) -> None:
    """Create each object (as `kubectl create`); one that exists already is left as it is."""
    from kubernetes import utils
    from kubernetes.client.rest import ApiException

    for doc in docs:
        try:
            utils.create_from_dict(client, doc)
        except utils.FailToCreateError as exc:
            if not all(isinstance(e, ApiException) and e.status == 409 for e in exc.api_exceptions):
                raise


def _install_crds(client) -> None:
    import kubernetes

    ext = kubernetes.client.ApiextensionsV1Api(client)
    for path in sorted((MANIFESTS / "crds").glob("*.yaml")):
        body = yaml.safe_load(path.read_text())
        try:
            ext.create_custom_resource_definition(body)
        except kubernetes.client.ApiException as exc:
            if exc.status != 409:
                raise
            body["metadata"]["resourceVersion"] = ext.read_custom_resource_definition(
                body["metadata"]["name"]
            ).metadata.resource_version
            ext.replace_custom_resource_definition(body["metadata"]["name"], body)
        name = body["metadata"]["name"]
        deadline = time.time() + 30
        while time.time() < deadline:
            conds = ext.read_custom_resource_definition(name).status.conditions or []
            if any(c.type == "Established" and c.status == "True" for c in conds):
                break
            time.sleep(0.2)


def _operator_rbac_for_user() -> list[dict]:
    """The shipped ClusterRole, bound to the local token user the operator runs as."""
    docs = list(yaml.safe_load_all((MANIFESTS / "rbac" / "operator.yaml").read_text()))
    role = next(d for d in docs if d["kind"] == "ClusterRole")
    binding = {
        "apiVersion": "rbac.authorization.k8s.io/v1",
        "kind": "ClusterRoleBinding",
        "metadata": {"name": "slotune-operator-test-user"},
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": role["metadata"]["name"]},
        "subjects": [{"apiGroup": "rbac.authorization.k8s.io", "kind": "User", "name": "slotune-operator"}],
    }
    return [role, binding]


@pytest.fixture(scope="session")
def cluster(tmp_path_factory):
    if os.environ.get("KUBECONFIG"):
        c = Cluster(os.environ["KUBECONFIG"], os.environ["KUBECONFIG"], is_local=False)
        _install_crds(c.client())
        yield c
        return
    if not (CACHE / "bin" / "kube-apiserver").exists() and os.geteuid() != 0 and not shutil.which("go"):
        pytest.skip(f"no kube-apiserver in {CACHE}/bin: run `bash {CLUSTER_SH.relative_to(ROOT)} build` (as root)")
    with local_cluster(CLUSTER_SH, tmp_path_factory.mktemp("k8s")) as c:
        yield c


@contextlib.contextmanager
def local_cluster(script: Path, d: Path):
    """`script up` under `d` (its watchdog stops it if this process dies): the Cluster, with the
    CRDs and the operator's RBAC for its token user; `script down` afterwards."""
    subprocess.run(["bash", str(script), "up", str(d), str(os.getpid())], check=True, stdout=subprocess.DEVNULL)
    try:
        c = Cluster(str(d / "kubeconfig"), str(d / "operator.kubeconfig"), is_local=True)
        client = c.client()
        _install_crds(client)
        apply_objects(client, _operator_rbac_for_user())
        yield c
    finally:
        subprocess.run(["bash", str(script), "down", str(d)], check=False)


@pytest.fixture
def ns(cluster):
    """A fresh namespace per test."""
    import kubernetes

    name = f"t-{uuid.uuid4().hex[:8]}"
    core = kubernetes.client.CoreV1Api(cluster.client())
    core.create_namespace({"metadata": {"name": name}})
    yield name
    # Custom resources first (an operator still running releases its finalizers; the next one
    # started does it otherwise): no namespace controller runs locally, so a deleted namespace
    # stays Terminating and anything left in it would keep being reconciled.
    custom = kubernetes.client.CustomObjectsApi(cluster.client())
    for plural in ("slotunings", "sloservings"):
        with contextlib.suppress(Exception):
            custom.delete_collection_namespaced_custom_object("slotune.dev", "v1alpha1", name, plural)
    with contextlib.suppress(Exception):
        core.delete_namespace(name)


@contextlib.contextmanager
def running_operator(cluster, verbose: bool = False):
    """The operator, in-process, as the RBAC-limited user; yields the KopfRunner."""
    from kopf.testing import KopfRunner

    from slotune.operator import api

    old = os.environ.get("SLOTUNE_KUBECONFIG")
    os.environ["SLOTUNE_KUBECONFIG"] = cluster.operator_kubeconfig
    api.reset_client()
    try:
        args = ["run", "--standalone", "--all-namespaces", "-m", "slotune.operator.handlers"]
        with KopfRunner([*args, "--verbose"] if verbose else args, timeout=60) as runner:
            yield runner
    finally:
        if old is None:
            os.environ.pop("SLOTUNE_KUBECONFIG", None)
        else:
            os.environ["SLOTUNE_KUBECONFIG"] = old
        api.reset_client()


@pytest.fixture(scope="module")
def operator(cluster):
    with running_operator(cluster) as runner:
        yield runner
