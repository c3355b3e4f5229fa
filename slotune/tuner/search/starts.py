"""Where a search starts: the reference trials and the search space's known-good starts (with their
repairs), and earlier studies' winners (warm starts)."""

from __future__ import annotations

from datetime import datetime
from typing import Any

from slotune.tuner.search.records import TrialRecord, enqueue, stored_fingerprint, stored_winner
from slotune.tuner.search.references import DEFAULT_TAG, default_is_base, reference_configs
from slotune.tuner.search.study import spec_fingerprint
from slotune.tuner.search.trials import best_trial
from slotune.tuner.spec.server import SERVER_KNOB, parse_config
from slotune.tuner.spec.shootout import default_tag
from slotune.tuner.spec.slo import SLO_KEYS
from slotune.tuner.spec.tuning_spec import TuningSpec

MAX_WARM_STARTS = 2  # earlier studies' winners enqueued at the start of a new study


def enqueue_reference_trials(study, spec: TuningSpec) -> None:
    """Default and naive reference configs first, so every result is a comparison; then the space's
    starting points for the objective's kind (`SearchSpace.starts`), each the base config with its
    params changed, and the winners of earlier studies of the same model and objective in the same
    storage (`warm_starts`), so the sampler starts from known-good corners.

    Only the process that created the study calls this, right after creating it (two processes
    starting together would each enqueue them otherwise; another may have started a trial
    already). A reference the space cannot express exactly (say the default max_num_seqs=16 in
    a space of 1..8) is not enqueued: `finalize` measures it beside the study instead, so a
    trial tagged `default` is always the true default config. A grid covers them on its own.
    """
    if spec.sampler == "grid" or any(TrialRecord.of(t).tag for t in study.get_trials(deepcopy=False)):
        return
    space = spec.search_space
    base, search = spec.base_config(), spec.search_base()
    for tag, cfg in reference_configs(base):
        params = {} if tag == DEFAULT_TAG and default_is_base(base) else _params_of(space, cfg, base)
        if params is not None and (tag == DEFAULT_TAG or cfg != base):
            enqueue(study, params, tag=tag)
    for label in [s.label for s in spec.servers or []][1:]:  # a shoot-out: each other server as it is run
        enqueue(study, {SERVER_KNOB: label}, tag=default_tag(label))
    for start in space.starts:
        if start.suits(spec.objective.kind, spec.objective.metric):
            params = _start_params(space, search, start.params)
            enqueue(study, params, start=start.name)
    for name, params in warm_starts(spec, study.study_name):
        enqueue(study, params, start=name)


class StartRepairs:
    """Optuna callback: a start (`SearchSpace.starts`) that missed an SLO limit on its trial is tried
    again with its next repair (`Start.then`, `Start.rung`), enqueued at once, as an expert who saw a
    batch-1 corner queue arrivals past the TTFT limit would try two sequences per step next, instead
    of leaving the neighbourhood of a good corner to the sampler's luck (the measured case:
    docs/design/tuner-search.md). A miss of the quality gates is not repaired (more sequences per
    step do not change the model's answers), nor a failed trial."""

    def __init__(self, spec: TuningSpec) -> None:
        self.spec = spec
        self.starts = {s.name: s for s in spec.search_space.starts if s.then}

    def __call__(self, study, trial) -> None:
        record = TrialRecord.of(trial)
        start, rung = self.starts.get(record.start), record.rung
        if start is None or rung >= len(start.then) or not _missed_slo(record):
            return
        params = _start_params(self.spec.search_space, self.spec.search_base(), start.rung(rung + 1))
        enqueue(study, params, start=start.name, rung=rung + 1)


def _missed_slo(record: TrialRecord) -> bool:
    """A measured trial that missed an SLO limit (or stopped early on one), its gates not failed."""
    v = record.violations or {}
    return (
        not record.feasible and not v.get("quality_gates") and any(v.get(k, 0) > 0 for k in (*SLO_KEYS, "early_stop"))
    )


def warm_starts(spec: TuningSpec, own_name: str) -> list[tuple[str, dict[str, Any]]]:
    """[(label, params)] of the winners of earlier studies in the spec's storage made for the same
    model, fixed engine config and objective (their fingerprints' `engine` and `objective` parts),
    newest first, at most MAX_WARM_STARTS: a re-tune on new traffic (the operator's schedule, a new
    workload) starts from what won before. Params are this space's, exact where the space can
    express the winner's config, else the knobs it can (the sampler fills the rest)."""
    import optuna

    mine = spec_fingerprint(spec)["parts"]
    space, base = spec.search_space, spec.search_base()
    url = spec.resolved_storage()
    found = []
    for s in sorted(
        optuna.get_all_study_summaries(url, include_best_trial=False),
        key=lambda s: s.datetime_start or datetime.min,
        reverse=True,
    ):
        parts = (stored_fingerprint(s) or {}).get("parts", {})
        if s.study_name == own_name or any(parts.get(k) != mine[k] for k in ("engine", "objective")):
            continue
        earlier = optuna.load_study(study_name=s.study_name, storage=url)
        number = stored_winner(s)  # declared after its confirmation; else its best trial
        best = (
            TrialRecord.of(earlier.trials[number])
            if number is not None and number < len(earlier.trials)
            else best_trial(earlier, spec)
        )
        if best is None or not best.config:
            continue
        cfg = parse_config(best.config)
        if type(cfg) is not type(spec.base_config()):  # a study of the other kind of config
            continue
        knobs = {k.name: k for k in space.knobs}
        params = _params_of(space, cfg, base) or {
            k: v for k, v in best.params.items() if k in knobs and knobs[k].can_take(v)
        }
        if params:
            found.append((f"warm: {s.study_name} trial {best.number}", params))
        if len(found) == MAX_WARM_STARTS:
            break
    return found


def _start_params(space, base, params: dict[str, Any]) -> dict[str, Any]:
    """A start's (or a repair's) params as the trial to enqueue: the whole config the base with them
    makes, in this space's params, when the space can express it; else them alone (the rest sampled)."""
    return _params_of(space, base.with_updates(params), base) or params


def _params_of(space, cfg, base) -> dict[str, Any] | None:
    """The space's parameters that turn `base` into exactly `cfg` (as a trial would), or None."""
    params: dict[str, Any] = {}
    for k in space.knobs:
        if not all(params.get(f) in vals for f, vals in k.when.items()):
            continue  # an inactive conditional knob
        v = cfg.value_at(k.name)
        if not _representable(k, v):
            return None
        params[k.name] = v
    return params if base.with_updates(params) == cfg else None


def _representable(knob, value) -> bool:
    if knob.type == "categorical":
        return value in knob.choices
    return isinstance(value, (int, float)) and not isinstance(value, bool) and knob.low <= value <= knob.high
