"""The fused operations in plain PyTorch: the CPU path, the autograd path (training) and the oracle the
Triton kernels are tested against. Each function computes in float32 and rounds once at the end, as the
kernels do, so both paths round alike."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """x, residual [..., H] -> (rms_norm(x + residual) * weight, x + residual), both in x's dtype.
    Without residual the sum is x itself (returned as is)."""
    s = x if residual is None else x + residual
    y = F.rms_norm(s.float(), weight.shape, eps=eps) * weight.float()
    return y.to(x.dtype), s


def rope_kv_write(
    qkv: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    positions: torch.Tensor,
    slots: torch.Tensor,
    write_pos: torch.Tensor,
    kv: torch.Tensor,
    num_heads: int,
    num_kv_heads: int,
) -> None:
    """RoPE on q and k (Hugging Face rotate-half layout) and the K/V write, in one step.

    qkv [B, T, (H + 2 KVH) * D]: q heads, k heads, v heads; q is rotated in place.
    cos, sin [max_position, D] float32 tables; positions, write_pos [B, T]; slots [B].
    kv [slots, capacity, 2, KVH, D]: one layer of KVCache.kv; rotated k and v land at (slot, write_pos).
    """
    b, t, _ = qkv.shape
    h, kvh = num_heads, num_kv_heads
    view = qkv.view(b, t, h + 2 * kvh, -1)
    half = view.shape[-1] // 2
    c, s = cos[positions][:, :, None, :half], sin[positions][:, :, None, :half]  # [B, T, 1, D/2]
    qk = view[:, :, : h + kvh].float()
    x1, x2 = qk[..., :half], qk[..., half:]
    rotated = torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1).to(qkv.dtype)  # [B, T, H + KVH, D]
    view[:, :, :h] = rotated[:, :, :h]
    new = torch.stack((rotated[:, :, h:], view[:, :, h + kvh :]), dim=2)  # [B, T, 2, KVH, D]
    kv[slots[:, None].expand(b, t), write_pos] = new.to(kv.dtype)


def swiglu(gate_up: torch.Tensor) -> torch.Tensor:
    """gate_up [..., 2I] (gate | up) -> silu(gate) * up [..., I]."""
    gate, up = gate_up.float().chunk(2, dim=-1)
    return (F.silu(gate) * up).to(gate_up.dtype)


def visibility(prefix_len: torch.Tensor, window: torch.Tensor, kv_len: int) -> torch.Tensor:
    """Which cache positions each query row sees, as a dense mask [B, T, kv_len].

    Row t of sequence b sees position p when p < prefix_len[b], or when w = p - prefix_len[b] lies in
    [0, W) and window[b, t, w]. Example: prefix_len 3, window [[1, 0], [1, 1]] (a root and its child),
    kv_len 6:
        root  [1 1 1 1 0 0]
        child [1 1 1 1 1 0]
    """
    b, t, w = window.shape
    rel = torch.arange(kv_len, device=window.device)[None, :] - prefix_len[:, None]  # [B, K]
    in_window = (rel >= 0) & (rel < w)  # [B, K]
    win = window.gather(2, rel.clamp(0, w - 1)[:, None, :].expand(b, t, kv_len))  # [B, T, K]
    return (rel < 0)[:, None, :] | (win & in_window[:, None, :])


def attention_bias(
    prefix_len: torch.Tensor, window: torch.Tensor, kv_len: int, groups: int, dtype: torch.dtype
) -> torch.Tensor:
    """The visibility mask as an additive bias [B, 1, groups * T, kv_len] in dtype: 0 where seen, the
    dtype's most negative finite value where not (finite: a fully masked padding row stays finite).
    Row g * T + t is query t of the g-th query head of a KV head (see attention)."""
    b, t, _ = window.shape
    mask = visibility(prefix_len, window, kv_len)  # [B, T, K]
    bias = torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(~mask, torch.finfo(dtype).min)
    return bias[:, None, None].expand(b, 1, groups, t, kv_len).reshape(b, 1, groups * t, kv_len)


def attention(q: torch.Tensor, kv: torch.Tensor, slots: torch.Tensor, kv_len: int, bias: torch.Tensor) -> torch.Tensor:
    """Attention of new queries over one layer's cache.

    q [B, T, H, D]; kv [slots, capacity, 2, KVH, D]; slots [B]; kv_len: cache positions read;
    bias [B, 1, G * T, kv_len] from attention_bias. Returns [B, T, H * D] in q's dtype.
    GQA without repeating K/V: the G query heads of a KV head become G * T rows of one head, so SDPA sees
    KVH heads and one additive mask, which its fused CPU and CUDA kernels take.
    """
    b, t, h, d = q.shape
    kvh = kv.shape[3]
    g = h // kvh
    keys = kv.narrow(1, 0, kv_len).index_select(0, slots)  # [B, K, 2, KVH, D]
    qg = q.reshape(b, t, kvh, g, d).permute(0, 2, 3, 1, 4).reshape(b, kvh, g * t, d)
    k = keys[:, :, 0].to(q.dtype).transpose(1, 2)  # [B, KVH, K, D]
    v = keys[:, :, 1].to(q.dtype).transpose(1, 2)
    out = F.scaled_dot_product_attention(qg, k, v, attn_mask=bias)  # [B, KVH, G*T, D]
    return out.view(b, kvh, g, t, d).permute(0, 3, 1, 2, 4).reshape(b, t, h * d)


def topk_logprobs(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [..., V] -> the k largest log-probabilities [..., k] (float32, descending) and their ids."""
    values, ids = logits.float().topk(k, dim=-1)
    return values - torch.logsumexp(logits.float(), dim=-1, keepdim=True), ids
