"""What the operator lets a custom resource ask for, and why a spec is refused.

The operator creates Jobs, Deployments and Roles with its own RBAC, so a free `image` or
`serviceAccountName` in a SLOTuning would let anyone allowed to create one run any code as
any service account of the namespace. The allow-lists come from the operator's own
configuration, read once at startup from its environment (manifests/operator.yaml sets it
from the ConfigMap `slotune-operator`):

    SLOTUNE_DEFAULT_IMAGE             image of resources without spec.image
                                      (default ghcr.io/slotune/slotune:0.1.0)
    SLOTUNE_ALLOWED_IMAGES            comma-separated entries: `registry/name` allows any tag or
                                      digest of that image, `registry/name:tag` (or `@sha256:...`)
                                      exactly that one, `registry/prefix/` anything under it;
                                      default: the default image's name
    SLOTUNE_ALLOWED_SERVICE_ACCOUNTS  default: slotune-tuner,slotune-serving
    SLOTUNE_ALLOWED_SECRET_KEYS       keys a secretKeyRef may name; default: url,api-key

A refused spec becomes a `Rejection` (the field, a CamelCase reason, a message naming the
value and what is allowed); the handlers turn it into the `Valid` condition and create no
children. The operator never reads a Secret: it only checks the reference.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from typing import Any, Mapping

from pydantic import ValidationError

from slotune.operator import children, schedule, traffic
from slotune.tuner.spec.server import ServerConfig, is_launch
from slotune.tuner.spec.tuning_spec import TuningSpec

_NAME = r"[a-z0-9]+(?:(?:[._]|__|-+)[a-z0-9]+)*"
# distribution's reference grammar, lower-case names; a registry port only before a '/'
_IMAGE = re.compile(
    rf"^(?P<name>(?:[A-Za-z0-9.-]+(?::[0-9]+)?/)?{_NAME}(?:/{_NAME})*)"
    r"(?::(?P<tag>[A-Za-z0-9_][A-Za-z0-9_.-]{0,127}))?(?:@(?P<digest>sha256:[0-9a-f]{64}))?$"
)
_DNS_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")
_SECRET_KEY = re.compile(r"^[-._a-zA-Z0-9]+$")

DEFAULT_SERVICE_ACCOUNTS = (children.TUNER_SERVICE_ACCOUNT, children.SERVING_SERVICE_ACCOUNT)
DEFAULT_SECRET_KEYS = ("url", "api-key")
# the Secret references each kind may hold, with the key each defaults to (the CRDs' defaults)
SECRET_REFS = {"SLOTuning": {"storageSecret": "url"}, "SLOServing": {"apiKeySecret": "api-key"}}


@dataclass(frozen=True, slots=True)
class Rejection:
    """Why a spec is refused: `field` (e.g. spec.image), a CamelCase `reason`, a `message`."""

    field: str
    reason: str
    message: str


class Rejected(ValueError):
    """A refused spec, raised where a return value cannot carry it (SLOServing reconcile)."""

    def __init__(self, rejection: Rejection):
        super().__init__(rejection.message)
        self.rejection = rejection


def image_name(ref: str) -> str:
    """`registry/name` of an image reference (tag and digest dropped); ValueError if malformed."""
    m = _IMAGE.match(ref)
    if m is None:
        raise ValueError(f"'{ref}' is not an image reference")
    return m.group("name")


def is_image_allowed(ref: str, allowed: tuple[str, ...]) -> bool:
    m = _IMAGE.match(ref)
    if m is None:
        return False
    for entry in allowed:
        if entry.endswith("/"):
            if ref.startswith(entry):
                return True
        elif "@" in entry or _IMAGE.match(entry).group("tag"):
            if ref == entry:
                return True
        elif m.group("name") == entry:
            return True
    return False


def _list(env: Mapping[str, str], key: str, default: tuple[str, ...]) -> tuple[str, ...]:
    items = tuple(x.strip() for x in env.get(key, "").split(",") if x.strip())
    return items or default


@dataclass(frozen=True, slots=True)
class Admission:
    """The operator's allow-lists (see the module docstring for the environment variables)."""

    default_image: str = children.DEFAULT_IMAGE
    allowed_images: tuple[str, ...] = (image_name(children.DEFAULT_IMAGE),)
    allowed_service_accounts: tuple[str, ...] = DEFAULT_SERVICE_ACCOUNTS
    allowed_secret_keys: tuple[str, ...] = DEFAULT_SECRET_KEYS

    def __post_init__(self) -> None:
        for entry in self.allowed_images:
            if (
                not (entry.endswith("/") and _DNS_SUBDOMAIN.match(entry.split("/")[0].split(":")[0]))
                and _IMAGE.match(entry) is None
            ):
                raise ValueError(
                    f"SLOTUNE_ALLOWED_IMAGES: '{entry}' is neither an image reference nor a "
                    "registry prefix ending in '/'"
                )
        if not is_image_allowed(self.default_image, self.allowed_images):
            raise ValueError(
                f"SLOTUNE_DEFAULT_IMAGE '{self.default_image}' is not in SLOTUNE_ALLOWED_IMAGES "
                f"({', '.join(self.allowed_images)})"
            )
        for sa in self.allowed_service_accounts:
            if not _DNS_SUBDOMAIN.match(sa):
                raise ValueError(f"SLOTUNE_ALLOWED_SERVICE_ACCOUNTS: '{sa}' is not a service account name")
        for key in self.allowed_secret_keys:
            if not _SECRET_KEY.match(key):
                raise ValueError(f"SLOTUNE_ALLOWED_SECRET_KEYS: '{key}' is not a Secret key")

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> "Admission":
        """The allow-lists from `env` (default os.environ); ValueError names a bad entry."""
        env = os.environ if env is None else env
        default_image = env.get("SLOTUNE_DEFAULT_IMAGE", "").strip() or children.DEFAULT_IMAGE
        return cls(
            default_image=default_image,
            allowed_images=_list(env, "SLOTUNE_ALLOWED_IMAGES", (image_name(default_image),)),
            allowed_service_accounts=_list(env, "SLOTUNE_ALLOWED_SERVICE_ACCOUNTS", DEFAULT_SERVICE_ACCOUNTS),
            allowed_secret_keys=_list(env, "SLOTUNE_ALLOWED_SECRET_KEYS", DEFAULT_SECRET_KEYS),
        )

    def admit(self, kind: str, namespace: str, spec: dict[str, Any]) -> dict[str, Any]:
        """`spec` with the image and service account filled in; Rejected when not allowed."""
        rejection = self.check(kind, namespace, spec)
        if rejection is not None:
            raise Rejected(rejection)
        default_sa = children.TUNER_SERVICE_ACCOUNT if kind == "SLOTuning" else children.SERVING_SERVICE_ACCOUNT
        return {
            **spec,
            "image": spec.get("image") or self.default_image,
            "serviceAccountName": spec.get("serviceAccountName") or default_sa,
        }

    def check(self, kind: str, namespace: str, spec: dict[str, Any]) -> Rejection | None:
        """The first thing `spec` asks for that the allow-lists do not allow, or None."""
        image = spec.get("image")
        if image and not is_image_allowed(image, self.allowed_images):
            return Rejection(
                "spec.image",
                "ImageNotAllowed",
                f"spec.image '{image}' is not allowed; allowed images: {', '.join(self.allowed_images)} "
                "(operator setting SLOTUNE_ALLOWED_IMAGES)",
            )
        sa = spec.get("serviceAccountName")
        if sa and sa not in self.allowed_service_accounts:
            return Rejection(
                "spec.serviceAccountName",
                "ServiceAccountNotAllowed",
                f"spec.serviceAccountName '{sa}' is not allowed; allowed service accounts: "
                f"{', '.join(self.allowed_service_accounts)} (operator setting "
                "SLOTUNE_ALLOWED_SERVICE_ACCOUNTS)",
            )
        for field, default_key in SECRET_REFS[kind].items():
            ref = spec.get(field)
            if ref:
                rejection = self._check_secret(f"spec.{field}", namespace, dict(ref), default_key)
                if rejection is not None:
                    return rejection
        return None

    def _check_secret(self, field: str, namespace: str, ref: dict[str, Any], default_key: str) -> Rejection | None:
        other = ref.get("namespace")
        if other and other != namespace:
            return Rejection(
                f"{field}.namespace",
                "SecretNotAllowed",
                f"{field}.namespace '{other}': a Secret must be in the resource's own namespace '{namespace}'",
            )
        name = str(ref.get("name") or "")
        if not _DNS_SUBDOMAIN.match(name) or len(name) > 253:
            return Rejection(f"{field}.name", "SecretNotAllowed", f"{field}.name '{name}' is not a Secret name")
        key = ref.get("key") or default_key
        if key not in self.allowed_secret_keys:
            return Rejection(
                f"{field}.key",
                "SecretNotAllowed",
                f"{field}.key '{key}' is not allowed; allowed Secret keys: "
                f"{', '.join(self.allowed_secret_keys)} (operator setting SLOTUNE_ALLOWED_SECRET_KEYS)",
            )
        return None


