"""The operator runs from the core install (`pip install slotune`, no extras): importing it, and the
spec, EngineConfig and model validation it does at admission, loads none of the engine's or the tuner's
heavy dependencies. Checked in a fresh interpreter (this test process has imported them all)."""

from __future__ import annotations

import subprocess
import sys

HEAVY = (
    "torch",
    "mlflow",
    "optuna",
    "lm_eval",
    "gguf",
    "tokenizers",
    "safetensors",
    "fastapi",
    "uvicorn",
    "jinja2",
    "plotly",
    "psycopg2",
    "psutil",
    "transformers",
    "triton",
)


def test_operator_and_its_validation_import_no_heavy_dependency():
    code = (
        "import sys\n"
        "import slotune.operator.handlers, slotune.operator.render, slotune.operator.serving\n"
        "from slotune.operator import admission, serving\n"
        "serving.validate_config({'quantization': 'int8', 'max_num_seqs': 4})\n"
        "print(admission._tuning_spec_problem({'name': 'x', 'objective': {'kind': 'latency', 'metric': 'tpot'}}))\n"
        "assert admission.check_serving({'config': {'model': 'smollm2-135m'}}) is None\n"  # the model check runs
        "from slotune.engine.checkpoint import check_model\n"
        f"print(' '.join(sorted(m for m in {HEAVY!r} if m in sys.modules)))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.splitlines()
    assert out[0] == "None"  # the spec validated
    assert out[1] == "", f"heavy modules imported by the operator: {out[1]}"
