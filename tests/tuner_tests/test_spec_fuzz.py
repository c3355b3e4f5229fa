"""Property-based fuzzing of the user-input schemas: TuningSpec, EngineConfig, WorkloadSpec, SearchSpace.

Documents are mutations of valid ones (a value replaced by the wrong type, NaN, inf, a huge number
or nested garbage; a key deleted; an unknown key added; a value wrapped in a list). Each one either
validates or fails with field messages (pydantic's ValidationError or our SpecError, printed as
`path: field: message` lines) -- never another exception. Bounded for CI (a few hundred documents
in all, the same every run); FUZZ_EXAMPLES=2000 searches longer, with fresh random documents.
"""

from __future__ import annotations

import copy
import math
import os
import tempfile
from pathlib import Path
from typing import Any

import pytest
import yaml
from pydantic import ValidationError

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from slotune.engine.config import EngineConfig  # noqa: E402
from slotune.search_spaces.schema import SearchSpace  # noqa: E402
from slotune.tuner.spec.tuning_spec import TuningSpec, resolved_dict  # noqa: E402
from slotune.tuner.spec.workload_spec import WorkloadSpec  # noqa: E402
from slotune.tuner.spec.yaml_reader import SpecError, error_lines, parse_yaml  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = int(os.environ.get("FUZZ_EXAMPLES", "80"))
FUZZ = settings(
    max_examples=EXAMPLES,
    deadline=None,
    derandomize="FUZZ_EXAMPLES" not in os.environ,  # CI: fixed
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
FIELD_ERRORS = (ValidationError, SpecError)

WORKLOAD = {
    "name": "w",
    "arrivals": "poisson",
    "rate": 2.0,
    "num_requests": 8,
    "duration_s": 10.0,
    "prompt_len": {"kind": "lognormal", "mean": 64, "sigma": 0.5, "min": 8, "max": 256},
    "output_len": {"kind": "uniform", "min": 4, "max": 32},
    "shared_prefix": {"num_tokens": 32, "fraction": 0.5},
    "seed": 3,
}
SPACE = {
    "name": "s",
    "knobs": [
        {"name": "quantization", "type": "categorical", "choices": ["none", "int8", "int4"]},
        {"name": "quant_group_size", "type": "categorical", "choices": [32, 64], "when": {"quantization": ["int4"]}},
        {"name": "max_num_seqs", "type": "int", "low": 1, "high": 16, "log": True},
        {"name": "kv_cache_memory_gb", "type": "float", "low": 0.1, "high": 0.5, "step": 0.1},
        {"name": "speculative.method", "type": "categorical", "choices": ["none", "ngram"]},
    ],
    "forbidden": [{"quantization": ["int4"], "max_num_seqs": [16]}],
}
ENGINE = {
    "max_num_seqs": 8,
    "quantization": "int8",
    "kv_dtype": "int8",
    "max_model_len": 1024,
    "speculative": {"method": "ngram", "num_speculative_tokens": 3},
    "admission": {"max_queued_requests": 4},
    "kernels": {"decode_attention": {"num_splits": 4}},
}
RICH_SPEC = {
    "name": "fuzz",
    "engine": ENGINE,
    "workload": WORKLOAD,
    "search_space": SPACE,
    "objective": {
        "kind": "latency",
        "metric": "ttft",
        "percentile": 90,
        "ttft_limit_s": 1.0,
        "min_output_tokens_per_s": 5.0,
        "pareto_with": ["output_tokens_per_s"],
    },
    "quality_gates": [
        {"name": "a", "kind": "agreement", "min_top1": 0.9},
        {
            "name": "m",
            "kind": "lm_eval",
            "task": "slotune_arithmetic_1digit",
            "metric": "acc",
            "max_abs_drop": 0.1,
            "limit": 10,
        },
    ],
    "budget": {"n_trials": 4, "timeout_s": 60.0, "trial_timeout_s": 30.0, "trial_memory_gb": 2.0},
    "sampler": "nsga2",
    "seed": 7,
    "early_stop": {"min_requests": 2, "factor": 2.0},
}
SPECS = [RICH_SPEC] + [
    parse_yaml(p.read_text(), str(p))
    for p in [
        *sorted((ROOT / "examples").glob("0[1-4]*/spec.yaml")),
        ROOT / "slotune" / "tuner" / "specs" / "quickstart.yaml",
    ]
]

scalar_garbage = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(10**30), max_value=10**30),
    st.sampled_from([math.nan, math.inf, -math.inf, 1e308, -1.0, 0, 2**63, 2**32, "", "auto", "../x", "a\x00b"]),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=12),
)
garbage = st.recursive(
    scalar_garbage,
    lambda inner: st.one_of(st.lists(inner, max_size=3), st.dictionaries(st.text(max_size=6), inner, max_size=3)),
    max_leaves=6,
)


