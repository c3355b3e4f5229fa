"""The objects the operator owns, rendered as plain dicts (pure functions, no API calls).

SLOServing -> ConfigMap `<name>-config` (config.yaml), Deployment `<name>` running
`tune serve`, Service `<name>`; with `spec.canary`, also `<name>-canary-config` and the
Deployment `<name>-canary`; with `spec.recordTraffic`, every pod records into its own folder
of the claim (traffic.py). SLOTuning -> ConfigMap `<name>-spec` (the tuning spec), per run a
result ConfigMap, the Job `<name>-run-<n>` (plus `<name>-run-<n>-workers` for parallel
workers) and the Role + RoleBinding `<name>-run-<n>` that let the Job's service account
get/patch that one result ConfigMap and nothing else. Every child carries a controller owner
reference, so deleting the resource garbage-collects its children.

`image` and `serviceAccountName` are rendered as given: the handlers pass specs through
`admission.Admission.admit`, which checks them against the operator's allow-lists and fills
in the defaults.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

import yaml

from slotune.operator import api, traffic
from slotune.tuner.spec.server import is_launch

DEFAULT_IMAGE = "ghcr.io/slotune/slotune:0.1.0"
CONFIG_DIR = "/etc/slotune"
SPEC_PATH = f"{CONFIG_DIR}/spec.yaml"
WORK_DIR = "/work"  # an emptyDir, or spec.workVolumeClaim
RESULT_DIR = f"{WORK_DIR}/out"
TRAFFIC_DIR = "/traffic"  # spec.recordTraffic.claimName: read-write in serving pods, read-only in tuning Jobs
TRAFFIC_SNAPSHOT = f"{RESULT_DIR}/traffic.jsonl"  # the window a run replays (publish.py writes it)
POD_NAME_ENV = "SLOTUNE_POD_NAME"
DEFAULT_RECORD_MAX_MIB = 256
TUNER_SERVICE_ACCOUNT = "slotune-tuner"
SERVING_SERVICE_ACCOUNT = "slotune-serving"


def config_hash(config: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(config, sort_keys=True).encode()).hexdigest()[:10]


def serving_config(spec: dict[str, Any], config: dict[str, Any] | None = None) -> dict[str, Any]:
    """The EngineConfig mapping a serving track runs: its config, with the model from the spec."""
    out = dict(config if config is not None else spec.get("config") or {})
    if spec.get("model"):
        out["model"] = spec["model"]
    return out


def _meta(name: str, owner: dict[str, Any], labels: dict[str, str], annotations: dict[str, str] | None = None):
    meta = {"name": name, "labels": {api.LABEL_MANAGED: api.MANAGER, **labels}, "ownerReferences": [owner]}
    if annotations:
        meta["annotations"] = annotations
    return meta


def config_map(name: str, owner: dict[str, Any], labels: dict[str, str], data: dict[str, str]) -> dict[str, Any]:
    return {"apiVersion": "v1", "kind": "ConfigMap", "metadata": _meta(name, owner, labels), "data": data}


def serving_config_map(serving: str, track: str, owner, config: dict[str, Any]) -> dict[str, Any]:
    name = serving if track == "stable" else f"{serving}-canary"
    return config_map(
        f"{name}-config",
        owner,
        {api.LABEL_SERVING: serving, api.LABEL_TRACK: track},
        {"config.yaml": yaml.safe_dump(config, sort_keys=True)},
    )


def deployment(
    serving: str, track: str, spec: dict[str, Any], owner, config: dict[str, Any], replicas: int
) -> dict[str, Any]:
    """The Deployment of one track (stable or canary) of a SLOServing."""
    name = serving if track == "stable" else f"{serving}-canary"
    port = int(spec.get("port", 8000))
    labels = {api.LABEL_SERVING: serving, api.LABEL_TRACK: track}
    digest = config_hash(config)
    env = []
    if spec.get("apiKeySecret"):  # the key goes pod-side only; the operator never reads it
        env.append(
            {
                "name": "SLOTUNE_API_KEY",
                "valueFrom": {
                    "secretKeyRef": {
                        "name": spec["apiKeySecret"]["name"],
                        "key": spec["apiKeySecret"].get("key", "api-key"),
                    }
                },
            }
        )
    command = ["tune", "serve", f"{CONFIG_DIR}/config.yaml", "--host", "0.0.0.0", "--port", str(port)]
    if not is_launch(config):  # an external server (behind tune serve's metering proxy) names its own model
        command += ["--served-model-name", spec.get("model") or config.get("model") or serving]
    mounts = [{"name": "config", "mountPath": CONFIG_DIR, "readOnly": True}]
    volumes = [{"name": "config", "configMap": {"name": f"{name}-config"}}]
    record = spec.get("recordTraffic")
    if record:  # each pod its own folder (the kubelet expands $(VAR) from the container's env)
        env.append({"name": POD_NAME_ENV, "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}})
        command += [
            "--record-traffic",
            f"{recording_dir(serving)}/$({POD_NAME_ENV})",
            "--record-traffic-max-mib",
            str(int(record.get("maxMiB", DEFAULT_RECORD_MAX_MIB))),
        ]
        mounts.append({"name": "traffic", "mountPath": TRAFFIC_DIR})
        volumes.append({"name": "traffic", "persistentVolumeClaim": {"claimName": record["claimName"]}})
    container = {
        "name": "serve",
        "image": spec.get("image", DEFAULT_IMAGE),
        "command": command,
        "ports": [{"name": "http", "containerPort": port}],
        "env": env,
        "readinessProbe": {"httpGet": {"path": "/ready", "port": "http"}, "periodSeconds": 5},
        "livenessProbe": {"httpGet": {"path": "/health", "port": "http"}, "periodSeconds": 10, "failureThreshold": 3},
        # model load can take minutes: liveness starts only after /health first answers
        "startupProbe": {"httpGet": {"path": "/health", "port": "http"}, "periodSeconds": 5, "failureThreshold": 120},
        "volumeMounts": mounts,
        "resources": spec.get("resources") or {},
    }
    pod_spec = {
        "serviceAccountName": spec.get("serviceAccountName", SERVING_SERVICE_ACCOUNT),
        "automountServiceAccountToken": False,  # `tune serve` never calls the API
        "containers": [container],
        "volumes": volumes,
    }
    if record:  # the image's user (uid 10001) writes to the claim
        pod_spec["securityContext"] = {"fsGroup": 10001}
    pod_annotations = {
        "prometheus.io/scrape": "true",
        "prometheus.io/port": str(port),
        "prometheus.io/path": "/metrics",
        api.ANNOTATION_CONFIG_HASH: digest,
    }
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": _meta(name, owner, labels, {api.ANNOTATION_CONFIG_HASH: digest}),
        "spec": {
            "replicas": replicas,
            "selector": {"matchLabels": labels},
            "template": {
                "metadata": {"labels": labels, "annotations": pod_annotations},
                "spec": pod_spec,
            },
        },
    }


def service(serving: str, spec: dict[str, Any], owner) -> dict[str, Any]:
    """One Service over both tracks: the canary gets its share of traffic by pod count."""
    port = int(spec.get("port", 8000))
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": _meta(
            serving,
            owner,
            {api.LABEL_SERVING: serving},
            {"prometheus.io/scrape": "true", "prometheus.io/port": str(port)},
        ),
        "spec": {
            "selector": {api.LABEL_SERVING: serving},
            "ports": [{"name": "http", "port": port, "targetPort": "http"}],
        },
    }


def recording_dir(serving: str) -> str:
    """Where the pods of SLOServing `serving` record, one sub-folder per pod."""
    return f"{TRAFFIC_DIR}/{serving}"


def tuning_spec(spec: dict[str, Any], plan: traffic.Plan | None, run: int) -> dict[str, Any]:
    """The tuning spec a run's `tune run` reads: spec.tuning, its workload replaced by the
    snapshot of recorded traffic when the run tunes on it. Each run is its own study,
    `<name>-run-<n>`: on a persistent store a re-tune gets its whole trial budget (resuming run
    1's study would count its trials and add none) and earlier runs' studies stay as they were."""
    out = dict(spec.get("tuning") or {})
    if out.get("name"):
        out["name"] = f"{out['name']}-run-{run}"
    if plan is not None:
        out["workload"] = {
            "name": f"{plan.serving}-traffic",
            "description": f"the last {plan.window_s} s of traffic recorded by SLOServing {plan.serving}",
            "trace": {"path": TRAFFIC_SNAPSHOT, "format": "recorded", "time_scale": plan.time_scale},
        }
    return out


def job_name(tuning: str, run: int) -> str:
    return f"{tuning}-run-{run}"


def result_name(tuning: str, run: int) -> str:
    return f"{tuning}-run-{run}-result"


def tuning_jobs(
    tuning: str, spec: dict[str, Any], owner, run: int, namespace: str, plan: traffic.Plan | None = None
) -> list[dict[str, Any]]:
    """The Job running `tune run` for one run, and a workers Job when spec.workers > 1.

    The main container runs `python -m slotune.operator.publish ... -- tune run SPEC`, which
    runs the study and then writes best.yaml and its metrics into the result ConfigMap through
    the API: results never travel through pod logs. With a traffic `plan`, the recording's claim
    is mounted read-only and the publisher snapshots and summarizes the window first, and skips
    the study when the traffic has not drifted from `plan.tuned_traffic`.
    """
    labels = {api.LABEL_TUNING: tuning, api.LABEL_RUN: str(run)}
    env = [{"name": "SLOTUNE_RUN", "value": str(run)}]
    if spec.get("storageSecret"):
        env.append(
            {
                "name": "SLOTUNE_STORAGE",
                "valueFrom": {
                    "secretKeyRef": {
                        "name": spec["storageSecret"]["name"],
                        "key": spec["storageSecret"].get("key", "url"),
                    }
                },
            }
        )
    tune = ["tune", "run", SPEC_PATH, "--no-progress", "--output-dir", RESULT_DIR]
    main = [
        "python",
        "-m",
        "slotune.operator.publish",
        "--configmap",
        result_name(tuning, run),
        "--namespace",
        namespace,
        "--result-dir",
        RESULT_DIR,
    ]
    if plan is not None:
        main += [
            "--traffic-dir",
            recording_dir(plan.serving),
            "--traffic-window-s",
            str(plan.window_s),
            "--traffic-snapshot",
            TRAFFIC_SNAPSHOT,
            "--drift-threshold",
            f"{plan.drift_threshold:g}",
        ]
        if plan.tuned_traffic is not None:
            main += ["--tuned-traffic", json.dumps(plan.tuned_traffic, sort_keys=True)]
    main += ["--", *tune]
    workers = int(spec.get("workers", 1))
    jobs = [_job(job_name(tuning, run), spec, owner, labels, env, main, parallelism=1, is_publisher=True, plan=plan)]
    if workers > 1:
        jobs.append(
            _job(
                f"{job_name(tuning, run)}-workers",
                spec,
                owner,
                labels,
                env,
                [*tune, "--worker"],
                parallelism=workers - 1,
                is_publisher=False,
            )
        )
    return jobs


def publish_rbac(tuning: str, spec: dict[str, Any], owner, run: int, namespace: str) -> list[dict[str, Any]]:
    """Role + RoleBinding `<tuning>-run-<n>`: the Job's service account may get/patch its run's
    result ConfigMap (by name) and nothing else; pruned with the run, collected with the owner."""
    labels = {api.LABEL_TUNING: tuning, api.LABEL_RUN: str(run)}
    name = job_name(tuning, run)
    role = {
        "apiVersion": "rbac.authorization.k8s.io/v1",
        "kind": "Role",
        "metadata": _meta(name, owner, labels),
        "rules": [
            {
                "apiGroups": [""],
                "resources": ["configmaps"],
                "resourceNames": [result_name(tuning, run)],
                "verbs": ["get", "patch"],
            }
        ],
    }
    binding = {
        "apiVersion": "rbac.authorization.k8s.io/v1",
        "kind": "RoleBinding",
        "metadata": _meta(name, owner, labels),
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": name},
        "subjects": [
            {
                "kind": "ServiceAccount",
                "namespace": namespace,
                "name": spec.get("serviceAccountName", TUNER_SERVICE_ACCOUNT),
            }
        ],
    }
    return [role, binding]


def _job(
    name, spec, owner, labels, env, command, parallelism: int, is_publisher: bool, plan: traffic.Plan | None = None
) -> dict[str, Any]:
    claim = spec.get("workVolumeClaim")
    work = {"persistentVolumeClaim": {"claimName": claim}} if claim else {"emptyDir": {}}
    mounts = [{"name": "spec", "mountPath": CONFIG_DIR, "readOnly": True}, {"name": "work", "mountPath": WORK_DIR}]
    volumes = [{"name": "spec", "configMap": {"name": f"{owner['name']}-spec"}}, {"name": "work", **work}]
    if plan is not None:  # read-only twice: the pod cannot write to the servers' recording
        mounts.append({"name": "traffic", "mountPath": TRAFFIC_DIR, "readOnly": True})
        volumes.append({"name": "traffic", "persistentVolumeClaim": {"claimName": plan.claim, "readOnly": True}})
    container = {
        "name": "tune",
        "image": spec.get("image", DEFAULT_IMAGE),
        "command": command,
        "env": env,
        "volumeMounts": mounts,
        "resources": spec.get("resources") or {},
    }
    return {
        "apiVersion": "batch/v1",
        "kind": "Job",
        "metadata": _meta(name, owner, labels),
        "spec": {
            "parallelism": parallelism,
            "completions": parallelism,
            "backoffLimit": int(spec.get("backoffLimit", 1)),
            "template": {
                "metadata": {"labels": labels},
                "spec": {
                    "restartPolicy": "Never",
                    "serviceAccountName": spec.get("serviceAccountName", TUNER_SERVICE_ACCOUNT),
                    # only the publisher writes to the API (its result ConfigMap)
                    "automountServiceAccountToken": is_publisher,
                    "containers": [container],
                    "volumes": volumes,
                },
            },
        },
    }
