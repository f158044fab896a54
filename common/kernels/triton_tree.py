"""Triton kernels of the draft's tree expansion and of tree verification (the model's own ops are in
common/kernels/triton_ops.py): one launch where PyTorch needs several, for the reasons given at each.
Numerics match common.kernels.reference; shapes are in the docstrings."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from common.kernels import reference


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


# ---- Two RMSNorms into one buffer (the draft head's input) ---------------------------------------------
# PyTorch: two norms and a cat (3 launches and a copy). Program (row, half) normalises its half in place
# in the output row.
@triton.jit
def _rms_norm_cat_kernel(a_ptr, b_ptr, wa_ptr, wb_ptr, out_ptr, n_cols, eps, s_a, s_b, s_o, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    half = tl.program_id(1)
    cols = tl.arange(0, BLOCK)
    m = cols < n_cols
    if half == 0:
        x = tl.load(a_ptr + row * s_a + cols, mask=m, other=0.0).to(tl.float32)
        w = tl.load(wa_ptr + cols, mask=m, other=0.0).to(tl.float32)
    else:
        x = tl.load(b_ptr + row * s_b + cols, mask=m, other=0.0).to(tl.float32)
        w = tl.load(wb_ptr + cols, mask=m, other=0.0).to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / n_cols + eps)
    tl.store(out_ptr + row * s_o + half * n_cols + cols, (x * rstd * w).to(out_ptr.dtype.element_ty), mask=m)


def rms_norm_cat(a: torch.Tensor, wa: torch.Tensor, b: torch.Tensor, wb: torch.Tensor, eps: float) -> torch.Tensor:
    """a, b [..., H] -> [..., 2H]; see reference.rms_norm_cat."""
    shape = a.shape
    a2, b2 = a.reshape(-1, shape[-1]), b.reshape(-1, shape[-1])
    out = torch.empty((a2.shape[0], 2 * shape[-1]), dtype=a.dtype, device=a.device)
    block = triton.next_power_of_2(shape[-1])
    _rms_norm_cat_kernel[(a2.shape[0], 2)](
        a2, b2, wa, wb, out, shape[-1], eps, a2.stride(0), b2.stride(0), out.stride(0), BLOCK=block, num_warps=4
    )
    return out.view(*shape[:-1], 2 * shape[-1])


@triton.jit
def _rank_key(score, i, BLOCK: tl.constexpr):
    """int64 keys that order candidates as the tree selection does, all distinct: a higher score first, an
    equal one created earlier (lower i) first. The float's bits, made order-preserving as a signed int,
    above the complement of the index: one sort or compare of keys instead of a pairwise rank count,
    which costs 25-200 us at 410 candidates on an H100 (measured, depending on the tile)."""
    bits = score.to(tl.int32, bitcast=True)
    ordered = bits ^ ((bits >> 31) & 0x7FFFFFFF)
    return (ordered.to(tl.int64) << 32) | (BLOCK - 1 - i).to(tl.int64)


# ---- One level of the draft's tree expansion ------------------------------------------------------------
# PyTorch: the children's cumulative scores, four candidate records, the next frontier's top-K and six
# gathers (its ids, scores, creation indices, parents' hidden states, ancestor masks, embeddings): about
# 15 launches a level, each a few microseconds of an idle GPU. One program per sequence does it all; the
# top-K is one sort of the F * K children's distinct keys (_rank_key).
@triton.jit
def _draft_level_kernel(
    kid_ids_ptr,
    kid_score_ptr,
    kid_logq_ptr,
    fscore_ptr,
    fid_ptr,
    hid_ptr,
    s_hb,
    s_hf,
    anc_ptr,
    emb_ptr,
    s_e,
    ctok_ptr,
    cscore_ptr,
    clogq_ptr,
    cpar_ptr,
    s_c,
    ntok_ptr,
    nscore_ptr,
    nid_ptr,
    nhid_ptr,
    nanc_ptr,
    nemb_ptr,
    offset,
    created,
    own_base,
    F: tl.constexpr,
    K: tl.constexpr,
    H: tl.constexpr,
    S: tl.constexpr,
    BLOCK_C: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_S: tl.constexpr,
    ROOT: tl.constexpr,
    NEXT: tl.constexpr,
):
    b = tl.program_id(0)
    i = tl.arange(0, BLOCK_C)  # child i of expanded node i // K
    ok = i < F * K
    f = i // K
    ids = tl.load(kid_ids_ptr + b * F * K + i, mask=ok, other=0)
    score = tl.load(kid_score_ptr + b * F * K + i, mask=ok, other=float("-inf"))
    logq = tl.load(kid_logq_ptr + b * F * K + i, mask=ok, other=0.0)
    if ROOT:
        parent = tl.full([BLOCK_C], -1, tl.int64)
    else:
        score = score + tl.load(fscore_ptr + b * F + f, mask=ok, other=0.0)
        parent = tl.load(fid_ptr + b * F + f, mask=ok, other=-1)
    cand = b * s_c + offset + i
    tl.store(ctok_ptr + cand, ids, mask=ok)
    tl.store(cscore_ptr + cand, score, mask=ok)
    tl.store(clogq_ptr + cand, logq, mask=ok)
    tl.store(cpar_ptr + cand, parent, mask=ok)
    if NEXT:
        key = _rank_key(score, i, BLOCK_C)
        best = tl.sort(key, descending=True)  # [BLOCK_C] the frontier's keys first
        r = tl.arange(0, BLOCK_K)  # frontier place r takes the child of the r-th best key
        key_r = tl.sum(tl.where(i[None, :] == r[:, None], best[None, :], 0), axis=1)  # [BLOCK_K]
        hit = (key[None, :] == key_r[:, None]) & ok[None, :]  # [BLOCK_K, BLOCK_C], one hit a row r < K
        src = tl.sum(tl.where(hit, i[None, :], 0), axis=1)  # [BLOCK_K]
        tok = tl.sum(tl.where(hit, ids[None, :], 0), axis=1)
        top = tl.sum(tl.where(hit, score[None, :], 0.0), axis=1)
        rok = r < K
        out = b * K + r
        tl.store(ntok_ptr + out, tok, mask=rok)
        tl.store(nscore_ptr + out, top, mask=rok)
        tl.store(nid_ptr + out, created + src, mask=rok)
        fsrc = src // K
        h = tl.arange(0, BLOCK_H)  # the whole row in one tile: the copies' latencies overlap
        hm = rok[:, None] & (h < H)[None, :]
        v = tl.load(hid_ptr + b * s_hb + fsrc[:, None] * s_hf + h[None, :], mask=hm, other=0.0)
        tl.store(nhid_ptr + out[:, None] * H + h[None, :], v, mask=hm)
        e = tl.load(emb_ptr + tok[:, None] * s_e + h[None, :], mask=hm, other=0.0)
        tl.store(nemb_ptr + out[:, None] * H + h[None, :], e, mask=hm)
        s = tl.arange(0, BLOCK_S)
        sm = rok[:, None] & (s < S)[None, :]
        own = s[None, :] == own_base + r[:, None]
        if not ROOT:
            own = own | (tl.load(anc_ptr + (b * F + fsrc)[:, None] * S + s[None, :], mask=sm, other=0) != 0)
        tl.store(nanc_ptr + out[:, None] * S + s[None, :], own.to(tl.uint8), mask=sm)


def draft_level(
    kid_ids: torch.Tensor,
    kid_score: torch.Tensor,
    kid_logq: torch.Tensor,
    front_score: torch.Tensor | None,
    front_id: torch.Tensor | None,
    hidden: torch.Tensor,
    front_anc: torch.Tensor | None,
    embed: torch.Tensor,
    cand: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor],
    offset: int,
    created: int,
    own_base: int | None,
    scratch: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """See reference.draft_level. hidden [B, F, H] with unit stride on H; embed [Vd, H] contiguous rows;
    cand's four [B, C] tensors share one row stride."""
    b, f, k = kid_ids.shape
    hd = hidden.shape[-1]
    root = front_score is None
    nxt = own_base is not None
    tok = torch.empty((b, k), dtype=torch.int64, device=kid_ids.device)
    score = torch.empty((b, k), dtype=torch.float32, device=kid_ids.device)
    ids = torch.empty_like(tok)
    h = torch.empty((b, k, hd), dtype=hidden.dtype, device=hidden.device)
    anc = torch.empty((b, k, scratch), dtype=torch.bool, device=hidden.device)
    emb = torch.empty((b, k, hd), dtype=embed.dtype, device=embed.device)
    front_score = score if root else front_score.contiguous()  # unread at the root
    front_id = ids if root else front_id.contiguous()
    front_anc = anc if root else front_anc.contiguous()
    _draft_level_kernel[(b,)](
        kid_ids.contiguous(),
        kid_score.contiguous(),
        kid_logq.contiguous(),
        front_score,
        front_id,
        hidden,
        hidden.stride(0),
        hidden.stride(1),
        front_anc.view(torch.uint8),
        embed,
        embed.stride(0),
        *cand,
        cand[0].stride(0),
        tok,
        score,
        ids,
        h,
        anc.view(torch.uint8),
        emb,
        offset,
        created,
        own_base if nxt else 0,
        F=f,
        K=k,
        H=hd,
        S=scratch,
        BLOCK_C=triton.next_power_of_2(f * k),
        BLOCK_K=triton.next_power_of_2(k),
        BLOCK_H=triton.next_power_of_2(hd),
        BLOCK_S=triton.next_power_of_2(max(scratch, 1)),
        ROOT=root,
        NEXT=nxt,
        num_warps=4,
    )
    return (tok, score, ids, h, anc, emb) if nxt else None


