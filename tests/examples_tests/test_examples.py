"""Every example spec and built-in data file loads and resolves."""

from pathlib import Path

import pytest

from slotune.search_spaces.schema import SearchSpace, builtin_spaces
from slotune.tuner.spec.tuning_spec import TuningSpec, default_spec_path

ROOT = Path(__file__).resolve().parents[2]
SPECS = (
    sorted((ROOT / "examples").glob("*/spec.yaml"))
    + sorted((ROOT / "bench" / "tuner").glob("*spec.yaml"))
    + [default_spec_path()]
)


@pytest.mark.parametrize("path", SPECS, ids=lambda p: f"{p.parent.name}/{p.name}")
def test_example_spec_resolves(path):
    spec = TuningSpec.from_yaml(path)
    assert spec.workload.num_requests >= 1
    assert spec.search_space.knobs
    spec.base_config()
    assert all(g.name for g in spec.quality_gates)


def test_every_builtin_space_loads():
    assert {"latency", "throughput", "low-memory"} <= set(builtin_spaces())
    for n in builtin_spaces():
        assert SearchSpace.load(n).knobs
