"""Names, labels and the Kubernetes client the handlers share.

One credential source for kopf's watch streams and the `kubernetes` client the handlers use:
in-cluster service account, else the kubeconfig named by $SLOTUNE_KUBECONFIG, else the usual
$KUBECONFIG / ~/.kube/config. Children are created idempotently (AlreadyExists is success), so
a handler that crashes half-way converges when it runs again.
"""

from __future__ import annotations

import os
import threading
from typing import Any

import kubernetes
from kubernetes.client.rest import ApiException

GROUP = "slotune.dev"
VERSION = "v1alpha1"
API_VERSION = f"{GROUP}/{VERSION}"
TUNINGS = "slotunings"
SERVINGS = "sloservings"

LABEL_MANAGED = "app.kubernetes.io/managed-by"
LABEL_SERVING = f"{GROUP}/serving"
LABEL_TRACK = f"{GROUP}/track"  # stable | canary
LABEL_TUNING = f"{GROUP}/tuning"
LABEL_RUN = f"{GROUP}/run"
ANNOTATION_CONFIG_HASH = f"{GROUP}/config-hash"
MANAGER = "slotune-operator"

_lock = threading.Lock()
_client: kubernetes.client.ApiClient | None = None


def load_configuration() -> kubernetes.client.Configuration:
    """The client configuration: in-cluster, else $SLOTUNE_KUBECONFIG, else the default kubeconfig."""
    cfg = kubernetes.client.Configuration()
    explicit = os.environ.get("SLOTUNE_KUBECONFIG")
    if explicit:
        kubernetes.config.load_kube_config(config_file=explicit, client_configuration=cfg)
        return cfg
    try:
        kubernetes.config.load_incluster_config(client_configuration=cfg)
    except kubernetes.config.ConfigException:
        kubernetes.config.load_kube_config(client_configuration=cfg)
    return cfg


def client() -> kubernetes.client.ApiClient:
    global _client
    with _lock:
        if _client is None:
            _client = kubernetes.client.ApiClient(load_configuration())
        return _client


def reset_client() -> None:
    """Forget the cached client (a restarted operator logs in afresh)."""
    global _client
    with _lock:
        _client = None


def core() -> kubernetes.client.CoreV1Api:
    return kubernetes.client.CoreV1Api(client())


def apps() -> kubernetes.client.AppsV1Api:
    return kubernetes.client.AppsV1Api(client())


def batch() -> kubernetes.client.BatchV1Api:
    return kubernetes.client.BatchV1Api(client())


def rbac() -> kubernetes.client.RbacAuthorizationV1Api:
    return kubernetes.client.RbacAuthorizationV1Api(client())


def custom() -> kubernetes.client.CustomObjectsApi:
    return kubernetes.client.CustomObjectsApi(client())


def is_status(exc: BaseException, *codes: int) -> bool:
    return isinstance(exc, ApiException) and exc.status in codes


def owner_reference(body: Any) -> dict[str, Any]:
    """A controller owner reference to a slotune custom resource (kopf body or dict)."""
    meta = body["metadata"]
    return {
        "apiVersion": body.get("apiVersion", API_VERSION),
        "kind": body["kind"],
        "name": meta["name"],
        "uid": meta["uid"],
        "controller": True,
        "blockOwnerDeletion": True,
    }


# The namespaced kinds the operator manages: kind -> (API group client, resource in the method names).
_KINDS = {
    "ConfigMap": (core, "config_map"),
    "Service": (core, "service"),
    "Deployment": (apps, "deployment"),
    "Job": (batch, "job"),
    "Role": (rbac, "role"),
    "RoleBinding": (rbac, "role_binding"),
}


def _call(verb: str, kind: str):
    """The kubernetes client's `<verb>_namespaced_<resource>` method for `kind` (create, read, patch, delete)."""
    api, resource = _KINDS[kind]
    return getattr(api(), f"{verb}_namespaced_{resource}")


def create(kind: str, namespace: str, obj: dict[str, Any]) -> bool:
    """Create a namespaced child; False when it already exists (idempotent)."""
    try:
        _call("create", kind)(namespace, obj)
        return True
    except ApiException as exc:
        if exc.status == 409:
            return False
        raise


def read(kind: str, namespace: str, name: str) -> Any | None:
    """Read a child as a plain dict, None when absent."""
    try:
        obj = _call("read", kind)(name, namespace)
    except ApiException as exc:
        if exc.status == 404:
            return None
        raise
    return client().sanitize_for_serialization(obj)


def patch(kind: str, namespace: str, name: str, body: dict[str, Any]) -> None:
    _call("patch", kind)(name, namespace, body, _content_type=MERGE_PATCH)


def delete(kind: str, namespace: str, name: str) -> bool:
    """Delete a child (background propagation); False when it was already gone."""
    try:
        _call("delete", kind)(name, namespace, propagation_policy="Background")
        return True
    except ApiException as exc:
        if exc.status == 404:
            return False
        raise


MERGE_PATCH = "application/merge-patch+json"  # lists are replaced whole, `null` deletes a key


def patch_serving(namespace: str, name: str, body: dict[str, Any]) -> None:
    """Merge-patch a SLOServing (the tuning controller sets and clears its canary this way)."""
    custom().patch_namespaced_custom_object(GROUP, VERSION, namespace, SERVINGS, name, body, _content_type=MERGE_PATCH)


def read_serving(namespace: str, name: str) -> dict[str, Any] | None:
    return read_custom(SERVINGS, namespace, name)


def read_custom(plural: str, namespace: str, name: str) -> dict[str, Any] | None:
    """One of our custom resources as stored now, None when absent."""
    try:
        return custom().get_namespaced_custom_object(GROUP, VERSION, namespace, plural, name)
    except ApiException as exc:
        if exc.status == 404:
            return None
        raise
