"""Quality gates: a candidate config must not lose quality against its unquantized baseline.

Kinds (a tuning spec embeds a list of these under `quality_gates:`):
- agreement: top-1 next-token agreement and mean KL(baseline || candidate) on a fixed set of
  real-text prompts (evals/agreement.py). Sensitive where a 135M model's task accuracy is too
  noisy to tell.
- lm_eval: a bundled lm-eval task run through our engine; the drop in its metric (higher is
  better) is judged against the margin, with a paired standard error.
- perplexity: a bundled loglikelihood_rolling task; the increase in perplexity is judged.

The baseline is the same config with 16-bit-or-better everything and no drafts
(`baseline_config`). Its numbers are computed once per (model identity, gate, task data,
limit, scorer version, baseline dtype/device) and cached on disk as JSON, per item, so later
candidates are compared pairwise on the same items.

Lifecycle: `evaluate_gates(config, gates, llm=trial_llm)` -> for each gate: baseline from the
cache (or computed on a lazily loaded baseline engine) -> candidate on `llm` -> `stats.judge`.
A gate that raises is recorded as failed with the error as its reason, never raised.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from slotune.engine.paths import cache_root
from slotune.evals.stats import judge, paired_drop, paired_perplexity_drop
from slotune.tuner.errors import SpecError, load_yaml

log = logging.getLogger(__name__)

SCORER_VERSION = 2  # bump when scoring changes numerics: invalidates cached baselines
DEFAULT_METRIC = {"lm_eval": "acc", "perplexity": "word_perplexity", "agreement": "top1"}
DEFAULT_TASK = {"perplexity": "slotune_kjv_perplexity"}


class GateSpec(BaseModel):
    """One quality gate, as written under `quality_gates:` in a tuning spec or a gates YAML."""

    model_config = ConfigDict(extra="forbid")

    name: str
    kind: Literal["agreement", "lm_eval", "perplexity"]
    task: str | None = Field(None, description="bundled lm-eval task (lm_eval, perplexity); see evals/tasks/SOURCES.md")
    metric: str | None = Field(None, description="lm_eval: acc | acc_norm | exact_match; perplexity: "
                               "word_perplexity | byte_perplexity; agreement: top1 (default per kind)")
    limit: int | None = Field(None, ge=2, description="documents (lm_eval, perplexity) or prompts (agreement); None = all")
    max_abs_drop: float | None = Field(None, ge=0, description="largest accepted drop, in the metric's units")
    max_rel_drop: float | None = Field(None, ge=0, le=10, description="largest accepted drop as a fraction of the baseline")
    min_top1: float | None = Field(None, ge=0, le=1, description="agreement: minimum top-1 agreement")
    max_mean_kl: float | None = Field(None, ge=0, description="agreement: maximum mean KL(baseline || candidate), nats")
    mode: Literal["threshold", "non_inferiority"] = "threshold"
    confidence: float = Field(0.95, gt=0.5, lt=1, description="non_inferiority: one-sided confidence")

    @model_validator(mode="after")
    def _check(self) -> "GateSpec":
        where = f"gate '{self.name}'"
        if self.kind == "agreement":
            if self.task:
                raise ValueError(f"{where}: agreement takes no task")
            if self.metric not in (None, "top1"):
                raise ValueError(f"{where}: agreement metric must be top1, got '{self.metric}'")
            if self.min_top1 is None and self.max_mean_kl is None and self.max_abs_drop is None:
                raise ValueError(f"{where}: agreement needs min_top1, max_mean_kl or max_abs_drop")
            return self
        if self.min_top1 is not None or self.max_mean_kl is not None:
            raise ValueError(f"{where}: min_top1 / max_mean_kl apply to agreement gates only")
        self.task = self.task or DEFAULT_TASK.get(self.kind)
        if not self.task:
            raise ValueError(f"{where}: {self.kind} needs a task")
        from slotune.evals.tasks import bundled_tasks

        if self.task not in bundled_tasks():
            raise ValueError(f"{where}: unknown task '{self.task}'; bundled: {', '.join(bundled_tasks())}")
        if self.max_abs_drop is None and self.max_rel_drop is None:
            raise ValueError(f"{where}: set max_abs_drop and/or max_rel_drop")
        return self

    @property
    def metric_name(self) -> str:
        return self.metric or DEFAULT_METRIC[self.kind]

    def margin(self, baseline: float) -> float:
        """Largest accepted drop: the tighter of the absolute and relative limits."""
        m = math.inf
        if self.max_abs_drop is not None:
            m = min(m, self.max_abs_drop)
        if self.max_rel_drop is not None:
            m = min(m, self.max_rel_drop * abs(baseline))
        return m


@dataclass
class GateResult:
    name: str
    kind: str
    passed: bool
    baseline: float | None  # the metric on the baseline config
    candidate: float | None  # the metric on the candidate config
    stderr: float | None  # SE of the drop (paired where the items match)
    drop: float | None  # positive = candidate worse, in the metric's units
    reason: str
    metric: str = ""
    margin: float | None = None
    num_items: int = 0
    seconds: float = 0.0  # candidate evaluation time (baseline excluded)
    details: dict[str, Any] = field(default_factory=dict)


@dataclass
class GateReport:
    gates: list[GateResult]

    @property
    def passed(self) -> bool:
        return all(g.passed for g in self.gates)

    @property
    def failures(self) -> list[str]:
        return [f"{g.name}: {g.reason}" for g in self.gates if not g.passed]

    def to_dict(self) -> dict[str, Any]:
        return {"passed": self.passed, "gates": [asdict(g) for g in self.gates]}


# --- baseline --------------------------------------------------------------------------------
def model_identity(model_path: Path) -> str:
    """Cheap stable identity: size + mtime + hash of the first MiB (files) or of each file's stat (dirs)."""
    p = Path(model_path)
    h = hashlib.sha256()
    if p.is_dir():
        for f in sorted(p.glob("*.json")) + sorted(p.glob("*.safetensors")):
            st = f.stat()
            h.update(f"{f.name}:{st.st_size}:{st.st_mtime_ns}".encode())
    else:
        st = p.stat()
        h.update(f"{st.st_size}:{st.st_mtime_ns}".encode())
        with p.open("rb") as fh:
            h.update(fh.read(2**20))
    return h.hexdigest()[:16]


