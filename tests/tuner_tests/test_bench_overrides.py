"""`tune bench --set key=value`: values are plain YAML read by the one reader (slotune/tuner/spec/yaml_reader.py)."""

from __future__ import annotations

import pytest
from slotune.tuner.cli import app
from slotune.tuner.commands import parse_overrides
from slotune.tuner.spec.yaml_reader import SpecError
from typer.testing import CliRunner


def test_override_values_are_plain_yaml():
    assert parse_overrides(
        [
            "max_num_seqs=8",
            "kv_cache_memory_gb=0.5",
            "enable_prefix_caching=true",
            "scheduling=static",
            "x=[1, 2]",
            "y=",
        ]
    ) == {
        "max_num_seqs": 8,
        "kv_cache_memory_gb": 0.5,
        "enable_prefix_caching": True,
        "scheduling": "static",
        "x": [1, 2],
        "y": None,
    }
    with pytest.raises(SpecError, match=r"^--set x:1:1: tag '!!python/object/apply:os.system' is not allowed"):
        parse_overrides(["x=!!python/object/apply:os.system ['true']"])
    with pytest.raises(SpecError, match=r"^--set y:1:6: while parsing a flow sequence"):
        parse_overrides(["y=[1, 2"])


def test_tune_bench_refuses_a_tagged_value_with_exit_2():
    r = CliRunner().invoke(app, ["bench", "--set", "max_num_seqs=!!binary AAAA"])
    assert r.exit_code == 2 and "Traceback" not in r.stderr
    assert r.stderr.startswith("--set max_num_seqs:1:1: tag '!!binary' is not allowed")
