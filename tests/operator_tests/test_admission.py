"""What the operator admits (no cluster needed): image / service account / Secret allow-lists,
shared and persistent study storage, schedules that never fire; a refused spec becomes the
`Valid` condition and creates nothing; the shipped manifests configure the same defaults."""

from __future__ import annotations

from pathlib import Path
from typing import get_args

import pytest
import yaml

from slotune.operator import admission, api, children, tuning
from slotune.operator.admission import Admission
from slotune.tuner.spec.sections import ObjectiveSpec

from .resources import TUNING_SPEC

MANIFESTS = Path(__file__).resolve().parents[2] / "slotune" / "operator" / "manifests"
DIGEST = "sha256:" + "ab" * 32


def tuning_spec(**spec) -> dict:
    return {"tuning": dict(TUNING_SPEC), "target": {"servingName": "chat"}, **spec}


@pytest.mark.parametrize(
    "ref,allowed,ok",
    [
        ("ghcr.io/slotune/slotune:0.1.0", ("ghcr.io/slotune/slotune",), True),
        (f"ghcr.io/slotune/slotune@{DIGEST}", ("ghcr.io/slotune/slotune",), True),
        ("ghcr.io/slotune/slotune", ("ghcr.io/slotune/slotune",), True),
        ("ghcr.io/slotune/slotune-miner:1", ("ghcr.io/slotune/slotune",), False),  # a longer name is another image
        ("ghcr.io/slotune/slotune/evil:1", ("ghcr.io/slotune/slotune",), False),
        ("docker.io/library/busybox:1", ("ghcr.io/slotune/slotune",), False),
        ("registry.internal/ml/slotune:2", ("registry.internal/ml/",), True),  # a registry prefix
        ("registry.internal/mlx/slotune:2", ("registry.internal/ml/",), False),
        ("registry.internal/ml/../x:1", ("registry.internal/ml/",), False),  # not a reference at all
        ("ghcr.io/slotune/slotune:0.2.0", ("ghcr.io/slotune/slotune:0.1.0",), False),  # an exact entry
        ("localhost:5000/slotune:1", ("localhost:5000/slotune",), True),
        ("", ("ghcr.io/slotune/slotune",), False),
    ],
)
def test_image_allow_list(ref, allowed, ok):
    assert admission.is_image_allowed(ref, allowed) is ok


def test_defaults_are_the_operator_image_and_dedicated_service_accounts():
    a = Admission.from_env({})
    assert a == Admission()
    assert a.allowed_images == ("ghcr.io/slotune/slotune",) and a.default_image == children.DEFAULT_IMAGE
    assert a.allowed_service_accounts == ("slotune-tuner", "slotune-serving")
    tuned = a.admit("SLOTuning", "ns", tuning_spec())
    served = a.admit("SLOServing", "ns", {"model": "m"})
    assert (tuned["image"], tuned["serviceAccountName"]) == (children.DEFAULT_IMAGE, "slotune-tuner")
    assert (served["image"], served["serviceAccountName"]) == (children.DEFAULT_IMAGE, "slotune-serving")


def test_configuration_from_the_environment():
    a = Admission.from_env(
        {
            "SLOTUNE_ALLOWED_IMAGES": " registry.internal/ml/ ,ghcr.io/slotune/slotune",
            "SLOTUNE_DEFAULT_IMAGE": "registry.internal/ml/slotune:2",
            "SLOTUNE_ALLOWED_SERVICE_ACCOUNTS": "tuner-a",
            "SLOTUNE_ALLOWED_SECRET_KEYS": "url,token",
        }
    )
    assert a.allowed_images == ("registry.internal/ml/", "ghcr.io/slotune/slotune")
    assert a.admit("SLOServing", "ns", {"serviceAccountName": "tuner-a"})["image"] == "registry.internal/ml/slotune:2"
    rejection = a.check("SLOTuning", "ns", tuning_spec(serviceAccountName="slotune-tuner"))
    assert rejection.reason == "ServiceAccountNotAllowed"
    assert a.check("SLOTuning", "ns", tuning_spec(storageSecret={"name": "db", "key": "token"})) is None