def default_cache_dir() -> Path:
    return cache_root() / "baselines"


def baseline_config(config):
    """The reference for a candidate: same model and shape knobs, full-precision weights and KV
    cache, default compute dtype (bf16 on CUDA, fp32 on CPU), no speculative decoding."""
    return config.with_updates({"quantization": "none", "kv_dtype": "auto", "speculative.method": "none",
                                "dtype": "auto", "num_kv_blocks": None,
                                "kv_cache_memory_gb": min(config.kv_cache_memory_gb, 0.5)})


def _resolved(config) -> dict[str, Any]:
    """The fields that decide a config's numbers, with auto resolved."""
    from slotune.engine.model_runner import resolve_device, resolve_dtype

    dev = resolve_device(config)
    return {"device": dev.type, "dtype": str(resolve_dtype(config, dev)), "quantization": config.quantization,
            "quant_group_size": config.quant_group_size if config.quantization == "int4" else None,
            "kv_dtype": config.kv_dtype, "speculative": config.speculative.method, "model": config.model}


class Baseline:
    """The baseline engine (loaded only when a number is not cached) and the on-disk cache."""

    def __init__(self, candidate_llm, cache_dir: Path, baseline_llm=None) -> None:
        from slotune.engine.loader import resolve_model_path

        self.config = baseline_config(candidate_llm.config)
        self.cache_dir = cache_dir
        spec = _resolved(self.config)
        # The candidate is its own baseline when every number-deciding field already matches.
        self.is_candidate = _resolved(candidate_llm.config) == spec
        if baseline_llm is not None and _resolved(baseline_llm.config) != spec:
            raise ValueError(f"baseline_llm does not run the baseline config: {_resolved(baseline_llm.config)} != {spec}")
        self._llm = candidate_llm if self.is_candidate else baseline_llm
        self.identity = {"model": model_identity(resolve_model_path(self.config.model)),
                         "device": spec["device"], "dtype": spec["dtype"], "scorer": SCORER_VERSION}

    @property
    def llm(self):
        if self._llm is None:
            from slotune.engine import LLM

            log.info("loading the baseline engine for quality gates")
            self._llm = LLM(self.config)
        return self._llm

    def cached(self, key: dict[str, Any], compute: Callable[[], Any]) -> Any:
        full = {**key, **self.identity}
        digest = hashlib.sha256(json.dumps(full, sort_keys=True).encode()).hexdigest()[:24]
        path = self.cache_dir / f"{key.get('kind', 'gate')}-{digest}.json"
        if path.exists():
            try:
                return json.loads(path.read_text())["value"]
            except (ValueError, KeyError):
                log.warning("ignoring unreadable baseline cache %s", path)
        value = compute()
        self.cache_dir.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=self.cache_dir, suffix=".tmp")  # atomic: parallel trials share it
        with os.fdopen(fd, "w") as fh:
            json.dump({"key": full, "value": value}, fh)
        os.replace(tmp, path)
        return value


