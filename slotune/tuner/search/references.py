"""The two reference configs measured in every study, and how their numbers are found again.

"default" is the engine's defaults with the spec's fixed overrides; "naive" is the naive server
every result is compared with (static batches, no levers). The quality gates' full-precision
reference is the "baseline" (slotune/evals/baseline.py), a different thing with its own word.

Each is enqueued as a tagged trial (`study.enqueue_reference_trials`); when the search space
cannot represent one, it is measured beside the study and kept in a study user attribute under
its tag. Studies made before the naive config's rename tagged it "baseline" and are still read.
"""

from __future__ import annotations

from typing import Any

from slotune.tuner.measure.measurement import Measurement
from slotune.tuner.search.records import TrialRecord, stored_side_measurement
from slotune.tuner.spec.server import ServerConfig

DEFAULT_TAG, NAIVE_TAG = "default", "naive"
LEGACY_TAGS = {"baseline": NAIVE_TAG}  # studies made before the rename tagged the naive config "baseline"
NAIVE_UPDATES = {
    "scheduling": "static",
    "enable_prefix_caching": False,
    "quantization": "none",
    "speculative.method": "none",
    "kv_dtype": "auto",
}


def reference_configs(base) -> list[tuple[str, Any]]:
    """[(tag, config)] of the references of a study whose fixed config is `base`. An external server's
    default launch is its naive server too: only "default"."""
    if isinstance(base, ServerConfig):
        return [(DEFAULT_TAG, base)]
    return [(DEFAULT_TAG, base), (NAIVE_TAG, base.with_updates(NAIVE_UPDATES))]


def default_is_base(base) -> bool:
    """Whether the default trial measures the base config itself, sampling no knob: an external
    server's default leaves its flags off, which no value of a search space expresses."""
    return isinstance(base, ServerConfig)


def trial_tag(trial) -> str | None:
    """A trial's (FrozenTrial or TrialRecord) reference tag under its current name, or None for a searched trial."""
    tag = TrialRecord.of(trial).tag
    return LEGACY_TAGS.get(tag, tag)


def side_measurement(study, tag: str) -> dict | None:
    """The reference measured beside the study under `tag`, or under its name before the rename."""
    for key in (tag, *(old for old, new in LEGACY_TAGS.items() if new == tag)):
        stored = stored_side_measurement(study, key)
        if stored:
            return stored
    return None


def reference_results(study, field: str) -> dict[str, Any]:
    """{tag: the `field` ("metrics", "latencies") of the default-config and naive-config trials, or of
    their side measurements; None where neither has it}."""
    refs: dict[str, Any] = {DEFAULT_TAG: None, NAIVE_TAG: None}
    for t in map(TrialRecord.of, study.trials):
        tag = trial_tag(t)
        if tag in refs and t.is_complete and refs[tag] is None:
            refs[tag] = getattr(t, field)
    for tag in refs:
        if refs[tag] is None:
            refs[tag] = (side_measurement(study, tag) or {}).get(field)
    return refs


def reference_metrics(study) -> dict[str, Measurement | None]:
    """Metrics of the default-config and naive-config trials (or their side measurements)."""
    return {
        tag: Measurement.from_dict(m) if m is not None else None
        for tag, m in reference_results(study, "metrics").items()
    }


def trial_label(record: TrialRecord) -> str:
    """How the report, the progress display and MLflow name a trial's origin: a reference's tag
    (default, naive), a start's name, the trial whose measurement a repeat took, and the failed
    trial a retry measures again; "" if sampled."""
    if record.repeat_of is not None:
        return f"repeat of {record.repeat_of}"
    origin = str(record.tag or record.start or "")
    if record.retry_of is not None:
        return f"{origin}, retry of {record.retry_of}" if origin else f"retry of {record.retry_of}"
    return origin
