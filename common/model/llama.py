"""Llama-family decoder in PyTorch (RMSNorm, RoPE, GQA, SwiGLU) over a static, slotted KV cache.

Every call writes the new tokens' K/V into the cache first and then attends over the cache with an
explicit boolean mask, so prefill, single-token decoding and tree verification are one code path:
the caller decides positions, where K/V land, and who sees whom. The model does not know whether it
is being captured in a CUDA graph.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from common.config import LlamaConfig


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


def rope_tables(head_dim: int, max_position: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin: [max_position, head_dim] in the rotate-half layout of Hugging Face Llama."""
    inv = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
    freqs = torch.outer(torch.arange(max_position, dtype=torch.float64), inv)
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().float(), emb.sin().float()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [B, T, H, D]; cos, sin: [B, T, 1, D]."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return (x.float() * cos + rotated.float() * sin).to(x.dtype)


@dataclass
class KVCache:
    """Static K/V storage for `slots` sequences of up to `capacity` positions each."""

    k: torch.Tensor  # [L, slots, capacity, kv_heads, head_dim]
    v: torch.Tensor  # [L, slots, capacity, kv_heads, head_dim]

    @classmethod
    def allocate(cls, layers: int, slots: int, capacity: int, kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device) -> KVCache:
        shape = (layers, slots, capacity, kv_heads, head_dim)
        return cls(k=torch.zeros(shape, dtype=dtype, device=device),
                   v=torch.zeros(shape, dtype=dtype, device=device))

    @property
    def capacity(self) -> int:
        return self.k.shape[2]

    def move(self, slot: int, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Copy positions src -> dst of one slot in every layer (src, dst: [M] long).
        Gather first, then scatter, so overlapping moves read the old values."""
        self.k[:, slot, dst] = self.k[:, slot, src].clone()
        self.v[:, slot, dst] = self.v[:, slot, src].clone()


@dataclass
class Batch:
    """Where a forward's tokens sit and what they see."""

    input_ids: torch.Tensor  # [B, T] token ids
    positions: torch.Tensor  # [B, T] RoPE positions
    slots: torch.Tensor      # [B] KV cache slot of each sequence
    write_pos: torch.Tensor  # [B, T] cache position each token's K/V is written to
    mask: torch.Tensor       # [B, 1, T, K] bool, True = may attend; K = attended cache length


class Attention(nn.Module):
    def __init__(self, cfg: LlamaConfig, in_dim: int | None = None) -> None:
        super().__init__()
        d = in_dim or cfg.hidden_size
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.q_proj = nn.Linear(d, cfg.num_heads * cfg.head_dim, bias=False)
        self.k_proj = nn.Linear(d, cfg.num_kv_heads * cfg.head_dim, bias=False)
        self.v_proj = nn.Linear(d, cfg.num_kv_heads * cfg.head_dim, bias=False)
        self.o_proj = nn.Linear(cfg.num_heads * cfg.head_dim, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor, batch: Batch, cos: torch.Tensor, sin: torch.Tensor,
                k_cache: torch.Tensor, v_cache: torch.Tensor) -> torch.Tensor:
        """x: [B, T, d]; k_cache, v_cache: [slots, capacity, kv_heads, head_dim] (one layer)."""
        b, t, _ = x.shape
        q = apply_rope(self.q_proj(x).view(b, t, self.num_heads, self.head_dim), cos, sin)
        k = apply_rope(self.k_proj(x).view(b, t, self.num_kv_heads, self.head_dim), cos, sin)
        v = self.v_proj(x).view(b, t, self.num_kv_heads, self.head_dim)
        slot_idx = batch.slots[:, None].expand(b, t)
        k_cache[slot_idx, batch.write_pos] = k.to(k_cache.dtype)
        v_cache[slot_idx, batch.write_pos] = v.to(v_cache.dtype)
        kv_len = batch.mask.shape[-1]
        keys = k_cache[batch.slots, :kv_len].transpose(1, 2)    # [B, kv_heads, K, D]
        values = v_cache[batch.slots, :kv_len].transpose(1, 2)  # [B, kv_heads, K, D]
        out = F.scaled_dot_product_attention(q.transpose(1, 2), keys.to(q.dtype), values.to(q.dtype),
                                             attn_mask=batch.mask, enable_gqa=True)
        return self.o_proj(out.transpose(1, 2).reshape(b, t, -1))


class MLP(nn.Module):
    def __init__(self, hidden: int, intermediate: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden, intermediate, bias=False)
        self.up_proj = nn.Linear(hidden, intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_eps)
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_eps)
        self.mlp = MLP(cfg.hidden_size, cfg.intermediate_size)

    def forward(self, x: torch.Tensor, batch: Batch, cos: torch.Tensor, sin: torch.Tensor,
                k_cache: torch.Tensor, v_cache: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), batch, cos, sin, k_cache, v_cache)
        return x + self.mlp(self.post_attention_layernorm(x))


@dataclass
class ForwardOutput:
    hidden: torch.Tensor  # [B, T, H] final hidden states after the last norm (feed lm_head)
    aux: torch.Tensor     # [B, T, 3H] inputs of the three EAGLE layers, concatenated low|mid|high


class LlamaModel(nn.Module):
    """Parameter names follow Hugging Face's LlamaForCausalLM, so HF checkpoints load as they are."""

    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        cos, sin = rope_tables(cfg.head_dim, cfg.max_position, cfg.rope_theta)
        self.register_buffer("rope_cos", cos, persistent=False)  # [max_position, D]
        self.register_buffer("rope_sin", sin, persistent=False)  # [max_position, D]
        self.aux_layers = cfg.eagle_layers()

    def forward(self, batch: Batch, cache: KVCache) -> ForwardOutput:
        x = self.embed_tokens(batch.input_ids)
        cos = self.rope_cos[batch.positions][:, :, None, :]
        sin = self.rope_sin[batch.positions][:, :, None, :]
        taps: dict[int, torch.Tensor] = {}
        for i, layer in enumerate(self.layers):
            if i in self.aux_layers:
                taps[i] = x
            x = layer(x, batch, cos, sin, cache.k[i], cache.v[i])
        # a small model may name one layer twice (6 layers -> (2, 3, 3)): still 3 * H wide
        return ForwardOutput(hidden=self.norm(x), aux=torch.cat([taps[i] for i in self.aux_layers], dim=-1))

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [..., H] -> logits [..., V] in float32."""
        return self.lm_head(hidden).float()