# --- gates -----------------------------------------------------------------------------------
def _task_gate(gate: GateSpec, llm, base: Baseline) -> GateResult:
    from slotune.evals.tasks import run_task, task_fingerprint

    metric = gate.metric_name
    key = {"kind": gate.kind, "task": gate.task, "data": task_fingerprint(gate.task), "limit": gate.limit}
    cand = None
    if base.is_candidate:  # one run serves both sides
        cand = run_task(llm, gate.task, gate.limit)
        ref = base.cached(key, lambda: cand["per_doc"])
    else:
        ref = base.cached(key, lambda: run_task(base.llm, gate.task, gate.limit)["per_doc"])
    if metric not in ref:
        raise ValueError(f"gate '{gate.name}': task {gate.task} has no metric '{metric}' (has: {', '.join(ref)})")
    if cand is None:
        cand = run_task(llm, gate.task, gate.limit)
    b = {int(k): v for k, v in ref[metric].items()}
    c = cand["per_doc"][metric]
    if gate.kind == "perplexity":  # lower is better: drop = candidate - baseline
        b_val, c_val, se, n = paired_perplexity_drop(b, c)
        drop = c_val - b_val
    else:
        drop, se, n = paired_drop(b, c)
        b_val = sum(b[i] for i in c if i in b) / max(n, 1)
        c_val = b_val - drop
    margin = gate.margin(b_val)
    v = judge(drop, se, margin, gate.mode, gate.confidence, what=f"{metric} drop" if gate.kind != "perplexity"
              else f"{metric} increase")
    return GateResult(name=gate.name, kind=gate.kind, passed=v.passed, baseline=b_val, candidate=c_val, stderr=se,
                      drop=drop, reason=v.reason, metric=metric, margin=margin, num_items=n, seconds=cand["seconds"],
                      details={"task": gate.task, "bound": v.bound, "metrics": cand["metrics"]})


