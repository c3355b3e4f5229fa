"""LLMEngine: admission -> schedule -> run -> postprocess, one iteration per `step()`."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import torch

from slotune.engine.block_manager import BlockManager
from slotune.engine.config import EngineConfig
from slotune.engine.draft_model import DraftModelProposer
from slotune.engine.loader import resolve_model_path
from slotune.engine.model_runner import ModelRunner
from slotune.engine.outputs import RequestOutput
from slotune.engine.sampler import Sampler
from slotune.engine.sampling_params import SamplingParams
from slotune.engine.scheduler import ScheduledSeq, Scheduler
from slotune.engine.sequence import Sequence, SequenceStatus
from slotune.engine.speculative import EarlyExitProposer, NgramProposer, verify_batch
from slotune.engine.tokenizer import Tokenizer

# Called after every step that ran, with the engine and the step's outputs; returns extra outputs
# to emit (e.g. those of requests it aborted), or None. The trial runner's in-flight early stop is one.
StepHook = Callable[["LLMEngine", list[RequestOutput]], Iterable[RequestOutput] | None]


class RequestRejected(Exception):
    """Admission control refused a request; `reason` is a stable machine-readable code."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason
        self.message = message


def build_proposer(cfg: EngineConfig, runner: ModelRunner, block_manager: BlockManager, sampler: Sampler):
    """The proposer cfg.speculative.method names, over the target's runner, block manager and sampler."""
    m = cfg.speculative.method
    if m == "ngram":
        return NgramProposer(cfg)
    if m == "early_exit":
        return EarlyExitProposer(cfg, runner, block_manager, sampler)
    return DraftModelProposer(cfg, runner.model_cfg.vocab_size, sampler)


@dataclass(slots=True)
class EngineStats:
    num_running: int
    num_waiting: int
    num_free_blocks: int
    num_total_blocks: int
    peak_blocks_used: int
    prefix_cache_queries: int
    prefix_cache_hits: int
    num_draft_tokens: int
    num_accepted_tokens: int
    num_preemptions: int
    num_steps: int
    num_rejected: dict[str, int] = field(default_factory=dict)
    num_spec_verifications: int = 0  # (sequence, step) pairs that verified drafts
    step_seconds: float = 0.0  # wall time inside `step` (schedule, model, sample, detokenize), cumulative
    execute_seconds: float = 0.0  # of which the model's forward (`ModelRunner.execute`)
    num_step_tokens: int = 0  # tokens the steps ran through the model (prefill + decode + drafts)
    window_peak_blocks: int = 0  # KV-block peak since `LLMEngine.start_stats_window` (a measured run)
    kernel_fallbacks: dict[str, int] = field(default_factory=dict)  # `ModelRunner.kernel_fallbacks`, cumulative

    @property
    def spec_mean_accepted_length(self) -> float:
        """Tokens emitted per verification: accepted drafts + the bonus/correction token."""
        v = self.num_spec_verifications
        return (self.num_accepted_tokens + v) / v if v else 0.0

    @property
    def prefix_cache_hit_rate(self) -> float:
        return self.prefix_cache_hits / self.prefix_cache_queries if self.prefix_cache_queries else 0.0

    @property
    def spec_acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0


