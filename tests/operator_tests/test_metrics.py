"""Canary metrics: histogram maths, and alignment with the real `tune serve` -- the serving
pod's own command (as the operator renders it) runs as a local process and is scraped."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest

from slotune.operator import children, metrics

from .kubelet import free_port, wait_for

TEXT = """\
# TYPE slotune_time_to_first_token_seconds histogram
slotune_time_to_first_token_seconds_bucket{le="0.1"} 6.0
slotune_time_to_first_token_seconds_bucket{le="0.5"} 9.0
slotune_time_to_first_token_seconds_bucket{le="+Inf"} 10.0
slotune_time_to_first_token_seconds_count 10.0
slotune_time_to_first_token_seconds_sum 2.0
# TYPE other_seconds histogram
other_seconds_bucket{le="+Inf"} 3.0
other_seconds_count 3.0
other_seconds_sum 1.0
"""


def test_parse_and_quantiles():
    h = metrics.parse(TEXT)
    assert set(h) == {"ttft"}
    ttft = h["ttft"]
    assert ttft.count == 10 and ttft.mean == pytest.approx(0.2)
    assert ttft.quantile(0.5) == pytest.approx(0.1 * 5 / 6)  # inside the first bucket
    assert ttft.quantile(0.8) == pytest.approx(0.1 + 0.4 * (8 - 6) / 3)
    assert ttft.quantile(0.99) == pytest.approx(0.5)  # in +Inf: the last finite bound


def test_histograms_sum_over_pods():
    a, b = metrics.parse(TEXT)["ttft"], metrics.parse(TEXT)["ttft"]
    a.add(b)
    assert a.count == 20 and a.quantile(0.5) == pytest.approx(0.1 * 10 / 12)


def test_scrape_reports_unreachable_pods():
    h, errors = metrics.scrape([f"http://127.0.0.1:{free_port()}/metrics"], timeout_s=0.5)
    assert h == {} and len(errors) == 1


def test_real_tune_serve_exports_the_histograms_the_operator_judges(tmp_path):
    """Run the serving container's command locally, send two requests, scrape /metrics."""
    owner = {"apiVersion": "slotune.dev/v1alpha1", "kind": "SLOServing", "name": "m", "uid": "u"}
    spec = {"model": "smollm2-135m", "port": free_port(), "config": {"max_num_seqs": 4, "max_model_len": 512}}
    config = children.serving_config(spec)
    cm = children.serving_config_map("m", "stable", owner, config)
    (tmp_path / "config.yaml").write_text(cm["data"]["config.yaml"])
    dep = children.deployment("m", "stable", spec, owner, config, replicas=1)
    argv = [
        str(tmp_path / "config.yaml")
        if a == f"{children.CONFIG_DIR}/config.yaml"
        else "127.0.0.1"
        if a == "0.0.0.0"
        else a
        for a in dep["spec"]["template"]["spec"]["containers"][0]["command"]
    ]
    argv[0] = str(Path(sys.executable).with_name("tune"))
    port = spec["port"]
    proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env={**os.environ})
    try:
        wait_for("/ready", lambda: _get(f"http://127.0.0.1:{port}/ready") is not None, timeout=240, interval=0.5)
        for _ in range(2):
            body = json.dumps({"model": "smollm2-135m", "prompt": "Hello", "max_tokens": 4}).encode()
            req = urllib.request.Request(
                f"http://127.0.0.1:{port}/v1/completions", body, {"Content-Type": "application/json"}
            )
            urllib.request.urlopen(req, timeout=60).read()
        h, errors = metrics.scrape([f"http://127.0.0.1:{port}/metrics"])
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    assert not errors
    assert h["ttft"].count == 2 and h["tpot"].count >= 1 and h["e2e"].count == 2
    assert 0 < h["ttft"].quantile(0.95) < 60


def _get(url: str) -> bytes | None:
    try:
        with urllib.request.urlopen(url, timeout=2) as r:
            return r.read() if r.status == 200 else None
    except OSError:
        return None
