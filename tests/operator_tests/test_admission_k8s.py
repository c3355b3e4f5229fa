"""Against a real kube-apiserver, with the operator configured through its environment: specs
asking for an image, service account, Secret, schedule or store the operator does not allow
get the `Valid` condition and no children; a tuning Job may patch only its own result
ConfigMap; a Job retry that succeeds after a failed attempt is honoured."""

from __future__ import annotations

import kubernetes
import pytest

from slotune.operator import api

from .conftest import running_operator
from .kubelet import free_port, get, get_cr, run_job, wait_for
from .resources import create, patch, serving, tuning

pytestmark = pytest.mark.k8s

ALLOWED_IMAGES = "ghcr.io/slotune/slotune,registry.internal/ml/"


@pytest.fixture(scope="module")
def operator(cluster):
    """The operator with an allow-list from its environment, as manifests/operator.yaml sets it."""
    env = pytest.MonkeyPatch()
    env.setenv("SLOTUNE_ALLOWED_IMAGES", ALLOWED_IMAGES)
    try:
        with running_operator(cluster) as runner:
            yield runner
    finally:
        env.undo()


def condition(client, plural, ns, name, type_="Valid"):
    status = get_cr(client, plural, ns, name).get("status") or {}
    return next((c for c in status.get("conditions") or [] if c["type"] == type_), None)


def refused(client, plural, ns, name, reason):
    """Wait for the Valid=False condition with `reason`; returns it."""
    return wait_for(
        f"{name}: Valid=False {reason}",
        lambda: (lambda c: c if c and c["status"] == "False" and c["reason"] == reason else None)(
            condition(client, plural, ns, name)
        ),
    )


def assert_nothing_created(client, ns):
    core = kubernetes.client.CoreV1Api(client)
    assert kubernetes.client.BatchV1Api(client).list_namespaced_job(ns).items == []
    assert kubernetes.client.AppsV1Api(client).list_namespaced_deployment(ns).items == []
    assert kubernetes.client.RbacAuthorizationV1Api(client).list_namespaced_role(ns).items == []
    assert [
        c.metadata.name for c in core.list_namespaced_config_map(ns).items if c.metadata.name != "kube-root-ca.crt"
    ] == []
    assert core.list_namespaced_service(ns).items == []


def test_images_outside_the_allow_list_are_refused(cluster, operator, ns):
    client = cluster.client()
    create(client, ns, tuning("img-tune", "img", image="evil.example/miner:1"))
    create(client, ns, serving("img", free_port(), image="evil.example/miner:1"))
    for plural, name in ((api.TUNINGS, "img-tune"), (api.SERVINGS, "img")):
        cond = refused(client, plural, ns, name, "ImageNotAllowed")
        assert "spec.image 'evil.example/miner:1'" in cond["message"] and "registry.internal/ml/" in cond["message"]
    assert get_cr(client, api.TUNINGS, ns, "img-tune")["status"]["phase"] == "Failed"
    assert get_cr(client, api.SERVINGS, ns, "img")["status"]["phase"] == "Invalid"
    assert_nothing_created(client, ns)
    # an image the operator's configuration allows: the children come, with it
    patch(client, ns, api.TUNINGS, "img-tune", {"spec": {"image": "registry.internal/ml/slotune:2"}})
    patch(client, ns, api.SERVINGS, "img", {"spec": {"image": "registry.internal/ml/slotune:2"}})
    job = wait_for("the Job", lambda: get(client, "Job", ns, "img-tune-run-2"))
    dep = wait_for("the Deployment", lambda: get(client, "Deployment", ns, "img"))
    for pod in (job["spec"]["template"]["spec"], dep["spec"]["template"]["spec"]):
        assert pod["containers"][0]["image"] == "registry.internal/ml/slotune:2"
    assert job["spec"]["template"]["spec"]["serviceAccountName"] == "slotune-tuner"
    assert dep["spec"]["template"]["spec"]["serviceAccountName"] == "slotune-serving"
    assert dep["spec"]["template"]["spec"]["automountServiceAccountToken"] is False
    wait_for("Valid=True", lambda: (condition(client, api.SERVINGS, ns, "img") or {}).get("status") == "True")


def test_service_accounts_and_secrets_outside_the_allow_lists_are_refused(cluster, operator, ns):
    client = cluster.client()
    create(client, ns, tuning("sa-tune", "sa", serviceAccountName="cluster-admin-sa"))
    create(client, ns, serving("sa", free_port(), serviceAccountName="default"))
    create(client, ns, tuning("key-tune", "sa", storageSecret={"name": "creds", "key": "password"}))
    create(client, ns, serving("other-ns", free_port(), apiKeySecret={"name": "creds", "namespace": "kube-system"}))
    for plural, name in ((api.TUNINGS, "sa-tune"), (api.SERVINGS, "sa")):
        cond = refused(client, plural, ns, name, "ServiceAccountNotAllowed")
        assert "spec.serviceAccountName" in cond["message"] and "slotune-tuner, slotune-serving" in cond["message"]
    cond = refused(client, api.TUNINGS, ns, "key-tune", "SecretNotAllowed")
    assert "spec.storageSecret.key 'password'" in cond["message"] and "url, api-key" in cond["message"]
    cond = refused(client, api.SERVINGS, ns, "other-ns", "SecretNotAllowed")
    assert "spec.apiKeySecret.namespace 'kube-system'" in cond["message"]
    assert_nothing_created(client, ns)


