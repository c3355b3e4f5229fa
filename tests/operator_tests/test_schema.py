"""The API server itself rejects invalid resources (the CRDs' OpenAPI v3 schemas), and the
example resources in examples/04-kubernetes are accepted (server-side dry run)."""

from __future__ import annotations

from pathlib import Path

import kubernetes
import pytest
import yaml

from slotune.operator import api

from .resources import serving, tuning

pytestmark = pytest.mark.k8s
EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "04-kubernetes"


def _create(client, obj, dry_run=None):
    plural = api.TUNINGS if obj["kind"] == "SLOTuning" else api.SERVINGS
    return kubernetes.client.CustomObjectsApi(client).create_namespaced_custom_object(
        api.GROUP, api.VERSION, "default", plural, obj, dry_run=dry_run
    )


def _with(obj, path, value):
    *keys, last = path.split(".")
    node = obj
    for k in keys:
        node = node.setdefault(k, {})
    if value is None:
        node.pop(last, None)
    else:
        node[last] = value
    return obj


INVALID = [
    ("SLOTuning", "spec.target", None, "spec.target"),
    ("SLOTuning", "spec.tuning.objective.kind", "fastest", "spec.tuning.objective.kind"),
    ("SLOTuning", "spec.rollout.mode", "yolo", "spec.rollout.mode"),
    ("SLOTuning", "spec.rollout.canaryFraction", 0.9, "spec.rollout.canaryFraction"),
    ("SLOTuning", "spec.workers", 0, "spec.workers"),
    ("SLOTuning", "spec.schedule", "every tuesday", "spec.schedule"),
    ("SLOTuning", "spec.tuning.storage", "postgresql://user:hunter2@db/optuna", "spec.tuning.storage"),
    ("SLOTuning", "spec.traffic.window", "1 day", "spec.traffic.window"),
    ("SLOTuning", "spec.traffic.driftThreshold", -0.5, "spec.traffic.driftThreshold"),
    ("SLOServing", "spec.replicas", -1, "spec.replicas"),
    ("SLOServing", "spec.recordTraffic.maxMiB", 0, "spec.recordTraffic.maxMiB"),
    ("SLOServing", "spec.port", 70000, "spec.port"),
    ("SLOServing", "spec.canary", {"replicas": 1}, "spec.canary.config"),
]


@pytest.mark.parametrize("kind,path,value,field", INVALID, ids=[f"{k}:{p}" for k, p, _, _ in INVALID])
def test_api_server_rejects_invalid(cluster, kind, path, value, field):
    obj = tuning("bad", "x") if kind == "SLOTuning" else serving("bad", 8000)
    with pytest.raises(kubernetes.client.ApiException) as err:
        _create(cluster.client(), _with(obj, path, value), dry_run="All")
    assert err.value.status == 422 and field in err.value.body


def test_example_resources_are_accepted(cluster):
    docs = [
        d
        for f in sorted(EXAMPLE.glob("*.yaml"))
        if f.name != "spec.yaml"
        for d in yaml.safe_load_all(f.read_text())
        if d
    ]
    assert {d["kind"] for d in docs} == {"SLOTuning", "SLOServing"}
    for d in docs:
        d["metadata"].pop("namespace", None)
        created = _create(cluster.client(), d, dry_run="All")
        assert created["spec"]  # defaults applied by the API server


def test_rendered_resource_is_accepted(cluster):
    from slotune.operator.render import render_tuning

    cr = render_tuning(EXAMPLE / "spec.yaml", namespace="default")
    assert _create(cluster.client(), cr, dry_run="All")["spec"]["tuning"]["name"] == "chat-k8s"
