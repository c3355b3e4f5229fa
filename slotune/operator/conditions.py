"""status.conditions of both custom resources: one entry per type, in the Kubernetes shape.

`lastTransitionTime` moves only when `status` flips, and an unchanged condition gives back an
equal list, so a reconcile that learns nothing new writes nothing.
"""

from __future__ import annotations

from typing import Any

# types (reasons are CamelCase and specific: admission.Rejection.reason, rollout verdicts, ...)
VALID = "Valid"  # the spec is admitted (False: nothing is created; the message says why)
PERSISTENT_STORAGE = "PersistentStorage"  # False: the study / MLflow data go with the pod
SCHEDULED = "Scheduled"  # False: the schedule cannot start a next run
RETUNED = "Retuned"  # spec.traffic: False when a run was skipped (its traffic has not drifted)


def with_condition(
    conditions: list[dict[str, Any]] | None, type_: str, ok: bool, reason: str, message: str, at: str
) -> list[dict[str, Any]]:
    """`conditions` with the one of `type_` set; `at` is the transition time if `status` flips."""
    conditions = [dict(c) for c in (conditions or [])]
    old = next((c for c in conditions if c.get("type") == type_), None)
    state = "True" if ok else "False"
    if old is not None and (old.get("status"), old.get("reason"), old.get("message")) == (state, reason, message):
        return conditions
    new = {
        "type": type_,
        "status": state,
        "reason": reason,
        "message": message,
        "lastTransitionTime": at if old is None or old.get("status") != state else old.get("lastTransitionTime"),
    }
    return [c for c in conditions if c.get("type") != type_] + [new]
