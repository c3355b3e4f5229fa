"""Layering: the engine core never imports the HTTP front end (slotune/engine/serving/): building and
stepping an engine needs neither FastAPI nor uvicorn (checked in a fresh interpreter, since this
test process has imported everything already); slotune/kernels/ imports nothing from the rest of slotune
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
    """slotune/kernels/ holds the Triton kernels, the native CPU step and their torch references: it
    takes plain tensors and tile configs, and never reads the engine's classes (slotune/engine/native_step.py
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
    assert not {k: v for k, v in bad.items() if v}, f"kernels import outside slotune/kernels/: {bad}"


def test_the_layering_check_sees_function_level_imports(tmp_path):
    """Negative control: an engine import hidden inside a function is found."""
    f = tmp_path / "k.py"
    f.write_text("def f():\n    from slotune.engine.layers.linear import Linear\n    return Linear\n")
    assert "slotune.engine.layers.linear" in _imported_modules(f)


# --- the tuner's layers ---------------------------------------------------------------------------
# Data flows one way: a module of the tuner imports only from its own layer or an earlier one.
TUNER_LAYERS = {"spec": 0, "workload": 1, "measure": 2, "search": 3, "decide": 4, "report": 5, "tracking": 5}
TOP = 6  # cli, run, sweep, commands: they drive the whole flow


def _slotune_modules() -> dict[str, Path]:
    import slotune.engine
    import slotune.tuner

    out = {}
    for pkg in ("engine", "tuner", "kernels", "search_spaces", "evals", "operator"):
        root = (
            Path(slotune.tuner.__file__).parents[1] / pkg if pkg != "engine" else Path(slotune.engine.__file__).parent
        )
        for f in root.rglob("*.py"):
            parts = f.relative_to(root.parent).with_suffix("").parts
            name = "slotune." + ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
            out[name] = f
    return out


def _import_graph(modules: dict[str, Path]) -> dict[str, set[str]]:
    """module -> the slotune modules it imports (function-level and TYPE_CHECKING imports included;
    `from pkg import mod` counts as importing pkg.mod)."""
    graph = {}
    for name, f in modules.items():
        deps = set()
        for node in ast.walk(ast.parse(f.read_text(), filename=str(f))):
            if isinstance(node, ast.Import):
                deps |= {a.name for a in node.names}
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                subs = {f"{node.module}.{a.name}" for a in node.names} & modules.keys()
                deps |= subs or {node.module}
        graph[name] = {d for d in deps if d in modules and d != name}
    return graph


def _layer(module: str) -> int | None:
    parts = module.split(".")
    if parts[:2] != ["slotune", "tuner"] or len(parts) < 3:
        return None
    return TUNER_LAYERS.get(parts[2], TOP)


def _backward_imports(graph: dict[str, set[str]]) -> list[str]:
    return sorted(
        f"{m} -> {d}"
        for m, deps in graph.items()
        for d in deps
        if _layer(m) is not None and _layer(d) is not None and _layer(d) > _layer(m)
    )


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on, out, counter = {}, {}, [], set(), [], [0]

    def visit(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_the_tuner_imports_only_earlier_layers():
    """spec -> workload -> measure -> search -> decide -> report/tracking -> cli/run/sweep."""
    graph = _import_graph(_slotune_modules())
    assert any(m.startswith("slotune.tuner.decide.") for m in graph)  # the layout was found
    assert _backward_imports(graph) == []


def test_the_tuner_is_in_no_import_cycle():
    """Across all of slotune (the engine's lazy Triton backend import is a cycle of its own, not the tuner's)."""
    cycles = _cycles(_import_graph(_slotune_modules()))
    assert [c for c in cycles if any(m.startswith("slotune.tuner.") for m in c)] == []


def test_the_layer_checks_see_backward_imports_and_cycles():
    """Negative controls: a report module imported by search, and a two-module cycle, are found."""
    graph = {"slotune.tuner.search.x": {"slotune.tuner.report.y"}, "slotune.tuner.report.y": {"slotune.tuner.search.x"}}
    assert _backward_imports(graph) == ["slotune.tuner.search.x -> slotune.tuner.report.y"]
    assert _cycles(graph) == [["slotune.tuner.report.y", "slotune.tuner.search.x"]]


def test_no_tuner_module_is_over_400_lines():
    import slotune.tuner

    root = Path(slotune.tuner.__file__).parent
    long = {str(f.relative_to(root)): n for f in root.rglob("*.py") if (n := len(f.read_text().splitlines())) > 400}
    assert long == {}