def _paths(doc: Any, prefix: tuple = ()) -> list[tuple]:
    out = [prefix]
    if isinstance(doc, dict):
        for k, v in doc.items():
            out += _paths(v, prefix + (k,))
    elif isinstance(doc, list):
        for i, v in enumerate(doc):
            out += _paths(v, prefix + (i,))
    return out


def _set(doc: Any, path: tuple, value: Any) -> Any:
    if not path:
        return value
    node = doc
    for p in path[:-1]:
        node = node[p]
    node[path[-1]] = value
    return doc


@st.composite
def mutated(draw, seeds: list[dict]) -> Any:
    doc = copy.deepcopy(draw(st.sampled_from(seeds)))
    for _ in range(draw(st.integers(1, 3))):
        path = draw(st.sampled_from(_paths(doc)))
        op = draw(st.sampled_from(["replace", "replace", "delete", "unknown_key", "wrap", "nudge", "nudge"]))
        parent = doc
        for p in path[:-1]:
            parent = parent[p]
        value = parent[path[-1]] if path else doc
        if op == "nudge" and type(value) in (int, float):  # a plausible number: many of these validate
            doc = _set(
                doc, path, draw(st.integers(-4, 2**33) if type(value) is int else st.floats(-1.0, 1e4, allow_nan=False))
            )
        elif op == "nudge" and isinstance(value, str):
            doc = _set(
                doc,
                path,
                draw(
                    st.sampled_from(
                        [
                            "auto",
                            "none",
                            "int8",
                            "ngram",
                            "tpot",
                            "poisson",
                            "random",
                            "grid",
                            "throughput",
                            "chat-small",
                            "low-memory",
                            value[:-1],
                        ]
                    )
                ),
            )
        elif op == "delete" and path:
            del parent[path[-1]]
        elif op == "unknown_key" and isinstance(parent, dict):
            parent[draw(st.text(min_size=1, max_size=8))] = draw(garbage)
        elif op == "wrap":
            doc = _set(doc, path, [copy.deepcopy(parent[path[-1]]) if path else doc])
        else:
            doc = _set(doc, path, draw(garbage))
    return doc


def assert_field_errors(exc: BaseException, source: str) -> None:
    """Our error type, printed as `source: ...` lines with a message each."""
    assert isinstance(exc, FIELD_ERRORS), f"{type(exc).__name__}: {exc}"
    lines = error_lines(exc, source)
    assert lines and all(ln.startswith(source) and len(ln) > len(source) + 2 for ln in lines), lines


def check(fn, arg, source: str = "spec.yaml") -> Any:
    try:
        return fn(arg)
    except Exception as exc:  # noqa: BLE001 - the property: nothing but field errors
        assert_field_errors(exc, source)
        return None


@FUZZ
@given(doc=mutated(SPECS))
def test_tuning_spec_fuzz(doc):
    spec = check(TuningSpec.model_validate, doc)
    if spec is not None:  # accepted: everything the CLI reads from it works too
        spec.base_config()
        assert len({g.name for g in spec.quality_gates}) == len(spec.quality_gates)
        space = spec.search_space
        for k in space.knobs:
            k.distribution()
        assert spec.workload.num_requests or spec.workload.duration_s
        resolved_dict(spec)


@settings(FUZZ, max_examples=max(10, EXAMPLES // 4))
@given(doc=mutated(SPECS))
def test_tuning_spec_files_fuzz(doc):
    """The same documents as files, through the YAML reader and `from_yaml` (paths resolved)."""
    with tempfile.TemporaryDirectory() as d:
        p = Path(d) / "spec.yaml"
        p.write_text(yaml.safe_dump(doc, allow_unicode=True))
        check(TuningSpec.from_yaml, p, str(p))


@FUZZ
@given(doc=mutated([ENGINE, {}, {"speculative": {"method": "model", "draft_model": "/d"}}]))
def test_engine_config_fuzz(doc):
    check(EngineConfig.model_validate, doc)


@FUZZ
@given(
    doc=mutated(
        [
            WORKLOAD,
            {"arrivals": "closed_loop", "concurrency": 2, "prompt_len": {"kind": "fixed", "value": 9}},
            {"shared_prefix": {"text": "hi", "fraction": 1.0}, "mode": "chat"},
        ]
    )
)
def test_workload_spec_fuzz(doc):
    check(WorkloadSpec.model_validate, doc)


@pytest.mark.filterwarnings("error::UserWarning")  # Optuna's warnings about a space it would quietly change
@FUZZ
@given(doc=mutated([SPACE, parse_yaml((ROOT / "slotune" / "search_spaces" / "latency.yaml").read_text())]))
def test_search_space_fuzz(doc):
    space = check(SearchSpace.model_validate, doc)
    if space is not None:
        for k in space.knobs:
            k.distribution()  # Optuna accepts every knob of an accepted space
        try:
            space.grid()
        except ValueError as exc:
            assert "grid" in str(exc) and "knob" in str(exc) or "configs" in str(exc), exc