# --- SLOTuning: the tuning spec, the schedule, where the study lives ------------------------


def check_tuning(spec: dict[str, Any], namespace: str, admission: Admission) -> Rejection | None:
    """The first reason the SLOTuning's spec cannot run, or None (warnings: `storage_warning`)."""
    tuning_spec = spec.get("tuning") or {}
    message = _tuning_spec_problem(tuning_spec)
    if message is not None:
        return Rejection("spec.tuning", "InvalidSpec", message)
    parsed = TuningSpec.model_validate(tuning_spec)
    if not isinstance(parsed.base_config(), ServerConfig):  # the bundled engine's study
        message = model_problem(parsed.model)
        if message is not None:
            return Rejection("spec.tuning.model", "UnsupportedModel", message)
    rejection = admission.check("SLOTuning", namespace, spec)
    if rejection is not None:
        return rejection
    if int(spec.get("workers", 1)) > 1:
        if not (spec.get("storageSecret") or tuning_spec.get("storage")):
            return Rejection(
                "spec.workers",
                "StorageNotShared",
                "workers > 1 needs a shared study: set spec.storageSecret to a Secret holding a PostgreSQL URL",
            )
        if not spec.get("storageSecret") and on_pod_disk(tuning_spec.get("storage")):
            return Rejection(
                "spec.tuning.storage",
                "StorageNotShared",
                f"workers > 1 cannot share the SQLite study '{tuning_spec['storage']}' across pods: "
                "set spec.storageSecret to a Secret holding a PostgreSQL URL",
            )
    trouble = traffic.problem(spec)
    if trouble is not None:
        return Rejection(trouble[0], "InvalidTraffic", trouble[1])
    if spec.get("schedule"):
        try:
            schedule.parse(spec["schedule"])
        except schedule.ScheduleError as exc:
            return Rejection("spec.schedule", "InvalidSchedule", str(exc))
        lost = ephemeral_data(spec)
        if lost:
            return Rejection(
                "spec.schedule",
                "StorageNotPersistent",
                f"a schedule re-tunes over runs, but {' and '.join(lost)} would be lost with the "
                f"Job's emptyDir: {PERSISTENCE_HINT}",
            )
    return None


