"""Layering: the engine core never imports the HTTP front end (engine/serving/): building and
stepping an engine needs neither FastAPI nor uvicorn (checked in a fresh interpreter, since this
test process has imported everything already); kernels/ imports nothing from the rest of slotune
(checked on the source, so an import inside a function counts too)."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

FRONT_END = ("fastapi", "starlette", "uvicorn", "slotune.engine.serving")


def test_engine_core_does_not_import_the_http_front_end():
    code = (
        "import sys\n"
        "import slotune.engine, slotune.engine.llm, slotune.engine.llm_engine, slotune.engine.model_runner\n"
        f"bad = sorted(m for m in sys.modules if m.split('.')[0] in {FRONT_END!r} or m.startswith({FRONT_END!r}))\n"
        "print('\\n'.join(bad))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    assert out == [], f"engine core imported the front end: {out}"


def _imported_modules(path: Path) -> set[str]:
    """Every module a source file imports, at any depth (function-level imports included)."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            names |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
    return names


def test_kernels_are_a_leaf_and_import_nothing_from_the_engine():
    """kernels/ holds the Triton kernels, the native CPU step and their torch references: it
    takes plain tensors and tile configs, and never reads the engine's classes (engine/native_step.py
    is the glue, on the engine's side)."""
    import slotune.kernels

    root = Path(slotune.kernels.__file__).parent
    files = sorted(root.glob("*.py"))
    assert len(files) > 5  # the package was found, not an empty folder
    bad = {
        f.name: sorted(
            m for m in _imported_modules(f) if m.startswith("slotune.") and not m.startswith("slotune.kernels")
        )
        for f in files
    }
    assert not {k: v for k, v in bad.items() if v}, f"kernels import outside kernels/: {bad}"


def test_the_layering_check_sees_function_level_imports(tmp_path):
    """Negative control: an engine import hidden inside a function is found."""
    f = tmp_path / "k.py"
    f.write_text("def f():\n    from slotune.engine.layers.linear import Linear\n    return Linear\n")
    assert "slotune.engine.layers.linear" in _imported_modules(f)
