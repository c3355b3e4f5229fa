"""Live progress for `tune run`: trial n/N, best so far, the current trial's phase; a summary
table at the end. With `--no-progress` (or when stdout is not a terminal) plain log lines."""

from __future__ import annotations

from rich.console import Console, Group
from rich.live import Live
from rich.table import Table
from slotune.tuner.measure.units import format_params, format_value, metric_label
from slotune.tuner.search.records import TrialRecord
from slotune.tuner.search.retry import replaced_attempts
from slotune.tuner.search.references import trial_label
from slotune.tuner.search.trials import best_trial
from slotune.tuner.spec.slo import metric_key


class Progress:
    """Context manager fed by the study: `phase()` from the objective, `callback()` per trial."""

    def __init__(self, spec, total: int, enabled: bool = True) -> None:
        self.spec = spec
        self.total = total
        self.console = Console()
        self.is_live = enabled and self.console.is_terminal
        self.rows: list[tuple[str, ...]] = []
        self.num_finished = 0
        self.current = ""
        self.best = "-"
        self._live: Live | None = None
        self._is_finished = False

    def __enter__(self) -> "Progress":
        if self.is_live:
            self._live = Live(self._render(), console=self.console, refresh_per_second=4, transient=True)
            self._live.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self.finish()

    def finish(self) -> None:
        """Stop the live display and print the table of all trials (once)."""
        if self._is_finished:
            return
        self._is_finished = True
        if self._live is not None:
            self._live.__exit__(None, None, None)
            self._live = None
        self.console.print(self._table(len(self.rows)))

    # --- fed by the study ------------------------------------------------------------------
    def seed_rows(self, study) -> None:
        """Show the trials a resumed study already has."""
        for t in study.trials:
            if t.state.is_finished():
                self._add(study, t, log=False)
        if self.rows:
            self.say(
                f"resuming study '{self.spec.name}': {_slots(self.num_finished)}/{self.total} trials already finished"
            )

    def phase(self, number: int | None, text: str) -> None:
        self.current = f"trial {number}: {text}" if number is not None else text
        if self._live is not None:
            self._live.update(self._render())
        elif number is None or not text.startswith("replay "):  # plain mode: no per-request spam
            self.console.print(f"  {self.current}", highlight=False, soft_wrap=True)

    def callback(self, study, trial) -> None:
        self._add(study, trial, log=True)
        self.current = ""
        if self._live is not None:
            self._live.update(self._render())

    def say(self, text: str) -> None:
        self.console.print(text, highlight=False, soft_wrap=True)

    def summary(self, best, remeasure: dict, references: dict, out) -> None:
        """Final table: winner vs its re-measurement vs the default and naive configs."""
        self.finish()
        obj = self.spec.objective
        p = obj.percentile
        keys = [
            obj.metric_key(),
            metric_key("ttft", p),
            metric_key("tpot", p),
            "output_tokens_per_s",
            "goodput_rps",
            "slo_attainment",
        ]
        t = Table(title=f"study {self.spec.name}: winner = trial {best.number}")
        for c in ("metric", "winner", "re-measured", "default", "naive"):
            t.add_column(c, justify="right" if c != "metric" else "left")
        cols = [
            TrialRecord.of(best).metrics or {},
            (remeasure or {}).get("metrics") or {},
            references.get("default") or {},
            references.get("naive") or {},
        ]
        for k in dict.fromkeys(keys):
            t.add_row(metric_label(k), *[format_value(k, c.get(k)) for c in cols])
        self.console.print(t)
        self.say(f"best config -> {out / 'best.yaml'}; report -> {out / 'report.md'} (+ .html)")

    # --- rendering -------------------------------------------------------------------------
    def _add(self, study, trial, log: bool) -> None:
        trial = TrialRecord.of(trial)
        key = self.spec.objective.metric_key()
        value = format_value(key, trial.values[0]) if trial.values else "-"
        feasible = {True: "yes", False: "no", None: "-"}[trial.feasible]
        if trial.early_stopped:
            feasible = "no (early stop)"
        detail = trial.fail_reason or format_params(trial.params) or "no knob set"
        tag = trial_label(trial)
        self.rows.append(
            (f"{trial.number}" + (f" ({tag})" if tag else ""), trial.state.name, value, feasible, detail[:100])
        )
        if trial.number not in replaced_attempts(study.get_trials(deepcopy=False)):  # a retry holds the slot
            self.num_finished += trial.budget_share  # a screened-out trial: its short replay's share
        b = best_trial(study, self.spec)
        self.best = f"{format_value(key, b.values[0])} (trial {b.number})" if b else "-"
        if log and self._live is None:
            self.say(
                f"[{_slots(self.num_finished)}/{self.total}] trial {trial.number} {trial.state.name} "
                f"{key}={value} feasible={feasible} best={self.best} | {detail[:160]}"
            )

    def _table(self, last: int = 12) -> Table:
        obj = self.spec.objective
        t = Table(title=f"study {self.spec.name}: {obj.direction()} {obj.metric_key()}")
        for c in ("trial", "state", obj.metric_key(), "feasible", "params / reason"):
            t.add_column(c)
        for r in self.rows[-last:]:
            t.add_row(*r)
        return t

    def _render(self) -> Group:
        return Group(
            self._table(),
            f"[bold]{_slots(self.num_finished)}/{self.total}[/bold] trials · best {self.best} · {self.current}",
        )


def _slots(x: float) -> str:
    """Budget slots held: "3", or "3.33" with screened-out trials' shares."""
    return str(round(x)) if abs(x - round(x)) < 1e-9 else f"{x:.2f}"
