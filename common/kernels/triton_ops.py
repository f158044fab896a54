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


@triton.jit
def _rotate(x1, x2, pos, cos_ptr, sin_ptr, s_table, hd, ok):
    """The rotate-half RoPE of vectors whose halves are x1, x2 [rows, D / 2] at positions pos [rows], in
    float32 (as _rope_kv_kernel)."""
    c = tl.load(cos_ptr + pos[:, None] * s_table + hd[None, :], mask=ok[:, None], other=0.0)
    s = tl.load(sin_ptr + pos[:, None] * s_table + hd[None, :], mask=ok[:, None], other=0.0)
    x1, x2 = x1.to(tl.float32), x2.to(tl.float32)
    return x1 * c - x2 * s, x2 * c + x1 * s


@triton.jit
def _attend(q1, q2, kv_at, s_kv, half, n_ok, seen, m_i, l_i, acc, qk_scale, IEEE: tl.constexpr):
    """One block of keys of the online softmax: q1, q2 [M, D / 2] the queries' halves; kv_at [N, D / 2]
    addresses of the block's K first halves (K second halves at + half, V at + s_kv); n_ok [N] the keys
    that exist; seen [M, N]; acc [M, D / 2, 2] the output's halves."""
    k1 = tl.load(kv_at, mask=n_ok[:, None], other=0.0)
    k2 = tl.load(kv_at + half, mask=n_ok[:, None], other=0.0)
    v1 = tl.load(kv_at + s_kv, mask=n_ok[:, None], other=0.0)
    v2 = tl.load(kv_at + s_kv + half, mask=n_ok[:, None], other=0.0)
    if IEEE:
        s = tl.dot(q1, tl.trans(k1), input_precision="ieee") + tl.dot(q2, tl.trans(k2), input_precision="ieee")
    else:
        s = tl.dot(q1, tl.trans(k1)) + tl.dot(q2, tl.trans(k2))
    s = tl.where(seen, s * qk_scale, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    alpha = tl.exp2(m_i - m_new)
    pr = tl.exp2(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(pr, axis=1)
    if IEEE:
        acc = acc * alpha[:, None, None] + tl.join(
            tl.dot(pr.to(v1.dtype), v1, input_precision="ieee"), tl.dot(pr.to(v2.dtype), v2, input_precision="ieee")
        )
    else:
        acc = acc * alpha[:, None, None] + tl.join(tl.dot(pr.to(v1.dtype), v1), tl.dot(pr.to(v2.dtype), v2))
    return m_new, l_i, acc


# ---- Attention over the cache with a prefix and a window mask ---------------------------------------------
# PyTorch (SDPA) needs the keys gathered out of the slot, a dense additive mask over the whole attended
# length built per forward, and layout permutes: 6-8 launches per layer, and inside a CUDA graph the
# gathered length is fixed at capture, so every step paid for the whole slot. This kernel reads K/V in
# place and loops over prefix_len + W positions read at run time: a captured graph's attention costs
# what the sequence's real length costs.
# Split over keys (flash-decoding): a program per (sequence, KV head) loops over its keys one 64-key
# block after another, about 1.4 us a block on an H100 (decode at 256 keys: 9-11 us, 30 times a step,
# a third of the step) while 3 programs leave the GPU idle. With SPLITS > 1, split 0 reads the window
# and splits 1.. SPLITS - 1 cut the prefix into ranges, one program each (the window is a block of its
# own: given to a prefix range, that range's program would take one block longer than the others), and
# a second kernel merges their partial softmaxes.
# RoPE (the new tokens' rope_kv_write) fused: the queries are rotated in registers by every program; the
# new keys and values are written to the cache by split 0, which alone reads the window positions
# (prefix_len onwards: every engine writes its new tokens there), after a barrier that makes its own
# writes visible to all its threads. With several row blocks (a tree: 61 tokens x 3 query heads a KV
# head) the split 0 of each writes all T tokens: the same values to the same places, so whichever write
# lands last, each program reads what it wrote. The other splits read only the prefix, never written.
_ATTENTION_VARYING = ["T", "W", "n_rows", "ss_b", "sp_b", "sq_b", "sq_t", "sw_b", "sw_t", "so_b", "so_t"]


@triton.jit(do_not_specialize=_ATTENTION_VARYING + ["sr_b", "sr_t", "sx_b", "sx_t"])
def _attention_kernel(
    q_ptr,
    kv_ptr,
    slot_ptr,
    prefix_ptr,
    win_ptr,
    out_ptr,
    part_ptr,
    lse_ptr,
    cos_ptr,
    sin_ptr,
    pos_ptr,
    wpos_ptr,
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
    s_table,
    sr_b,
    sr_t,
    sx_b,
    sx_t,
    G: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    IEEE: tl.constexpr,
    KVH: tl.constexpr,
    ROPE: tl.constexpr,
    SPLITS: tl.constexpr,
    BLOCK_T: tl.constexpr,
):
    bh = tl.program_id(0)  # b * KVH + kv head
    b = bh // KVH
    kvh = bh % KVH
    split = tl.program_id(2)
    r = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)  # query row r = t * G + g
    row_ok = r < n_rows
    t = r // G
    head = kvh * G + r % G
    half: tl.constexpr = HEAD_DIM // 2
    hd = tl.arange(0, half)
    slot = tl.load(slot_ptr + b * ss_b)
    prefix = tl.load(prefix_ptr + b * sp_b)
    kv_base = kv_ptr + slot * s_slot + kvh * s_head
    q_at = q_ptr + b * sq_b + t[:, None] * sq_t + head[:, None] * sq_h + hd[None, :]
    q1 = tl.load(q_at, mask=row_ok[:, None], other=0.0)
    q2 = tl.load(q_at + half, mask=row_ok[:, None], other=0.0)
    if ROPE:  # q rotated and rounded as rope_kv_write would store it (q points into qkv: k, v heads after q)
        pos_b = pos_ptr + b * sr_b
        y1, y2 = _rotate(q1, q2, tl.load(pos_b + t * sr_t, mask=row_ok, other=0), cos_ptr, sin_ptr, s_table, hd, row_ok)
        q1, q2 = y1.to(q_ptr.dtype.element_ty), y2.to(q_ptr.dtype.element_ty)
        if split == 0:
            tok = tl.arange(0, BLOCK_T)  # all T tokens, whichever row block this is
            tok_ok = tok < T
            k_at = q_ptr + b * sq_b + tok[:, None] * sq_t + (KVH * G + kvh) * sq_h + hd[None, :]
            k1 = tl.load(k_at, mask=tok_ok[:, None], other=0.0)
            k2 = tl.load(k_at + half, mask=tok_ok[:, None], other=0.0)
            # new names: a compiled `if` may not rebind y1, y2 to the [BLOCK_T, D / 2] shape
            ky1, ky2 = _rotate(
                k1, k2, tl.load(pos_b + tok * sr_t, mask=tok_ok, other=0), cos_ptr, sin_ptr, s_table, hd, tok_ok
            )
            wpos = tl.load(wpos_ptr + b * sx_b + tok * sx_t, mask=tok_ok, other=0)
            dst = kv_base + wpos[:, None] * s_pos + hd[None, :]
            tl.store(dst, ky1.to(kv_ptr.dtype.element_ty), mask=tok_ok[:, None])  # k, rotated
            tl.store(dst + half, ky2.to(kv_ptr.dtype.element_ty), mask=tok_ok[:, None])
            for part in tl.static_range(2):  # v as it is
                v = tl.load(k_at + KVH * sq_h + part * half, mask=tok_ok[:, None], other=0.0)
                tl.store(dst + s_kv + part * half, v.to(kv_ptr.dtype.element_ty), mask=tok_ok[:, None])
            tl.debug_barrier()
    m_i = tl.full((BLOCK_M,), -1.0e30, tl.float32)  # finite: a fully masked block leaves it unchanged
    l_i = tl.zeros((BLOCK_M,), tl.float32)
    acc = tl.zeros((BLOCK_M, half, 2), tl.float32)  # [M, D / 2, 2]: the output's halves, joined
    # this program's share of the prefix: all of it unsplit; else none for split 0 (the window's), and
    # whole key blocks for splits 1.., range after range
    per = tl.cdiv(tl.cdiv(prefix, BLOCK_N), tl.maximum(SPLITS - 1, 1)) * BLOCK_N
    lo = tl.where(SPLITS == 1, 0, tl.where(split == 0, prefix, (split - 1) * per))
    hi = tl.where(SPLITS == 1, prefix, tl.minimum(lo + per, prefix))
    for start in range(lo, hi, BLOCK_N):
        p = start + tl.arange(0, BLOCK_N)
        p_ok = p < hi
        kv_at = kv_base + p[:, None] * s_pos + hd[None, :]
        seen = row_ok[:, None] & p_ok[None, :]
        m_i, l_i, acc = _attend(q1, q2, kv_at, s_kv, half, p_ok, seen, m_i, l_i, acc, qk_scale, IEEE)
    # the window (new tokens and, in the draft, its scratch entries): split 0's
    for w0 in range(0, tl.where(split == 0, W, 0), BLOCK_N):
        w = w0 + tl.arange(0, BLOCK_N)
        w_ok = w < W
        win = tl.load(
            win_ptr + b * sw_b + t[:, None] * sw_t + w[None, :], mask=row_ok[:, None] & w_ok[None, :], other=0
        )
        kv_at = kv_base + (prefix + w)[:, None] * s_pos + hd[None, :]
        m_i, l_i, acc = _attend(q1, q2, kv_at, s_kv, half, w_ok, win != 0, m_i, l_i, acc, qk_scale, IEEE)
    o = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None, None]
    o = tl.reshape(tl.permute(o, (0, 2, 1)), (BLOCK_M, HEAD_DIM))  # [M, D]: first halves, then second
    d = tl.arange(0, HEAD_DIM)
    if SPLITS == 1:
        dst = out_ptr + b * so_b + t[:, None] * so_t + head[:, None] * so_h + d[None, :]
        tl.store(dst, o.to(out_ptr.dtype.element_ty), mask=row_ok[:, None])
    else:  # the partial softmax: normalised output and log2-sum-exp (-inf: nothing seen) of each row
        prog = (bh * tl.num_programs(1) + tl.program_id(1)) * SPLITS + split
        tl.store(part_ptr + (prog * BLOCK_M + tl.arange(0, BLOCK_M))[:, None] * HEAD_DIM + d[None, :], o)
        lse = tl.where(l_i > 0.0, m_i + tl.log2(tl.where(l_i > 0.0, l_i, 1.0)), float("-inf"))
        tl.store(lse_ptr + prog * BLOCK_M + tl.arange(0, BLOCK_M), lse)


