"""Shared fixtures. The real bundled model is loaded once per session and shared. The fault suite's
fixture and table: tests/faults.py."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.faults import TAG, FaultRow, markdown, write_table

_FAULT_ROWS: list[FaultRow] = []


@pytest.fixture(scope="session")
def llm():
    from slotune.engine import LLM, EngineConfig

    return LLM(EngineConfig(max_num_seqs=8, max_model_len=1024, num_kv_blocks=256))


def pytest_addoption(parser):
    parser.addoption(
        "--fault-table", default=None, metavar="PATH", help="write the fault suite's table (Markdown) to PATH"
    )


@pytest.fixture
def fault(request, monkeypatch) -> FaultRow:
    """The row of a fault test (`@pytest.mark.fault("<the fault>")`); its processes carry the tag."""
    marker = request.node.get_closest_marker("fault")
    if marker is None or not marker.args:
        raise pytest.UsageError(f"{request.node.nodeid}: mark it @pytest.mark.fault('<the fault>')")
    row = FaultRow(marker.args[0], request.node.nodeid)
    monkeypatch.setenv(TAG, row.tag)
    _FAULT_ROWS.append(row)
    return row


def pytest_collection_modifyitems(config, items):
    for item in items:
        if item.get_closest_marker("fault") and "fault" not in getattr(item, "fixturenames", ()):
            raise pytest.UsageError(f"{item.nodeid} is marked fault but does not take the `fault` fixture")


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    if not _FAULT_ROWS:
        return
    terminalreporter.section("fault table")
    terminalreporter.write(markdown(_FAULT_ROWS))
    path = config.getoption("--fault-table")
    if path:
        outcome = {k: len(terminalreporter.stats.get(k, ())) for k in ("passed", "failed", "error")}
        write_table(_FAULT_ROWS, Path(path), ", ".join(f"{n} {k}" for k, n in outcome.items() if n))
        terminalreporter.write_line(f"written to {path}")
