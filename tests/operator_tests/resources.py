"""Custom resources the operator tests create (small, fast timing knobs)."""

from __future__ import annotations

import copy

import kubernetes

from slotune.operator import api

TUNING_SPEC = {
    "name": "ci",
    "workload": "chat-small",
    "search_space": "latency",
    "objective": {"kind": "latency", "metric": "tpot", "percentile": 95, "ttft_limit_s": 2.0},
    "budget": {"n_trials": 1},
}


def serving(name: str, port: int, **spec) -> dict:
    return {
        "apiVersion": api.API_VERSION,
        "kind": "SLOServing",
        "metadata": {"name": name},
        "spec": {"model": "smollm2-135m", "replicas": 2, "port": port, "config": {"max_num_seqs": 8}, **spec},
    }


def tuning(name: str, serving_name: str, rollout: dict | None = None, **spec) -> dict:
    r = {
        "canaryDurationSeconds": 1,
        "readyDeadlineSeconds": 30,
        "slo": {"ttftSeconds": 0.5, "tpotSeconds": 0.05, "minRequests": 10},
        **(rollout or {}),
    }
    return {
        "apiVersion": api.API_VERSION,
        "kind": "SLOTuning",
        "metadata": {"name": name},
        "spec": {
            "tuning": copy.deepcopy(dict(TUNING_SPEC, **spec.pop("tuning", {}))),
            "target": {"servingName": serving_name},
            "rollout": r,
            **spec,
        },
    }


def create(client, ns: str, obj: dict) -> dict:
    plural = api.TUNINGS if obj["kind"] == "SLOTuning" else api.SERVINGS
    return kubernetes.client.CustomObjectsApi(client).create_namespaced_custom_object(
        api.GROUP, api.VERSION, ns, plural, obj
    )


def patch(client, ns: str, plural: str, name: str, body: dict) -> dict:
    return kubernetes.client.CustomObjectsApi(client).patch_namespaced_custom_object(
        api.GROUP, api.VERSION, ns, plural, name, body, _content_type=api.MERGE_PATCH
    )


def events(client, ns: str, name: str) -> list[tuple[str, str, str]]:
    items = kubernetes.client.CoreV1Api(client).list_namespaced_event(ns).items
    return [(e.type, e.reason, e.message) for e in items if e.involved_object.name == name]
