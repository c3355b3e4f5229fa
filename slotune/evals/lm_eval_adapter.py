"""lm-eval on our engine: an `lm_eval.api.model.LM` backed by a loaded `slotune.engine.LLM`.

- loglikelihood: batched teacher-forced scoring through the paged KV cache (`PagedScorer`),
  so weight *and* KV-cache precision show in the score.
- loglikelihood_rolling: lm-eval's disjoint rolling windows of the engine's sequence limit.
- generate_until: `LLM.generate` (continuous batching, speculative decoding if configured)
  with the task's stop strings.
"""

from __future__ import annotations

from lm_eval.api.model import LM

from slotune.engine.sampling_params import SamplingParams
from slotune.evals.scoring import PagedScorer


class SlotuneLM(LM):
    """Lifecycle: built around an already loaded LLM (a trial's), used for one or more
    `simple_evaluate` calls, then dropped; it owns nothing the LLM does not.

    Args:
        llm: a loaded, idle `slotune.engine.LLM`.
        max_length: longest scored sequence; default min(max_model_len, KV cache capacity).
        max_batch_tokens: tokens per scoring forward; default the engine's max_num_batched_tokens.
    """

    def __init__(self, llm, max_length: int | None = None, max_batch_tokens: int | None = None) -> None:
        super().__init__()
        self.llm = llm
        self.tok = llm.tokenizer
        self.scorer = PagedScorer(llm, max_batch_tokens=max_batch_tokens)
        self.max_length = min(max_length or self.scorer.max_seq_len, self.scorer.max_seq_len)
        # Prepended when a context is empty, as lm-eval's HF model does with its prefix token.
        bos, eos = self.tok.bos_token_id, self.tok.eos_token_id
        self.prefix_token_id = bos if bos is not None else (eos if eos is not None else 0)

    # --- encoding ------------------------------------------------------------------------
    def _encode_pair(self, context: str, continuation: str) -> tuple[list[int], list[int]]:
        # Encode jointly so the boundary tokenizes as in running text (lm-eval's HF convention):
        # trailing context whitespace moves onto the continuation.
        n_space = len(context) - len(context.rstrip())
        if n_space:
            continuation, context = context[-n_space:] + continuation, context[:-n_space]
        if not context:
            return [self.prefix_token_id], self.tok.encode(continuation)
        whole = self.tok.encode(context + continuation, add_special_tokens=True)  # BOS where due (HFLM's gemma rule)
        n_ctx = len(self.tok.encode(context, add_special_tokens=True))
        return whole[:n_ctx], whole[n_ctx:]

    # --- lm-eval API -----------------------------------------------------------------------
    def loglikelihood(self, requests, disable_tqdm: bool = False) -> list[tuple[float, bool]]:
        pairs = []
        for req in requests:
            ctx, cont = self._encode_pair(*req.args)
            cont = cont[-(self.max_length - 1) :] or [self.prefix_token_id]  # never empty, never longer than fits
            ids = (ctx + cont)[-self.max_length :]  # left-truncate the context
            pairs.append((ids, len(cont)))
        scored = self.scorer.score(pairs)
        out = [(float(sum(s.logprobs)), bool(all(s.is_greedy))) for s in scored]
        for req, o in zip(requests, out):
            self.cache_hook.add_partial("loglikelihood", req.args, o)
        return out

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        from lm_eval.utils import get_rolling_token_windows, make_disjoint_window

        pairs, owner = [], []
        for k, req in enumerate(requests):
            (text,) = req.args
            windows = get_rolling_token_windows(
                token_list=self.tok.encode(text),
                prefix_token=self.prefix_token_id,
                max_seq_len=self.max_length - 1,
                context_len=1,
            )
            for ctx, pred in map(make_disjoint_window, windows):
                pairs.append((ctx + pred, len(pred)))
                owner.append(k)
        totals = [0.0] * len(requests)
        for k, s in zip(owner, self.scorer.score(pairs)):
            totals[k] += sum(s.logprobs)
        return totals

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        prompts, params = [], []
        for req in requests:
            context, kw = req.args
            until = kw.get("until") or []
            until = [until] if isinstance(until, str) else list(until)
            max_new = int(kw.get("max_gen_toks", 256))
            prompts.append(self.tok.encode(context, add_special_tokens=True)[-max(1, self.max_length - max_new) :])
            params.append(SamplingParams(max_tokens=max_new, temperature=float(kw.get("temperature", 0.0)), stop=until))
        if not prompts:
            return []
        texts = []
        for o in self.llm.generate(prompts, params):
            text = o.text
            for s in params[len(texts)].stop:  # lm-eval's contract: cut at the first stop string
                text = text.split(s)[0] if s else text
            texts.append(text)
        return texts