def evaluate_gates(config, gates: list[GateSpec], *, llm=None, cache_dir: str | Path | None = None,
                   baseline_llm=None) -> GateReport:
    """Run every gate for `config` against its cached baseline.

    Args:
        config: the candidate EngineConfig.
        gates: validated gate specs (`GateSpec.model_validate(d)` for each dict).
        llm: a loaded, idle `slotune.engine.LLM` for `config` (saves a model load in trials).
        cache_dir: baseline cache folder (default `engine/paths.py: cache_root()`/baselines).
        baseline_llm: a loaded engine for `baseline_config(config)`, used when a baseline number
            is not cached (default: loaded on demand, or `llm` itself when config is its own baseline).
    Returns:
        GateReport: one GateResult per gate, in order; `report.passed`, `report.to_dict()`.
        A gate that errors is a failed GateResult whose reason starts with "error:".
    """
    if llm is None:
        from slotune.engine import LLM

        llm = LLM(config)
    base = Baseline(llm, Path(cache_dir) if cache_dir else default_cache_dir(), baseline_llm)
    results = []
    for g in gates:
        t0 = time.perf_counter()
        try:
            if g.kind == "agreement":
                from slotune.evals.agreement import agreement_gate

                r = agreement_gate(g, llm, base)
            else:
                r = _task_gate(g, llm, base)
        except Exception as e:  # recorded, not raised: a failed gate makes a trial infeasible, not the study crash
            log.exception("gate %s errored", g.name)
            r = GateResult(name=g.name, kind=g.kind, passed=False, baseline=None, candidate=None, stderr=None,
                           drop=None, reason=f"error: {type(e).__name__}: {e}", metric=g.metric_name)
        r.details["wall_s"] = time.perf_counter() - t0
        results.append(r)
    return GateReport(results)


# --- built-in gates and the `tune eval` command -----------------------------------------------
def builtin_gates_path() -> Path:
    from importlib import resources

    return Path(str(resources.files("slotune.evals") / "tasks" / "default_gates.yaml"))


def load_gates(path: Path | None) -> list[GateSpec]:
    """A gates YAML: a list of gates, or a mapping with `quality_gates:` (a tuning spec works too).

    Read by the one plain-YAML reader (tuner/errors.py). Raises MissingFileError, or SpecError naming
    the file and each bad gate's field (`quality_gates[1].margin: ...`).
    """
    path = Path(path) if path else builtin_gates_path()
    data = load_yaml(path, "gates file")
    key = ""
    if isinstance(data, dict):
        key = "quality_gates" if "quality_gates" in data else "gates"
        data = data.get(key)
    if not isinstance(data, list):
        raise SpecError("expected a list of gates (or a mapping with 'quality_gates:')", source=path)
    gates, problems = [], []
    for i, g in enumerate(data):
        try:
            gates.append(GateSpec.model_validate(g))
        except ValidationError as exc:
            problems += SpecError.from_validation(exc, path, prefix=f"{key}[{i}]").problems
    if problems:
        raise SpecError(problems=problems)
    return gates


def render_report(report: GateReport, title: str = "quality gates"):
    from rich.table import Table

    t = Table(title=f"{title}: {'[green]PASS[/green]' if report.passed else '[red]FAIL[/red]'}")
    for c in ("gate", "metric", "baseline", "candidate", "drop", "stderr", "margin", "n", "s", "result"):
        t.add_column(c, justify="right" if c not in ("gate", "metric", "result") else "left")
    f = lambda v: "-" if v is None else f"{v:.4g}"  # noqa: E731
    for r in report.gates:
        t.add_row(r.name, r.metric, f(r.baseline), f(r.candidate), f(r.drop), f(r.stderr), f(r.margin),
                  str(r.num_items), f"{r.seconds:.1f}", ("[green]" if r.passed else "[red]") + r.reason)
    return t


def eval_command(config: Path | None, gates: Path | None, json_out: Path | None) -> GateReport:
    """`tune eval CONFIG --gates GATES.yaml [--json OUT]`: run gates alone and print a table."""
    from rich.console import Console

    from slotune.engine.config import EngineConfig

    cfg = EngineConfig.from_yaml(config) if config else EngineConfig()
    specs = load_gates(gates)
    report = evaluate_gates(cfg, specs)
    Console().print(render_report(report))
    if json_out:
        Path(json_out).write_text(json.dumps(report.to_dict(), indent=1))
    return report
