"""kopf handlers: tiny, each hands off to serving.reconcile or tuning.advance.

Errors: API hiccups (5xx, 409 conflicts, timeouts) are temporary and retried after a delay;
an invalid spec is permanent (reported in status and an Event, not retried until the spec
changes), with the `Valid` condition. The operator never reads Secrets: credentials reach
pods through secretKeyRef, to keys of the resource's own namespace that it allows.

The allow-lists for images, service accounts and Secret keys (admission.Admission) are read
from the environment once, at startup, and handed to the handlers through kopf's memo.

Timing knobs: $SLOTUNE_OPERATOR_POLL_SECONDS (timer interval, default 10); rollout durations
come from each SLOTuning's spec.rollout.
"""

from __future__ import annotations

import json
import logging
import os
from typing import Any

import kopf
import urllib3
from kubernetes.client.rest import ApiException

from slotune.operator import admission, api, conditions, serving, tuning

POLL_S = float(os.environ.get("SLOTUNE_OPERATOR_POLL_SECONDS", "10"))


@kopf.on.startup()
def configure(settings: kopf.OperatorSettings, memo: kopf.Memo, **_: Any) -> None:
    try:
        memo.admission = admission.Admission.from_env()
    except ValueError as exc:  # a misconfigured operator stops here, naming the setting
        raise kopf.PermanentError(str(exc)) from None
    settings.posting.level = logging.WARNING  # our own Events are posted explicitly
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix=api.GROUP)
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(prefix=api.GROUP)
    # kopf holds a finalizer while timers run, to stop them before the object goes
    settings.persistence.finalizer = f"{api.GROUP}/operator"
    settings.watching.server_timeout = 300
    settings.networking.request_timeout = 30


@kopf.on.login()
def login(**_: Any) -> kopf.ConnectionInfo:
    """The same credentials for kopf and for the kubernetes client the handlers use."""
    api.reset_client()
    cfg = api.load_configuration()
    header = cfg.get_api_key_with_prefix("BearerToken") or cfg.get_api_key_with_prefix("authorization") or ""
    scheme, _, token = header.rpartition(" ")
    return kopf.ConnectionInfo(
        server=cfg.host,
        ca_path=cfg.ssl_ca_cert,
        insecure=not cfg.verify_ssl,
        scheme=scheme or None,
        token=token or None,
        certificate_path=cfg.cert_file,
        private_key_path=cfg.key_file,
    )


def _api_call(fn, *args: Any) -> Any:
    try:
        return fn(*args)
    except ApiException as exc:
        if exc.status in (400, 422):
            raise kopf.PermanentError(f"the API server rejected a child: {_message(exc)}") from None
        raise kopf.TemporaryError(f"API {exc.status}: {_message(exc)}", delay=max(POLL_S, 1)) from None
    except (OSError, urllib3.exceptions.HTTPError) as exc:  # connection trouble (an API server restart)
        raise kopf.TemporaryError(f"API unreachable: {exc}", delay=max(POLL_S, 1)) from None


def _message(exc: ApiException) -> str:
    """The API server's own explanation (a Status message: names, fields, never Secret data)."""
    try:
        return str(json.loads(exc.body)["message"])[:300]
    except (TypeError, ValueError, KeyError):
        return str(exc.reason)


# --- SLOServing ----------------------------------------------------------------------------


def _reconcile_serving(name: str, namespace: str, spec: Any, body: Any, status: Any, patch: Any, memo: Any) -> None:
    status = dict(status or {})
    old = [dict(c) for c in status.get("conditions") or []]
    try:
        observed = _api_call(serving.reconcile, name, namespace, dict(spec), body, memo.admission)
    except ValueError as exc:
        reason = exc.rejection.reason if isinstance(exc, admission.Rejected) else "InvalidConfig"
        new = conditions.with_condition(old, conditions.VALID, False, reason, str(exc), tuning.stamp(tuning.now()))
        if status.get("phase") != "Invalid" or status.get("message") != str(exc) or new != old:
            patch.status.update({"phase": "Invalid", "message": str(exc), "conditions": new})
            kopf.warn(body, reason=reason, message=str(exc))
        return
    observed["message"] = None
    observed["conditions"] = conditions.with_condition(
        old, conditions.VALID, True, "Valid", "the spec is valid", tuning.stamp(tuning.now())
    )
    if any(status.get(k) != v for k, v in observed.items()):
        patch.status.update(observed)


@kopf.on.create(api.GROUP, api.VERSION, api.SERVINGS)
@kopf.on.update(api.GROUP, api.VERSION, api.SERVINGS, field="spec")
@kopf.on.resume(api.GROUP, api.VERSION, api.SERVINGS)
def serving_changed(name, namespace, spec, body, status, patch, memo, **_: Any) -> None:
    _reconcile_serving(name, namespace, spec, body, status, patch, memo)


@kopf.timer(api.GROUP, api.VERSION, api.SERVINGS, interval=POLL_S)
def serving_tick(name, namespace, spec, body, status, patch, memo, **_: Any) -> None:
    _reconcile_serving(name, namespace, spec, body, status, patch, memo)


# --- SLOTuning -----------------------------------------------------------------------------


@kopf.timer(api.GROUP, api.VERSION, api.TUNINGS, interval=POLL_S)
def tuning_tick(name, namespace, spec, body, status, patch, memo, **_: Any) -> None:
    # The state machine steps from the stored status: kopf's copy is stale while its watch reconnects
    # (an API server restart), and a stale phase would repeat a step (a second canary, a second run).
    stored = _api_call(api.read_custom, api.TUNINGS, namespace, name)
    if stored is None:
        return
    spec, status = stored.get("spec") or spec, stored.get("status") or {}
    step = tuning.Step(
        name=name, namespace=namespace, spec=dict(spec), status=dict(status or {}), body=body, admission=memo.admission
    )
    _api_call(tuning.advance, step)
    if step.patch:
        patch.status.update(step.patch)
    for type_, reason, message in step.events:
        kopf.event(body, type=type_, reason=reason, message=message)


@kopf.on.update(api.GROUP, api.VERSION, api.TUNINGS, field="spec")
def tuning_spec_changed(status, patch, **_: Any) -> None:
    """A fixed spec gets a fresh run (a failed one would otherwise wait for its schedule)."""
    if (status or {}).get("phase") == "Failed":
        patch.status["phase"] = "Pending"
