"""Turns a scheduled batch into tensors, runs the model, returns logits where they are needed.

Owns the torch side: device, dtype, the model, and the one preallocated paged KV cache. On CPU
(kernels.backend auto|native) a step's rows go to the native step (slotune/kernels/cpu_decode.py): all of
them, in several calls if need be, where the weight format has no measured crossover to torch's
GEMM (every format on AVX2); else up to that crossover. What does not go, and speculative
verification, runs through torch.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import torch

from slotune.engine.config import EngineConfig
from slotune.engine.cuda_graph import DecodeGraphs
from slotune.engine.layers.attention import KVCache
from slotune.engine.layers.attn_metadata import (
    AttentionMetadata,
    SeqSpan,
    build_metadata,
    scratch_metadata,
    slot_mapping,
)
from slotune.engine.layers.backend import backend_name, select_backend
from slotune.engine.checkpoint import ModelConfig, context_problem
from slotune.engine.loader import load_model
from slotune.engine.models.llama import LlamaModel
from slotune.engine.native_step import native_decoder
from slotune.engine.quantize import quantize_model
from slotune.engine.scheduler import ScheduledSeq
from slotune.kernels.cpu_decode import PREFILL_ROWS

log = logging.getLogger(__name__)


def resolve_device(cfg: EngineConfig) -> torch.device:
    if cfg.device == "cuda" or (cfg.device == "auto" and torch.cuda.is_available()):
        if not torch.cuda.is_available():
            raise ValueError("device: 'cuda' requested but no CUDA device is available; use device: cpu or auto")
        return torch.device("cuda")
    return torch.device("cpu")


def resolve_dtype(cfg: EngineConfig, device: torch.device) -> torch.dtype:
    if cfg.dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return getattr(torch, cfg.dtype)


@dataclass(slots=True)
class StepResult:
    logits: torch.Tensor  # [N, V] float32, rows grouped per sequence in `scheduled` order
    row_ranges: list[tuple[int, int]]  # per scheduled seq: [start, end) rows of logits (empty = no logits)


def build_model(
    cfg: EngineConfig, model_cfg: ModelConfig, sd: dict[str, torch.Tensor], dtype: torch.dtype, device: torch.device
) -> LlamaModel:
    """The model `cfg` serves: built with the kernel backend cfg.kernels selects, then its Linear
    layers converted to cfg.quantization (the quantized layers take the backend's matmul tiles)."""
    backend = select_backend(cfg.kernels, device, model_cfg.sliding_window, model_cfg.full_attention_layers)
    model = LlamaModel(model_cfg, sd, dtype, device, backend)
    if cfg.quantization != "none":
        quantize_model(model, cfg.quantization, cfg.quant_group_size, tiles=backend.matmul)
    return model


class ModelRunner:
    """Args:
    cfg: the engine config.
    weights: (model config, state dict) to build the model from instead of loading `cfg.model`.
    model: an already built model to share (`build_model` for a config with the same weights,
        dtype, quantization and kernel backend); used as it is.
    """

    def __init__(
        self,
        cfg: EngineConfig,
        weights: tuple[ModelConfig, dict[str, torch.Tensor]] | None = None,
        model: LlamaModel | None = None,
    ) -> None:
        self.cfg = cfg
        self.device = resolve_device(cfg)
        self.dtype = resolve_dtype(cfg, self.device)
        torch.manual_seed(cfg.seed)
        if cfg.num_threads is not None and self.device.type == "cpu":
            torch.set_num_threads(cfg.num_threads)  # process-wide: the engine owns its process
        t0 = time.perf_counter()
        if model is None:
            if weights is None:
                model_cfg, sd, self.model_path = load_model(cfg.model)
            else:
                model_cfg, sd = weights
            model = build_model(cfg, model_cfg, sd, self.dtype, self.device)
        elif model.backend.name != backend_name(cfg.kernels, self.device):
            raise ValueError(
                f"a shared model built for the {model.backend.name} backend cannot serve kernels.backend "
                f"{cfg.kernels.backend} on {self.device.type}"
            )
        self.backend = model.backend.name  # "native" below when the native CPU step takes decode steps
        self.model = model
        self.model_cfg: ModelConfig = model.cfg
        self.load_time_s = time.perf_counter() - t0
        if problem := context_problem(self.model_cfg, cfg.max_model_len):
            raise ValueError(problem)
        mc = self.model_cfg
        self.kv_bytes_per_token = KVCache.bytes_per_token(
            mc.num_layers, mc.num_kv_heads, mc.head_dim, self.dtype, cfg.kv_dtype
        )
        if cfg.num_kv_blocks is not None:
            num_blocks = cfg.num_kv_blocks
        else:
            num_blocks = int(cfg.kv_cache_memory_gb * 2**30 // (self.kv_bytes_per_token * cfg.block_size))
        if num_blocks < 2:
            raise ValueError(f"kv_cache_memory_gb={cfg.kv_cache_memory_gb} holds fewer than 2 blocks; raise it")
        self.num_blocks = num_blocks
        self.kv_cache = KVCache(
            mc.num_layers,
            num_blocks,
            cfg.block_size,
            mc.num_kv_heads,
            mc.head_dim,
            self.dtype,
            cfg.kv_dtype,
            self.device,
        )
        self.block_size = cfg.block_size
        self.native = self._native_decoder(cfg)
        # Rows the chosen kernel backend did not run, by reason: a lever must never be credited
        # with another path's timings (EngineStats.kernel_fallbacks, trial metrics).
        self.num_native_rows_to_torch = 0
        self.graphs = None
        if cfg.use_cuda_graph and self.device.type == "cuda" and self.backend == "triton":
            self.graphs = DecodeGraphs(self, cfg.max_num_seqs)

    def _native_decoder(self, cfg: EngineConfig):
        """The native CPU decode step (slotune/kernels/cpu_decode.py) when chosen and possible, else None."""
        if self.device.type != "cpu" or cfg.kernels.backend not in ("auto", "native"):
            return None
        rows = cfg.max_num_seqs + min(PREFILL_ROWS, cfg.max_num_batched_tokens)
        decoder = native_decoder(
            self.model,
            self.kv_cache,
            max_rows=rows,
            max_ctx=cfg.max_model_len,
            int8_activations=cfg.kernels.int8_activations,
            act_group=cfg.kernels.int8_activation_group_size,
        )
        if isinstance(decoder, str):
            if cfg.kernels.backend == "native":
                raise ValueError(
                    f"kernels.backend: native cannot run this config: {decoder}; use kernels.backend: torch"
                )
            log.info("decode steps stay on torch ops: %s", decoder)
            return None
        self.backend = "native"
        return decoder

    @torch.inference_mode()
    def forward_hidden(self, batch: list[ScheduledSeq]) -> list[torch.Tensor]:
        """Teacher forcing for scoring and quality checks: run every new token of `batch` through
        the torch model over the paged KV cache (writing their K/V, exactly as a serving step does)
        and return each scheduled sequence's final hidden states [num_new_tokens, D], in `batch`'s
        order. `model.compute_logits` turns rows into logits; row j predicts token j + 1."""
        input_ids, positions, meta, _, _ = self._prepare(batch)
        hidden = self.model(input_ids, positions, self.kv_cache, meta)  # rows: extend steps first, then decodes
        order = [s for s in batch if s.num_new_tokens > 1] + [s for s in batch if s.num_new_tokens == 1]
        at, start = {}, 0
        for s in order:
            at[id(s)] = (start, start + s.num_new_tokens)
            start += s.num_new_tokens
        return [hidden[slice(*at[id(s)])] for s in batch]

    # --- input preparation ---------------------------------------------------------------
    def _prepare(
        self, batch: list[ScheduledSeq]
    ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, list[tuple[int, int]], torch.Tensor]:
        extend = [s for s in batch if s.num_new_tokens > 1]
        decode = [s for s in batch if s.num_new_tokens == 1]
        ids: list[int] = []
        pos: list[int] = []
        logit_rows: list[int] = []
        ranges: dict[int, tuple[int, int]] = {}
        t = 0
        for s in extend + decode:
            seq, n = s.seq, s.num_new_tokens
            start = seq.num_computed_tokens
            n_known = n - s.num_draft_tokens
            ids.extend(seq.token_ids[start : start + n_known])
            ids.extend(seq.spec_token_ids[: s.num_draft_tokens])
            pos.extend(range(start, start + n))
            if start + n_known >= seq.num_tokens:  # reaches the end: needs logits
                k = s.num_draft_tokens + 1
                r0 = len(logit_rows)
                logit_rows.extend(range(t + n - k, t + n))
                ranges[id(s)] = (r0, r0 + k)
            else:
                ranges[id(s)] = (0, 0)
            t += n
        span = lambda s: SeqSpan(s.seq.block_table, s.seq.num_computed_tokens, s.num_new_tokens)  # noqa: E731
        meta = build_metadata([span(s) for s in extend], [span(s) for s in decode], self.block_size, self.device)
        dev = self.device
        input_ids = torch.tensor(ids, dtype=torch.int64).to(dev, non_blocking=True)
        positions = torch.tensor(pos, dtype=torch.int64).to(dev, non_blocking=True)
        rows = torch.tensor(logit_rows, dtype=torch.int64).to(dev, non_blocking=True)
        return input_ids, positions, meta, [ranges[id(s)] for s in batch], rows

    # --- execution -------------------------------------------------------------------------
    @torch.inference_mode()
    def execute(self, batch: list[ScheduledSeq], num_layers: int | None = None) -> StepResult:
        if self.graphs is not None and num_layers is None and self.graphs.can_run(batch):
            return StepResult(logits=self.graphs.run(batch), row_ranges=[(i, i + 1) for i in range(len(batch))])
        if self.native is not None and num_layers is None:
            native = self._native_group(batch)
            if native:
                return self._execute_split(batch, native)
            self.num_native_rows_to_torch += sum(s.num_new_tokens for s in batch)
        return self._execute_torch(batch, num_layers)

    def kernel_fallbacks(self) -> dict[str, int]:
        """Cumulative count per fallback: rows the native step handed to torch
        (`native_rows_to_torch`: past its row limit, or speculative verification) and Triton
        prefill calls that ran torch's SDPA after the kernel failed (`triton_prefill_to_sdpa`)."""
        out = {"native_rows_to_torch": self.num_native_rows_to_torch} if self.native is not None else {}
        return out | self.model.backend.attn.kernel_fallbacks()

    def _native_group(self, batch: list[ScheduledSeq]) -> list[ScheduledSeq]:
        """The sequences whose rows run natively this step: every one without draft tokens when
        their rows fit, else the decodes alone, else none."""
        limit = self.native.max_native_rows
        plain = [s for s in batch if s.num_draft_tokens == 0]
        if limit is None or sum(s.num_new_tokens for s in plain) <= limit:
            return plain
        decode = [s for s in batch if s.num_new_tokens == 1]
        return decode if len(decode) <= limit else []

    def _execute_split(self, batch: list[ScheduledSeq], native: list[ScheduledSeq]) -> StepResult:
        """`native` sequences' rows in one native call; the rest (long prefill chunks, speculative
        verification), if any, through torch.

        Under continuous batching most steps mix a new request's prefill into the running
        decodes; sending the whole step to torch cost every decode its native speed. The groups
        are different sequences writing disjoint KV slots.
        """
        native_logits, native_ranges = self._native_step(native)  # a view, valid until the next step
        if len(native) == len(batch):
            return StepResult(logits=native_logits, row_ranges=native_ranges)
        chosen = {id(s) for s in native}
        rest = [s for s in batch if id(s) not in chosen]
        self.num_native_rows_to_torch += sum(s.num_new_tokens for s in rest)
        res = self._execute_torch(rest)
        n = res.logits.shape[0]
        where = {id(s): r for s, r in zip(rest, res.row_ranges)}
        where |= {id(s): (a + n, b + n) if b > a else (0, 0) for s, (a, b) in zip(native, native_ranges)}
        logits = torch.cat([res.logits.view(n, -1), native_logits]) if n else native_logits
        return StepResult(logits=logits, row_ranges=[where[id(s)] for s in batch])

    def _execute_torch(self, batch: list[ScheduledSeq], num_layers: int | None = None) -> StepResult:
        input_ids, positions, meta, ranges, rows = self._prepare(batch)
        hidden = self.model(input_ids, positions, self.kv_cache, meta, num_layers=num_layers)
        logits = self.model.compute_logits(hidden[rows]) if rows.numel() else hidden.new_zeros(0, 0).float()
        return StepResult(logits=logits, row_ranges=ranges)

    def _native_step(self, group: list[ScheduledSeq]) -> tuple[torch.Tensor, list[tuple[int, int]]]:
        """Every new token of `group` as one row; logits for the rows that reach a sequence's end."""
        bs = self.block_size
        ids, pos, slots, tables, logit_rows, ranges = [], [], [], [], [], []
        for s in group:
            seq, start, n = s.seq, s.seq.num_computed_tokens, s.num_new_tokens
            ids += seq.token_ids[start : start + n]
            pos += range(start, start + n)
            slots += slot_mapping(seq.block_table, start, n, bs)
            tables += [seq.block_table] * n
            if start + n >= seq.num_tokens:  # reaches the end: samples
                ranges.append((len(logit_rows), len(logit_rows) + 1))
                logit_rows.append(len(ids) - 1)
            else:
                ranges.append((0, 0))
        cap = self.native.max_rows
        if len(ids) <= cap:
            return self.native.step(ids, pos, slots, tables, logit_rows), ranges
        # More rows than one call holds (a burst of prompts): consecutive calls in row order. A
        # sequence's rows are in position order, so a later call attends to the KV an earlier one
        # wrote. Each call's logits live in one reused buffer, hence the copies.
        parts = []
        for a in range(0, len(ids), cap):
            b = min(a + cap, len(ids))
            rows = [r - a for r in logit_rows if a <= r < b]
            parts.append(self.native.step(ids[a:b], pos[a:b], slots[a:b], tables[a:b], rows).clone())
        return torch.cat(parts), ranges

    @torch.inference_mode()
    def run_decode(
        self, block_tables: list[list[int]], token_ids: list[int], positions: list[int], num_layers: int | None = None
    ) -> torch.Tensor:
        """One token per sequence at explicit positions (draft steps). -> logits [B, V].

        Each block table must already cover its sequence's position.
        """
        spans = [SeqSpan(t, p, 1) for t, p in zip(block_tables, positions)]
        meta = build_metadata([], spans, self.block_size, self.device)
        ids = torch.tensor(token_ids, dtype=torch.int64, device=self.device)
        pos = torch.tensor(positions, dtype=torch.int64, device=self.device)
        return self.model.compute_logits(self.model(ids, pos, self.kv_cache, meta, num_layers=num_layers))

    @torch.inference_mode()
    def full_logits(self, token_ids: list[int]) -> torch.Tensor:
        """Logits at every position of one sequence, without touching the KV cache. -> [T, V]."""
        n = len(token_ids)
        meta = scratch_metadata(n, self.block_size, self.device)
        ids = torch.tensor(token_ids, dtype=torch.int64, device=self.device)
        pos = torch.arange(n, device=self.device)
        return self.model.compute_logits(self.model(ids, pos, self.kv_cache, meta))
