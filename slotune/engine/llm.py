"""LLM: the offline, synchronous front door (batch generation and scoring)."""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from slotune.engine.config import EngineConfig
from slotune.engine.llm_engine import LLMEngine
from slotune.engine.outputs import RequestOutput
from slotune.engine.sampling_params import SamplingParams


@dataclass(slots=True)
class PromptLogprobs:
    token_logprobs: list[float]  # len T-1: log p(token t | tokens < t)
    is_greedy: list[bool]  # len T-1: token t was the argmax


class LLM:
    def __init__(self, config: EngineConfig | None = None, **overrides) -> None:
        cfg = config or EngineConfig()
        if overrides:
            cfg = cfg.with_updates(overrides)
        self.config = cfg
        self.engine = LLMEngine(cfg)
        self.tokenizer = self.engine.tokenizer
        self._ids = itertools.count()

    def generate(
        self,
        prompts: str | list[int] | list[str | list[int]],
        params: SamplingParams | list[SamplingParams] | None = None,
    ) -> list[RequestOutput]:
        """Run prompts to completion with continuous batching; outputs in input order."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]  # type: ignore[list-item]
        params = params or SamplingParams()
        plist = params if isinstance(params, list) else [params] * len(prompts)
        if len(plist) != len(prompts):
            raise ValueError(f"got {len(plist)} SamplingParams for {len(prompts)} prompts")
        ids = [f"llm-{next(self._ids)}" for _ in prompts]
        for rid, prompt, p in zip(ids, prompts, plist):
            self.engine.add_request(rid, prompt, p)
        done: dict[str, RequestOutput] = {}
        while self.engine.has_unfinished_requests():
            for out in self.engine.step():
                if out.finished:
                    done[out.request_id] = out
        return [done[r] for r in ids]

    def stream(self, prompt: str | list[int], params: SamplingParams | None = None) -> Iterator[RequestOutput]:
        """Yield one delta per engine step (new_token_ids / new_text) until the request finishes."""
        rid = f"llm-{next(self._ids)}"
        self.engine.add_request(rid, prompt, params or SamplingParams())
        try:
            while True:
                for out in self.engine.step():
                    if out.request_id == rid:
                        yield out
                        if out.finished:
                            return
        finally:
            self.engine.abort_request(rid)  # consumer stopped early: free its blocks

    def logits(self, token_ids: list[int]) -> torch.Tensor:
        """[T, V] float32 logits at every position (no KV cache used)."""
        self._check_len(token_ids)
        return self.engine.runner.full_logits(token_ids).float().cpu()

    def prompt_logprobs(self, seqs: list[list[int]]) -> list["PromptLogprobs"]:
        out = []
        for ids in seqs:
            self._check_len(ids)
            logits = self.engine.runner.full_logits(ids)[:-1].float()
            lp = torch.log_softmax(logits, dim=-1)
            tgt = torch.tensor(ids[1:], device=lp.device)
            out.append(
                PromptLogprobs(
                    token_logprobs=lp.gather(1, tgt[:, None]).squeeze(1).tolist(),
                    is_greedy=(lp.argmax(-1) == tgt).tolist(),
                )
            )
        return out

    def _check_len(self, ids: list[int]) -> None:
        limit = self.engine.runner.model_cfg.max_position_embeddings
        if not ids or len(ids) > limit:
            raise ValueError(f"sequence length {len(ids)} must be in [1, {limit}]")
