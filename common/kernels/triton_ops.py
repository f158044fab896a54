"""Triton kernels for the engine step on a GPU, one launch where PyTorch needs several.

A decode step of a small model is bound by kernel launches, not by memory or arithmetic (SmolLM2-135M:
about 270 MB of weights, under 0.1 ms of traffic on an H100, against 2 ms for 525 launches). Every kernel
here replaces a chain of PyTorch ops, with the reason at each. TorchInductor would fuse the elementwise
chains too, but compiling the step for every graph bucket costs minutes at each start of a service and
cannot fuse the attention with its tree mask; these kernels compile in seconds, once per shape class.

Numerics match common.kernels.reference: math in float32, one rounding to the storage dtype at the end.
Each wrapper checks nothing the caller (common.kernels) has not checked; shapes are in the docstrings.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl


# ---- RMSNorm with the residual add --------------------------------------------------------------------
# PyTorch: add, then rms_norm (2 launches, and the sum makes a round trip through memory).
@triton.jit
def _add_rms_norm_kernel(
    x_ptr,
    res_ptr,
    w_ptr,
    out_ptr,
    sum_ptr,
    n_cols,
    eps,
    stride_x,
    stride_r,
    stride_o,
    stride_s,
    HAS_RES: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    m = cols < n_cols
    x = tl.load(x_ptr + row * stride_x + cols, mask=m, other=0.0).to(tl.float32)
    if HAS_RES:
        x = x + tl.load(res_ptr + row * stride_r + cols, mask=m, other=0.0).to(tl.float32)
        s = x.to(sum_ptr.dtype.element_ty)
        tl.store(sum_ptr + row * stride_s + cols, s, mask=m)
        x = s.to(tl.float32)  # normalise the rounded sum, as the unfused add then norm would
    rstd = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / n_cols + eps)
    w = tl.load(w_ptr + cols, mask=m, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_o + cols, (x * rstd * w).to(out_ptr.dtype.element_ty), mask=m)


def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """x, residual [..., H] -> (normed [..., H], x + residual [..., H]); see reference.add_rms_norm."""
    shape = x.shape
    x2 = x.reshape(-1, shape[-1])
    out = torch.empty_like(x2)
    if residual is None:
        total = x
        r2, s2 = x2, x2
    else:
        r2 = residual.reshape(-1, shape[-1])
        s2 = torch.empty_like(x2)
        total = s2.view(shape)
    block = triton.next_power_of_2(shape[-1])
    _add_rms_norm_kernel[(x2.shape[0],)](
        x2,
        r2,
        weight,
        out,
        s2,
        shape[-1],
        eps,
        x2.stride(0),
        r2.stride(0),
        out.stride(0),
        s2.stride(0),
        HAS_RES=residual is not None,
        BLOCK=block,
        num_warps=4 if block <= 2048 else 8,
    )
    return out.view(shape), total


# ---- RoPE with the K/V write ---------------------------------------------------------------------------
# PyTorch: gather cos/sin at the positions, swap halves, two multiplies for q and k, a cast, and an
# index_put into the cache (7 launches per layer). Here one program per (token, head) rotates a q or k
# head in float32 and writes k and v straight into the cache slot.
# Sizes and strides that vary between calls are not specialised on (Triton would compile a variant per
# value class, 1 / multiple of 16 / other, and an eager call meeting a new class pays a compile).
@triton.jit(do_not_specialize=["T", "sp_b", "sp_t", "ss_b", "sw_b", "sw_t"])
def _rope_kv_kernel(
    qkv_ptr,
    cos_ptr,
    sin_ptr,
    pos_ptr,
    slot_ptr,
    wpos_ptr,
    kv_ptr,
    T,
    stride_row,
    stride_table,
    sp_b,
    sp_t,
    ss_b,
    sw_b,
    sw_t,
    s_slot,
    s_pos,
    s_kv,
    s_head,
    H: tl.constexpr,
    KVH: tl.constexpr,
    HALF: tl.constexpr,
):
    row = tl.program_id(0)  # b * T + t
    b = row // T
    t = row % T
    head = tl.program_id(1)  # [0, H): q, [H, H + KVH): k, [H + KVH, H + 2 KVH): v
    d = tl.arange(0, HALF)
    base = qkv_ptr + row * stride_row + head * 2 * HALF
    x1 = tl.load(base + d).to(tl.float32)
    x2 = tl.load(base + HALF + d).to(tl.float32)
    if head < H + KVH:
        pos = tl.load(pos_ptr + b * sp_b + t * sp_t)
        c = tl.load(cos_ptr + pos * stride_table + d)
        s = tl.load(sin_ptr + pos * stride_table + d)
        y1 = x1 * c - x2 * s
        y2 = x2 * c + x1 * s
    else:
        y1 = x1
        y2 = x2
    if head < H:
        tl.store(base + d, y1.to(qkv_ptr.dtype.element_ty))
        tl.store(base + HALF + d, y2.to(qkv_ptr.dtype.element_ty))
    else:
        slot = tl.load(slot_ptr + b * ss_b)
        wpos = tl.load(wpos_ptr + b * sw_b + t * sw_t)
        which = (head - H) // KVH  # 0 = k, 1 = v
        kvhead = (head - H) % KVH
        dst = kv_ptr + slot * s_slot + wpos * s_pos + which * s_kv + kvhead * s_head
        tl.store(dst + d, y1.to(kv_ptr.dtype.element_ty))
        tl.store(dst + HALF + d, y2.to(kv_ptr.dtype.element_ty))


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
    """See reference.rope_kv_write. qkv [B, T, (H + 2 KVH) * D] with contiguous rows; kv [S, C, 2, KVH, D]
    with unit stride on D."""
    b, t, width = qkv.shape
    d = width // (num_heads + 2 * num_kv_heads)
    rows = qkv.reshape(b * t, width)
    # positions, write_pos [B, T] and slots [B] are often columns of a packed block: pass their strides
    _rope_kv_kernel[(b * t, num_heads + 2 * num_kv_heads)](
        rows,
        cos,
        sin,
        positions,
        slots,
        write_pos,
        kv,
        t,
        rows.stride(0),
        cos.stride(0),
        positions.stride(0),
        positions.stride(1),
        slots.stride(0),
        write_pos.stride(0),
        write_pos.stride(1),
        kv.stride(0),
        kv.stride(1),
        kv.stride(2),
        kv.stride(3),
        H=num_heads,
        KVH=num_kv_heads,
        HALF=d // 2,
        num_warps=1,
    )


# ---- SwiGLU ---------------------------------------------------------------------------------------------
# PyTorch: silu, then mul (2 launches and a round trip of the activation through memory).
@triton.jit
def _swiglu_kernel(x_ptr, out_ptr, n_cols, stride_x, stride_o, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    m = cols < n_cols
    g = tl.load(x_ptr + row * stride_x + cols, mask=m, other=0.0).to(tl.float32)
    u = tl.load(x_ptr + row * stride_x + n_cols + cols, mask=m, other=0.0).to(tl.float32)
    y = g / (1.0 + tl.exp(-g)) * u
    tl.store(out_ptr + row * stride_o + cols, y.to(out_ptr.dtype.element_ty), mask=m)


def swiglu(gate_up: torch.Tensor) -> torch.Tensor:
    """gate_up [..., 2I] -> [..., I]; see reference.swiglu."""
    shape = gate_up.shape
    x2 = gate_up.reshape(-1, shape[-1])
    n = shape[-1] // 2
    out = torch.empty((x2.shape[0], n), dtype=gate_up.dtype, device=gate_up.device)
    block = min(1024, triton.next_power_of_2(n))
    _swiglu_kernel[(x2.shape[0], triton.cdiv(n, block))](
        x2, out, n, x2.stride(0), out.stride(0), BLOCK=block, num_warps=4
    )
    return out.view(*shape[:-1], n)


# ---- Attention over the cache with a prefix and a window mask ------------------------------------------
# PyTorch (SDPA) needs the keys gathered out of the slot, a dense additive mask over the whole attended
# length built per forward, and layout permutes: 6-8 launches per layer, and inside a CUDA graph the
# gathered length is fixed at capture, so every step paid for the whole slot. This kernel reads K/V in
# place and loops over prefix_len + W positions read at run time: a captured graph's attention costs
# what the sequence's real length costs.
@triton.jit(do_not_specialize=["T", "W", "n_rows", "ss_b", "sp_b", "sq_b", "sq_t", "sw_b", "sw_t", "so_b", "so_t"])
def _attention_kernel(
    q_ptr,
    kv_ptr,
    slot_ptr,
    prefix_ptr,
    win_ptr,
    out_ptr,
    T,
    W,
    n_rows,
    qk_scale,
    ss_b,
    sp_b,
    sq_b,
    sq_t,
    sq_h,
    s_slot,
    s_pos,
    s_kv,
    s_head,
    sw_b,
    sw_t,
    so_b,
    so_t,
    so_h,
    G: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    IEEE: tl.constexpr,
    KVH: tl.constexpr,
):
    bh = tl.program_id(0)  # b * KVH + kv head
    b = bh // KVH
    kvh = bh % KVH
    r = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)  # query row r = t * G + g
    row_ok = r < n_rows
    t = r // G
    head = kvh * G + r % G
    d = tl.arange(0, HEAD_DIM)
    q = tl.load(
        q_ptr + b * sq_b + t[:, None] * sq_t + head[:, None] * sq_h + d[None, :], mask=row_ok[:, None], other=0.0
    )
    slot = tl.load(slot_ptr + b * ss_b)
    prefix = tl.load(prefix_ptr + b * sp_b)
    n_keys = prefix + W
    kv_base = kv_ptr + slot * s_slot + kvh * s_head
    m_i = tl.full((BLOCK_M,), -1.0e30, tl.float32)  # finite: a fully masked block leaves it unchanged
    l_i = tl.zeros((BLOCK_M,), tl.float32)
    acc = tl.zeros((BLOCK_M, HEAD_DIM), tl.float32)
    for start in range(0, n_keys, BLOCK_N):
        p = start + tl.arange(0, BLOCK_N)
        p_ok = p < n_keys
        k = tl.load(kv_base + p[:, None] * s_pos + d[None, :], mask=p_ok[:, None], other=0.0)
        v = tl.load(kv_base + s_kv + p[:, None] * s_pos + d[None, :], mask=p_ok[:, None], other=0.0)
        if IEEE:  # noqa: SIM108 - a compile-time branch of the kernel
            s = tl.dot(q, tl.trans(k), input_precision="ieee")
        else:
            s = tl.dot(q, tl.trans(k))
        w = p - prefix
        in_win = (w >= 0) & p_ok
        win = tl.load(
            win_ptr + b * sw_b + t[:, None] * sw_t + w[None, :], mask=row_ok[:, None] & in_win[None, :], other=0
        )
        seen = (p[None, :] < prefix) | (win != 0)
        s = tl.where(seen, s * qk_scale, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        alpha = tl.exp2(m_i - m_new)
        pr = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(pr, axis=1)
        if IEEE:  # noqa: SIM108 - a compile-time branch of the kernel
            acc = acc * alpha[:, None] + tl.dot(pr.to(v.dtype), v, input_precision="ieee")
        else:
            acc = acc * alpha[:, None] + tl.dot(pr.to(v.dtype), v)
        m_i = m_new
    acc = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
    tl.store(
        out_ptr + b * so_b + t[:, None] * so_t + head[:, None] * so_h + d[None, :],
        acc.to(out_ptr.dtype.element_ty),
        mask=row_ok[:, None],
    )


def attention(
    q: torch.Tensor, kv: torch.Tensor, slots: torch.Tensor, prefix_len: torch.Tensor, window: torch.Tensor
) -> torch.Tensor:
    """See reference.attention. q [B, T, H, D] (any strides, unit on D); kv [S, C, 2, KVH, D] with the
    same dtype as q; window [B, T, W] bool (unit stride on W). Returns [B, T, H * D]."""
    b, t, h, d = q.shape
    kvh = kv.shape[3]
    g = h // kvh
    n_rows = t * g
    block_m = 16 if n_rows <= 16 else 32 if n_rows <= 32 else 64
    out = torch.empty((b, t, h, d), dtype=q.dtype, device=q.device)
    win = window.view(torch.uint8) if window.dtype == torch.bool else window
    scale = 1.0 / math.sqrt(d) * 1.4426950408889634  # log2(e): the kernel uses exp2
    grid = (b * kvh, triton.cdiv(n_rows, block_m))
    _attention_kernel[grid](
        q,
        kv,
        slots,
        prefix_len,
        win,
        out,
        t,
        window.shape[-1],
        n_rows,
        scale,
        slots.stride(0),  # slots and prefix_len are often columns of a packed block
        prefix_len.stride(0),
        q.stride(0),
        q.stride(1),
        q.stride(2),
        kv.stride(0),
        kv.stride(1),
        kv.stride(2),
        kv.stride(3),
        win.stride(0),
        win.stride(1),
        out.stride(0),
        out.stride(1),
        out.stride(2),
        G=g,
        HEAD_DIM=d,
        BLOCK_M=block_m,
        BLOCK_N=64,
        IEEE=q.dtype == torch.float32,
        KVH=kvh,
        num_warps=4,
    )
    return out.view(b, t, h * d)


# ---- Top-k log-probabilities (the draft's per-level expansion) ---------------------------------------
# PyTorch: cast to float32, log_softmax (max, sum, subtract) and topk over the 8,192-token draft
# vocabulary: 4-5 launches per level. One program per row keeps the row in registers: the log-sum-exp,
# then k rounds of argmax-and-knock-out (k <= 64, a few microseconds in all).
@triton.jit
def _topk_logprobs_kernel(x_ptr, val_ptr, idx_ptr, n_cols, stride_x, K: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    x = tl.load(x_ptr + row * stride_x + cols, mask=cols < n_cols, other=float("-inf")).to(tl.float32)
    mx = tl.max(x, axis=0)
    lse = mx + tl.log(tl.sum(tl.exp(x - mx), axis=0))
    for j in tl.static_range(K):
        best = tl.max(x, axis=0)
        at = tl.min(tl.where(x == best, cols, BLOCK), axis=0)  # the lowest index among ties
        tl.store(val_ptr + row * K + j, best - lse)
        tl.store(idx_ptr + row * K + j, at.to(tl.int64))
        x = tl.where(cols == at, float("-inf"), x)


def topk_logprobs(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [..., V] -> (log-probabilities [..., k] float32, ids [..., k] int64), best first."""
    shape = logits.shape
    x2 = logits.reshape(-1, shape[-1])
    vals = torch.empty((x2.shape[0], k), dtype=torch.float32, device=logits.device)
    ids = torch.empty((x2.shape[0], k), dtype=torch.int64, device=logits.device)
    block = triton.next_power_of_2(shape[-1])
    _topk_logprobs_kernel[(x2.shape[0],)](
        x2, vals, ids, shape[-1], x2.stride(0), K=k, BLOCK=block, num_warps=8 if block >= 4096 else 4
    )
    return vals.view(*shape[:-1], k), ids.view(*shape[:-1], k)
