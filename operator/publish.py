"""Job side: run the tuning command, then publish its result into a ConfigMap via the API.

    python -m slotune.operator.publish --configmap NAME [--namespace NS] --result-dir DIR -- tune run ...

The operator pre-creates the (empty, owned) result ConfigMap; this fills it with `best.yaml`,
`best_metrics.json` and, when the study logged one, `mlflow_run_id` -- or with `error` when
the command failed or found no config meeting the SLO. Each write replaces what an earlier
attempt of the Job published (a retry that succeeds clears the first attempt's `error`), and
result files left in the result dir by an earlier run (a persistent /work) are removed before
the command runs. Only `get`/`patch` on that one ConfigMap is needed: the operator creates a
Role for it per run (children.publish_rbac). Exit status: the command's own.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

RESULT_KEYS = ("best.yaml", "best_metrics.json", "mlflow_run_id", "error")
RESULT_FILES = ("best.yaml", "best_metrics.json")


def report_result(configmap: str, namespace: str, result_dir: Path | None = None, *,
                  error: str | None = None, api_client=None) -> dict[str, str]:
    """Write the tuning result (or an error) into the ConfigMap `configmap`.

    Args:
        configmap: the result ConfigMap the operator created for this run.
        result_dir: where `tune run` wrote best.yaml and best_metrics.json.
        error: a failure message, published instead of a result.
    Returns:
        the data written.
    """
    data: dict[str, str | None] = dict.fromkeys(RESULT_KEYS)  # null deletes: no key of an earlier attempt stays
    best = result_dir / "best.yaml" if result_dir is not None else None
    if error is None and (best is None or not best.exists()):
        error = "NoFeasibleConfig: no trial met the SLO and the quality gates (see the study report)"
    if error is None:
        data["best.yaml"] = best.read_text()
        metrics_path = result_dir / "best_metrics.json"
        if metrics_path.exists():
            text = metrics_path.read_text()
            data["best_metrics.json"] = text
            run_id = json.loads(text).get("mlflow_run_id")
            if run_id:
                data["mlflow_run_id"] = str(run_id)
    else:
        data["error"] = error[:2000]
    # a JSON merge patch: `null` deletes the key (a strategic merge patch leaves "" behind)
    _core(api_client).patch_namespaced_config_map(configmap, namespace, {"data": data},
                                                  _content_type="application/merge-patch+json")
    return {k: v for k, v in data.items() if v is not None}


def clear_stale_results(result_dir: Path) -> None:
    """Remove result files an earlier run left (a persistent /work): never publish them as ours."""
    for name in RESULT_FILES:
        (result_dir / name).unlink(missing_ok=True)


def _core(api_client=None):
    import kubernetes

    if api_client is None:
        from slotune.operator.api import load_configuration

        api_client = kubernetes.client.ApiClient(load_configuration())
    return kubernetes.client.CoreV1Api(api_client)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    command: list[str] = []
    if "--" in argv:
        i = argv.index("--")
        argv, command = argv[:i], argv[i + 1:]
    p = argparse.ArgumentParser(prog="python -m slotune.operator.publish", description=__doc__.split("\n\n")[0])
    p.add_argument("--configmap", required=True)
    p.add_argument("--namespace", default=None, help="default: the pod's namespace")
    p.add_argument("--result-dir", type=Path, required=True)
    args = p.parse_args(argv)
    namespace = args.namespace or _pod_namespace()
    rc = 0
    error = None
    if command:
        clear_stale_results(args.result_dir)
        rc = subprocess.call(command)
        if rc != 0:
            error = f"TuningFailed: `{' '.join(command[:2])}` exited with status {rc}"
    report_result(args.configmap, namespace, args.result_dir, error=error)
    return rc


def _pod_namespace() -> str:
    path = Path("/var/run/secrets/kubernetes.io/serviceaccount/namespace")
    return path.read_text().strip() if path.exists() else "default"


if __name__ == "__main__":
    sys.exit(main())
