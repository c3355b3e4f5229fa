"""Llama-family decoder over a paged KV cache (GQA, RoPE, RMSNorm, SwiGLU).

One implementation for every family the loader reads; what differs is data in `ModelConfig`
and the state dict: biases present or not (Qwen2, `attention_bias`, `mlp_bias`), per-head q/k
RMSNorm (`qk_norm`, Qwen3), layers without RoPE (`no_rope_layers`, SmolLM3), RoPE on part of
each head (`rotary_dim`, Phi-3, whose fused projections the loader splits), an attention window
(`sliding_window`, Mistral; the attention backend applies it), an explicit head_dim; and for
Gemma 3, four norms per layer (`sandwich_norms`), GeGLU, scaled embeddings, its own softmax
scale, and windowed layers with their own RoPE table between full-attention ones.

QKV and gate/up projections are fused into one matmul each: fewer launches (GPU) and
fewer Python ops per layer (CPU), same math.

The kernel backend (attention, pointwise ops: slotune/engine/layers/backend.py) is an input of the
constructor; nothing swaps it on a built model.
"""

from __future__ import annotations

import torch
from torch import nn

from slotune.engine.layers.attention import AttentionMetadata, KVCache
from slotune.engine.layers.backend import Backend, torch_backend
from slotune.engine.layers.linear import Linear
from slotune.engine.layers.ops import rope_cos_sin
from slotune.engine.checkpoint import ModelConfig


