"""Teacher-forced scoring through the engine's paged KV cache, batched.

`LLM.prompt_logprobs` / `LLM.logits` run one sequence at a time and attend over fresh K/V, so
a quantized KV cache (`kv_dtype: int8 | fp8`) never shows in their numbers. Quality gates
must see what serving sees, so every scored position here attends over the K/V *as stored
in the cache*: each batch is written to blocks taken from the engine's block manager and
read back through the same attention path as batched prefill and decode. With kv_dtype
auto the cache holds the compute dtype and the numbers equal plain attention.

Lifecycle of one batch: allocate blocks -> one forward over all sequences (a lone sequence
is fed in two steps, first token then the rest, so it too reads the cache) -> LM head on the
scored rows only -> free the blocks. The engine must be idle (no requests in flight).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch

from slotune.engine.sampling_params import SamplingParams
from slotune.engine.scheduler import ScheduledSeq
from slotune.engine.sequence import Sequence

LOGIT_ROWS_PER_CHUNK = 256  # LM-head rows at once: 256 x 49k vocab x fp32 = 50 MB


@dataclass(slots=True)
class Scored:
    logprobs: list[float]  # log p(token | tokens before it), for each scored token
    is_greedy: list[bool]  # each scored token was the argmax


class PagedScorer:
    """Batched scoring of token sequences on an idle `slotune.engine.LLM`.

    Args:
        llm: the loaded engine (its model, KV cache and block manager are used as they are).
        max_batch_tokens: tokens per forward; default the engine's `max_num_batched_tokens`.
    """

    def __init__(self, llm, max_batch_tokens: int | None = None) -> None:
        self.llm = llm
        self.engine = llm.engine
        self.runner = llm.engine.runner
        bm = self.engine.block_manager
        self.max_batch_tokens = max_batch_tokens or llm.config.max_num_batched_tokens
        # Longest sequence one forward can hold: context limit and the whole cache.
        self.max_seq_len = min(
            self.runner.model_cfg.max_position_embeddings, llm.config.max_model_len, bm.num_blocks * bm.block_size
        )

    # --- public ------------------------------------------------------------------------------
    def score(self, requests: list[tuple[list[int], int]]) -> list[Scored]:
        """Log-probs of the last `n` tokens of each sequence, given all tokens before them.

        Args:
            requests: (token_ids, n) pairs with 1 <= n < len(token_ids) <= max_seq_len.
        Returns:
            One `Scored` per request, in input order.
        """

        def reduce(i: int, logits: torch.Tensor) -> Scored:
            ids = requests[i][0]
            tgt = torch.tensor(ids[len(ids) - logits.shape[0] :], device=logits.device)
            lp = torch.log_softmax(logits, dim=-1)
            return Scored(lp.gather(1, tgt[:, None]).squeeze(1).tolist(), (lp.argmax(-1) == tgt).tolist())

        return self.map_logits(requests, reduce)

    def map_logits(self, requests: list[tuple[list[int], int]], fn: Callable[[int, torch.Tensor], object]) -> list:
        """Apply fn(request_index, logits) per request; logits: [n, V] float32, row j predicts token -n+j.

        Rows are handed over batch by batch and dropped after fn, so memory stays bounded.
        """
        for ids, n in requests:
            if not 1 <= n < len(ids) <= self.max_seq_len:
                raise ValueError(f"cannot score {n} of {len(ids)} tokens (sequence limit {self.max_seq_len})")
        if self.engine.has_unfinished_requests():
            raise RuntimeError("PagedScorer needs an idle engine: requests are still in flight")
        out: list[object] = [None] * len(requests)
        for batch in self._batches(requests):
            for i, logits in zip(batch, self._forward([requests[i] for i in batch])):
                out[i] = fn(i, logits)
        return out

    # --- internals ---------------------------------------------------------------------------
    def _batches(self, requests: list[tuple[list[int], int]]) -> Iterator[list[int]]:
        """Indices grouped by similar length (less padding), within the token and block budgets."""
        bm = self.engine.block_manager
        order = sorted(range(len(requests)), key=lambda i: len(requests[i][0]))
        batch: list[int] = []
        num_tokens = num_blocks = 0
        for i in order:
            n = len(requests[i][0])
            b = bm.blocks_needed(n)
            if batch and (num_tokens + n > self.max_batch_tokens or num_blocks + b > bm.num_free_blocks):
                yield batch
                batch, num_tokens, num_blocks = [], 0, 0
            batch.append(i)
            num_tokens += n
            num_blocks += b
        if batch:
            yield batch

    @torch.inference_mode()
    def _forward(self, reqs: list[tuple[list[int], int]]) -> list[torch.Tensor]:
        bm = self.engine.block_manager
        seqs = [Sequence(f"score-{k}", ids, SamplingParams(max_tokens=1), 0.0) for k, (ids, _) in enumerate(reqs)]
        try:
            for s in seqs:
                if not bm.allocate(s, s.num_tokens):
                    raise RuntimeError(f"KV cache too small to score {s.num_tokens} tokens; raise num_kv_blocks")
            if len(seqs) == 1:
                # A lone fresh prefill attends over its own fresh K/V: feed 1 token first, so the
                # rest reads the cache. Token 0's row predicts token 1 (scored when n = len - 1).
                (ids, n), s = reqs[0], seqs[0]
                first = self._run([ScheduledSeq(s, 1)], [int(n == len(ids) - 1)])[0]
                s.num_computed_tokens = 1
                rest = self._run([ScheduledSeq(s, s.num_uncomputed_tokens)], [min(n, len(ids) - 2)])[0]
                return [torch.cat([first, rest])]
            steps = [ScheduledSeq(s, s.num_tokens) for s in seqs]
            return self._run(steps, [n for _, n in reqs])
        finally:
            for s in seqs:
                bm.free_seq(s)

    def _run(self, steps, num_scored: list[int]) -> list[torch.Tensor]:
        """One forward; per step, logits [n_k, V] of the rows that predict its last n_k new tokens."""
        runner = self.runner
        # The engine's own input preparation (block tables, slots, masks): the same attention
        # path as serving (ModelRunner.forward_hidden, teacher forcing).
        out = []
        for hidden, s, n in zip(runner.forward_hidden(steps), steps, num_scored):
            # Token j is predicted by token j-1's row. In a multi-token step the last row predicts
            # past the sequence and is skipped; a 1-token step (a lone sequence's first token) is
            # asked only for its own row, which predicts the next token.
            end = s.num_new_tokens - 1 if s.num_new_tokens > 1 else s.num_new_tokens
            if n <= 0:
                out.append(runner.model.compute_logits(hidden[:0]).float())  # [0, V]
                continue
            h = hidden[end - n : end]
            out.append(
                torch.cat(
                    [
                        runner.model.compute_logits(h[j : j + LOGIT_ROWS_PER_CHUNK])
                        for j in range(0, h.shape[0], LOGIT_ROWS_PER_CHUNK)
                    ]
                ).float()
            )
        return out
