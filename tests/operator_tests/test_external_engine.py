"""An SLOServing of llama-server, end to end against a real kube-apiserver: the operator renders the
launch a llama-server study chose, canaries it, judges the canary on the /metrics of a real
`tune serve` (the metering proxy in front of a real llama-server) under real requests, and promotes
it. No kubelet runs: kubelet.run_pod runs the canary pod's own command locally (see kubelet.py);
skipped where llama-server is not on PATH."""

from __future__ import annotations

import json
import shutil
import signal
import urllib.error
import urllib.request

import pytest
import yaml

from slotune.operator import api

from .kubelet import free_port, get, get_cr, run_job, run_pod, wait_for
from .resources import create, serving, tuning

pytestmark = [
    pytest.mark.k8s,
    pytest.mark.skipif(shutil.which("llama-server") is None, reason="needs llama.cpp's llama-server on PATH"),
]

STABLE = {"engine": "llama-server", "knobs": {"threads": 2, "parallel": 1}}
TUNED = {"engine": "llama-server", "knobs": {"threads": 2, "parallel": 2}}
SERVER_STUDY = {
    "name": "ls",
    "server": {"engine": "llama-server", "knobs": {"threads": 2}},
    "workload": "chat-small",
    "search_space": {
        "name": "slots",
        "engine": "llama-server",
        "knobs": [{"name": "parallel", "type": "categorical", "choices": [1, 2]}],
    },
    "objective": {"kind": "latency", "metric": "tpot", "percentile": 95, "ttft_limit_s": 5.0},
    "budget": {"n_trials": 2},
}


def _stream(port: int) -> None:
    body = {"prompt": "Name three colours:", "max_tokens": 8, "temperature": 0, "stream": True}
    req = urllib.request.Request(
        f"http://127.0.0.1:{port}/v1/completions",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            assert b"[DONE]" in r.read()
    except urllib.error.HTTPError as exc:  # the proxy's reason, in the failure
        raise AssertionError(exc.read()) from None


def test_a_llama_server_launch_is_canaried_on_its_real_metrics_and_promoted(cluster, operator, ns, tmp_path):
    client = cluster.client()
    port = free_port()
    create(client, ns, serving("ls", port, config=STABLE))
    stable = wait_for("the stable Deployment", lambda: get(client, "Deployment", ns, "ls"))
    command = stable["spec"]["template"]["spec"]["containers"][0]["command"]
    assert command == ["tune", "serve", "/etc/slotune/config.yaml", "--host", "0.0.0.0", "--port", str(port)]
    config = yaml.safe_load(get(client, "ConfigMap", ns, "ls-config")["data"]["config.yaml"])
    assert config == {**STABLE, "model": "smollm2-135m"}
    rollout = {"canaryDurationSeconds": 20, "slo": {"ttftSeconds": 5.0, "tpotSeconds": 0.5, "minRequests": 10}}
    create(client, ns, tuning("ls-tune", "ls", rollout, tuning=SERVER_STUDY))
    wait_for("the tuning Job", lambda: get(client, "Job", ns, "ls-tune-run-1"))
    proc = run_job(cluster, ns, "ls-tune-run-1", tmp_path / "job", best_config=TUNED)
    assert proc.returncode == 0, proc.stderr
    wait_for("the canary Deployment", lambda: get(client, "Deployment", ns, "ls-canary"))
    pod = run_pod(cluster, ns, "ls-canary", tmp_path / "canary")
    try:
        for _ in range(12):  # the Service's traffic, as it reaches the canary pod
            _stream(port)
        status = wait_for(
            "a verdict",
            lambda: (lambda s: s if s.get("phase") in ("Promoted", "RolledBack") else None)(
                get_cr(client, api.TUNINGS, ns, "ls-tune").get("status") or {}
            ),
            timeout=120,
        )
    finally:
        pod.send_signal(signal.SIGTERM)
        code = pod.wait(timeout=30)
    assert status["phase"] == "Promoted", status
    measured = status["history"][-1]["measured"]
    assert measured["requests"] == 12 and 0 < measured["tpot_p95"] < 0.5  # judged on what the proxy timed
    assert get_cr(client, api.SERVINGS, ns, "ls")["spec"]["config"] == TUNED
    assert code == 0  # the pod's tune serve stopped cleanly, and its llama-server with it