@pytest.mark.parametrize(
    "env,match",
    [
        ({"SLOTUNE_ALLOWED_IMAGES": "not an image"}, "SLOTUNE_ALLOWED_IMAGES: 'not an image'"),
        ({"SLOTUNE_ALLOWED_IMAGES": "registry.internal/ml/"}, "SLOTUNE_DEFAULT_IMAGE"),  # the default must be allowed
        ({"SLOTUNE_ALLOWED_SERVICE_ACCOUNTS": "Admin!"}, "SLOTUNE_ALLOWED_SERVICE_ACCOUNTS"),
        ({"SLOTUNE_ALLOWED_SECRET_KEYS": "a/b"}, "SLOTUNE_ALLOWED_SECRET_KEYS"),
    ],
)
def test_bad_configuration_names_the_setting(env, match):
    with pytest.raises(ValueError, match=match):
        Admission.from_env(env)


@pytest.mark.parametrize(
    "kind,spec,field,reason,allowed",
    [
        ("SLOTuning", {"image": "evil.example/miner:1"}, "spec.image", "ImageNotAllowed", "ghcr.io/slotune/slotune"),
        ("SLOServing", {"image": "evil.example/miner:1"}, "spec.image", "ImageNotAllowed", "ghcr.io/slotune/slotune"),
        (
            "SLOTuning",
            {"serviceAccountName": "cluster-admin"},
            "spec.serviceAccountName",
            "ServiceAccountNotAllowed",
            "slotune-tuner, slotune-serving",
        ),
        (
            "SLOServing",
            {"serviceAccountName": "default"},
            "spec.serviceAccountName",
            "ServiceAccountNotAllowed",
            "slotune-tuner, slotune-serving",
        ),
        (
            "SLOTuning",
            {"storageSecret": {"name": "db", "key": "password"}},
            "spec.storageSecret.key",
            "SecretNotAllowed",
            "url, api-key",
        ),
        (
            "SLOServing",
            {"apiKeySecret": {"name": "db", "key": "tls.key"}},
            "spec.apiKeySecret.key",
            "SecretNotAllowed",
            "url, api-key",
        ),
        (
            "SLOServing",
            {"apiKeySecret": {"name": "creds", "namespace": "kube-system"}},
            "spec.apiKeySecret.namespace",
            "SecretNotAllowed",
            "'ns'",
        ),
        (
            "SLOTuning",
            {"storageSecret": {"name": "kube-system/creds"}},
            "spec.storageSecret.name",
            "SecretNotAllowed",
            "kube-system/creds",
        ),
    ],
)
def test_refusals_name_the_field_and_the_allow_list(kind, spec, field, reason, allowed):
    base = tuning_spec() if kind == "SLOTuning" else {"model": "m"}
    rejection = Admission().check(kind, "ns", {**base, **spec})
    assert (rejection.field, rejection.reason) == (field, reason)
    assert field in rejection.message and allowed in rejection.message
    with pytest.raises(admission.Rejected) as err:
        Admission().admit(kind, "ns", {**base, **spec})
    assert err.value.rejection == rejection


def test_secret_in_the_own_namespace_with_an_allowed_key_is_admitted():
    a = Admission()
    assert a.check("SLOServing", "ns", {"apiKeySecret": {"name": "creds", "namespace": "ns"}}) is None
    assert a.check("SLOTuning", "ns", tuning_spec(storageSecret={"name": "creds"})) is None  # key defaults to url


@pytest.mark.parametrize(
    "spec,reason",
    [
        ({"workers": 2}, "StorageNotShared"),
        ({"workers": 2, "tuning": dict(TUNING_SPEC, storage="sqlite:////work/study.db")}, "StorageNotShared"),
        ({"schedule": "0 0 30 2 *"}, "InvalidSchedule"),  # February 30: never fires
        ({"schedule": "0 0 31 4,6,9,11 *"}, "InvalidSchedule"),
        ({"schedule": "@every 6h"}, "StorageNotPersistent"),  # the study would go with each run's pod
        ({"schedule": "@every 6h", "storageSecret": {"name": "db"}}, "StorageNotPersistent"),  # MLflow still would
        (
            {
                "schedule": "@every 6h",
                "workVolumeClaim": "w",
                "tuning": dict(TUNING_SPEC, storage="sqlite:////tmp/study.db"),
            },
            "StorageNotPersistent",
        ),  # not on the claim
        ({"image": "evil.example/miner:1"}, "ImageNotAllowed"),
    ],
)
def test_tuning_refusals(spec, reason):
    rejection = admission.check_tuning(tuning_spec(**spec), "ns", Admission())
    assert rejection is not None and rejection.reason == reason, rejection


