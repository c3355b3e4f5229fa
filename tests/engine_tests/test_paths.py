"""One cache root everywhere: slotune/engine/paths.py's rule, and slotune/kernels/cpu_decode.py's copy of it (the
kernels package is the leaf and cannot import the engine) agree for every environment."""

from __future__ import annotations

from pathlib import Path

import pytest

from slotune.engine.paths import cache_root
from slotune.evals.baseline import default_cache_dir
from slotune.kernels import cpu_decode


@pytest.mark.parametrize(
    ("slotune", "xdg", "want"),
    [
        ("/srv/c", "/x", "/srv/c"),
        (None, "/x", "/x/slotune"),
        (None, None, "~/.cache/slotune"),
        ("", "", "~/.cache/slotune"),
    ],
)
def test_every_cache_lives_under_the_one_root(monkeypatch, slotune, xdg, want):
    for var, value in (("SLOTUNE_CACHE_DIR", slotune), ("XDG_CACHE_HOME", xdg)):
        if value is None:
            monkeypatch.delenv(var, raising=False)
        else:
            monkeypatch.setenv(var, value)
    root = Path(want).expanduser()
    assert cache_root() == root
    assert cpu_decode.cache_dir() == root / "native"
    assert default_cache_dir() == root / "baselines"
