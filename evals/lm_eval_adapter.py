"""lm-eval on our engine: an `lm_eval.api.model.LM` backed by `slotune.engine.LLM`, the bundled
offline tasks, and the lm_eval / perplexity quality gates."""

from __future__ import annotations

import math
from importlib import resources
from pathlib import Path
from typing import Any

from lm_eval.api.model import LM

from slotune.evals.gates import GateResult, GateSpec, judge_drop


def _data_dir() -> Path:
    return Path(str(resources.files("slotune.evals") / "tasks"))


def tasks_dir() -> Path:
    """lm-eval reads data_files relative to the process CWD, so the bundled task templates are
    materialized with absolute data paths into the cache (cheap; rewritten when they change)."""
    from slotune.engine.loader import cache_dir

    out = cache_dir() / "lm_eval_tasks"
    src = _data_dir()
    for tmpl in src.glob("*/task.yaml.tmpl"):
        dst = out / tmpl.parent.name / "task.yaml"
        text = tmpl.read_text().replace("{data_dir}", str(src))
        if not dst.exists() or dst.read_text() != text:
            dst.parent.mkdir(parents=True, exist_ok=True)
            dst.write_text(text)
    return out


class SlotuneLM(LM):
    """loglikelihood / loglikelihood_rolling via prompt logprobs, generate_until via the batched engine."""

    def __init__(self, llm, max_length: int | None = None) -> None:
        super().__init__()
        self.llm = llm
        self.tok = llm.tokenizer
        self.max_length = max_length or min(llm.config.max_model_len, 1024)
        self.prefix_token = self.tok.eos_token_id if self.tok.eos_token_id is not None else 0

    def _encode_pair(self, context: str, continuation: str) -> tuple[list[int], list[int]]:
        # Encode jointly so the boundary tokenizes as in real text (lm-eval's HF convention).
        n_space = len(context) - len(context.rstrip())
        if n_space:
            continuation, context = context[-n_space:] + continuation, context[:-n_space]
        whole = self.tok.encode(context + continuation)
        ctx = self.tok.encode(context) if context else [self.prefix_token]
        if not context:
            whole = [self.prefix_token] + whole
        return whole[: len(ctx)], whole[len(ctx):]

    def loglikelihood(self, requests) -> list[tuple[float, bool]]:
        out = []
        for req in requests:
            context, continuation = req.args
            ctx, cont = self._encode_pair(context, continuation)
            ids = (ctx + cont)[-(self.max_length + 1):]
            n = len(cont)
            lp = self.llm.prompt_logprobs([ids])[0]
            out.append((float(sum(lp.token_logprobs[-n:])), bool(all(lp.is_greedy[-n:]))))
        return out

    def loglikelihood_rolling(self, requests) -> list[float]:
        out = []
        for req in requests:
            (text,) = req.args
            ids = self.tok.encode(text)
            total, pos = 0.0, 0
            while pos < len(ids):  # disjoint windows, each conditioned on the tokens before it
                window = ids[pos : pos + self.max_length]
                prev = ids[max(0, pos - 1) : pos] or [self.prefix_token]
                lp = self.llm.prompt_logprobs([prev + window])[0]
                total += sum(lp.token_logprobs)
                pos += len(window)
            out.append(total)
        return out

    def generate_until(self, requests) -> list[str]:
        from slotune.engine import SamplingParams

        prompts, params = [], []
        for req in requests:
            context, kw = req.args
            until = kw.get("until") or []
            until = [until] if isinstance(until, str) else list(until)
            prompts.append(self.tok.encode(context)[-(self.max_length - 1):])
            params.append(SamplingParams(max_tokens=int(kw.get("max_gen_toks", 64)), temperature=float(kw.get("temperature", 0.0)),
                                         stop=until))
        return [o.text for o in self.llm.generate(prompts, params)] if prompts else []


def run_task(llm, task: str, limit: int | None) -> dict[str, Any]:
    """Run one bundled task; returns {metric: value, metric_stderr: se, 'samples': [...]}."""
    import lm_eval
    from lm_eval.tasks import TaskManager

    tm = TaskManager(include_path=str(tasks_dir()))
    if task not in tm.all_tasks:
        raise ValueError(f"unknown lm_eval task '{task}'; bundled: {sorted(bundled_tasks())}")
    res = lm_eval.simple_evaluate(model=SlotuneLM(llm), tasks=[task], limit=limit, task_manager=tm, log_samples=True,
                                  num_fewshot=None, bootstrap_iters=0, verbosity="ERROR")
    metrics = {k.split(",")[0]: v for k, v in res["results"][task].items() if isinstance(v, (int, float))}
    metrics["_stderr"] = {k.split(",")[0].replace("_stderr", ""): v for k, v in res["results"][task].items()
                          if "_stderr" in k and isinstance(v, (int, float))}
    metrics["samples"] = res.get("samples", {}).get(task, [])
    return metrics


def bundled_tasks() -> list[str]:
    return sorted(f"slotune_{p.parent.name}" for p in _data_dir().glob("*/task.yaml.tmpl"))


def _per_sample(samples: list[dict], metric: str) -> dict[int, float]:
    return {s["doc_id"]: float(s[metric]) for s in samples if metric in s}


def lm_eval_gate(gate: GateSpec, llm, base) -> GateResult:
    """lm_eval: accuracy-like metric, higher is better. perplexity: word_perplexity, lower is better."""
    metric = "word_perplexity" if gate.kind == "perplexity" else gate.metric
    key = {"gate": gate.kind, "task": gate.task, "metric": metric, "limit": gate.limit, "v": 1}

    def compute():
        m = run_task(base.llm, gate.task, gate.limit)
        return {"value": m[metric], "samples": _per_sample(m["samples"], metric) if gate.kind != "perplexity" else {}}

    from slotune.evals.gates import baseline_config

    if baseline_config(llm.config) == llm.config:
        base._llm = llm
    ref = base.cached(key, compute)
    cand = run_task(llm, gate.task, gate.limit)
    value = cand[metric]
    higher = gate.kind != "perplexity"
    stderr = None
    if higher:
        a = {int(k): v for k, v in ref["samples"].items()}
        b = _per_sample(cand["samples"], metric)
        common = sorted(set(a) & set(b))
        if len(common) > 1:  # paired: the same items under both configs
            d = [a[i] - b[i] for i in common]
            mean = sum(d) / len(d)
            stderr = math.sqrt(sum((x - mean) ** 2 for x in d) / (len(d) - 1) / len(d))
    ok, drop, why = judge_drop(gate, ref["value"], value, stderr, higher_is_better=higher)
    return GateResult(name=gate.name, kind=gate.kind, passed=ok, baseline=ref["value"], candidate=value, stderr=stderr,
                      drop=drop, reason=why, details={"task": gate.task, "metric": metric, "limit": gate.limit})