@pytest.mark.parametrize(
    "spec",
    [
        {"workers": 3, "storageSecret": {"name": "db"}},
        {"workers": 3, "tuning": dict(TUNING_SPEC, storage="postgresql://optuna@db/optuna")},
        {"schedule": "@every 6h", "workVolumeClaim": "w"},  # default SQLite study + MLflow under /work
        {"schedule": "@every 6h", "workVolumeClaim": "w", "tuning": dict(TUNING_SPEC, storage="sqlite:///runs/s.db")},
        {
            "schedule": "0 3 * * 1",
            "storageSecret": {"name": "db"},
            "tuning": dict(TUNING_SPEC, mlflow_tracking_uri="http://mlflow.ml:5000"),
        },
        {"schedule": "0 0 29 2 *", "workVolumeClaim": "w"},  # leap days do fire
        {"schedule": "0 0 30 2 1", "workVolumeClaim": "w"},  # either day field: every Monday
    ],
)
def test_tuning_admitted(spec):
    assert admission.check_tuning(tuning_spec(**spec), "ns", Admission()) is None


def test_a_cost_objective_is_admitted_with_a_price_and_refused_without_naming_the_field():
    """The operator validates the tuning spec as `tune run` does; the CRD lists the cost kind."""
    cost = {"kind": "cost", "metric": "usd_per_1m_output_tokens", "ttft_limit_s": 2.0}
    rejection = admission.check_tuning(tuning_spec(tuning=dict(TUNING_SPEC, objective=cost)), "ns", Admission())
    assert rejection is not None and rejection.reason == "InvalidSpec"
    assert "objective.kind 'cost'" in rejection.message and "cost.usd_per_hour" in rejection.message
    priced = dict(TUNING_SPEC, objective=cost, cost={"usd_per_hour": 2.5})
    assert admission.check_tuning(tuning_spec(tuning=priced), "ns", Admission()) is None
    crd = _docs(MANIFESTS / "crds" / "slotunings.yaml")[0]
    tuning_schema = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]["properties"][
        "tuning"
    ]
    kinds = set(get_args(ObjectiveSpec.model_fields["kind"].annotation))
    assert (
        set(tuning_schema["properties"]["objective"]["properties"]["kind"]["enum"])
        == kinds
        == {"latency", "throughput", "cost"}
    )


def test_ephemeral_storage_is_a_warning_without_a_schedule():
    assert "emptyDir" in admission.storage_warning(tuning_spec())
    assert admission.storage_warning(tuning_spec(workVolumeClaim="w")) is None
    job = children.tuning_jobs("t", tuning_spec(workVolumeClaim="w"), {"name": "t"}, 1, "ns")[0]
    work = job["spec"]["template"]["spec"]["volumes"][1]
    assert work == {"name": "work", "persistentVolumeClaim": {"claimName": "w"}}


# --- a refused spec in the state machine: the condition, and no API call ------------------


@pytest.fixture
def no_api(monkeypatch):
    """Any write to the API fails the test."""

    def refuse(*args, **kwargs):
        raise AssertionError(f"unexpected API call {args}")

    for name in ("create", "patch", "delete", "read", "patch_serving"):
        monkeypatch.setattr(api, name, refuse)


def step(status=None, **spec) -> tuning.Step:
    return tuning.Step(
        name="t",
        namespace="ns",
        spec=tuning_spec(**spec),
        status=dict(status or {}),
        body={"metadata": {"name": "t", "uid": "u"}, "kind": "SLOTuning"},
    )


@pytest.mark.parametrize(
    "spec,reason",
    [
        ({"image": "evil.example/miner:1"}, "ImageNotAllowed"),
        ({"serviceAccountName": "cluster-admin"}, "ServiceAccountNotAllowed"),
        ({"schedule": "0 0 30 2 *"}, "InvalidSchedule"),
        ({"workers": 2, "tuning": dict(TUNING_SPEC, storage="sqlite:///study.db")}, "StorageNotShared"),
    ],
)
def test_refused_tuning_fails_with_a_condition_and_creates_nothing(no_api, spec, reason):
    s = step(**spec)
    tuning.advance(s)
    assert s.patch["phase"] == "Failed" and s.patch["history"][-1]["reason"] == reason
    valid = next(c for c in s.patch["conditions"] if c["type"] == "Valid")
    assert (valid["status"], valid["reason"]) == ("False", reason)