class LlamaLayer(nn.Module):
    def __init__(
        self, cfg: ModelConfig, sd: dict[str, torch.Tensor], index: int, dtype: torch.dtype, backend: Backend
    ) -> None:
        super().__init__()
        prefix = f"model.layers.{index}."
        self.index = index  # this layer's slice of the KV cache
        self.attn, self.ops = backend.attn, backend.ops
        g = lambda n: sd.pop(prefix + n).to(dtype)  # noqa: E731 - pop: free float32 copies as we go

        def fused(names: list[str]) -> Linear:
            """One Linear over several projections; biases (Qwen2's q/k/v, attention_bias, mlp_bias)
            are present for all of them or none."""
            biases = [prefix + n + ".bias" in sd for n in names]
            if any(biases) and not all(biases):
                raise ValueError(
                    f"{prefix}: biases on {[n for n, b in zip(names, biases) if b]} but not on the "
                    f"rest of {names}: a layout this engine does not implement"
                )
            weight = torch.cat([g(n + ".weight") for n in names])
            return Linear(weight, torch.cat([g(n + ".bias") for n in names]) if all(biases) else None)

        norm = lambda n: nn.Parameter(g(n + ".weight"), requires_grad=False)  # noqa: E731
        self.input_norm = norm("input_layernorm")
        if cfg.sandwich_norms:  # Gemma: post_attention_layernorm norms the attention's output
            self.attn_out_norm, self.mlp_norm = norm("post_attention_layernorm"), norm("pre_feedforward_layernorm")
            self.mlp_out_norm = norm("post_feedforward_layernorm")
        else:
            self.attn_out_norm, self.mlp_norm, self.mlp_out_norm = None, norm("post_attention_layernorm"), None
        # Qwen3: [head_dim] weights of the per-head RMSNorm on q and on k
        self.q_norm = nn.Parameter(g("self_attn.q_norm.weight"), requires_grad=False) if cfg.qk_norm else None
        self.k_norm = nn.Parameter(g("self_attn.k_norm.weight"), requires_grad=False) if cfg.qk_norm else None
        self.qkv_proj = fused(["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"])
        self.o_proj = fused(["self_attn.o_proj"])
        self.gate_up_proj = fused(["mlp.gate_proj", "mlp.up_proj"])
        self.down_proj = fused(["mlp.down_proj"])
        self.num_heads = cfg.num_heads
        self.num_kv_heads = cfg.num_kv_heads
        self.head_dim = cfg.head_dim
        self.eps = cfg.rms_norm_eps
        self.scale = cfg.attn_scale or cfg.head_dim**-0.5
        self.gate = self.ops.gelu_tanh_and_mul if cfg.hidden_act == "gelu_tanh" else self.ops.silu_and_mul
        self.rope = index not in cfg.no_rope_layers  # SmolLM3: NoPE layers
        self.rotary_dim = cfg.rotary_dim or cfg.head_dim  # Phi-3: the first dims of each head only
        # windowed layers of a model with a local RoPE base read the model's second table
        self.local_rope = cfg.local_rope_theta is not None and cfg.window_of(index) is not None
        self.q_size = cfg.num_heads * cfg.head_dim
        self.kv_size = cfg.num_kv_heads * cfg.head_dim

    def forward(
        self,
        x: torch.Tensor,
        residual: torch.Tensor | None,
        cos_sin: torch.Tensor,
        cache: KVCache,
        meta: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """x: [T, D] this layer's input (before the residual add), residual: [T, D] or None (first
        layer); cos_sin: [T, Dh] -> (output [T, D], residual [T, D]), the residual add deferred to the
        next norm (fused there)."""
        ops = self.ops
        h, residual = ops.rms_norm(x, self.input_norm, self.eps, residual)
        qkv = self.qkv_proj(h)
        # q and k are adjacent in qkv: rotate all their heads in one pass.
        if self.q_norm is None:
            qk = qkv[:, : self.q_size + self.kv_size].view(-1, self.num_heads + self.num_kv_heads, self.head_dim)
        else:
            qk = self._qk_norm(qkv)
        if self.rope and self.rotary_dim < self.head_dim:
            rd = self.rotary_dim
            qk = torch.cat([ops.rotary(qk[..., :rd].contiguous(), cos_sin), qk[..., rd:]], dim=-1)
        elif self.rope:
            qk = ops.rotary(qk, cos_sin)
        q, k = qk.split([self.num_heads, self.num_kv_heads], dim=1)
        v = qkv[:, self.q_size + self.kv_size :].view(-1, self.num_kv_heads, self.head_dim)
        o = self.attn.forward(cache, self.index, q, k, v, meta, self.scale)
        x = self.o_proj(o.reshape(-1, self.q_size))
        if self.attn_out_norm is not None:
            x = ops.rms_norm(x, self.attn_out_norm, self.eps)[0]
        h, residual = ops.rms_norm(x, self.mlp_norm, self.eps, residual)
        x = self.down_proj(self.gate(self.gate_up_proj(h)))
        if self.mlp_out_norm is not None:
            x = ops.rms_norm(x, self.mlp_out_norm, self.eps)[0]
        return x, residual

    def _qk_norm(self, qkv: torch.Tensor) -> torch.Tensor:
        """Qwen3's RMSNorm over head_dim of every q and k head (before RoPE), through the backend's
        ops (the Triton rms_norm kernel there). qkv: [T, (H + 2*Hkv) * D] -> q|k heads [T, H + Hkv, D]."""
        d = self.head_dim
        q = self.ops.rms_norm(qkv[:, : self.q_size].reshape(-1, d), self.q_norm, self.eps)[0]  # [T*H, D]
        k = self.ops.rms_norm(qkv[:, self.q_size : self.q_size + self.kv_size].reshape(-1, d), self.k_norm, self.eps)[0]
        return torch.cat([q.view(-1, self.num_heads, d), k.view(-1, self.num_kv_heads, d)], dim=1)


class LlamaModel(nn.Module):
    def __init__(
        self,
        cfg: ModelConfig,
        sd: dict[str, torch.Tensor],
        dtype: torch.dtype,
        device: torch.device,
        backend: Backend | None = None,
    ) -> None:
        """backend: attention and pointwise ops (slotune/engine/layers/backend.py); None = plain torch."""
        super().__init__()
        self.cfg = cfg
        self.dtype = dtype
        self.backend = backend or torch_backend(cfg.sliding_window, cfg.full_attention_layers)
        self.ops = self.backend.ops
        self.embed = nn.Parameter(sd.pop("model.embed_tokens.weight").to(dtype), requires_grad=False)
        scale = (
            None if cfg.embed_scale is None else torch.tensor(cfg.embed_scale).to(dtype)
        )  # as transformers rounds it
        self.register_buffer("embed_scale", scale, persistent=False)  # Gemma
        self.layers = nn.ModuleList(LlamaLayer(cfg, sd, i, dtype, self.backend) for i in range(cfg.num_layers))
        self.norm = nn.Parameter(sd.pop("model.norm.weight").to(dtype), requires_grad=False)
        lm_head = sd.pop("lm_head.weight", None)
        self.lm_head = Linear(self.embed.data if lm_head is None else lm_head.to(dtype))
        unused = sorted(k for k in sd if not k.endswith("rotary_emb.inv_freq"))  # derived buffers of old checkpoints
        if unused:
            raise ValueError(
                f"model weights this engine does not use (a layout it does not implement; refusing "
                f"rather than computing something else): {', '.join(unused[:8])}"
                + (f" and {len(unused) - 8} more" if len(unused) > 8 else "")
            )
        self.to(device)
        if lm_head is None:  # tied: share storage after the move
            self.lm_head.weight = self.embed
        rotary = cfg.rotary_dim or cfg.head_dim
        self.register_buffer(
            "cos_sin",
            rope_cos_sin(rotary, cfg.max_position_embeddings, cfg.rope_theta, device, cfg.rope_scaling),
            persistent=False,
        )
        local = cfg.local_rope_theta
        self.register_buffer(  # Gemma 3's windowed layers: their own base, no scaling
            "cos_sin_local",
            None if local is None else rope_cos_sin(rotary, cfg.max_position_embeddings, local, device),
            persistent=False,
        )

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        cache: KVCache,
        meta: AttentionMetadata,
        num_layers: int | None = None,
    ) -> torch.Tensor:
        """input_ids, positions: [T] -> final-normed hidden states [T, D].

        num_layers < all runs only the first layers (early-exit self-drafting).
        """
        x = self.embed[input_ids]
        if self.embed_scale is not None:
            x = x * self.embed_scale
        cos_sin = self.cos_sin[positions]
        local = cos_sin if self.cos_sin_local is None else self.cos_sin_local[positions]
        residual = None
        for layer in self.layers if num_layers is None else self.layers[:num_layers]:
            x, residual = layer(x, residual, local if layer.local_rope else cos_sin, cache, meta)
        x, _ = self.ops.rms_norm(x, self.norm, self.cfg.rms_norm_eps, residual)
        return x

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden).float()

    def linears(self) -> list[tuple[str, Linear]]:
        return [(n, m) for n, m in self.named_modules() if isinstance(m, Linear)]

    def weight_bytes(self) -> int:
        """Bytes a decode step reads: every layer's weights + LM head (the embedding row gather is negligible)."""
        seen, total = set(), 0
        for _, m in self.named_modules():
            if hasattr(m, "weight_bytes") and m is not self and id(m) not in seen:
                seen.add(id(m))
                total += m.weight_bytes()
        for p in self.parameters(recurse=True):
            if p.dim() == 1:
                total += p.numel() * p.element_size()
        return total
