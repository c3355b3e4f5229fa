"""Llama-family decoder over a paged KV cache (GQA, RoPE, RMSNorm, SwiGLU).

One implementation for every family the loader reads; what differs is data in `ModelConfig`
and the state dict: biases present or not (Qwen2, `attention_bias`, `mlp_bias`), per-head q/k
RMSNorm (`qk_norm`, Qwen3), an attention window (`sliding_window`, Mistral; the attention
backend applies it), an explicit head_dim.

QKV and gate/up projections are fused into one matmul each: fewer launches (GPU) and
fewer Python ops per layer (CPU), same math.
"""

from __future__ import annotations

import torch
from torch import nn

from slotune.engine.layers.attention import AttentionMetadata, KVCache, TorchAttentionBackend
from slotune.engine.layers.linear import Linear
from slotune.engine.layers.ops import apply_rotary, rms_norm, rope_cos_sin, silu_and_mul
from slotune.engine.loader import ModelConfig


class LlamaLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, sd: dict[str, torch.Tensor], prefix: str, dtype: torch.dtype) -> None:
        super().__init__()
        g = lambda n: sd.pop(prefix + n).to(dtype)  # noqa: E731 - pop: free float32 copies as we go

        def fused(names: list[str]) -> Linear:
            """One Linear over several projections; biases (Qwen2's q/k/v, attention_bias, mlp_bias)
            are present for all of them or none."""
            biases = [prefix + n + ".bias" in sd for n in names]
            if any(biases) and not all(biases):
                raise ValueError(f"{prefix}: biases on {[n for n, b in zip(names, biases) if b]} but not on the "
                                 f"rest of {names}: a layout this engine does not implement")
            weight = torch.cat([g(n + ".weight") for n in names])
            return Linear(weight, torch.cat([g(n + ".bias") for n in names]) if all(biases) else None)

        self.input_norm = nn.Parameter(g("input_layernorm.weight"), requires_grad=False)
        self.post_norm = nn.Parameter(g("post_attention_layernorm.weight"), requires_grad=False)
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
        self.scale = cfg.head_dim ** -0.5
        self.q_size = cfg.num_heads * cfg.head_dim
        self.kv_size = cfg.num_kv_heads * cfg.head_dim


class LlamaModel(nn.Module):
    def __init__(self, cfg: ModelConfig, sd: dict[str, torch.Tensor], dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        self.cfg = cfg
        self.dtype = dtype
        self.embed = nn.Parameter(sd.pop("model.embed_tokens.weight").to(dtype), requires_grad=False)
        self.layers = nn.ModuleList(LlamaLayer(cfg, sd, f"model.layers.{i}.", dtype) for i in range(cfg.num_layers))
        self.norm = nn.Parameter(sd.pop("model.norm.weight").to(dtype), requires_grad=False)
        lm_head = sd.pop("lm_head.weight", None)
        self.lm_head = Linear(self.embed.data if lm_head is None else lm_head.to(dtype))
        unused = sorted(k for k in sd if not k.endswith("rotary_emb.inv_freq"))  # derived buffers of old checkpoints
        if unused:
            raise ValueError(f"model weights this engine does not use (a layout it does not implement; refusing "
                             f"rather than computing something else): {', '.join(unused[:8])}"
                             + (f" and {len(unused) - 8} more" if len(unused) > 8 else ""))
        self.to(device)
        if lm_head is None:  # tied: share storage after the move
            self.lm_head.weight = self.embed
        self.register_buffer("cos_sin", rope_cos_sin(cfg.head_dim, cfg.max_position_embeddings, cfg.rope_theta, device,
                                                     cfg.rope_scaling), persistent=False)
        self.attn = TorchAttentionBackend(cfg.sliding_window)
        self.ops = _TorchOps()

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, cache: KVCache, meta: AttentionMetadata,
                num_layers: int | None = None) -> torch.Tensor:
        """input_ids, positions: [T] -> final-normed hidden states [T, D].

        num_layers < all runs only the first layers (early-exit self-drafting).
        """
        ops = self.ops
        x = self.embed[input_ids]
        cos_sin = self.cos_sin[positions]
        residual = None
        layers = self.layers if num_layers is None else self.layers[:num_layers]
        for i, layer in enumerate(layers):
            h, residual = ops.rms_norm(x, layer.input_norm, layer.eps, residual)
            qkv = layer.qkv_proj(h)
            # q and k are adjacent in qkv: rotate all their heads in one pass.
            if layer.q_norm is None:
                qk = qkv[:, : layer.q_size + layer.kv_size].view(-1, layer.num_heads + layer.num_kv_heads, layer.head_dim)
            else:
                qk = self._qk_norm(layer, qkv)
            qk = ops.rotary(qk, cos_sin)
            q, k = qk.split([layer.num_heads, layer.num_kv_heads], dim=1)
            v = qkv[:, layer.q_size + layer.kv_size :].view(-1, layer.num_kv_heads, layer.head_dim)
            o = self.attn.forward(cache, i, q, k, v, meta, layer.scale)
            x = layer.o_proj(o.reshape(-1, layer.q_size))
            h, residual = ops.rms_norm(x, layer.post_norm, layer.eps, residual)
            x = layer.down_proj(ops.silu_and_mul(layer.gate_up_proj(h)))
        x, _ = ops.rms_norm(x, self.norm, self.cfg.rms_norm_eps, residual)
        return x

    def _qk_norm(self, layer: LlamaLayer, qkv: torch.Tensor) -> torch.Tensor:
        """Qwen3's RMSNorm over head_dim of every q and k head (before RoPE), through `self.ops` so the
        Triton path runs its rms_norm kernel. qkv: [T, (H + 2*Hkv) * D] -> q|k heads [T, H + Hkv, D]."""
        d = layer.head_dim
        q = self.ops.rms_norm(qkv[:, : layer.q_size].reshape(-1, d), layer.q_norm, layer.eps)[0]  # [T*H, D]
        k = self.ops.rms_norm(qkv[:, layer.q_size : layer.q_size + layer.kv_size].reshape(-1, d), layer.k_norm,
                              layer.eps)[0]
        return torch.cat([q.view(-1, layer.num_heads, d), k.view(-1, layer.num_kv_heads, d)], dim=1)

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


class _TorchOps:
    """Pointwise ops; the Triton backend swaps this object for fused kernels."""

    rms_norm = staticmethod(rms_norm)
    silu_and_mul = staticmethod(silu_and_mul)
    rotary = staticmethod(apply_rotary)
