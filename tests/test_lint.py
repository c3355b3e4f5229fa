"""`ruff check` over the whole tree is clean under the rule set in pyproject.toml ([tool.ruff]):
syntax errors (also syntax newer than Python 3.10), unused imports and variables, undefined names,
mutable defaults, useless expressions, blind assertRaises and raise-without-from in except;
and `ruff format --check` finds nothing to reformat (line length 120, pyproject.toml); and no
package at the repository root takes an importable name."""

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


def test_nothing_at_the_root_shadows_a_stdlib_module_or_an_installed_package():
    """The repo root is on sys.path under pytest and for `python -c` run from it, so a package there
    (a folder with __init__.py, or a module) named like a dependency's would be imported instead of
    it: a ./kernels folder broke transformers, which imports the `kernels` distribution."""
    import importlib.metadata

    taken = (set(sys.stdlib_module_names) | set(importlib.metadata.packages_distributions())) - {"slotune"}
    assert "operator" in taken  # the stdlib module an operator/ folder at the root would shadow
    here = {p.name for p in ROOT.iterdir() if (p / "__init__.py").is_file()}
    here |= {p.stem for p in ROOT.glob("*.py")}
    assert "tests" in here and not here & taken, f"move {sorted(here & taken)} under slotune/"