@triton.jit(do_not_specialize=["T", "n_rows", "so_b", "so_t"])
def _attention_merge_kernel(
    part_ptr,
    lse_ptr,
    out_ptr,
    T,
    n_rows,
    so_b,
    so_t,
    so_h,
    G: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_M: tl.constexpr,
    MERGE_M: tl.constexpr,
    KVH: tl.constexpr,
    SPLITS: tl.constexpr,
):
    """Merge the SPLITS partial softmaxes of MERGE_M rows of a program of _attention_kernel: weights
    2^(lse - max). A program per MERGE_M rows (a 64-row tree block in 4: the merge reads SPLITS tiles of
    the block's rows, 128 KB at 8 splits, too much for one program to read quickly); a split that saw
    no key (lse -inf: a short prefix leaves the last ranges empty) is not read."""
    bh = tl.program_id(0)
    b = bh // KVH
    kvh = bh % KVH
    prog = bh * tl.num_programs(1) + tl.program_id(1)
    m = tl.program_id(2) * MERGE_M + tl.arange(0, MERGE_M)  # rows of the program's BLOCK_M
    d = tl.arange(0, HEAD_DIM)
    top = tl.full((MERGE_M,), float("-inf"), tl.float32)
    for sp in tl.static_range(SPLITS):
        top = tl.maximum(top, tl.load(lse_ptr + (prog * SPLITS + sp) * BLOCK_M + m))
    top = tl.where(top == float("-inf"), 0.0, top)
    total = tl.zeros((MERGE_M,), tl.float32)
    o = tl.zeros((MERGE_M, HEAD_DIM), tl.float32)
    for sp in tl.static_range(SPLITS):  # one coalesced [M, D] tile a split
        w = tl.exp2(tl.load(lse_ptr + (prog * SPLITS + sp) * BLOCK_M + m) - top)  # 0: the split saw nothing
        at = part_ptr + ((prog * SPLITS + sp) * BLOCK_M + m)[:, None] * HEAD_DIM + d[None, :]
        o += tl.load(at, mask=(w > 0.0)[:, None], other=0.0) * w[:, None]
        total += w
    o = o / tl.maximum(total, 1e-30)[:, None]
    r = tl.program_id(1) * BLOCK_M + m
    t = r // G
    head = kvh * G + r % G
    dst = out_ptr + b * so_b + t[:, None] * so_t + head[:, None] * so_h + d[None, :]
    tl.store(dst, o.to(out_ptr.dtype.element_ty), mask=(r < n_rows)[:, None])


