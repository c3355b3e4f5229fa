"""Stand-ins for what a kubelet and the built-in controllers would do (no kubelet runs here).

Each writes to the API exactly what the real component would: a tuning Job's command is run
as a local process against the same API server, then the Job's status is set as the Job
controller would; serving pods are created from the Deployment's template with the status a
kubelet reports (podIP 127.0.0.1, Ready), and the Deployment's status as its controller would;
`run_pod` runs a pod's own container command locally and reports it Ready once its readiness
probe's path answers.
"""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
import textwrap
import time
import urllib.request
from pathlib import Path
from typing import Any, Callable

import kubernetes

from slotune.operator import api


def wait_for(what: str, fn: Callable[[], Any], timeout: float = 60.0, interval: float = 0.2) -> Any:
    deadline = time.time() + timeout
    while True:
        value = fn()
        if value:
            return value
        if time.time() > deadline:
            raise AssertionError(f"timed out after {timeout:g}s waiting for {what}")
        time.sleep(interval)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def get(client, kind: str, ns: str, name: str) -> dict | None:
    read = {
        "Job": lambda: kubernetes.client.BatchV1Api(client).read_namespaced_job(name, ns),
        "Deployment": lambda: kubernetes.client.AppsV1Api(client).read_namespaced_deployment(name, ns),
        "ConfigMap": lambda: kubernetes.client.CoreV1Api(client).read_namespaced_config_map(name, ns),
        "Service": lambda: kubernetes.client.CoreV1Api(client).read_namespaced_service(name, ns),
    }[kind]
    try:
        return client.sanitize_for_serialization(read())
    except kubernetes.client.ApiException as exc:
        if exc.status == 404:
            return None
        raise


def get_cr(client, plural: str, ns: str, name: str) -> dict:
    return kubernetes.client.CustomObjectsApi(client).get_namespaced_custom_object(
        api.GROUP, api.VERSION, ns, plural, name
    )


STAND_IN_TUNE = textwrap.dedent("""
    # Stand-in for `tune run SPEC --output-dir DIR`: writes the files the real study writes.
    import json, sys, pathlib, yaml
    out = pathlib.Path(sys.argv[sys.argv.index("--output-dir") + 1]); out.mkdir(parents=True, exist_ok=True)
    config = json.loads(sys.argv[1])
    (out / "best.yaml").write_text("# stand-in best config\\n" + yaml.safe_dump(config))
    (out / "best_metrics.json").write_text(json.dumps({"study": "stand-in", "trial": 0,
        "objective": "tpot_p95", "value": 0.0123, "metrics": {"tpot_p95": 0.0123, "ttft_p95": 0.2},
        "mlflow_run_id": "0123456789abcdef"}))
""")


def run_job(
    cluster,
    ns: str,
    job: str,
    workdir: Path,
    best_config: dict | None = None,
    real_tune: bool = False,
    inner: list[str] | None = None,
    is_retried: bool = False,
    claims: dict[str, Path] | None = None,
    tune_s: float = 0.0,
) -> subprocess.CompletedProcess:
    """Run a tuning Job's container command locally (one attempt), then set the Job's status.

    The command is the Job's own (`python -m slotune.operator.publish ... -- tune run SPEC`)
    with the pod's mount paths mapped as a kubelet mounts them: the spec ConfigMap's files and
    /work (an emptyDir) to `workdir`, each PersistentVolumeClaim to its folder in `claims`
    (claim name -> local folder), in the arguments and in the spec file alike. With
    `best_config`, the inner `tune run` is replaced by STAND_IN_TUNE writing that config after
    `tune_s` seconds; with
    `real_tune`, the real `tune run` runs; `inner` replaces it with any command. The Job ends
    Complete or Failed as the command does, except that with `is_retried` a failed attempt
    leaves it active with a retry to come (as the Job controller under backoffLimit).
    """
    client = cluster.client()
    body = get(client, "Job", ns, job)
    pod = body["spec"]["template"]["spec"]
    container = pod["containers"][0]
    spec_cm = pod["volumes"][0]["configMap"]["name"]
    workdir.mkdir(parents=True, exist_ok=True)
    volumes = {v["name"]: v for v in pod["volumes"]}
    mounts = {}
    for m in container["volumeMounts"]:
        claim = (volumes[m["name"]].get("persistentVolumeClaim") or {}).get("claimName")
        mounts[m["mountPath"]] = str(claims[claim]) if claims and claim in claims else str(workdir)
    spec_yaml = _mapped(get(client, "ConfigMap", ns, spec_cm)["data"]["spec.yaml"], mounts)
    (workdir / "spec.yaml").write_text(spec_yaml)
    argv = [_mapped(a, mounts) for a in container["command"]]
    argv[0] = sys.executable if argv[0] == "python" else argv[0]
    split = argv.index("--")
    inner = inner or argv[split + 1 :]
    if best_config is not None:
        stand_in = f"import time; time.sleep({tune_s})\n{STAND_IN_TUNE}"
        inner = [sys.executable, "-c", stand_in, json.dumps(best_config), *inner[2:]]
    elif real_tune:
        inner = [str(Path(sys.executable).with_name("tune")), *inner[1:]]
    env = {**os.environ, "SLOTUNE_KUBECONFIG": cluster.kubeconfig}
    for e in container.get("env") or []:
        if "value" in e:
            env[e["name"]] = e["value"]
    proc = subprocess.run([*argv[: split + 1], *inner], env=env, capture_output=True, text=True, cwd=workdir)
    now = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    ok = proc.returncode == 0
    num_failed = int((body.get("status") or {}).get("failed") or 0) + (0 if ok else 1)
    if not ok and is_retried:
        status = {"startTime": now, "active": 1, "failed": num_failed}
    else:
        status = {
            "startTime": now,
            "completionTime": now if ok else None,
            "succeeded": 1 if ok else 0,
            "failed": num_failed,
            "active": 0,
            "conditions": [
                {
                    "type": "Complete" if ok else "Failed",
                    "status": "True",
                    "lastProbeTime": now,
                    "lastTransitionTime": now,
                }
            ],
        }
    kubernetes.client.BatchV1Api(client).patch_namespaced_job_status(job, ns, {"status": status})
    return proc


