"""The quality baseline: the candidate's config with full-precision weights and KV cache and no
drafts (`baseline_config`), its engine loaded only when a number is not cached, and the on-disk cache
of its numbers per (model identity, gate, task data, limit, scorer version, dtype/device).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import tempfile
from pathlib import Path
from typing import Any, Callable

from slotune.engine.paths import cache_root

log = logging.getLogger(__name__)

SCORER_VERSION = 2  # bump when scoring changes numerics: invalidates cached baselines


def model_identity(model_path: Path) -> str:
    """Cheap stable identity: size + mtime + hash of the first MiB (files) or of each file's stat (dirs)."""
    p = Path(model_path)
    h = hashlib.sha256()
    if p.is_dir():
        for f in sorted(p.glob("*.json")) + sorted(p.glob("*.safetensors")):
            st = f.stat()
            h.update(f"{f.name}:{st.st_size}:{st.st_mtime_ns}".encode())
    else:
        st = p.stat()
        h.update(f"{st.st_size}:{st.st_mtime_ns}".encode())
        with p.open("rb") as fh:
            h.update(fh.read(2**20))
    return h.hexdigest()[:16]


def default_cache_dir() -> Path:
    return cache_root() / "baselines"


def baseline_config(config):
    """The reference for a candidate: same model and shape knobs, full-precision weights and KV
    cache, default compute dtype (bf16 on CUDA, fp32 on CPU), no speculative decoding."""
    return config.with_updates(
        {
            "quantization": "none",
            "kv_dtype": "auto",
            "speculative.method": "none",
            "dtype": "auto",
            "num_kv_blocks": None,
            "kv_cache_memory_gb": min(config.kv_cache_memory_gb, 0.5),
        }
    )


def _resolved(config) -> dict[str, Any]:
    """The fields that decide a config's numbers, with auto resolved."""
    from slotune.engine.model_runner import resolve_device, resolve_dtype  # imports torch: a gate run has it loaded

    dev = resolve_device(config)
    return {
        "device": dev.type,
        "dtype": str(resolve_dtype(config, dev)),
        "quantization": config.quantization,
        "quant_group_size": config.quant_group_size if config.quantization == "int4" else None,
        "kv_dtype": config.kv_dtype,
        "speculative": config.speculative.method,
        "model": config.model,
    }


class Baseline:
    """The baseline engine (loaded only when a number is not cached) and the on-disk cache."""

    def __init__(self, candidate_llm, cache_dir: Path, baseline_llm=None) -> None:
        from slotune.engine.loader import resolve_model_path  # imports torch: a gate run has it loaded

        self.config = baseline_config(candidate_llm.config)
        self.cache_dir = cache_dir
        spec = _resolved(self.config)
        # The candidate is its own baseline when every number-deciding field already matches.
        self.is_candidate = _resolved(candidate_llm.config) == spec
        if baseline_llm is not None and _resolved(baseline_llm.config) != spec:
            raise ValueError(
                f"baseline_llm does not run the baseline config: {_resolved(baseline_llm.config)} != {spec}"
            )
        self._llm = candidate_llm if self.is_candidate else baseline_llm
        self.identity = {
            "model": model_identity(resolve_model_path(self.config.model)),
            "device": spec["device"],
            "dtype": spec["dtype"],
            "scorer": SCORER_VERSION,
        }

    @property
    def llm(self):
        if self._llm is None:
            from slotune.engine import LLM  # imports torch: only when a baseline number is not cached

            log.info("loading the baseline engine for quality gates")
            self._llm = LLM(self.config)
        return self._llm

    def cached(self, key: dict[str, Any], compute: Callable[[], Any]) -> Any:
        return cached_value(self.cache_dir, {**key, **self.identity}, compute)


def cached_value(cache_dir: Path, key: dict[str, Any], compute: Callable[[], Any]) -> Any:
    """The value stored under `key` (JSON) in `cache_dir`, else `compute()`d and stored, atomically:
    parallel trials share the folder."""
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:24]
    path = cache_dir / f"{key.get('kind', 'gate')}-{digest}.json"
    if path.exists():
        try:
            return json.loads(path.read_text())["value"]
        except (ValueError, KeyError):
            log.warning("ignoring unreadable baseline cache %s", path)
    value = compute()
    cache_dir.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=cache_dir, suffix=".tmp")
    with os.fdopen(fd, "w") as fh:
        json.dump({"key": key, "value": value}, fh)
    os.replace(tmp, path)
    return value
