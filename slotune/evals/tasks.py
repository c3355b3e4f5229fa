"""The bundled offline lm-eval tasks: discovery, materialization, running one on an engine.

Each task lives in `slotune/evals/tasks/<name>/` as `task.yaml.tmpl` + local JSONL data (see
`tasks/SOURCES.md`). lm-eval resolves `data_files` against the process CWD, so the templates
are written out with absolute data paths (`{data_dir}` -> this package's tasks folder) into a
per-user folder and handed to `TaskManager(include_path=...)`: works from a checkout, an
editable install and a wheel alike.
"""

from __future__ import annotations

import hashlib
import math
import os
import tempfile
from importlib import resources
from pathlib import Path
from typing import Any

from slotune.engine.paths import cache_root

TASK_PREFIX = "slotune_"


def data_dir() -> Path:
    return Path(str(resources.files("slotune.evals") / "tasks"))


def bundled_tasks() -> list[str]:
    """Names of the bundled tasks, as lm-eval knows them (`slotune_<folder>`)."""
    return sorted(TASK_PREFIX + p.parent.name for p in data_dir().glob("*/task.yaml.tmpl"))


def task_fingerprint(task: str) -> str:
    """Hash of a bundled task's template and data: part of every cached baseline's key."""
    folder = data_dir() / task.removeprefix(TASK_PREFIX)
    if not folder.is_dir():
        raise ValueError(f"unknown task '{task}'; bundled: {', '.join(bundled_tasks())}")
    h = hashlib.sha256()
    for f in sorted(folder.iterdir()):
        h.update(f.name.encode() + f.read_bytes())
    return h.hexdigest()[:16]


def tasks_dir(out: Path | None = None) -> Path:
    """Write every template with absolute data paths under `out`; returns the folder."""
    if out is None:
        out = cache_root() / "lm_eval_tasks"
    src = data_dir()
    for tmpl in src.glob("*/task.yaml.tmpl"):
        dst = out / tmpl.parent.name / "task.yaml"
        text = tmpl.read_text().replace("{data_dir}", str(src))
        if dst.exists() and dst.read_text() == text:
            continue
        dst.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=dst.parent, suffix=".tmp")  # atomic: trial processes share it
        with os.fdopen(fd, "w") as fh:
            fh.write(text)
        os.replace(tmp, dst)
    return out


def run_task(llm, task: str, limit: int | None = None, *, max_batch_tokens: int | None = None) -> dict[str, Any]:
    """Run one bundled task through lm-eval on a loaded engine.

    Args:
        llm: a loaded, idle `slotune.engine.LLM`.
        task: a bundled task name (`bundled_tasks()`).
        limit: first N documents (None = all).
    Returns:
        {"metrics": {metric: value}, "stderr": {metric: se}, "per_doc": {metric: {doc_id: value}},
         "num_docs": int, "seconds": float}. Per-doc values are floats, or [loglik, units] pairs
        for perplexity metrics.
    """
    from slotune.evals.lm_eval_adapter import SlotuneLM  # imports torch and lm_eval

    return _evaluate(SlotuneLM(llm, max_batch_tokens=max_batch_tokens), task, limit)


def run_task_api(url: str, model: str | None, task: str, limit: int | None = None) -> dict[str, Any]:
    """Run one bundled generation task through lm-eval's `local-completions` against the
    OpenAI-compatible server at `url` (greedy, one request at a time, text prompts: no tokenizer
    needed). Returns what `run_task` does."""
    from lm_eval.models.openai_completions import LocalCompletionsAPI

    lm = LocalCompletionsAPI(
        base_url=f"{url}/v1/completions",
        model=model or "default",
        tokenizer_backend=None,
        tokenized_requests=False,
        num_concurrent=1,
        max_retries=1,
        timeout=300,
    )
    return _evaluate(lm, task, limit)


def task_output_type(task: str) -> str:
    """How a bundled task is scored: generate_until, multiple_choice, loglikelihood_rolling, ..."""
    task_fingerprint(task)  # raises on unknown names
    tmpl = data_dir() / task.removeprefix(TASK_PREFIX) / "task.yaml.tmpl"
    for line in tmpl.read_text().splitlines():
        if line.startswith("output_type:"):
            return line.split(":", 1)[1].strip()
    return "generate_until"  # lm-eval's default


def generation_tasks() -> list[str]:
    """The bundled tasks scored on generated text (what a server's API can give)."""
    return [t for t in bundled_tasks() if task_output_type(t) == "generate_until"]


def _evaluate(model, task: str, limit: int | None) -> dict[str, Any]:
    """lm-eval's simple_evaluate of one bundled task on `model` (an lm_eval LM), per document."""
    import time

    import lm_eval
    from lm_eval.tasks import TaskManager

    task_fingerprint(task)  # raises on unknown names
    tm = TaskManager(include_path=str(tasks_dir()), include_defaults=False)
    t0 = time.perf_counter()
    res = lm_eval.simple_evaluate(
        model=model,
        tasks=[task],
        limit=limit,
        task_manager=tm,
        log_samples=True,
        bootstrap_iters=0,
        verbosity="ERROR",
        random_seed=0,
        numpy_random_seed=0,
        torch_random_seed=0,
        fewshot_random_seed=0,
    )
    seconds = time.perf_counter() - t0
    raw = res["results"][task]
    metrics, stderr = {}, {}
    for key, v in raw.items():
        name = key.split(",")[0]
        if not isinstance(v, (int, float)):
            continue
        if name.endswith("_stderr"):
            stderr[name.removesuffix("_stderr")] = float(v) if math.isfinite(v) else None
        else:
            metrics[name] = float(v)
    per_doc: dict[str, dict[int, Any]] = {}
    for s in res["samples"][task]:
        for name in metrics:
            if name in s:
                v = s[name]
                per_doc.setdefault(name, {})[int(s["doc_id"])] = list(v) if isinstance(v, (list, tuple)) else float(v)
    return {
        "metrics": metrics,
        "stderr": stderr,
        "per_doc": per_doc,
        "num_docs": len(res["samples"][task]),
        "seconds": seconds,
    }
