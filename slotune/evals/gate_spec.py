"""What a quality gate is (GateSpec, as a user writes it) and what it found (GateResult, GateReport).

Plain records, no engine: the tuning spec, the trial process and the gate kinds (slotune/evals/gates.py,
slotune/evals/agreement.py) all read them from here.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from slotune.evals.tasks import bundled_tasks

DEFAULT_METRIC = {"lm_eval": "acc", "perplexity": "word_perplexity", "agreement": "top1", "greedy_match": "match"}
DEFAULT_TASK = {"perplexity": "slotune_kjv_perplexity"}


class GateSpec(BaseModel):
    """One quality gate, as written under `quality_gates:` in a tuning spec or a gates YAML."""

    model_config = ConfigDict(extra="forbid")

    name: str
    kind: Literal["agreement", "lm_eval", "perplexity", "greedy_match"]
    task: str | None = Field(
        None, description="bundled lm-eval task (lm_eval, perplexity); see slotune/evals/tasks/SOURCES.md"
    )
    metric: str | None = Field(
        None,
        description="lm_eval: acc | acc_norm | exact_match; perplexity: "
        "word_perplexity | byte_perplexity; agreement: top1 (default per kind)",
    )
    limit: int | None = Field(
        None, ge=2, description="documents (lm_eval, perplexity) or prompts (agreement); None = all"
    )
    max_abs_drop: float | None = Field(None, ge=0, description="largest accepted drop, in the metric's units")
    max_rel_drop: float | None = Field(
        None, ge=0, le=10, description="largest accepted drop as a fraction of the baseline"
    )
    min_top1: float | None = Field(None, ge=0, le=1, description="agreement: minimum top-1 agreement")
    max_mean_kl: float | None = Field(None, ge=0, description="agreement: maximum mean KL(baseline || candidate), nats")
    min_match: float | None = Field(
        None, ge=0, le=1, description="greedy_match: minimum mean share of the reference's answer tokens reproduced"
    )
    max_tokens: int | None = Field(None, ge=1, le=512, description="greedy_match: tokens per answer (default 32)")
    mode: Literal["threshold", "non_inferiority"] = "threshold"
    confidence: float = Field(0.95, gt=0.5, lt=1, description="non_inferiority: one-sided confidence")

    @model_validator(mode="after")
    def _check(self) -> "GateSpec":
        where = f"gate '{self.name}'"
        if self.kind != "greedy_match" and (self.min_match is not None or self.max_tokens is not None):
            raise ValueError(f"{where}: min_match / max_tokens apply to greedy_match gates only")
        if self.kind == "greedy_match":
            if self.task or self.metric not in (None, "match"):
                raise ValueError(f"{where}: greedy_match takes no task, and its metric is match")
            if self.min_match is None:
                raise ValueError(f"{where}: greedy_match needs min_match, e.g. 0.9")
            return self
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
