"""`tune run`'s sweep after the study: the winner, the default and the naive config swept (measure/load_sweep.py),
kept in the study so a resumed run does not sweep again."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

from slotune.tuner.measure.load_sweep import LoadCurve, SweepResult, load_kind, run_sweep
from slotune.tuner.measure.trial_process import DEFAULT_TRIAL_RUNNER
from slotune.tuner.report.facts import ReportSection
from slotune.tuner.report.markdown import write_atomic
from slotune.tuner.report.sweep_figures import point_line, report_sections
from slotune.tuner.search.records import TrialRecord, store_sweep, stored_sweep
from slotune.tuner.search.references import reference_configs
from slotune.tuner.spec.server import parse_config
from slotune.tuner.spec.slo import SLOLimits


def sweep_after_study(
    spec, study, best, *, runner: tuple[str, ...] = DEFAULT_TRIAL_RUNNER, say: Callable[[str], None] = print
) -> list[ReportSection]:
    """`run.finalize`'s sweep: with `spec.sweep.enabled`, the winner, the default and the naive
    config swept; sweep.json written to the output directory; the report's sections returned.

    Kept in the study (user attribute `sweep_<trial>`), so a resumed finalize does not sweep again.
    Returns [] when the sweep is off or there is no winner.
    """
    if not spec.sweep.enabled or best is None:
        return []
    best = TrialRecord.of(best)
    doc = stored_sweep(study, best.number)
    if doc is None:
        winner = parse_config(best.config)
        refs = reference_configs(spec.base_config())
        same = [tag for tag, cfg in refs if cfg == winner]
        configs = [(f"winner (= {same[0]})" if same else "winner", winner)] + [(t, c) for t, c in refs if c != winner]
        limits = SLOLimits.from_objective(spec.objective)
        say(f"sweeping the offered load of {', '.join(t for t, _ in configs)} (up to {spec.sweep.steps} steps each)")
        curves = []
        for tag, cfg in configs:
            try:
                curves.append(
                    run_sweep(
                        spec,
                        cfg,
                        name=tag,
                        runner=runner,
                        on_point=lambda n, load, p: say(point_line(n, load, p, limits)),
                    )
                )
            # The workload cannot be swept (a trace with no span): the report stays.
            except (ValueError, OSError) as exc:
                curves.append(
                    LoadCurve(tag, load_kind(spec.workload), cfg.model_dump(mode="json"), (), f"could not sweep: {exc}")
                )
        doc = SweepResult(spec.workload.name, limits, tuple(curves), spec.peak_rps).to_dict()
        store_sweep(study, best.number, doc)
    result = SweepResult.from_dict(doc)
    write_json(result, spec.resolved_output_dir() / "sweep.json")
    return report_sections(result)


def write_json(result: SweepResult, path: Path) -> None:
    write_atomic(path, json.dumps(result.to_dict(), indent=1))
