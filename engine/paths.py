"""The one cache root: converted model weights (engine/loader.py), materialized eval tasks and
quality baselines (evals/), and the compiled native step (kernels/cpu_decode.py, which as the
leaf package applies the same rule itself; tests/engine_tests/test_paths.py holds them equal).

`SLOTUNE_CACHE_DIR` wins; else `$XDG_CACHE_HOME/slotune`; else `~/.cache/slotune`.
Pure standard library: no torch.
"""

from __future__ import annotations

import os
from pathlib import Path


def cache_root() -> Path:
    if os.environ.get("SLOTUNE_CACHE_DIR"):
        return Path(os.environ["SLOTUNE_CACHE_DIR"])
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "slotune"
