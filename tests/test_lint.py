"""`ruff check` over the whole tree is clean under the rule set in pyproject.toml ([tool.ruff]):
syntax errors (also syntax newer than Python 3.10), unused imports and variables, undefined names,
mutable defaults, useless expressions, blind assertRaises and raise-without-from in except;
and `ruff format --check` finds nothing to reformat (line length 120, pyproject.toml)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_ruff_check_is_clean():
    res = subprocess.run(
        [sys.executable, "-m", "ruff", "check", "--no-cache", "--output-format", "concise", str(ROOT)],
        capture_output=True,
        text=True,
        cwd=ROOT,
    )
    assert res.returncode == 0, res.stdout + res.stderr


def test_ruff_format_is_clean():
    res = subprocess.run(
        [sys.executable, "-m", "ruff", "format", "--check", "--no-cache", str(ROOT)],
        capture_output=True,
        text=True,
        cwd=ROOT,
    )
    assert res.returncode == 0, res.stdout + res.stderr