def _mapped(text: str, mounts: dict[str, str]) -> str:
    """`text` with every pod path under a mount replaced by the local folder it maps to."""
    for path, local in sorted(mounts.items(), key=lambda kv: -len(kv[0])):
        text = re.sub(rf"(?<![\w/]){re.escape(path)}(?=/|\b|$)", lambda _: local, text)
    return text


def start_pods(cluster, ns: str, deployment: str, ready: bool = True) -> list[str]:
    """Create the Deployment's pods from its template and report them like a kubelet would."""
    client = cluster.client()
    dep = get(client, "Deployment", ns, deployment)
    core = kubernetes.client.CoreV1Api(client)
    names = []
    for i in range(dep["spec"]["replicas"]):
        tmpl = dep["spec"]["template"]
        pod = {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {
                "name": f"{deployment}-{i}",
                "labels": tmpl["metadata"]["labels"],
                "annotations": tmpl["metadata"].get("annotations") or {},
            },
            "spec": tmpl["spec"],
        }
        core.create_namespaced_pod(ns, pod)
        now = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
        core.patch_namespaced_pod_status(
            f"{deployment}-{i}",
            ns,
            {
                "status": {
                    "phase": "Running",
                    "podIP": "127.0.0.1",
                    "hostIP": "127.0.0.1",
                    "conditions": [
                        {"type": "Ready", "status": "True" if ready else "False", "lastTransitionTime": now}
                    ],
                }
            },
        )
        names.append(f"{deployment}-{i}")
    n = dep["spec"]["replicas"]
    kubernetes.client.AppsV1Api(client).patch_namespaced_deployment_status(
        deployment,
        ns,
        {
            "status": {
                "observedGeneration": dep["metadata"]["generation"],
                "replicas": n,
                "updatedReplicas": n,
                "readyReplicas": n if ready else 0,
                "availableReplicas": n if ready else 0,
            }
        },
    )
    return names


def run_pod(cluster, ns: str, deployment: str, workdir: Path) -> subprocess.Popen:
    """Run one pod of the Deployment as a kubelet would, as a local process: its container's command
    (`tune serve` of the config in force) with the ConfigMap volume's files in `workdir`; returns once
    the readiness probe's path answers 200, after start_pods has reported the pod Ready."""
    client = cluster.client()
    pod = get(client, "Deployment", ns, deployment)["spec"]["template"]["spec"]
    container = pod["containers"][0]
    volumes = {v["name"]: v for v in pod["volumes"]}
    mounts = {}
    for m in container["volumeMounts"]:
        cm = get(client, "ConfigMap", ns, volumes[m["name"]]["configMap"]["name"])
        local = workdir / m["name"]
        local.mkdir(parents=True, exist_ok=True)
        for file, text in cm["data"].items():
            (local / file).write_text(text)
        mounts[m["mountPath"]] = str(local)
    argv = [_mapped(a, mounts) for a in container["command"]]
    argv[0] = str(Path(sys.executable).with_name(argv[0]))
    env = {**os.environ, **{e["name"]: e["value"] for e in container.get("env") or [] if "value" in e}}
    proc = subprocess.Popen(argv, env=env, cwd=workdir, start_new_session=True)
    probe = container["readinessProbe"]["httpGet"]["path"]
    port = next(p["containerPort"] for p in container["ports"])
    wait_for("the pod's readiness probe", lambda: _ready(f"http://127.0.0.1:{port}{probe}"), timeout=180)
    start_pods(cluster, ns, deployment)
    return proc


def _ready(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2) as r:
            return r.status == 200
    except OSError:
        return False


FAKE_METRICS = textwrap.dedent("""
    # A minimal real /metrics endpoint standing in for a canary pod of `tune serve`: the
    # operator's histogram names (slotune.operator.metrics), with chosen latencies.
    import sys, http.server
    from prometheus_client import CollectorRegistry, Histogram, generate_latest
    from slotune.operator.metrics import TTFT_METRIC, TPOT_METRIC
    port, ttft, tpot, n = int(sys.argv[1]), float(sys.argv[2]), float(sys.argv[3]), int(sys.argv[4])
    b = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
    r = CollectorRegistry()
    h1 = Histogram(TTFT_METRIC, "ttft", buckets=b, registry=r); h2 = Histogram(TPOT_METRIC, "tpot", buckets=b, registry=r)
    for _ in range(n):
        h1.observe(ttft); h2.observe(tpot)
    class H(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            body = generate_latest(r) if self.path == "/metrics" else b"ok"
            self.send_response(200); self.end_headers(); self.wfile.write(body)
        def log_message(self, *a): pass
    http.server.HTTPServer(("127.0.0.1", port), H).serve_forever()
""")


def serve_metrics(port: int, ttft_s: float, tpot_s: float, num_requests: int = 50) -> subprocess.Popen:
    proc = subprocess.Popen(
        [sys.executable, "-c", FAKE_METRICS, str(port), str(ttft_s), str(tpot_s), str(num_requests)]
    )
    wait_for("the metrics endpoint", lambda: _answers(port), timeout=20)
    return proc


def _answers(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.5):
            return True
    except OSError:
        return False