# --- SLOServing: what it records ------------------------------------------------------------


def check_serving(spec: dict[str, Any]) -> Rejection | None:
    """The first reason the SLOServing's spec cannot be rendered, beyond the allow-lists, or None."""
    for field, config in (
        ("spec.config", spec.get("config")),
        ("spec.canary.config", (spec.get("canary") or {}).get("config")),
    ):
        if isinstance(config, dict) and config.get("model") and not is_launch(config):
            message = model_problem(str(config["model"]))
            if message is not None:
                return Rejection(f"{field}.model", "UnsupportedModel", message)
    record = spec.get("recordTraffic")
    if record is None:
        return None
    if is_launch(spec.get("config") or {}) or is_launch((spec.get("canary") or {}).get("config") or {}):
        return Rejection(
            "spec.recordTraffic",
            "InvalidRecording",
            "spec.recordTraffic: traffic is recorded by the bundled engine's server only; "
            "remove recordTraffic, or serve a config of the bundled engine",
        )
    claim = str((record or {}).get("claimName") or "")
    if not claim:
        return Rejection(
            "spec.recordTraffic.claimName",
            "InvalidRecording",
            "spec.recordTraffic.claimName is empty: name the PersistentVolumeClaim the pods record "
            "traffic on (ReadWriteMany when pods run on several nodes)",
        )
    if not _DNS_SUBDOMAIN.match(claim) or len(claim) > 253:
        return Rejection(
            "spec.recordTraffic.claimName",
            "InvalidRecording",
            f"spec.recordTraffic.claimName '{claim}' is not a PersistentVolumeClaim name",
        )
    max_mib = record.get("maxMiB", children.DEFAULT_RECORD_MAX_MIB)
    if isinstance(max_mib, bool) or not isinstance(max_mib, int) or max_mib < 1:
        return Rejection(
            "spec.recordTraffic.maxMiB",
            "InvalidRecording",
            f"spec.recordTraffic.maxMiB {max_mib!r} must be a whole number of MiB >= 1",
        )
    return None