def test_a_schedule_changed_to_one_that_never_fires_is_a_condition(no_api):
    s = step({"phase": "Promoted", "run": 1, "lastTuningTime": "2026-11-22T00:00:00Z"}, schedule="0 0 30 2 *")
    tuning.advance(s)  # no exception inside the handler
    cond = next(c for c in s.patch["conditions"] if c["type"] == "Scheduled")
    assert (cond["status"], cond["reason"]) == ("False", "InvalidSchedule") and "0 0 30 2 *" in cond["message"]
    assert "phase" not in s.patch  # no run started


def test_lost_job_of_a_spec_now_refused_is_not_recreated(monkeypatch):
    """The Job of a running run is gone and the spec now names another image: no new Job."""
    monkeypatch.setattr(api, "read", lambda kind, ns, name: None)
    monkeypatch.setattr(api, "create", lambda *a: pytest.fail(f"created {a}"))
    s = step({"phase": "Tuning", "run": 1}, image="evil.example/miner:1")
    tuning.advance(s)
    assert s.patch["phase"] == "Failed" and s.patch["history"][-1]["reason"] == "ImageNotAllowed"


# --- the shipped manifests ------------------------------------------------------------------


def _docs(path: Path) -> list[dict]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d]


def test_shipped_operator_configuration_is_the_default():
    docs = _docs(MANIFESTS / "operator.yaml")
    config = next(d for d in docs if d["kind"] == "ConfigMap")
    assert Admission.from_env(config["data"]) == Admission()
    container = next(d for d in docs if d["kind"] == "Deployment")["spec"]["template"]["spec"]["containers"][0]
    assert {"configMapRef": {"name": config["metadata"]["name"]}} in container["envFrom"]
    # The operator runs the light image of the same release (slotune/operator/Dockerfile --target operator);
    # the Jobs and pods it creates default to the full one.
    name, tag = Admission().default_image.rsplit(":", 1)
    assert container["image"] == f"{name}-operator:{tag}"


def test_pod_identities_are_dedicated_and_least_privilege():
    docs = _docs(MANIFESTS / "tuner" / "tuner.yaml")
    accounts = {d["metadata"]["name"]: d for d in docs if d["kind"] == "ServiceAccount"}
    assert set(accounts) == set(Admission().allowed_service_accounts)
    assert accounts["slotune-serving"]["automountServiceAccountToken"] is False
    for d in docs:  # no standing Role: configmaps only by name, per run (children.publish_rbac)
        for rule in d.get("rules", []):
            assert rule.get("resourceNames"), rule
    role, binding = children.publish_rbac("t", {}, {"name": "t"}, 3, "ns")
    assert role["rules"] == [
        {"apiGroups": [""], "resources": ["configmaps"], "resourceNames": ["t-run-3-result"], "verbs": ["get", "patch"]}
    ]
    assert binding["subjects"] == [{"kind": "ServiceAccount", "namespace": "ns", "name": "slotune-tuner"}]
    dep = children.deployment("chat", "stable", {}, {"name": "chat"}, {}, 1)["spec"]["template"]["spec"]
    assert (dep["serviceAccountName"], dep["automountServiceAccountToken"]) == ("slotune-serving", False)
    main, workers = children.tuning_jobs("t", {"workers": 2}, {"name": "t"}, 1, "ns")
    assert main["spec"]["template"]["spec"]["automountServiceAccountToken"] is True  # publishes the result
    assert workers["spec"]["template"]["spec"]["automountServiceAccountToken"] is False


def test_publish_clears_what_an_earlier_attempt_left(tmp_path, monkeypatch):
    from slotune.operator import publish

    class Core:
        def patch_namespaced_config_map(self, name, namespace, body, **kwargs):
            assert kwargs["_content_type"] == "application/merge-patch+json"  # null deletes a key
            self.body = body

    core = Core()
    monkeypatch.setattr(publish, "_core", lambda api_client=None: core)  # the one API call, captured
    (tmp_path / "best.yaml").write_text("max_num_seqs: 4\n")
    publish.report_result("r", "ns", tmp_path)
    assert core.body["data"]["error"] is None and core.body["data"]["best.yaml"] == "max_num_seqs: 4\n"
    publish.clear_stale_results(tmp_path)
    publish.report_result("r", "ns", tmp_path)  # a later run found nothing: no stale best.yaml
    assert core.body["data"]["best.yaml"] is None and core.body["data"]["error"].startswith("NoFeasibleConfig")
