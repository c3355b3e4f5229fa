"""slotune/tuner/measure/machine.py: the words a measurement's machine is recorded with (real /proc on this host)."""

from __future__ import annotations

import os
import re

from slotune.tuner.measure import machine


def test_this_machine_is_described_from_proc():
    d = machine.describe()
    assert d["cpus"] == os.cpu_count()
    assert set(d["isa"]) <= set(machine.ISA_FLAGS) and list(d["isa"]) == [f for f in machine.ISA_FLAGS if f in d["isa"]]
    assert machine.words().startswith(f"{d['cpu']}, {d['cpus']} CPUs, ")
    assert re.fullmatch(r"[a-z0-9-]+-\d+c", machine.label()) and machine.label().endswith(f"-{d['cpus']}c")


def test_words_and_label_of_another_machine():
    """A CPU without the listed extensions and unknown memory (what a non-Linux host gives)."""
    info = {"cpu": "Apple M2 (ARM)", "cpus": 8, "isa": [], "mem_gib": None}
    assert machine.words(info) == "Apple M2 (ARM), 8 CPUs, no AVX2"
    assert machine.label(info) == "apple-m2-arm-8c"
