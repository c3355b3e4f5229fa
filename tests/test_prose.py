"""Prose stays where it belongs: short reasons in code, stories in docs/design/ and bench READMEs.

Checks that every `why:` of a built-in search space is at most two sentences, that every pydantic
Field description is one line of at most 160 characters, and that no product source line carries a
date (a dated run anecdote). slotune/tuner/ is being redesigned: its cases are expected failures for now.
"""

from __future__ import annotations

import importlib
import inspect
import pkgutil
import re
from pathlib import Path

import pytest
import yaml
from pydantic import BaseModel, Field

ROOT = Path(__file__).resolve().parents[1]
MAX_WHY_SENTENCES = 2
MAX_DESCRIPTION_CHARS = 160
DATE = re.compile(r"\b20\d\d-\d\d-\d\d\b(?![ T]\d\d:\d\d)")  # a timestamp is a format example, not a run's date
# A sentence ends at . ? or ! followed by whitespace and a capital letter; the text's end closes the last.
_SENTENCE_BREAK = re.compile(r"[.?!]\s+(?=[A-Z])")


def count_sentences(text: str) -> int:
    """Sentences in `text`: one per break between sentences, plus the last; 0 for blank text."""
    text = text.strip()
    return 0 if not text else len(_SENTENCE_BREAK.findall(text)) + 1


def whys(node, where: str = ""):
    """(path, text) of every value under a key named `why` in parsed YAML."""
    if isinstance(node, dict):
        for key, value in node.items():
            path = f"{where}.{key}" if where else str(key)
            if key == "why":
                yield path, value
            yield from whys(value, path)
    elif isinstance(node, list):
        for i, value in enumerate(node):
            yield from whys(value, f"{where}[{i}]")


def test_count_sentences_counts_breaks_not_abbreviations_or_decimals():
    three = "Prefix caching skips the prefill. Wide batches admit at once. Small chunks bound a step."
    assert count_sentences(three) == 3  # negative control: a three-sentence why must be refused
    assert count_sentences("int4 reads 0.70x int8's bytes (e.g. on the bundled model).") == 1
    assert count_sentences("Is it fast? Yes! It is") == 3
    assert count_sentences("  ") == 0


@pytest.mark.parametrize("path", sorted((ROOT / "slotune" / "search_spaces").glob("*.yaml")), ids=lambda p: p.name)
def test_search_space_whys_are_at_most_two_sentences(path: Path):
    found = list(whys(yaml.safe_load(path.read_text())))
    long = {where: count_sentences(text) for where, text in found if count_sentences(text) > MAX_WHY_SENTENCES}
    assert not long, f"{path.name}: move the story to docs/design/search-spaces.md: {long}"


def test_the_latency_space_has_whys_to_check():
    assert list(whys(yaml.safe_load((ROOT / "slotune" / "search_spaces" / "latency.yaml").read_text())))


def _module_names(package: str, skip=("trial_runner", "__main__")) -> list[str]:
    """Every module under `package`, without importing any subpackage whose name is skipped."""
    names = [package]
    pkg = importlib.import_module(package)
    for info in pkgutil.iter_modules(pkg.__path__, package + "."):
        if any(s in info.name for s in skip):
            continue
        names += _module_names(info.name, skip) if info.ispkg else [info.name]
    return names


def _models_of(package: str) -> list[type[BaseModel]]:
    """The pydantic models defined in the modules of `package`; a module whose third-party dependency is
    not installed is skipped, a broken import of our own is an error."""
    models = []
    for name in _module_names(package):
        try:
            module = importlib.import_module(name)
        except ModuleNotFoundError as e:
            if (e.name or "").startswith("slotune"):
                raise
            continue
        models += [
            cls
            for _, cls in inspect.getmembers(module, inspect.isclass)
            if cls.__module__ == name and issubclass(cls, BaseModel) and cls is not BaseModel
        ]
    return models


def long_descriptions(model: type[BaseModel]) -> dict[str, str]:
    """Field name -> description, for the descriptions that are not one line of at most 160 characters."""
    return {
        f"{model.__module__}.{model.__qualname__}.{name}": field.description
        for name, field in model.model_fields.items()
        if field.description and ("\n" in field.description or len(field.description) > MAX_DESCRIPTION_CHARS)
    }


def test_long_descriptions_finds_a_two_line_and_an_overlong_description():
    class Knobs(BaseModel):
        short: int = Field(1, description="one line")
        two_lines: int = Field(1, description="first line\nsecond line")
        overlong: int = Field(1, description="x" * (MAX_DESCRIPTION_CHARS + 1))

    assert sorted(k.rsplit(".", 1)[1] for k in long_descriptions(Knobs)) == ["overlong", "two_lines"]


def test_the_walk_finds_models_in_subpackages_and_modules():
    found = {f"{m.__module__}.{m.__qualname__}" for m in _models_of("slotune.engine")}
    assert {"slotune.engine.config.EngineConfig", "slotune.engine.serving.api_protocol.ChatMessage"} <= found


PACKAGES = [
    "slotune.engine",
    "slotune.evals",
    "slotune.kernels",
    "slotune.operator",
    "slotune.search_spaces",
    "slotune.tuner",
]


@pytest.mark.parametrize("target", PACKAGES)
def test_field_descriptions_are_one_short_line(target: str):
    long = {k: v for model in _models_of(target) for k, v in long_descriptions(model).items()}
    assert not long, "one line, one sentence; the rest goes to a comment or docs/design/:\n" + "\n".join(
        f"{k} ({len(v)} chars): {v!r}" for k, v in long.items()
    )


SOURCE_SUFFIXES = {".py", ".yaml", ".yml", ".c"}
AREAS = ["engine", "evals", "operator", "kernels", "search_spaces", "tuner"]


def dated_lines(folder: Path, root: Path = ROOT) -> list[str]:
    """`path:line: text` for every source line under `folder` that carries a date like 2026-11-24."""
    hits = []
    for path in sorted(folder.rglob("*")):
        if path.suffix not in SOURCE_SUFFIXES or "__pycache__" in path.parts:
            continue
        for i, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
            if DATE.search(line):
                hits.append(f"{path.relative_to(root)}:{i}: {line.strip()}")
    return hits


def test_dated_lines_finds_a_date_in_code_only(tmp_path: Path):
    (tmp_path / "a.py").write_text(
        "x = 1  # measured 2026-11-24 on the dev machine\ny = 2  # Kubernetes 1.20\nz = 'like 2023-11-16 18:15:46'\n"
    )
    (tmp_path / "b.md").write_text("2026-11-24: docs may carry dates\n")
    assert dated_lines(tmp_path, tmp_path) == ["a.py:1: x = 1  # measured 2026-11-24 on the dev machine"]


@pytest.mark.parametrize("area", AREAS)
def test_no_dated_run_anecdotes_in_product_code(area: str):
    hits = dated_lines(ROOT / "slotune" / area)
    assert not hits, "a run's date and numbers go to docs/design/ or a bench README:\n" + "\n".join(hits)