def test_schedules_and_stores_that_lose_runs_are_refused(cluster, operator, ns):
    client = cluster.client()
    create(client, ns, tuning("feb30", "x", schedule="0 0 30 2 *", workVolumeClaim="w"))
    create(client, ns, tuning("nostore", "x", schedule="@every 1h"))
    create(client, ns, tuning("sqlite", "x", workers=2, tuning={"storage": "sqlite:////work/study.db"}))
    assert "never fires" in refused(client, api.TUNINGS, ns, "feb30", "InvalidSchedule")["message"]
    assert "spec.workVolumeClaim" in refused(client, api.TUNINGS, ns, "nostore", "StorageNotPersistent")["message"]
    assert "SQLite" in refused(client, api.TUNINGS, ns, "sqlite", "StorageNotShared")["message"]
    assert_nothing_created(client, ns)
    # without a schedule an emptyDir is allowed, and said to be lost with the pod
    create(client, ns, tuning("ephemeral", "x"))
    cond = wait_for(
        "the PersistentStorage condition", lambda: condition(client, api.TUNINGS, ns, "ephemeral", "PersistentStorage")
    )
    assert (cond["status"], cond["reason"]) == ("False", "EphemeralStorage") and "emptyDir" in cond["message"]
    assert get(client, "Job", ns, "ephemeral-run-1")


def test_tuning_job_may_patch_only_its_own_result(cluster, operator, ns):
    client = cluster.client()
    create(client, ns, tuning("own-tune", "own", workers=2, storageSecret={"name": "db"}))
    workers = wait_for("the workers Job", lambda: get(client, "Job", ns, "own-tune-run-1-workers"))
    assert workers["spec"]["template"]["spec"]["automountServiceAccountToken"] is False
    role = get_rbac(client, "Role", ns, "own-tune-run-1")
    assert role["rules"] == [
        {
            "apiGroups": [""],
            "resources": ["configmaps"],
            "resourceNames": ["own-tune-run-1-result"],
            "verbs": ["get", "patch"],
        }
    ]
    authz = kubernetes.client.AuthorizationV1Api(client)

    def may(verb, resource, name):
        review = authz.create_subject_access_review(
            {
                "spec": {
                    "user": f"system:serviceaccount:{ns}:slotune-tuner",
                    "groups": ["system:serviceaccounts", f"system:serviceaccounts:{ns}", "system:authenticated"],
                    "resourceAttributes": {"namespace": ns, "verb": verb, "resource": resource, "name": name},
                }
            }
        )
        return review.status.allowed

    assert may("patch", "configmaps", "own-tune-run-1-result") and may("get", "configmaps", "own-tune-run-1-result")
    assert not may("patch", "configmaps", "own-tune-spec")  # its own spec: read through the volume only
    assert not may("patch", "configmaps", "someone-elses-config")
    assert not may("list", "configmaps", "")
    assert not may("get", "secrets", "db")


def get_rbac(client, kind, ns, name):
    rbac = kubernetes.client.RbacAuthorizationV1Api(client)
    read = rbac.read_namespaced_role if kind == "Role" else rbac.read_namespaced_role_binding
    return client.sanitize_for_serialization(wait_for(f"{kind} {name}", lambda: _or_none(lambda: read(name, ns))))


def _or_none(fn):
    try:
        return fn()
    except kubernetes.client.ApiException as exc:
        if exc.status == 404:
            return None
        raise


def test_a_retry_that_succeeds_wins_over_a_failed_attempt(cluster, operator, ns, tmp_path):
    client = cluster.client()
    create(client, ns, serving("retry", free_port()))
    create(client, ns, tuning("retry-tune", "retry"))
    wait_for("the tuning Job", lambda: get(client, "Job", ns, "retry-tune-run-1"))
    proc = run_job(cluster, ns, "retry-tune-run-1", tmp_path / "a1", inner=["sh", "-c", "exit 3"], is_retried=True)
    assert proc.returncode == 3
    cond = wait_for(
        "the Retrying condition",
        lambda: (lambda c: c if c and c["reason"] == "Retrying" else None)(
            condition(client, api.TUNINGS, ns, "retry-tune", "Tuned")
        ),
    )
    assert "status 3" in cond["message"]
    assert get_cr(client, api.TUNINGS, ns, "retry-tune")["status"]["phase"] == "Tuning"
    proc = run_job(cluster, ns, "retry-tune-run-1", tmp_path / "a2", best_config={"max_num_seqs": 4})
    assert proc.returncode == 0, proc.stderr
    assert get(client, "Job", ns, "retry-tune-run-1")["status"]["failed"] == 1  # one failed pod, then success
    status = wait_for(
        "the result",
        lambda: (lambda st: st if st.get("phase") in ("Canary", "Failed") else None)(
            get_cr(client, api.TUNINGS, ns, "retry-tune").get("status") or {}
        ),
    )
    assert status["phase"] == "Canary" and status["best"]["config"] == {"max_num_seqs": 4}
    data = get(client, "ConfigMap", ns, "retry-tune-run-1-result")["data"]
    assert "error" not in data and "best.yaml" in data  # the retry's publish replaced the first attempt's
