"""Live progress for `tune run`: trial n/N, best so far, current phase; plain lines when off."""

from __future__ import annotations

from rich.console import Console
from rich.live import Live
from rich.table import Table


class Progress:
    def __init__(self, spec, total: int, enabled: bool = True) -> None:
        self.spec = spec
        self.total = total
        self.enabled = enabled
        self.console = Console()
        self.rows: list[tuple] = []
        self.current = ""
        self.best: str = "-"
        self._live: Live | None = None

    def __enter__(self) -> "Progress":
        if self.enabled and self.console.is_terminal:
            self._live = Live(self._render(), console=self.console, refresh_per_second=4, transient=False)
            self._live.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        if self._live is not None:
            self._live.__exit__(*exc)
        else:
            self.console.print(self._table())

    def phase(self, number: int, text: str) -> None:
        self.current = f"trial {number}: {text}"
        self._refresh()

    def _table(self) -> Table:
        obj = self.spec.objective
        t = Table(title=f"study {self.spec.name}: {obj.direction()} {obj.metric_key()}")
        for c in ("trial", "state", obj.metric_key(), "feasible", "params / reason"):
            t.add_column(c)
        for r in self.rows[-15:]:
            t.add_row(*r)
        return t

    def _render(self):
        from rich.console import Group

        done = len(self.rows)
        return Group(self._table(), f"[bold]{done}/{self.total}[/bold] trials · best {self.best} · {self.current}")

    def _refresh(self) -> None:
        if self._live is not None:
            self._live.update(self._render())

    def callback(self, study, trial) -> None:
        value = f"{trial.values[0]:.4g}" if trial.values else "-"
        feasible = {True: "yes", False: "no", None: "-"}[trial.user_attrs.get("feasible")]
        detail = trial.user_attrs.get("fail_reason") or ", ".join(f"{k}={v}" for k, v in trial.params.items())
        tag = trial.user_attrs.get("tag")
        self.rows.append((f"{trial.number}" + (f" ({tag})" if tag else ""), trial.state.name, value, feasible, detail[:90]))
        from slotune.tuner.study import best_trial

        b = best_trial(study, self.spec)
        self.best = f"{b.values[0]:.4g} (trial {b.number})" if b else "-"
        self.current = ""
        if self._live is None:
            self.console.print(f"[{len(self.rows)}/{self.total}] trial {trial.number} {trial.state.name} "
                               f"{self.spec.objective.metric_key()}={value} feasible={feasible} {detail[:120]}")
        self._refresh()