# ---- The draft tree's final selection ---------------------------------------------------------------------
# PyTorch: the depth mask, two sorts (best first, then creation order), a scatter of positions, gathers
# of parents, scores and ids, the d2t map and a stack of four casts: about 30 launches. One program per
# sequence: one sort of distinct keys finds the keep-th best (_rank_key), a prefix sum gives the kept
# candidates' rows in creation order, register gathers their parents' rows and scores.
@triton.jit
def _select_tree_kernel(
    tok_ptr,
    score_ptr,
    par_ptr,
    d2t_ptr,
    keep_ptr,
    depth_ptr,
    tree_ptr,
    kept_ptr,
    logq_ptr,
    temp_ptr,
    front_ptr,
    s_c,
    s_keep,
    s_depth,
    s_temp,
    s_front,
    F,
    C: tl.constexpr,
    K: tl.constexpr,
    N: tl.constexpr,
    BLOCK_C: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_F: tl.constexpr,
    DRAWN: tl.constexpr,
):
    b = tl.program_id(0)
    i = tl.arange(0, BLOCK_C)
    ok = i < C
    row_depth = tl.load(depth_ptr + b * s_depth)
    keep = tl.load(keep_ptr + b * s_keep)
    raw = tl.load(score_ptr + b * s_c + i, mask=ok, other=float("-inf"))
    deep = tl.where(i < K, 1, 2 + (i - K) // (K * K)) > row_depth  # deeper than the row's tree
    key = _rank_key(tl.where(deep, float("-inf"), raw), i, BLOCK_C)
    # the keep-th best key: the candidates at or above it are the tree (keys are distinct)
    last = tl.sum(tl.where(i == keep - 1, tl.sort(key, descending=True), 0), axis=0)
    sel = ok & (key >= last)
    pos = tl.cumsum(sel.to(tl.int32), axis=0) - 1  # each kept candidate's row in creation order
    par = tl.load(par_ptr + b * s_c + i, mask=ok, other=-1)
    at = tl.maximum(par, 0).to(tl.int32)  # parents precede their children: inside the block
    new_parent = tl.where(par < 0, -1, tl.gather(pos, at, 0))
    parent_score = tl.where(par < 0, 0.0, tl.gather(raw, at, 0))
    prob = tl.exp(raw - parent_score)
    q_row = tl.zeros([BLOCK_C], dtype=tl.float64) - 1.0
    if DRAWN:  # a sampling row's probability is its draw's; each expanded node's q row is its place + 1
        logq = tl.load(logq_ptr + b * s_c + i, mask=ok, other=0.0)
        prob = tl.where(tl.load(temp_ptr + b * s_temp) > 0, tl.exp(logq), prob)
        f = tl.arange(0, BLOCK_F)
        front = tl.load(front_ptr + b * s_front + f, mask=f < F, other=-1)
        q_row = tl.max(tl.where(front[None, :] == i[:, None], f[None, :] + 1, -1), axis=1).to(tl.float64)
    tok = tl.load(tok_ptr + b * s_c + i, mask=ok, other=0)
    base = tok + tl.load(d2t_ptr + tok, mask=ok, other=0)
    row = tree_ptr + b * 4 * N
    e = tl.arange(0, BLOCK_N)
    fill = (e >= keep) & (e < N)
    zero = tl.zeros([BLOCK_N], dtype=tl.float64)
    tl.store(row + e, zero, mask=fill)
    tl.store(row + N + e, zero - 1.0, mask=fill)
    tl.store(row + 2 * N + e, zero, mask=fill)
    tl.store(row + 3 * N + e, zero - 1.0, mask=fill)
    tl.store(kept_ptr + b * N + e, tl.zeros([BLOCK_N], dtype=tl.int64), mask=fill)
    tl.store(row + pos, base.to(tl.float64), mask=sel)
    tl.store(row + N + pos, new_parent.to(tl.float64), mask=sel)
    tl.store(row + 2 * N + pos, prob.to(tl.float64), mask=sel)
    tl.store(row + 3 * N + pos, q_row, mask=sel)
    tl.store(kept_ptr + b * N + pos, i.to(tl.int64), mask=sel)


def select_tree(
    tok: torch.Tensor,
    score: torch.Tensor,
    parent: torch.Tensor,
    d2t: torch.Tensor,
    keep: torch.Tensor,
    row_depth: torch.Tensor,
    k: int,
    n: int,
    drawn: reference.Drawn | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """See reference.select_tree. tok, score, parent (and drawn.logq) [B, C] share one row stride; keep,
    row_depth, drawn.temperature [B] (any stride: columns of a packed block); drawn.fronts [B, F] unit stride
    on F."""
    b, c = score.shape
    tree = torch.empty((b, 4, n), dtype=torch.float64, device=score.device)
    kept = torch.empty((b, n), dtype=torch.int64, device=score.device)
    block = triton.next_power_of_2(c)
    f = 0 if drawn is None else drawn.fronts.shape[1]
    _select_tree_kernel[(b,)](
        tok,
        score,
        parent,
        d2t,
        keep,
        row_depth,
        tree,
        kept,
        score if drawn is None else drawn.logq,  # unread without draws
        keep if drawn is None else drawn.temperature,
        kept if drawn is None else drawn.fronts,
        score.stride(0),
        keep.stride(0),
        row_depth.stride(0),
        0 if drawn is None else drawn.temperature.stride(0),
        0 if drawn is None else drawn.fronts.stride(0),
        f,
        C=c,
        K=k,
        N=n,
        BLOCK_C=block,
        BLOCK_N=triton.next_power_of_2(n),
        BLOCK_F=max(16, triton.next_power_of_2(max(f, 1))),
        DRAWN=drawn is not None,
        num_warps=4,
    )
    return tree, kept


# ---- Tree verification: mask, acceptance, the accepted path's K/V --------------------------------------
# In PyTorch the tree mask is an eye, a scatter and three doubling rounds of gathers (10 launches), the
# greedy acceptance and the result's tokens about 20 small launches (where, any, argmax, gathers, a sort,
# cat, scatter) and the K/V compaction an index gather and an index_put over all layers: about 60 us of a
# 1.26 ms verify on an H100 in 35 kernels. Here they are three launches: one program a tree for the mask
# and the acceptance (a tree of up to 128 rows is one tile), one program a (layer, sequence, row chunk)
# for the move, which touches only the accepted path's rows.


@triton.jit
def _tree_mask_kernel(parent_ptr, anc_ptr, depth_ptr, T, s_pb, BT: tl.constexpr):
    """anc[b, i, j] = j is i or one of its ancestors: each row and its parent written as a tile, then every
    row climbs to the root at once, one level an iteration, as long as any row still moves (the tree's
    depth in iterations, not T), writing each ancestor it reaches. The loop carries only [BT] vectors
    (Triton 3.6 fails to compile a while loop carrying the [128, 128] tile)."""
    b = tl.program_id(0)
    i = tl.arange(0, BT)
    ok = i < T
    at = anc_ptr + b * T * T
    par = tl.load(parent_ptr + b * s_pb + i, mask=ok, other=0)
    tile = (i[None, :] == i[:, None]) | (i[None, :] == par[:, None])
    tl.store(at + i[:, None] * T + i[None, :], tile.to(tl.uint8), mask=ok[:, None] & ok[None, :])
    tl.debug_barrier()  # the tile's zeros land before any thread's ancestor bits
    depth = (par != i).to(tl.int64)
    cur = par
    up = tl.load(parent_ptr + b * s_pb + cur, mask=ok, other=0)
    while tl.max((up != cur).to(tl.int32), axis=0) > 0:
        moved = ok & (up != cur)
        tl.store(at + i * T + up, tl.full((BT,), 1, tl.uint8), mask=moved)
        depth += moved.to(tl.int64)
        cur = up
        up = tl.load(parent_ptr + b * s_pb + cur, mask=ok, other=0)
    tl.store(depth_ptr + b * T + i, depth, mask=ok)


def tree_mask(parent_rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """See reference.tree_mask. parent_rows [B, T] int64 (unit stride on T)."""
    b, t = parent_rows.shape
    anc = torch.empty((b, t, t), dtype=torch.bool, device=parent_rows.device)
    depth = torch.empty((b, t), dtype=torch.int64, device=parent_rows.device)
    bt = max(16, triton.next_power_of_2(t))
    _tree_mask_kernel[(b,)](parent_rows, anc.view(torch.uint8), depth, t, parent_rows.stride(0), BT=bt, num_warps=4)
    return anc, depth


# The one-hot sets of a sampled verify's trees (reference.onehot_sets): PyTorch needs about 30 launches of
# [B, T, T] comparisons, reductions and two scatters; here one program a tree holds its [T, T] tile.
@triton.jit
def _onehot_sets_kernel(ids_ptr, par_ptr, pos_ptr, set_ptr, q_ptr, T, W, s_ib, s_pb, BT: tl.constexpr):
    """Rows j along axis 0, rows i along axis 1: rank[j] = the first-of-their-token siblings before j's
    token's first sibling; a node that fits (rank < W) writes its token and q 1 to its parent's cell rank."""
    b = tl.program_id(0)
    r = tl.arange(0, BT)
    ok = r < T
    ids = tl.load(ids_ptr + b * s_ib + r, mask=ok, other=0)
    par = tl.load(par_ptr + b * s_pb + r, mask=ok, other=0)
    node = ok & (par != r)
    sib = (par[:, None] == par[None, :]) & node[:, None] & node[None, :]  # [BT, BT]
    same = sib & (ids[:, None] == ids[None, :])
    first = tl.sum((same & (r[None, :] < r[:, None])).to(tl.int32), axis=1) == 0  # [BT] no earlier sibling has it
    f = tl.min(tl.where(same, r[None, :], BT), axis=1)  # [BT] its token's first sibling (itself when first)
    rank = tl.sum((sib & first[None, :] & (r[None, :] < f[:, None])).to(tl.int32), axis=1)
    fits = node & (rank < W)
    tl.store(pos_ptr + b * T + r, tl.where(fits, rank, 0).to(tl.int64), mask=ok)
    cell = b * T * W + par * W + rank
    tl.store(set_ptr + cell, ids, mask=fits)
    tl.store(q_ptr + cell, tl.full((BT,), 1.0, tl.float32), mask=fits)


def onehot_sets(ids: torch.Tensor, parent_rows: torch.Tensor, w: int) -> tuple[torch.Tensor, ...]:
    """See reference.onehot_sets. ids, parent_rows [K, T] int64 (unit stride on T), T <= 128; W even."""
    k, t = ids.shape
    pos = torch.empty((k, t), dtype=torch.int64, device=ids.device)
    set_ids = torch.zeros((k, t * w), dtype=torch.int64, device=ids.device)
    q = torch.zeros((k, t * w), dtype=torch.float32, device=ids.device)
    bt = max(16, triton.next_power_of_2(t))
    _onehot_sets_kernel[(k,)](
        ids, parent_rows, pos, set_ids, q, t, w, ids.stride(0), parent_rows.stride(0), BT=bt, num_warps=4
    )
    return pos, set_ids, q.view(torch.int64)


# A chained round's next verify block (reference.chained_block): PyTorch needs about 20 launches (a clone, the
# bonus gather, slice writes of the trees' columns and of padding); at 64 sequences a round is bound by the host's
# launches, so here one program a row writes the whole new row in one pass.
# launched between a call's graph replays (never captured): no int specialised on its value (1, multiples of 16),
# so that one compile serves every batch, tree and block width of a BLOCK (Verifier warms them at capture)
@triton.jit(
    do_not_specialize=["B", "K", "NODES", "TB", "NCOL", "C", "s_prev", "s_res", "s_tok", "s_par", "s_keep", "s_out"]
)
def _chained_block_kernel(
    prev_ptr, res_ptr, tok_ptr, par_ptr, keep_ptr, out_ptr,
    B, K, NODES, TB, NCOL, C, s_prev, s_res, s_tok, s_par, s_keep, s_out,
    BLOCK: tl.constexpr,
):  # fmt: skip
    """Row r: the root (column 0) the bonus token and the length (NCOL) + count + 1 when r < B; tree columns
    1..TB-1 and parent columns TB+1..2TB-1: row r < K's kept nodes (node j < min(NODES, keep)), else 0 and each
    row its own parent; rows r >= B as they were. A row's program reads each column before it writes it: out may
    be prev."""
    r = tl.program_id(0)
    live = r < B
    spec = r < K
    count = tl.load(res_ptr + r * s_res, mask=live, other=0) + 1
    bonus = tl.load(res_ptr + r * s_res + count, mask=live, other=0)
    keep = tl.load(keep_ptr + r * s_keep, mask=spec, other=0)
    for c0 in range(0, C, BLOCK):
        col = c0 + tl.arange(0, BLOCK)
        ok = col < C
        v = tl.load(prev_ptr + r * s_prev + col, mask=ok, other=0)
        j = col - 1  # a tree column's node
        in_tok = (col >= 1) & (col < TB)
        has = spec & (j < NODES) & (j < keep)
        tok = tl.load(tok_ptr + r * s_tok + j, mask=ok & in_tok & has, other=0).to(tl.int64)
        i = col - TB  # a parent column's row; its node i - 1
        in_par = (col > TB) & (col < 2 * TB)
        has_par = spec & (i - 1 < NODES) & (i - 1 < keep)
        par = tl.load(par_ptr + r * s_par + (i - 1), mask=ok & in_par & has_par, other=0).to(tl.int64)
        new = tl.where(col == 0, bonus, v)
        new = tl.where(col == NCOL, v + count, new)
        new = tl.where(in_tok, tok, new)
        new = tl.where(in_par, tl.where(has_par, par + 1, i.to(tl.int64)), new)
        tl.store(out_ptr + r * s_out + col, tl.where(live, new, v), mask=ok)


def chained_block(
    prev: torch.Tensor,
    result: torch.Tensor,
    tokens: torch.Tensor,
    parents: torch.Tensor,
    keep: torch.Tensor,
    tb: int,
    n_col: int,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """See reference.chained_block. prev, result, keep (and out) int64, tokens and parents int32, int64 or float64
    (integer values: the drafter's tree block); unit stride along the last dimension of the 2-D ones, keep any
    stride."""
    bb, c = prev.shape
    b, k = result.shape[0], tokens.shape[0]
    nodes = min(tokens.shape[1], tb - 1)
    out = torch.empty((bb, c), dtype=prev.dtype, device=prev.device) if out is None else out
    block = min(1024, triton.next_power_of_2(c))
    _chained_block_kernel[(bb,)](
        prev, result, tokens, parents, keep, out, b, k, nodes, tb, n_col, c,
        prev.stride(0), result.stride(0), tokens.stride(0), parents.stride(0), keep.stride(0), out.stride(0),
        BLOCK=block, num_warps=4,
    )  # fmt: skip
    return out


# A drafting launched behind a verify (reference.accept_inputs): its inputs written straight into the propose
# graph's buffers by one program per (row, token) (PyTorch: about ten launches a chained round, each tens of
# microseconds of the host's time, which at 64 sequences is what a round waits for).
@triton.jit(do_not_specialize=["B", "N", "L", "F", "s_pk", "s_res", "s_kb", "s_kn", "s_hb", "s_hn"])
def _accept_inputs_kernel(
    packed_ptr, hid_ptr, res_ptr, kept_ptr, am_ptr, at_ptr, took_ptr, m_ptr, keep_ptr,
    B, N, L, F, s_pk, s_res, s_kb, s_kn, s_hb, s_hn,
    HAS_AFTER: tl.constexpr, NB: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    """Program (r, j): hidden row j of row r (kept's, or 0); program (r, 0) of a row r < B also its columns."""
    r = tl.program_id(0)
    j = tl.program_id(1)
    real = (r < B) & (j < N)
    f = tl.arange(0, BLOCK)
    for f0 in range(0, F, BLOCK):
        ok = f0 + f < F
        x = tl.load(kept_ptr + r * s_kb + j * s_kn + f0 + f, mask=ok & real, other=0.0)
        tl.store(hid_ptr + r * s_hb + j * s_hn + f0 + f, x.to(hid_ptr.dtype.element_ty), mask=ok)
    if (j == 0) & (r < B):
        count = tl.load(res_ptr + r * s_res) + 1
        c = tl.arange(0, NB)
        tok = tl.load(res_ptr + r * s_res + 1 + c, mask=c < N, other=0)
        tl.store(packed_ptr + r * s_pk + c, tl.where(c < count, tok, 0), mask=c < N)
        tl.store(packed_ptr + r * s_pk + L + 1, count)
        if HAS_AFTER:
            n = tl.load(am_ptr + r) + tl.load(at_ptr + r)
            tl.store(packed_ptr + r * s_pk + L, n)
        else:
            n = tl.load(packed_ptr + r * s_pk + L)
        tl.store(took_ptr + r, count)
        tl.store(m_ptr + r, n)
        tl.store(keep_ptr + r, tl.load(packed_ptr + r * s_pk + L + 3))


def accept_inputs(
    packed: torch.Tensor,
    hidden: torch.Tensor,
    result: torch.Tensor,
    kept: torch.Tensor,
    after: tuple[torch.Tensor, torch.Tensor] | None,
    length: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """See reference.accept_inputs. packed and result int64 with unit stride on their last dimension, hidden and
    kept [., ., F] with unit stride on F, after's two contiguous int64 [B]."""
    bb, lh, f = hidden.shape
    b, n = kept.shape[:2]
    took, m, keep = (torch.empty(b, dtype=torch.int64, device=packed.device) for _ in range(3))
    am, at = after if after is not None else (took, took)  # unread without HAS_AFTER
    _accept_inputs_kernel[(bb, lh)](
        packed, hidden, result, kept, am, at, took, m, keep,
        b, n, length, f, packed.stride(0), result.stride(0), kept.stride(0), kept.stride(1),
        hidden.stride(0), hidden.stride(1),
        HAS_AFTER=after is not None, NB=max(16, triton.next_power_of_2(n)), BLOCK=min(2048, triton.next_power_of_2(f)),
        num_warps=4,
    )  # fmt: skip
    return took, m, keep


@triton.jit
def _accept_tree_kernel(
    ids_ptr, parent_ptr, anc_ptr, depth_ptr, target_ptr, greedy_ptr, res_ptr, src_ptr,
    T, s_ib, s_pb, s_gb, BT: tl.constexpr,
):  # fmt: skip
    """reference.accept_tree for one tree: rows i (and tree positions k) along one axis, columns j."""
    b = tl.program_id(0)
    i = tl.arange(0, BT)
    ok = i < T
    both = ok[:, None] & ok[None, :]
    ids = tl.load(ids_ptr + b * s_ib + i, mask=ok, other=0)
    par = tl.load(parent_ptr + b * s_pb + i, mask=ok, other=0)
    depth = tl.load(depth_ptr + b * T + i, mask=ok, other=0)
    right = ((ids == tl.load(target_ptr + b * T + par, mask=ok, other=-1)) & (par != i)) | (i == 0)
    anc = tl.load(anc_ptr + b * T * T + i[:, None] * T + i[None, :], mask=both, other=0) != 0  # [i, j]
    wrong_anc = tl.max((anc & (right == 0)[None, :]).to(tl.int32), axis=1)  # [i] an ancestor is wrong
    score = tl.where(ok & (wrong_anc == 0), depth * T + (T - 1 - i), -1)  # deepest, then first row
    top = tl.max(score, axis=0)
    count = top // T
    best = T - 1 - top % T
    bonus = tl.load(target_ptr + b * T + best)
    on_path = tl.load(anc_ptr + b * T * T + best * T + i, mask=ok, other=0) != 0  # [j]
    # src_rows[k]: the path row at depth k (k <= count), else k; and src_rows[k + 1], for the tokens
    lands = on_path[None, :] & (depth[None, :] == i[:, None])  # [k, j]
    src_rows = tl.where(i <= count, tl.sum(tl.where(lands, i[None, :], 0), axis=1), i)
    lands_next = on_path[None, :] & (depth[None, :] == (i + 1)[:, None])
    nxt = tl.where(i + 1 <= count, tl.sum(tl.where(lands_next, i[None, :], 0), axis=1), i + 1)
    nxt = tl.where(i + 1 < T, nxt, 0)  # the last position takes the root, as the reference's roll does
    tok = tl.where(i == count, bonus, tl.load(ids_ptr + b * s_ib + nxt, mask=ok, other=0))
    greedy = tl.load(greedy_ptr + b * s_gb) != 0
    tl.store(src_ptr + b * T + i, tl.where(greedy, src_rows, i), mask=ok)
    tl.store(res_ptr + b * (T + 1) + 1 + i, tok, mask=ok)
    tl.store(res_ptr + b * (T + 1), count)


def accept_tree(
    ids: torch.Tensor,
    parent_rows: torch.Tensor,
    anc: torch.Tensor,
    depth: torch.Tensor,
    target: torch.Tensor,
    greedy: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """See reference.accept_tree. ids, parent_rows [B, T] int64 and greedy [B] int64 (any strides on B,
    unit on T); anc, depth, target contiguous. The path rows are placed by depth: a tree's rows list
    parents before children (common.tree), so this is the reference's order by row."""
    b, t = ids.shape
    result = torch.empty((b, t + 1), dtype=torch.int64, device=ids.device)
    src = torch.empty((b, t), dtype=torch.int64, device=ids.device)
    bt = max(16, triton.next_power_of_2(t))
    _accept_tree_kernel[(b,)](
        ids, parent_rows, anc.view(torch.uint8), depth, target, greedy, result, src,
        t, ids.stride(0), parent_rows.stride(0), greedy.stride(0), BT=bt, num_warps=4,
    )  # fmt: skip
    return result, src


@triton.jit
def _move_rows_kernel(
    kv_ptr, slot_ptr, n_ptr, src_ptr, T, s_layer, s_slot, s_pos, s_sb, s_nb, ROW, BT: tl.constexpr, BC: tl.constexpr
):
    """The moved rows of one layer and sequence, columns [c * BC, (c + 1) * BC) of each: all read, a
    barrier, all written (a path row may land where another path row is read from)."""
    # 64-bit offsets: the whole cache is one tensor, and layer * s_layer passes 2**31 elements in a large one
    # (30 layers x 65 slots x 4,218 positions x 384 at --max-context 4096), where 32-bit ones wrapped around
    layer = tl.program_id(0).to(tl.int64)
    b = tl.program_id(1)
    k = tl.arange(0, BT)
    col = tl.program_id(2) * BC + tl.arange(0, BC)
    src = tl.load(src_ptr + b * T + k, mask=k < T, other=0)
    move = (k < T) & (src != k)  # unmoved rows (past the path, sampling sequences) are not touched
    base = kv_ptr + layer * s_layer + tl.load(slot_ptr + b * s_sb).to(tl.int64) * s_slot
    n = tl.load(n_ptr + b * s_nb).to(tl.int64)
    both = move[:, None] & (col < ROW)[None, :]
    rows = tl.load(base + (n + src)[:, None] * s_pos + col[None, :], mask=both)
    tl.debug_barrier()
    tl.store(base + (n + k)[:, None] * s_pos + col[None, :], rows, mask=both)


def move_rows(kv: torch.Tensor, slots: torch.Tensor, n: torch.Tensor, src: torch.Tensor) -> None:
    """See reference.move_rows. kv [L, S, C, ...] with each cache row contiguous; slots, n [B] (any
    stride); src [B, T] contiguous."""
    b, t = src.shape
    row = kv[0, 0, 0].numel()
    bc = 128
    _move_rows_kernel[(kv.shape[0], b, triton.cdiv(row, bc))](
        kv, slots, n, src, t, kv.stride(0), kv.stride(1), kv.stride(2), slots.stride(0), n.stride(0), row,
        BT=max(16, triton.next_power_of_2(t)), BC=bc, num_warps=4,
    )  # fmt: skip
