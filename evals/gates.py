"""Quality gates: a candidate config must not lose quality against the unquantized baseline.

Kinds:
- agreement: top-1 next-token agreement and mean KL(baseline || candidate) on a fixed set of
  real-text prompts. Sensitive where a 135M model's task accuracy is too noisy to tell.
- lm_eval: an lm-eval task run through our engine (`evals/lm_eval_adapter.py`), compared with
  the baseline's score; `non_inferiority` mode fails only if the drop exceeds the margin with
  the given one-sided confidence.
- perplexity: loglikelihood_rolling over real text; gate on the relative increase.
Baseline numbers are computed once per (model identity, gate) and cached on disk.
"""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator


class GateSpec(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str
    kind: Literal["agreement", "lm_eval", "perplexity"]
    task: str | None = Field(None, description="lm_eval: a bundled task name (see `slotune.evals.tasks`)")
    metric: str = Field("acc", description="lm_eval metric name")
    limit: int | None = Field(None, ge=1, description="number of samples / prompts")
    min_top1: float | None = Field(None, ge=0, le=1, description="agreement: minimum top-1 agreement")
    max_mean_kl: float | None = Field(None, ge=0, description="agreement: maximum mean KL (nats)")
    max_abs_drop: float | None = Field(None, ge=0)
    max_rel_drop: float | None = Field(None, ge=0, le=1)
    mode: Literal["threshold", "non_inferiority"] = "threshold"
    confidence: float = Field(0.95, gt=0.5, lt=1)

    @model_validator(mode="after")
    def _check(self) -> "GateSpec":
        if self.kind == "agreement" and self.min_top1 is None and self.max_mean_kl is None:
            raise ValueError(f"gate '{self.name}': agreement needs min_top1 and/or max_mean_kl")
        if self.kind == "lm_eval" and not self.task:
            raise ValueError(f"gate '{self.name}': lm_eval needs a task")
        if self.kind in ("lm_eval", "perplexity") and self.max_abs_drop is None and self.max_rel_drop is None:
            raise ValueError(f"gate '{self.name}': set max_abs_drop or max_rel_drop")
        return self


@dataclass
class GateResult:
    name: str
    kind: str
    passed: bool
    baseline: float | None
    candidate: float | None
    stderr: float | None
    drop: float | None
    reason: str
    details: dict[str, Any] = field(default_factory=dict)


@dataclass
class GateReport:
    gates: list[GateResult]

    @property
    def passed(self) -> bool:
        return all(g.passed for g in self.gates)

    def to_dict(self) -> dict[str, Any]:
        return {"passed": self.passed, "gates": [asdict(g) for g in self.gates]}


def model_identity(model_path: Path) -> str:
    """Cheap stable identity: size + mtime + hash of the first MiB (files) or config (dirs)."""
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
    from slotune.engine.loader import cache_dir

    return cache_dir() / "baselines"


def baseline_config(config):
    """The unquantized reference for a candidate: same model, 16-bit-or-better everything, no drafts."""
    return config.with_updates({"quantization": "none", "kv_dtype": "auto", "speculative.method": "none",
                                "dtype": "float32" if config.device != "cuda" else "bfloat16"})


class _Baseline:
    """Lazily loaded baseline engine plus an on-disk cache of its numbers."""

    def __init__(self, config, cache_dir: Path) -> None:
        self.config = baseline_config(config)
        self.cache_dir = cache_dir
        self._llm = None

    @property
    def llm(self):
        if self._llm is None:
            from slotune.engine import LLM

            self._llm = LLM(self.config)
        return self._llm

    def cached(self, key: dict[str, Any], compute):
        from slotune.engine.loader import resolve_model_path

        ident = model_identity(resolve_model_path(self.config.model))
        digest = hashlib.sha256(json.dumps({**key, "model": ident}, sort_keys=True).encode()).hexdigest()[:20]
        path = self.cache_dir / f"{digest}.json"
        if path.exists():
            return json.loads(path.read_text())
        value = compute()
        self.cache_dir.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(value))
        tmp.replace(path)
        return value


def one_sided_z(confidence: float) -> float:
    from statistics import NormalDist

    return NormalDist().inv_cdf(confidence)


def judge_drop(gate: GateSpec, baseline: float, candidate: float, stderr: float | None, higher_is_better: bool = True
               ) -> tuple[bool, float, str]:
    """Compare a candidate score with the baseline; returns (passed, drop, reason)."""
    drop = (baseline - candidate) if higher_is_better else (candidate - baseline)
    margin = math.inf
    if gate.max_abs_drop is not None:
        margin = min(margin, gate.max_abs_drop)
    if gate.max_rel_drop is not None:
        margin = min(margin, gate.max_rel_drop * abs(baseline))
    if gate.mode == "non_inferiority" and stderr:
        # Fail only if the drop exceeds the margin with the given one-sided confidence.
        lower = drop - one_sided_z(gate.confidence) * stderr
        ok = lower <= margin
        why = f"drop {drop:.4g} (lower {gate.confidence:.0%} bound {lower:.4g}) vs margin {margin:.4g}"
    else:
        ok = drop <= margin
        why = f"drop {drop:.4g} vs margin {margin:.4g}"
    return ok, drop, ("ok: " if ok else "failed: ") + why


def evaluate_gates(config, gates: list[GateSpec], *, llm=None, cache_dir: str | Path | None = None) -> GateReport:
    """Run every gate for `config` (using `llm` if already loaded) against the cached baseline.

    Args:
        config: candidate EngineConfig.
        gates: gate specs.
        llm: a loaded LLM for `config` (saves a model load inside trials).
        cache_dir: where baseline numbers are cached (default ~/.cache/slotune/baselines).
    Returns:
        GateReport with one GateResult per gate.
    """
    from slotune.engine import LLM

    llm = llm or LLM(config)
    base = _Baseline(config, Path(cache_dir) if cache_dir else default_cache_dir())
    results = []
    for g in gates:
        if g.kind == "agreement":
            from slotune.evals.agreement import agreement_gate

            results.append(agreement_gate(g, llm, base))
        else:
            from slotune.evals.lm_eval_adapter import lm_eval_gate

            results.append(lm_eval_gate(g, llm, base))
    return GateReport(results)


def builtin_gates_path() -> Path:
    from importlib import resources

    return Path(str(resources.files("slotune.evals") / "tasks" / "default_gates.yaml"))


def eval_command(config: Path | None, gates: Path | None, json_out: Path | None) -> GateReport:
    import yaml
    from rich.console import Console
    from rich.table import Table

    from slotune.engine.config import EngineConfig

    cfg = EngineConfig.from_yaml(config) if config else EngineConfig()
    data = yaml.safe_load(Path(gates or builtin_gates_path()).read_text())
    if isinstance(data, dict):
        data = data.get("quality_gates", data.get("gates"))
    if not isinstance(data, list):
        raise ValueError(f"{gates}: expected a list of gates (or a mapping with 'quality_gates:')")
    report = evaluate_gates(cfg, [GateSpec.model_validate(g) for g in data])
    t = Table(title=f"quality gates: {'PASS' if report.passed else 'FAIL'}")
    for c in ("gate", "baseline", "candidate", "stderr", "drop", "result"):
        t.add_column(c)
    f = lambda v: "-" if v is None else f"{v:.4g}"  # noqa: E731
    for r in report.gates:
        t.add_row(r.name, f(r.baseline), f(r.candidate), f(r.stderr), f(r.drop), r.reason)
    Console().print(t)
    if json_out:
        json_out.write_text(json.dumps(report.to_dict(), indent=1))
    return report
