"""Batched sampling: greedy, temperature, top-k, top-p, per-request seeds.

Sampling uses the exponential race (argmax p / E, E ~ Exp(1)), which equals drawing from p
and lets seeded requests draw their noise from their own generator without a per-row
multinomial call.
"""

from __future__ import annotations

import torch

from slotune.engine.sampling_params import SamplingParams


class Sampler:
    def __init__(self, device: torch.device, seed: int = 0) -> None:
        self.device = device
        self.generator = torch.Generator(device=device).manual_seed(seed)
        self._seeded: dict[int, torch.Generator] = {}  # seq_id -> generator

    def forget(self, seq_id: int) -> None:
        self._seeded.pop(seq_id, None)

    def seq_generator(self, seq_id: int, params: SamplingParams) -> torch.Generator:
        """The request's own generator when it has a seed (reproducible), else the shared one."""
        if params.seed is None:
            return self.generator
        g = self._seeded.get(seq_id)
        if g is None:
            g = self._seeded[seq_id] = torch.Generator(device=self.device).manual_seed(params.seed)
        return g

    def probs(self, logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
        """Filtered, temperature-scaled distributions. logits: [B, V] float32 -> [B, V]."""
        temps = torch.tensor([max(p.temperature, 1e-5) for p in params], device=logits.device)
        logits = logits / temps[:, None]
        if any(p.top_k > 0 for p in params):
            vocab = logits.shape[-1]  # top_k >= vocab means "off": clamp so topk never overruns
            ks = torch.tensor([min(p.top_k, vocab) if p.top_k > 0 else vocab for p in params], device=logits.device)
            kth = torch.topk(logits, int(ks.max()), dim=-1).values.gather(1, (ks - 1)[:, None])
            logits = logits.masked_fill(logits < kth, float("-inf"))
        if any(p.top_p < 1.0 for p in params):
            top_p = torch.tensor([p.top_p for p in params], device=logits.device)
            sorted_logits, idx = logits.sort(dim=-1, descending=True)
            cum = sorted_logits.softmax(-1).cumsum(-1)
            remove = cum - sorted_logits.softmax(-1) > top_p[:, None]  # keep the token that crosses top_p
            sorted_logits = sorted_logits.masked_fill(remove, float("-inf"))
            logits = torch.full_like(logits, float("-inf")).scatter(1, idx, sorted_logits)
        return logits.softmax(-1)

    def exponential_noise(
        self, shape: tuple[int, ...], params: list[SamplingParams], seq_ids: list[int]
    ) -> torch.Tensor:
        q = torch.empty(shape, device=self.device)
        q.exponential_(generator=self.generator)
        for row, (p, sid) in enumerate(zip(params, seq_ids)):
            if p.seed is not None:
                q[row].exponential_(generator=self.seq_generator(sid, p))
        return q

    def sample(self, logits: torch.Tensor, params: list[SamplingParams], seq_ids: list[int]) -> torch.Tensor:
        """logits: [B, V] -> token ids [B] (int64)."""
        greedy = logits.argmax(-1)
        if all(p.is_greedy for p in params):
            return greedy
        probs = self.probs(logits, params)
        noise = self.exponential_noise(tuple(probs.shape), params, seq_ids)
        sampled = (probs / noise).argmax(-1)
        is_greedy = torch.tensor([p.is_greedy for p in params], device=logits.device)
        return torch.where(is_greedy, greedy, sampled)
