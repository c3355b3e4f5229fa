"""`tune k8s render`: the custom resource for every example spec validates against our CRD schema."""

from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from slotune.tuner.cli import app

ROOT = Path(__file__).resolve().parents[2]


def _required_ok(schema: dict, obj) -> None:
    """Check required keys, types, enums and patterns of the CRD's OpenAPI schema (the subset we use)."""
    import re

    if obj is None:
        assert schema.get("nullable"), schema
        return
    t = schema.get("type")
    if t == "object":
        assert isinstance(obj, dict)
        for k in schema.get("required", []):
            assert k in obj, f"missing required {k}"
        for k, sub in schema.get("properties", {}).items():
            if k in obj:
                _required_ok(sub, obj[k])
    elif t == "string":
        assert isinstance(obj, str)
        if "enum" in schema:
            assert obj in schema["enum"]
        if "pattern" in schema:
            assert re.match(schema["pattern"], obj)
    elif t == "integer":
        assert isinstance(obj, int)


@pytest.mark.parametrize("spec", sorted((ROOT / "examples").glob("*/spec.yaml")), ids=lambda p: p.parent.name)
def test_render_matches_crd_schema(spec):
    r = CliRunner().invoke(app, ["k8s", "render", str(spec), "--namespace", "ml"])
    assert r.exit_code == 0, r.output
    cr = yaml.safe_load(r.output)
    crd = next(d for d in yaml.safe_load_all((ROOT / "operator/manifests/crds.yaml").read_text()) if d["spec"]["names"]["kind"] == "SLOTuning")
    _required_ok(crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"], cr)
    assert cr["metadata"]["namespace"] == "ml" and cr["spec"]["tuning"]["name"]


def test_render_rejects_an_invalid_spec(tmp_path):
    bad = tmp_path / "s.yaml"
    bad.write_text("name: x\nobjective: {kind: sideways, metric: ttft}\n")
    r = CliRunner().invoke(app, ["k8s", "render", str(bad)])
    assert r.exit_code == 2 and "objective" in r.output
