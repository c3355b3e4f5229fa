"""`tune k8s render`, the shipped manifests and the Dockerfile (no cluster needed)."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from slotune.operator import api
from slotune.tuner.cli import app

ROOT = Path(__file__).resolve().parents[2]
MANIFESTS = ROOT / "slotune" / "operator" / "manifests"
EXAMPLE = ROOT / "examples" / "04-kubernetes"


def test_render_prints_the_custom_resource():
    result = CliRunner().invoke(app, ["k8s", "render", str(EXAMPLE / "spec.yaml"), "--namespace", "ml"])
    assert result.exit_code == 0, result.output
    cr = yaml.safe_load(result.output)
    assert (cr["apiVersion"], cr["kind"]) == (api.API_VERSION, "SLOTuning")
    assert cr["metadata"] == {"name": "chat-k8s", "namespace": "ml"}
    assert cr["spec"]["tuning"] == yaml.safe_load((EXAMPLE / "spec.yaml").read_text())
    assert cr["spec"]["rollout"]["slo"]["ttftSeconds"] == 1.5
    assert cr["spec"]["target"]["servingName"] == "chat-k8s-serving"


def test_render_rejects_an_invalid_spec(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("name: x\nobjective: {kind: latency, metric: goodput_rps}\n")
    result = CliRunner().invoke(app, ["k8s", "render", str(bad)])
    assert result.exit_code == 2 and "objective" in result.output


def test_example_slotuning_embeds_the_example_spec():
    cr = yaml.safe_load((EXAMPLE / "slotuning.yaml").read_text())
    assert cr["spec"]["tuning"] == yaml.safe_load((EXAMPLE / "spec.yaml").read_text())


def test_kustomization_lists_existing_files_and_crds_match_the_code():
    kust = yaml.safe_load((MANIFESTS / "kustomization.yaml").read_text())
    for res in kust["resources"]:
        assert (MANIFESTS / res).exists(), res
    crds = {yaml.safe_load(p.read_text())["metadata"]["name"] for p in (MANIFESTS / "crds").glob("*.yaml")}
    assert crds == {f"{api.TUNINGS}.{api.GROUP}", f"{api.SERVINGS}.{api.GROUP}"}


def test_operator_role_is_least_privilege():
    docs = list(yaml.safe_load_all((MANIFESTS / "rbac" / "operator.yaml").read_text()))
    rules = next(d for d in docs if d["kind"] == "ClusterRole")["rules"]
    for rule in rules:
        assert "*" not in rule["verbs"] and "*" not in rule["resources"]
        assert "secrets" not in rule["resources"]
        if api.GROUP in rule["apiGroups"]:
            assert not {"create", "delete", "update"} & set(rule["verbs"])  # users own their resources


def test_dockerfile_pins_the_cpu_torch_and_the_operator_image_has_no_extras():
    text = (ROOT / "slotune" / "operator" / "Dockerfile").read_text()
    assert '"torch==2.13.0"' in text and "download.pytorch.org/whl/cpu" in text
    stages = {s.split()[2]: s for s in text.split("\nFROM ")[1:]}  # "python:... AS name\n..."
    assert "RUN pip install . " in stages["operator"] and "torch" not in stages["operator"]
    assert 'pip install ".[all]"' in stages["runtime"] and list(stages)[-1] == "runtime"  # the default target
    operator = next(
        d
        for d in yaml.safe_load_all((ROOT / "slotune" / "operator" / "manifests" / "operator.yaml").read_text())
        if d and d.get("kind") == "Deployment"
    )
    assert operator["spec"]["template"]["spec"]["containers"][0]["image"].endswith("/slotune-operator:0.1.0")


def test_a_llama_server_launch_is_rendered_as_a_serving_config():
    from slotune.operator import children, serving

    launch = {"engine": "llama-server", "knobs": {"threads": 2, "parallel": 2}, "model": "smollm2-135m"}
    serving.validate_config(launch)
    with pytest.raises(ValueError, match="'paralel' is not a knob of llama-server"):
        serving.validate_config({**launch, "knobs": {"paralel": 2}})
    owner = {"apiVersion": api.API_VERSION, "kind": "SLOServing", "name": "s", "uid": "u", "controller": True}
    pod = children.deployment("s", "stable", {"port": 8000}, owner, launch, 1)["spec"]["template"]["spec"]
    command = pod["containers"][0]["command"]
    assert command == ["tune", "serve", "/etc/slotune/config.yaml", "--host", "0.0.0.0", "--port", "8000"]
    bundled = children.deployment("s", "stable", {"port": 8000}, owner, {"max_num_seqs": 4}, 1)
    assert "--served-model-name" in bundled["spec"]["template"]["spec"]["containers"][0]["command"]