PERSISTENCE_HINT = (
    "set spec.workVolumeClaim (a PersistentVolumeClaim mounted at /work), or a database URL "
    "(spec.storageSecret or spec.tuning.storage) and a tracking server "
    "(spec.tuning.mlflow_tracking_uri)"
)


def storage_warning(spec: dict[str, Any]) -> str | None:
    """What a run would lose when its pod goes (runs without a schedule may do so), or None."""
    lost = ephemeral_data(spec)
    return f"{' and '.join(lost)} live in the Job's emptyDir and go with the pod: {PERSISTENCE_HINT}" if lost else None


def on_pod_disk(url: str | None) -> bool:
    """True for a location in the pod's file system: unset (SQLite in the output dir), SQLite, a path."""
    if not url:
        return True
    scheme = url.split("://", 1)[0].lower() if "://" in url else ""
    return scheme in ("", "file") or scheme.startswith("sqlite")


def ephemeral_data(spec: dict[str, Any]) -> list[str]:
    """Which of 'the Optuna study' and 'the MLflow runs' a run keeps only in an emptyDir."""
    tuning_spec = spec.get("tuning") or {}
    lost = []
    if not spec.get("storageSecret") and not _persists(tuning_spec.get("storage"), spec):
        lost.append(f"the Optuna study ({tuning_spec.get('storage') or 'SQLite in the output dir'})")
    if not _persists(tuning_spec.get("mlflow_tracking_uri"), spec):
        lost.append(f"the MLflow runs ({tuning_spec.get('mlflow_tracking_uri') or 'SQLite in the output dir'})")
    return lost


def _persists(url: str | None, spec: dict[str, Any]) -> bool:
    if not on_pod_disk(url):
        return True  # a database or tracking server
    if not spec.get("workVolumeClaim"):
        return False
    # on the claim: the default (the Job's --output-dir), a relative path, or one under /work
    path = (url or "").split("://", 1)[-1]
    path = path[1:] if (url or "").lower().startswith("sqlite:///") else path
    return not path.startswith("/") or path == children.WORK_DIR or path.startswith(children.WORK_DIR + "/")


def model_problem(model: str) -> str | None:
    """Why the bundled engine would refuse `model`, by the check `tune validate` runs (metadata
    only), or None. A model the operator's own file system cannot see (a path on a volume, a
    bundled model whose package its image lacks) passes here; the Job's `tune run` checks it."""
    from slotune.engine.checkpoint import check_model
    from slotune.tuner.spec.yaml_reader import SpecError

    try:
        check_model(model)
    except FileNotFoundError:
        return None
    except (ValueError, SpecError, OSError) as exc:
        return str(exc)
    return None


def _tuning_spec_problem(tuning_spec: dict[str, Any]) -> str | None:
    try:
        TuningSpec.model_validate(tuning_spec)
    except ValidationError as exc:
        return "; ".join(f"tuning{''.join('.' + str(x) for x in e['loc'])}: {e['msg']}" for e in exc.errors())
    except ValueError as exc:
        return f"tuning: {exc}"
    return None
