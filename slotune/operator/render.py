"""`tune k8s render SPEC.yaml`: print the SLOTuning custom resource for a tuning spec.

The spec is validated with TuningSpec first (the same check `tune run` makes), then embedded
as-is under `spec.tuning`; the rollout block holds the CRD defaults, with the canary SLO taken
from the spec's objective limits, so the printed resource is a complete starting point.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import yaml

from slotune.operator import api
from slotune.tuner.spec.slo import SLOLimits
from slotune.tuner.spec.tuning_spec import TuningSpec


def render_tuning(
    spec_path: Path, name: str | None = None, namespace: str = "default", serving: str | None = None
) -> dict[str, Any]:
    """The SLOTuning for the tuning spec at `spec_path`.

    Args:
        name: resource name; default: the spec's `name`, made DNS-safe.
        serving: the SLOServing to roll out to; default `<name>-serving`.
    """
    spec_path = Path(spec_path)
    if not spec_path.exists():
        raise FileNotFoundError(f"spec file not found: {spec_path}")
    data = yaml.safe_load(spec_path.read_text())
    if not isinstance(data, dict):
        raise ValueError(f"{spec_path}: expected a mapping at the top level")
    spec = TuningSpec.from_yaml(spec_path)  # pydantic ValidationError is a ValueError: the CLI prints it
    name = name or dns_name(str(data.get("name") or spec_path.stem))
    slo = {**SLOLimits.from_objective(spec.objective).to_crd(), "minRequests": 20}
    return {
        "apiVersion": api.API_VERSION,
        "kind": "SLOTuning",
        "metadata": {"name": name, "namespace": namespace},
        "spec": {
            "tuning": data,
            "target": {"servingName": serving or f"{name}-serving"},
            "rollout": {
                "mode": "auto",
                "canaryFraction": 0.1,
                "canaryDurationSeconds": 300,
                "readyDeadlineSeconds": 600,
                "slo": slo,
            },
            "historyLimit": 10,
        },
    }


def dns_name(text: str) -> str:
    """A Kubernetes object name (RFC 1123 label) from free text."""
    out = re.sub(r"[^a-z0-9-]+", "-", text.lower()).strip("-")[:63].strip("-")
    if not out:
        raise ValueError(f"cannot make a resource name from '{text}'; pass --name")
    return out


def render_command(spec: Path, name: str | None = None, namespace: str = "default") -> None:
    print(yaml.safe_dump(render_tuning(spec, name=name, namespace=namespace), sort_keys=False), end="")
