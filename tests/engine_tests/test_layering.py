"""The engine core never imports the HTTP front end (engine/serving/): building and stepping an
engine needs neither FastAPI nor uvicorn. Checked in a fresh interpreter, since this test
process has imported everything already."""

from __future__ import annotations

import subprocess
import sys

FRONT_END = ("fastapi", "starlette", "uvicorn", "slotune.engine.serving")


def test_engine_core_does_not_import_the_http_front_end():
    code = ("import sys\n"
            "import slotune.engine, slotune.engine.llm, slotune.engine.llm_engine, slotune.engine.model_runner\n"
            f"bad = sorted(m for m in sys.modules if m.split('.')[0] in {FRONT_END!r} or m.startswith({FRONT_END!r}))\n"
            "print('\\n'.join(bad))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    assert out == [], f"engine core imported the front end: {out}"
