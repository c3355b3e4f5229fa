"""The wheel ships every manifest (crds/, rbac/, tuner/, the kustomizations), each parses as
YAML, and the kustomizations resolve from the installed package alone (no source tree)."""

from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
MANIFESTS = ROOT / "slotune" / "operator" / "manifests"
PREFIX = "slotune/operator/manifests/"
# what `pip wheel .` reads: pyproject.toml, the readme and the package
SOURCES = ["pyproject.toml", "README.md", "slotune"]


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    """A wheel built offline from a copy of the tree (the build writes build/ and *.egg-info)."""
    src = tmp_path_factory.mktemp("src")
    for name in SOURCES:
        path = ROOT / name
        if path.is_dir():
            shutil.copytree(path, src / name, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
        else:
            shutil.copy2(path, src / name)
    out = tmp_path_factory.mktemp("wheel")
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--no-build-isolation",
            "--no-index",
            "-q",
            str(src),
            "-w",
            str(out),
        ],
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    return next(out.glob("slotune-*.whl"))


def test_wheel_ships_every_manifest(wheel):
    with zipfile.ZipFile(wheel) as zf:
        shipped = {n[len(PREFIX) :]: zf.read(n) for n in zf.namelist() if n.startswith(PREFIX)}
    in_tree = {str(p.relative_to(MANIFESTS)) for p in MANIFESTS.rglob("*.yaml")}
    assert {
        "crds/slotunings.yaml",
        "crds/sloservings.yaml",
        "rbac/operator.yaml",
        "tuner/tuner.yaml",
        "tuner/kustomization.yaml",
        "kustomization.yaml",
        "operator.yaml",
    } <= in_tree
    assert set(shipped) == in_tree
    assert "crds.yaml" not in shipped  # the stale copy of the CRDs is gone
    for name, data in shipped.items():
        docs = [d for d in yaml.safe_load_all(data) if d]
        assert docs and all("kind" in d for d in docs), name


def test_shipped_kustomizations_resolve(wheel, tmp_path):
    with zipfile.ZipFile(wheel) as zf:
        zf.extractall(tmp_path, [n for n in zf.namelist() if n.startswith(PREFIX)])
    root = tmp_path / PREFIX
    for kust in root.rglob("kustomization.yaml"):  # every listed resource is in the wheel
        for res in yaml.safe_load(kust.read_text())["resources"]:
            assert (kust.parent / res).exists(), f"{kust.relative_to(root)} lists {res}"
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        return  # the listing check above is what can be checked without it
    proc = subprocess.run([kubectl, "kustomize", str(root)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    kinds = sorted(d["kind"] for d in yaml.safe_load_all(proc.stdout) if d)
    assert kinds.count("CustomResourceDefinition") == 2 and "ClusterRole" in kinds and "Deployment" in kinds
    assert kinds.count("ServiceAccount") == 3  # the operator's, slotune-tuner, slotune-serving
