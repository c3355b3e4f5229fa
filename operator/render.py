"""`tune k8s render SPEC`: the SLOTuning custom resource for a tuning spec (validated first)."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import yaml

GROUP, VERSION = "slotune.dev", "v1alpha1"


def tuning_resource(spec_path: Path, name: str | None = None, namespace: str = "default",
                    target: str | None = None) -> dict[str, Any]:
    from slotune.tuner.spec import TuningSpec

    spec = TuningSpec.from_yaml(spec_path)  # fail here, not in the cluster
    raw = yaml.safe_load(Path(spec_path).read_text())
    rname = name or re.sub(r"[^a-z0-9-]+", "-", spec.name.lower()).strip("-")[:63]
    return {
        "apiVersion": f"{GROUP}/{VERSION}",
        "kind": "SLOTuning",
        "metadata": {"name": rname, "namespace": namespace},
        "spec": {
            "tuning": raw,
            "target": {"servingName": target or rname},
            "rollout": {"mode": "auto", "canaryReplicas": 1, "canaryDurationSeconds": 300,
                        "slo": {"ttftP95Seconds": spec.objective.ttft_limit_s, "tpotP95Seconds": spec.objective.tpot_limit_s}},
            "schedule": None,
            "workers": 1,
        },
    }


def render_command(spec: Path, name: str | None, namespace: str) -> None:
    print(yaml.safe_dump(tuning_resource(spec, name, namespace), sort_keys=False), end="")