class LLMEngine:
    def __init__(
        self, cfg: EngineConfig, runner: ModelRunner | None = None, tokenizer: Tokenizer | None = None
    ) -> None:
        self.cfg = cfg
        # The tokenizer before the weights: a vocabulary the engine refuses costs no weight load.
        self.tokenizer = tokenizer or Tokenizer.from_model_path(resolve_model_path(cfg.model))
        self.runner = runner or ModelRunner(cfg)
        self.block_manager = BlockManager(self.runner.num_blocks, cfg.block_size, cfg.enable_prefix_caching)
        self.scheduler = Scheduler.from_config(self.block_manager, cfg)
        self.sampler = Sampler(self.runner.device, cfg.seed)
        self.seqs: dict[str, Sequence] = {}
        self.num_steps = 0
        self.step_seconds = 0.0
        self.execute_seconds = 0.0
        self.num_step_tokens = 0
        self.num_draft_tokens = 0
        self.num_accepted_tokens = 0
        self.num_spec_verifications = 0
        self.num_rejected: dict[str, int] = {}
        self._step_hooks: list[StepHook] = []
        self.proposer = None
        if cfg.speculative.method != "none":
            self.proposer = build_proposer(cfg, self.runner, self.block_manager, self.sampler)
        self.eos_token_ids: frozenset[int] = self.tokenizer.eos_token_ids  # every end-of-turn id the model declares

    @property
    def weight_bytes(self) -> int:
        return self.runner.model.weight_bytes()

    @property
    def kv_bytes_per_token(self) -> int:
        return self.runner.kv_bytes_per_token

    # --- admission ------------------------------------------------------------------------
    def add_request(
        self, request_id: str, prompt: str | list[int], params: SamplingParams, arrival_time: float | None = None
    ) -> None:
        if request_id in self.seqs:
            raise ValueError(f"request_id '{request_id}' is already in flight")
        # text: a completion's prompt, which starts with BOS where the vocabulary says so (as llama.cpp and vLLM)
        ids = self.tokenizer.encode(prompt, add_special_tokens=True) if isinstance(prompt, str) else list(prompt)
        self._admit(ids, params)
        seq = Sequence(request_id, ids, params, time.perf_counter() if arrival_time is None else arrival_time)
        self.seqs[request_id] = seq
        self.scheduler.add(seq)

    def _reject(self, reason: str, message: str) -> None:
        self.num_rejected[reason] = self.num_rejected.get(reason, 0) + 1
        raise RequestRejected(reason, message)

    def _admit(self, ids: list[int], params: SamplingParams) -> None:
        cfg, adm = self.cfg, self.cfg.admission
        n = len(ids)
        if n == 0:
            self._reject("prompt_too_long", "prompt is empty")
        if any(t < 0 or t >= self.runner.model_cfg.vocab_size for t in ids):
            self._reject("invalid_prompt", f"prompt token ids must be in [0, {self.runner.model_cfg.vocab_size})")
        limit = min(adm.max_prompt_tokens or cfg.max_model_len, cfg.max_model_len - 1)
        if n > limit:
            self._reject("prompt_too_long", f"prompt has {n} tokens; the limit is {limit}")
        if adm.max_output_tokens is not None and params.max_tokens > adm.max_output_tokens:
            self._reject(
                "max_tokens_too_large",
                f"max_tokens={params.max_tokens} exceeds admission.max_output_tokens={adm.max_output_tokens}",
            )
        if n + params.max_tokens > cfg.max_model_len:
            self._reject(
                "max_tokens_too_large",
                f"prompt ({n}) + max_tokens ({params.max_tokens}) exceeds max_model_len ({cfg.max_model_len})",
            )
        total = n + params.max_tokens + cfg.speculative.num_speculative_tokens * (cfg.speculative.method != "none")
        if self.block_manager.blocks_needed(total) > self.block_manager.num_blocks:
            self._reject(
                "never_fits",
                f"request needs {self.block_manager.blocks_needed(total)} KV blocks; the cache has "
                f"{self.block_manager.num_blocks} in all",
            )
        if adm.max_queued_requests is not None and len(self.scheduler.waiting) >= adm.max_queued_requests:
            self._reject(
                "queue_full", f"{len(self.scheduler.waiting)} requests already queued (admission.max_queued_requests)"
            )
        if adm.max_tokens_in_flight is not None:
            in_flight = sum(s.max_total_tokens for s in self.seqs.values())
            if in_flight + n + params.max_tokens > adm.max_tokens_in_flight:
                self._reject(
                    "tokens_in_flight",
                    f"{in_flight} tokens in flight; adding {n + params.max_tokens} exceeds "
                    f"admission.max_tokens_in_flight={adm.max_tokens_in_flight}",
                )

    def abort_request(self, request_id: str) -> RequestOutput | None:
        seq = self.seqs.pop(request_id, None)
        if seq is None:
            return None
        self.scheduler.finish(seq, "abort")
        self.sampler.forget(seq.seq_id)
        seq.metrics.finish_time = time.perf_counter()
        return self._output(seq, [], "")

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.num_unfinished > 0

    # --- the loop --------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        t0 = time.perf_counter()
        sched = self.scheduler.schedule()
        if sched.is_empty:
            return []
        for s in sched.scheduled:
            if s.seq.metrics.scheduled_time is None:
                s.seq.metrics.scheduled_time = t0
        t1 = time.perf_counter()
        result = self.runner.execute(sched.scheduled)
        t2 = time.perf_counter()
        outputs = self._postprocess(sched.scheduled, result)
        self.num_steps += 1
        if self.proposer is not None:
            self.proposer.propose(list(self.scheduler.running))
        self.execute_seconds += t2 - t1
        self.step_seconds += time.perf_counter() - t0
        self.num_step_tokens += sched.num_batched_tokens
        for hook in list(self._step_hooks):
            outputs = outputs + list(hook(self, outputs) or ())
        return outputs

    def _postprocess(self, batch: list[ScheduledSeq], result) -> list[RequestOutput]:
        plain: list[tuple[ScheduledSeq, int]] = []  # (scheduled, logits row)
        spec: list[tuple[ScheduledSeq, torch.Tensor]] = []
        for s, (r0, r1) in zip(batch, result.row_ranges):
            if r0 == r1:  # a prefill chunk that did not reach the end
                s.seq.num_computed_tokens += s.num_new_tokens
                self.block_manager.cache_full_blocks(s.seq)
            elif s.num_draft_tokens:
                spec.append((s, result.logits[r0:r1]))
            else:
                plain.append((s, r0))
        new_tokens: dict[int, list[int]] = {}
        if plain:
            rows = torch.tensor([r for _, r in plain], device=result.logits.device)
            toks = self.sampler.sample(
                result.logits[rows], [s.seq.params for s, _ in plain], [s.seq.seq_id for s, _ in plain]
            ).tolist()
            for (s, _), tok in zip(plain, toks):
                s.seq.num_computed_tokens += s.num_new_tokens
                new_tokens[s.seq.seq_id] = [tok]
        if spec:
            for (s, _), toks in zip(spec, verify_batch(spec, self.sampler, self.proposer.draft_probs)):
                num_accepted = len(toks) - 1
                s.seq.num_computed_tokens += s.num_new_tokens - s.num_draft_tokens + num_accepted
                s.seq.metrics.num_draft_tokens += s.num_draft_tokens
                s.seq.metrics.num_accepted_tokens += num_accepted
                self.num_draft_tokens += s.num_draft_tokens
                self.num_accepted_tokens += num_accepted
                self.num_spec_verifications += 1
                new_tokens[s.seq.seq_id] = toks
        for s in batch:
            s.seq.spec_token_ids = []
        now = time.perf_counter()
        outputs = []
        for s in batch:
            seq = s.seq
            toks = new_tokens.get(seq.seq_id)
            if toks is None:
                continue
            appended = self._append(seq, toks, now)
            self.block_manager.cache_full_blocks(seq)
            outputs.append(self._finish_step(seq, appended))
        return outputs

    def _append(self, seq: Sequence, toks: list[int], now: float) -> list[int]:
        """Append tokens, stopping at the first stop condition. Returns the tokens kept."""
        p = seq.params
        kept = []
        for tok in toks:
            seq.token_ids.append(tok)
            kept.append(tok)
            seq.metrics.token_times.append(now)
            if seq.metrics.first_token_time is None:
                seq.metrics.first_token_time = now
            if (not p.ignore_eos and tok in self.eos_token_ids) or tok in p.stop_token_ids:
                seq.finish_reason = "stop"
                break
            if seq.num_output_tokens >= p.max_tokens or seq.num_tokens >= self.cfg.max_model_len:
                seq.finish_reason = "length"
                break
        return kept

    def _finish_step(self, seq: Sequence, appended: list[int]) -> RequestOutput:
        p = seq.params
        prev = seq.output_text
        # Only the new tokens are decoded (special tokens, EOS among them, are skipped); an
        # incomplete UTF-8 character waits for the next token unless the sequence ends here.
        delta, *offsets = self.tokenizer.decode_delta(
            seq.output_token_ids, *seq.detok_offsets, final=seq.finish_reason is not None
        )
        seq.detok_offsets = tuple(offsets)
        text = prev + delta
        if p.stop:
            search_from = max(0, len(prev) - max(len(x) for x in p.stop))
            hits = [(text.find(x, search_from), x) for x in p.stop]
            hits = [(i, x) for i, x in hits if i >= 0]
            if hits:
                text = text[: min(hits)[0]]
                seq.finish_reason = "stop"
        seq.output_text = text
        new_text = text[len(prev) :] if text.startswith(prev) else text
        if seq.finish_reason is not None:
            seq.metrics.finish_time = time.perf_counter()
            self.scheduler.finish(seq, seq.finish_reason)
            self.sampler.forget(seq.seq_id)
            self.seqs.pop(seq.request_id, None)
        return self._output(seq, appended, new_text)

    def _output(self, seq: Sequence, new_ids: list[int], new_text: str) -> RequestOutput:
        return RequestOutput(
            request_id=seq.request_id,
            prompt_token_ids=seq.prompt_token_ids,
            output_token_ids=seq.output_token_ids,
            text=seq.output_text,
            finished=seq.status == SequenceStatus.FINISHED,
            finish_reason=seq.finish_reason,
            metrics=seq.metrics,
            new_token_ids=new_ids,
            new_text=new_text,
        )

    def stats(self) -> EngineStats:
        bm = self.block_manager
        return EngineStats(
            num_running=len(self.scheduler.running),
            num_waiting=len(self.scheduler.waiting),
            num_free_blocks=bm.num_free_blocks,
            num_total_blocks=bm.num_blocks,
            peak_blocks_used=bm.peak_blocks_used,
            prefix_cache_queries=bm.num_prefix_queries,
            prefix_cache_hits=bm.num_prefix_hits,
            num_draft_tokens=self.num_draft_tokens,
            num_accepted_tokens=self.num_accepted_tokens,
            num_preemptions=self.scheduler.num_preemptions,
            num_steps=self.num_steps,
            num_rejected=dict(self.num_rejected),
            num_spec_verifications=self.num_spec_verifications,
            step_seconds=self.step_seconds,
            execute_seconds=self.execute_seconds,
            num_step_tokens=self.num_step_tokens,
            window_peak_blocks=bm.window_peak_blocks,
            kernel_fallbacks=self.runner.kernel_fallbacks(),
        )

    def start_stats_window(self) -> None:
        """Start a measured run: `stats().window_peak_blocks` counts from here. The cumulative
        counters are read as differences of two `stats()` snapshots (slotune/tuner/measure/metrics.py:
        engine_stats_delta), so nothing else is reset."""
        self.block_manager.start_peak_window()

    def add_step_hook(self, hook: StepHook) -> Callable[[], None]:
        """Call `hook(engine, outputs)` after every step that ran; the outputs it returns (e.g. of
        requests it aborted) are added to the step's. Returns a function that removes the hook."""
        self._step_hooks.append(hook)
        return lambda: self._step_hooks.remove(hook)
