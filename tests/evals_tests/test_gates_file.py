"""Gates files are read by the one plain-YAML reader (slotune/tuner/spec/yaml_reader.py): tags, duplicate keys and bad
gates are `path:line:column: message` / `path: field: message` errors, through `tune eval` too (exit 2,
before any engine is built)."""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

from slotune.evals.gates import load_gates
from slotune.tuner.cli import app
from slotune.tuner.spec.yaml_reader import MissingFileError, SpecError

ONE = "- {name: a, kind: agreement, min_top1: 0.9}\n"


@pytest.mark.parametrize(
    ("text", "needle"),
    [
        (
            "- !!python/object/apply:os.system ['echo pwned']\n",
            ":1:3: tag '!!python/object/apply:os.system' is not allowed",
        ),
        ("quality_gates: []\nquality_gates: []\n", ":2:1: duplicate key 'quality_gates' (first on line 1)"),
        ("name: a\n", ": expected a list of gates"),
    ],
)
def test_bad_gates_files_name_file_and_line(tmp_path, text, needle):
    p = tmp_path / "g.yaml"
    p.write_text(text)
    with pytest.raises(SpecError) as err:
        load_gates(p)
    assert f"{p}{needle}" in str(err.value)


def test_every_bad_gate_is_named_by_its_position(tmp_path):
    p = tmp_path / "spec.yaml"
    p.write_text(
        "quality_gates:\n  - {name: a, kind: agreement, min_top1: 0.9}\n  - {name: b, kind: agreement, "
        "min_top1: 2}\n  - {name: c, kind: nope}\n"
    )
    with pytest.raises(SpecError) as err:
        load_gates(p)
    lines = str(err.value).splitlines()
    assert lines[0].startswith(f"{p}: quality_gates[1].min_top1: ") and len(lines) >= 2
    assert all(line.startswith(f"{p}: quality_gates[2]") for line in lines[1:])
    list_form = tmp_path / "list.yaml"
    list_form.write_text(ONE + "- {name: b, kind: agreement, speed: 1}\n")
    with pytest.raises(SpecError, match=r"list.yaml: \[1\].speed: unknown field"):
        load_gates(list_form)
    with pytest.raises(MissingFileError, match="gates file not found"):
        load_gates(tmp_path / "nope.yaml")
    assert [g.name for g in load_gates(None)]  # the built-in gates still load


def test_tune_eval_refuses_a_tagged_gates_file_with_exit_2(tmp_path):
    p = tmp_path / "g.yaml"
    p.write_text("- !!set {a: null}\n")
    r = CliRunner().invoke(app, ["eval", "--gates", str(p)])
    assert r.exit_code == 2 and "Traceback" not in r.stderr
    assert r.stderr.strip() == f"{p}:1:3: tag '!!set' is not allowed: specs are plain YAML (no tags, no Python objects)"
