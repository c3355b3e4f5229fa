"""What a tracking-server outage costs one trial's MLflow callback: a real `mlflow server`, killed.

    python bench/hardening/tracking_outage_cost.py          # slotune's limits (slotune/tuner/tracking/tracker.py OUTAGE_LIMITS)
    MLFLOW_HTTP_REQUEST_MAX_RETRIES=7 MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR=2 MLFLOW_HTTP_REQUEST_TIMEOUT=120 \\
        python bench/hardening/tracking_outage_cost.py      # MLflow's own defaults

Prints the seconds of one trial's callback with the server up, then with it down (connection refused).
"""

from __future__ import annotations

import sys
import tempfile
import time
import warnings
from pathlib import Path

import optuna

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repo root: the server helpers are the tests'

from slotune.tuner.search.study import open_study  # noqa: E402
from slotune.tuner.spec.tuning_spec import TuningSpec  # noqa: E402
from slotune.tuner.tracking import MLflowTracker  # noqa: E402
from tests.tuner_tests.conftest import write_spec  # noqa: E402
from tests.tuner_tests.test_tracking_outage import _free_port, _start_server, _stop  # noqa: E402


def main() -> None:
    warnings.simplefilter("ignore")
    tmp = Path(tempfile.mkdtemp(prefix="outage-"))
    (tmp / "server").mkdir()
    port = _free_port()
    server = _start_server(tmp / "server" / "mlflow.db", port)
    try:
        spec = TuningSpec.from_yaml(write_spec(tmp, mlflow_tracking_uri=f"http://127.0.0.1:{port}"))
        study, _ = open_study(spec)
        tracker = MLflowTracker(spec, study)
        dist = {"max_num_seqs": optuna.distributions.IntDistribution(1, 8)}
        for i in range(3):
            study.add_trial(
                optuna.trial.create_trial(
                    state=optuna.trial.TrialState.COMPLETE,
                    values=[0.1],
                    params={"max_num_seqs": i + 1},
                    distributions=dist,
                )
            )
        t = time.perf_counter()
        tracker(study, study.trials[0])
        print(f"server up: {time.perf_counter() - t:.2f} s")
        _stop(server)
        for trial in study.trials[1:]:
            t = time.perf_counter()
            tracker(study, trial)
            print(f"server down (refused): {time.perf_counter() - t:.2f} s")
    finally:
        _stop(server)


if __name__ == "__main__":
    main()
