"""Llama-family decoder in PyTorch (RMSNorm, RoPE, GQA, SwiGLU) over a static, slotted KV cache.

Every call writes the new tokens' K/V into the cache first and then attends over the cache with an
explicit boolean mask, so prefill, single-token decoding and tree verification are one code path:
the caller decides positions, where K/V land, and who sees whom. The model does not know whether it
is being captured in a CUDA graph.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

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
        # one fused kernel on CUDA, accumulating in float32 (opmath) for half inputs too
        if x.dtype == self.weight.dtype:
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
        return self.weight * F.rms_norm(x.float(), self.weight.shape, eps=self.eps).to(x.dtype)


def rope_tables(head_dim: int, max_position: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin: [max_position, head_dim] in the rotate-half layout of Hugging Face Llama."""
    inv = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
    freqs = torch.outer(torch.arange(max_position, dtype=torch.float64), inv)
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().float(), emb.sin().float()


def rope_angles(cos_table: torch.Tensor, sin_table: torch.Tensor, positions: torch.Tensor,
                dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-forward RoPE factors for Attention: cos [B, T, 1, D] and *signed* sin [B, T, 1, D] (first half
    negated, so that rotate_half(x) * sin == swap_halves(x) * signed_sin), both in the compute dtype.
    Built once per forward and shared by every layer."""
    half = cos_table.shape[-1] // 2
    cos = cos_table[positions]
    sin = sin_table[positions]
    sin = torch.cat((-sin[..., :half], sin[..., half:]), dim=-1)
    return cos.to(dtype)[:, :, None, :], sin.to(dtype)[:, :, None, :]


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Reference RoPE (Hugging Face layout). x: [B, T, H, D]; cos, sin: [B, T, 1, D] (unsigned sin)."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return (x.float() * cos + rotated.float() * sin).to(x.dtype)


def rope_(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """RoPE in place on x [B, T, H, D] (any head stride) in 3 kernels: swap halves, x *= cos,
    x += swapped * signed_sin. cos, signed_sin: [B, T, 1, D] from rope_angles."""
    b, t, h, d = x.shape
    swapped = x.unflatten(-1, (2, d // 2)).flip(-2).flatten(-2)
    return x.mul_(cos).addcmul_(swapped, signed_sin)


def _fused_weight(owner: nn.Module, attr: str, parts: tuple[nn.Linear, ...]) -> torch.Tensor:
    """The row-concatenation of parts' weights, for one matmul instead of len(parts).

    The parts stay the registered parameters (Hugging Face names for loading, saving, training), but
    after fusing their .data are row views of one buffer, so the fused weight costs no memory and sees
    every in-place update (load_state_dict, optimizer steps, copy_). When a parameter was replaced
    (module.to(), param.data = ...) the views no longer match and the buffer is rebuilt. With autograd
    on the parameters the concatenation is done per forward (torch.cat: one kernel, differentiable)."""
    ws = [m.weight for m in parts]
    fused = owner.__dict__.get(attr)
    if fused is not None and _is_fused(fused, ws):
        if torch.is_grad_enabled() and any(w.requires_grad for w in ws):
            return torch.cat(ws)
        return fused
    if torch.is_grad_enabled() and any(w.requires_grad for w in ws):
        return torch.cat(ws)
    if fused_capture_guard(ws[0]):
        raise RuntimeError("fused weights must be built before CUDA graph capture: call model.fuse() "
                           "(or run one eager forward) after loading weights and moving the model")
    fused = torch.cat([w.detach() for w in ws])
    off = 0
    for w in ws:
        n = w.shape[0]
        w.data = fused[off:off + n]
        off += n
    owner.__dict__[attr] = fused
    return fused


def _is_fused(fused: torch.Tensor, ws: list[torch.Tensor]) -> bool:
    ptr, step = fused.data_ptr(), fused.stride(0) * fused.element_size()
    off = 0
    for w in ws:
        if (w.dtype != fused.dtype or w.device != fused.device or w.data_ptr() != ptr + off * step
                or w.stride() != fused.stride()):
            return False
        off += w.shape[0]
    return off == fused.shape[0]


def fused_capture_guard(w: torch.Tensor) -> bool:
    return w.is_cuda and torch.cuda.is_current_stream_capturing()


def fuse(module: nn.Module) -> nn.Module:
    """Build the fused q|k|v and gate|up weights of every Attention/MLP in module now (call after loading
    weights and moving to the device, before CUDA graph capture). Idempotent; returns module."""
    with torch.no_grad():
        for m in module.modules():
            if isinstance(m, (Attention, MLP)):
                m.fused_weight()
    return module


@dataclass
class KVCache:
    """Static K/V storage for `slots` sequences of up to `capacity` positions each.

    K and V of a layer live interleaved in one tensor, kv [L, slots, capacity, 2, kv_heads, head_dim],
    so one index_put writes both and one gather reads both; `k` and `v` are (strided) views of it."""

    kv: torch.Tensor  # [L, slots, capacity, 2, kv_heads, head_dim]

    @classmethod
    def allocate(cls, layers: int, slots: int, capacity: int, kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device) -> KVCache:
        return cls(kv=torch.zeros((layers, slots, capacity, 2, kv_heads, head_dim), dtype=dtype, device=device))

    @property
    def k(self) -> torch.Tensor:  # [L, slots, capacity, kv_heads, head_dim] view
        return self.kv[:, :, :, 0]

    @property
    def v(self) -> torch.Tensor:  # [L, slots, capacity, kv_heads, head_dim] view
        return self.kv[:, :, :, 1]

    @property
    def capacity(self) -> int:
        return self.kv.shape[2]



def _joint_kv(k_cache: torch.Tensor, v_cache: torch.Tensor) -> torch.Tensor | None:
    """The [slots, capacity, 2, kv_heads, D] tensor behind one layer's k/v views of a KVCache, or None
    when k_cache and v_cache are not interleaved that way (then they are written separately)."""
    if k_cache.shape != v_cache.shape or k_cache.stride() != v_cache.stride() or k_cache.dtype != v_cache.dtype:
        return None
    s0, s1, s2, s3 = k_cache.stride()
    gap = (v_cache.data_ptr() - k_cache.data_ptr()) // k_cache.element_size()
    if gap != k_cache.shape[2] * s2 or s1 != 2 * gap or v_cache.data_ptr() <= k_cache.data_ptr():
        return None
    n0, n1, n2, n3 = k_cache.shape
    return k_cache.as_strided((n0, n1, 2, n2, n3), (s0, s1, gap, s2, s3))


@dataclass
class Batch:
    """Where a forward's tokens sit and what they see."""

    input_ids: torch.Tensor  # [B, T] token ids
    positions: torch.Tensor  # [B, T] RoPE positions
    slots: torch.Tensor      # [B] KV cache slot of each sequence
    write_pos: torch.Tensor  # [B, T] cache position each token's K/V is written to
    mask: torch.Tensor       # [B, 1, T, K] bool, True = may attend; K = attended cache length
    # additive float form of mask for grouped queries, [B, 1, G * T, K] (G = heads per KV head) in the
    # compute dtype: the models fill it once per forward (attention_bias) so that layers share it
    attn_bias: torch.Tensor | None = None


def attention_bias(mask: torch.Tensor, groups: int, dtype: torch.dtype) -> torch.Tensor:
    """mask [B, 1, T, K] bool -> additive bias [B, 1, groups * T, K]: 0 where allowed, the dtype's most
    negative finite value where not (finite, so a fully masked padding row stays finite, never NaN).
    Row g * T + t belongs to query t of the g-th query head of a KV group (see Attention.forward)."""
    b, _, t, k = mask.shape
    bias = torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(~mask, torch.finfo(dtype).min)
    return bias[:, :, None].expand(b, 1, groups, t, k).reshape(b, 1, groups * t, k)


class Attention(nn.Module):
    def __init__(self, cfg: LlamaConfig, in_dim: int | None = None) -> None:
        super().__init__()
        d = in_dim or cfg.hidden_size
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.q_proj = nn.Linear(d, cfg.num_heads * cfg.head_dim, bias=False)
        self.k_proj = nn.Linear(d, cfg.num_kv_heads * cfg.head_dim, bias=False)
        self.v_proj = nn.Linear(d, cfg.num_kv_heads * cfg.head_dim, bias=False)
        self.o_proj = nn.Linear(cfg.num_heads * cfg.head_dim, cfg.hidden_size, bias=False)

    def fused_weight(self) -> torch.Tensor:
        """[(H + 2 KVH) * D, d]: q|k|v rows (see _fused_weight)."""
        return _fused_weight(self, "_qkv_weight", (self.q_proj, self.k_proj, self.v_proj))

    def forward(self, x: torch.Tensor, batch: Batch, cos: torch.Tensor, sin: torch.Tensor,
                k_cache: torch.Tensor, v_cache: torch.Tensor) -> torch.Tensor:
        """x: [B, T, d]; cos, sin: [B, T, 1, D] from rope_angles (sin signed, compute dtype);
        k_cache, v_cache: [slots, capacity, kv_heads, head_dim] (one layer, views of KVCache.kv)."""
        b, t, _ = x.shape
        h, kvh = self.num_heads, self.num_kv_heads
        qkv = F.linear(x, self.fused_weight()).view(b, t, h + 2 * kvh, self.head_dim)
        rope_(qkv[:, :, :h + kvh], cos, sin)  # q and k together, in place
        q = qkv[:, :, :h]
        kv_new = qkv[:, :, h:].unflatten(2, (2, kvh))  # [B, T, 2, KVH, D]: rotated k, then v
        slot_idx = batch.slots[:, None].expand(b, t)
        kv_len = batch.mask.shape[-1]
        joint = _joint_kv(k_cache, v_cache)
        if joint is not None:
            joint[slot_idx, batch.write_pos] = _as(kv_new, joint.dtype)
            kv = joint[batch.slots, :kv_len]                   # [B, K, 2, KVH, D]
            keys, values = kv[:, :, 0], kv[:, :, 1]
        else:
            k_cache[slot_idx, batch.write_pos] = _as(kv_new[:, :, 0], k_cache.dtype)
            v_cache[slot_idx, batch.write_pos] = _as(kv_new[:, :, 1], v_cache.dtype)
            keys, values = k_cache[batch.slots, :kv_len], v_cache[batch.slots, :kv_len]
        # GQA without repeating K/V: the G query heads of a KV head become G * T query rows of one
        # head (a view when T == 1), so SDPA sees plain multi-head attention with KVH heads and an
        # additive mask, which the fused (memory-efficient) CUDA kernel takes; enable_gqa with a mask
        # would fall back to the many-kernel math path.
        g, d = h // kvh, self.head_dim
        bias = batch.attn_bias
        if bias is None or bias.shape[-2] != g * t or bias.dtype != q.dtype:
            bias = attention_bias(batch.mask, g, q.dtype)
        qg = q.view(b, t, kvh, g, d).permute(0, 2, 3, 1, 4).reshape(b, kvh, g * t, d)
        out = F.scaled_dot_product_attention(qg, _as(keys, q.dtype).transpose(1, 2),
                                             _as(values, q.dtype).transpose(1, 2), attn_mask=bias)
        out = out.view(b, kvh, g, t, d).permute(0, 3, 1, 2, 4).reshape(b, t, h * d)
        return self.o_proj(out)


def _as(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return x if x.dtype == dtype else x.to(dtype)


class MLP(nn.Module):
    def __init__(self, hidden: int, intermediate: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden, intermediate, bias=False)
        self.up_proj = nn.Linear(hidden, intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)

    def fused_weight(self) -> torch.Tensor:
        """[2 I, H]: gate|up rows (see _fused_weight)."""
        return _fused_weight(self, "_gate_up_weight", (self.gate_proj, self.up_proj))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = F.linear(x, self.fused_weight()).chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)


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


class Float32RopeTables(nn.Module):
    """Modules holding `rope_cos`/`rope_sin` buffers: they follow .to(device) but stay float32 under
    .to(dtype), so positions are exact whatever dtype the weights run in."""

    def _apply(self, fn, recurse=True):
        super()._apply(fn, recurse)
        self.rope_cos, self.rope_sin = self.rope_cos.float(), self.rope_sin.float()
        return self


class LlamaModel(Float32RopeTables):
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
        cos, sin = rope_angles(self.rope_cos, self.rope_sin, batch.positions, x.dtype)
        batch = replace(batch, attn_bias=attention_bias(batch.mask, self.cfg.num_heads // self.cfg.num_kv_heads,
                                                        x.dtype))
        taps: dict[int, torch.Tensor] = {}
        for i, layer in enumerate(self.layers):
            if i in self.aux_layers:
                taps[i] = x
            x = layer(x, batch, cos, sin, cache.k[i], cache.v[i])
        # a small model may name one layer twice (6 layers -> (2, 3, 3)): still 3 * H wide
        return ForwardOutput(hidden=self.norm(x), aux=torch.cat([taps[i] for i in self.aux_layers], dim=-1))

    def fuse(self) -> LlamaModel:
        """Build the fused projection weights now (see fuse); call before CUDA graph capture."""
        return fuse(self)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [..., H] -> logits [..., V] in float32."""
        return self.lm_head(hidden).float()