def attention(
    q: torch.Tensor,
    kv: torch.Tensor,
    slots: torch.Tensor,
    prefix_len: torch.Tensor,
    window: torch.Tensor,
    splits: int | None = None,
) -> torch.Tensor:
    """See reference.attention. q [B, T, H, D] (any strides, unit on D); kv [S, C, 2, KVH, D] with the
    same dtype as q; window [B, T, W] bool (unit stride on W). Returns [B, T, H * D]."""
    return _attention(q, q.shape[2], kv, slots, prefix_len, window, None, splits)


def rope_attention(
    qkv: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    positions: torch.Tensor,
    slots: torch.Tensor,
    write_pos: torch.Tensor,
    kv: torch.Tensor,
    prefix_len: torch.Tensor,
    window: torch.Tensor,
    num_heads: int,
    num_kv_heads: int,
    splits: int | None = None,
) -> torch.Tensor:
    """rope_kv_write, then attention of the rotated q, in one launch (two with a split): qkv
    [B, T, (H + 2 KVH) D] contiguous, kv of qkv's dtype; T <= 64 (each program writing the T new keys
    holds them in one tile); write_pos >= prefix_len (the window's side). Returns [B, T, H * D]; qkv is
    read, not rotated in place."""
    b, t, width = qkv.shape
    heads = qkv.view(b, t, num_heads + 2 * num_kv_heads, width // (num_heads + 2 * num_kv_heads))
    return _attention(heads, num_heads, kv, slots, prefix_len, window, (cos, sin, positions, write_pos), splits)


def _attention(
    q: torch.Tensor,
    h: int,
    kv: torch.Tensor,
    slots: torch.Tensor,
    prefix_len: torch.Tensor,
    window: torch.Tensor,
    rope: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor] | None,
    splits: int | None = None,
) -> torch.Tensor:
    """The launch: q's first h heads attend (with rope: q holds k and v heads after them, rotated and
    written by the kernel first). Splits over keys while the programs would not fill the GPU: the window
    and 7 prefix ranges at batch 1 (3 KV heads), the window and 1 at batch 16, none from about 40
    sequences on. `splits` overrides the choice (measurements)."""
    b, t, _, d = q.shape
    kvh = kv.shape[3]
    g = h // kvh
    n_rows = t * g
    block_m = 16 if n_rows <= 16 else 32 if n_rows <= 32 else 64
    m_blocks = triton.cdiv(n_rows, block_m)
    if rope is not None and t > 64:
        raise ValueError(f"rope_attention takes at most 64 tokens a sequence, got {t}")
    programs = b * kvh * m_blocks
    if splits is None:
        splits = 1 if programs >= 64 else 2 if programs >= 32 else 4 if programs >= 16 else 8
    merge_m = min(block_m, 16)
    out = torch.empty((b, t, h, d), dtype=q.dtype, device=q.device)
    part = torch.empty((programs * splits * block_m, d), dtype=torch.float32, device=q.device) if splits > 1 else out
    lse = torch.empty(programs * splits * block_m, dtype=torch.float32, device=q.device) if splits > 1 else out
    win = window.view(torch.uint8) if window.dtype == torch.bool else window
    scale = 1.0 / math.sqrt(d) * 1.4426950408889634  # log2(e): the kernel uses exp2
    cos, sin, positions, write_pos = rope if rope is not None else (q, q, slots[:, None], slots[:, None])
    _attention_kernel[(b * kvh, m_blocks, splits)](
        q,
        kv,
        slots,
        prefix_len,
        win,
        out,
        part,
        lse,
        cos,
        sin,
        positions,
        write_pos,
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
        cos.stride(0),
        positions.stride(0),
        positions.stride(1),
        write_pos.stride(0),
        write_pos.stride(1),
        G=g,
        HEAD_DIM=d,
        BLOCK_M=block_m,
        BLOCK_N=64,
        IEEE=q.dtype == torch.float32,
        KVH=kvh,
        ROPE=rope is not None,
        SPLITS=splits,
        BLOCK_T=max(16, triton.next_power_of_2(t)) if rope is not None else 16,
        num_warps=4,
    )
    if splits > 1:
        _attention_merge_kernel[(b * kvh, m_blocks, block_m // merge_m)](
            part,
            lse,
            out,
            t,
            n_rows,
            out.stride(0),
            out.stride(1),
            out.stride(2),
            G=g,
            HEAD_DIM=d,
            BLOCK_M=block_m,
            MERGE_M=merge_m,
            KVH=kvh,
            SPLITS=splits,
            num_warps=4,
        )
    return out.view(b, t, h * d)


# the draft's and the verification's kernels live beside these: common.kernels dispatches to one module
from common.kernels.triton_tree import (  # noqa: E402
    accept_inputs,
    accept_tree,
    chained_block,
    draft_level,
    move_rows,
    onehot_sets,
    rms_norm_cat,
    select_tree,
    topk_logprobs,
    tree_mask,
)

__all__ = [
    "accept_inputs",
    "accept_tree",
    "chained_block",
    "draft_level",
    "move_rows",
    "onehot_sets",
    "rms_norm_cat",
    "select_tree",
    "topk_logprobs",
    "tree_mask",
]
