"""SLOServing reconcile: make the children match the spec, report what runs.

Children are compared through a digest of what the operator rendered (annotation
`slotune.dev/spec-hash`), so a reconcile that finds nothing to change writes nothing: a
restarted operator leaves generations and resourceVersions as they were.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

from pydantic import ValidationError

from slotune.engine.config import EngineConfig
from slotune.operator import admission, api, children
from slotune.tuner.spec.server import ServerConfig, is_launch

SPEC_HASH = f"{api.GROUP}/spec-hash"


def validate_config(config: dict[str, Any]) -> None:
    """ValueError (one `field: message` per problem) when `config` is neither a valid EngineConfig
    nor a valid external server's launch (a llama-server study's best.yaml)."""
    try:
        (ServerConfig if is_launch(config) else EngineConfig).model_validate(config)
    except ValidationError as exc:
        lines = [f"{'.'.join(str(x) for x in e['loc']) or 'config'}: {e['msg']}" for e in exc.errors()]
        raise ValueError("; ".join(lines)) from None


def ensure(kind: str, namespace: str, desired: dict[str, Any]) -> str:
    """Create or update one child; returns 'created', 'updated' or 'unchanged'."""
    digest = hashlib.sha256(json.dumps(desired, sort_keys=True).encode()).hexdigest()[:12]
    desired["metadata"].setdefault("annotations", {})[SPEC_HASH] = digest
    name = desired["metadata"]["name"]
    current = api.read(kind, namespace, name)
    if current is None:
        return "created" if api.create(kind, namespace, desired) else "unchanged"
    if (current["metadata"].get("annotations") or {}).get(SPEC_HASH) == digest:
        return "unchanged"
    body = {
        "metadata": {
            "labels": desired["metadata"]["labels"],
            "annotations": desired["metadata"]["annotations"],
            "ownerReferences": desired["metadata"]["ownerReferences"],
        }
    }
    for key in ("spec", "data"):
        if key in desired:
            body[key] = desired[key]
    api.patch(kind, namespace, name, body)
    return "updated"


def reconcile(
    name: str, namespace: str, spec: dict[str, Any], body: Any, allowed: admission.Admission
) -> dict[str, Any]:
    """Render and apply every child of one SLOServing; returns the status to report.

    Raises admission.Rejected (image, service account, Secret not allowed; a recordTraffic
    without a valid claim) or ValueError (an invalid config) before anything is applied.
    """
    spec = allowed.admit("SLOServing", namespace, spec)
    rejection = admission.check_serving(spec)
    if rejection is not None:
        raise admission.Rejected(rejection)
    owner = api.owner_reference(body)
    stable = children.serving_config(spec)
    validate_config(stable)
    if spec.get("canary"):
        validate_config(children.serving_config(spec, spec["canary"].get("config") or {}))
    replicas = int(spec.get("replicas", 1))
    ensure("ConfigMap", namespace, children.serving_config_map(name, "stable", owner, stable))
    ensure("Deployment", namespace, children.deployment(name, "stable", spec, owner, stable, replicas))
    ensure("Service", namespace, children.service(name, spec, owner))
    canary = spec.get("canary")
    if canary:
        cfg = children.serving_config(spec, canary.get("config") or {})
        ensure("ConfigMap", namespace, children.serving_config_map(name, "canary", owner, cfg))
        ensure(
            "Deployment",
            namespace,
            children.deployment(name, "canary", spec, owner, cfg, int(canary.get("replicas", 1))),
        )
    else:
        api.delete("Deployment", namespace, f"{name}-canary")
        api.delete("ConfigMap", namespace, f"{name}-canary-config")
    return observe(name, namespace, stable, canary)


def observe(name: str, namespace: str, stable: dict[str, Any], canary: dict[str, Any] | None) -> dict[str, Any]:
    dep = api.read("Deployment", namespace, name) or {}
    ready = int((dep.get("status") or {}).get("readyReplicas") or 0)
    wanted = int((dep.get("spec") or {}).get("replicas") or 0)
    status: dict[str, Any] = {
        "readyReplicas": ready,
        "configHash": children.config_hash(stable),
        "phase": "Ready" if ready >= wanted else "Progressing",
        "canary": None,
    }
    if canary:
        cdep = api.read("Deployment", namespace, f"{name}-canary") or {}
        status["canary"] = {
            "run": canary.get("run"),
            "readyReplicas": int((cdep.get("status") or {}).get("readyReplicas") or 0),
        }
        status["phase"] = "Canary"
    return status
