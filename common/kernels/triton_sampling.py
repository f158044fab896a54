"""Triton kernels of common.kernels.sampling, one launch where PyTorch needs tens: the random numbers are
computed in the kernels (the same int64 arithmetic as sampling.mix32, so the same bits), and each program
keeps its row in registers. Shapes and meaning are the reference functions'; numerics match them up to
the order of float32 sums.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from common.kernels import sampling
from common.kernels.sampling import Target

# the reference's constants, as Triton reads module globals: constexpr
TOKEN = tl.constexpr(sampling.TOKEN)
ACCEPT = tl.constexpr(sampling.ACCEPT)
DRAFT = tl.constexpr(sampling.DRAFT)
LOG_Q_FLOOR = tl.constexpr(sampling.LOG_Q_FLOOR)
TOP_P_SLACK = tl.constexpr(sampling.TOP_P_SLACK)
RULE_Q = tl.constexpr(sampling.RULE_Q)


@triton.jit
def _mix32(x):
    x = x ^ (x >> 16)
    x = (x * 0x21F0AAAD) & 0xFFFFFFFF
    x = x ^ (x >> 15)
    x = (x * 0x735A2D97) & 0xFFFFFFFF
    return x ^ (x >> 15)


@triton.jit
def _row_key(seed, counter, stream):
    k = _mix32((seed & 0xFFFFFFFF) ^ stream)
    k = _mix32(k ^ (seed >> 32))
    return _mix32(k ^ (counter & 0xFFFFFFFF))


@triton.jit
def _uniform(key, index):
    bits = _mix32(key ^ _mix32(index & 0xFFFFFFFF))
    return ((bits >> 9).to(tl.float32) + 0.5) * (1.0 / 8388608.0)


@triton.jit
def _gumbel(key, index):
    return -tl.log(-tl.log(_uniform(key, index)))


# ---- Token draws over the vocabulary ------------------------------------------------------------------
# PyTorch: the noise's hash over [R, V] (about 25 integer launches), the Gumbel logs, the scaling, the
# threshold's where, the max and the greedy rows' where. One program per row streams the row once.
@triton.jit(do_not_specialize=["V", "s_x", "s_i", "s_t", "s_s", "s_c"])
def _sample_kernel(
    x_ptr, temp_ptr, theta_ptr, seed_ptr, counter_ptr, idx_ptr, greedy_ptr, tok_ptr, key_ptr,
    V, s_x, s_i, s_t, s_s, s_c,
    BLOCK: tl.constexpr, THETA: tl.constexpr, INDEX: tl.constexpr, GREEDY: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0)
    temp = tl.load(temp_ptr + row * s_t)
    t = tl.where(temp > 0, temp, 1.0)
    theta = float("-inf")
    if THETA:
        theta = tl.load(theta_ptr + row)
    key = _row_key(tl.load(seed_ptr + row * s_s), tl.load(counter_ptr + row * s_c), TOKEN)
    best = tl.full([], float("-inf"), tl.float32)
    arg = tl.full([], 0, tl.int64)
    for start in range(0, V, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        ok = cols < V
        x = tl.load(x_ptr + row.to(tl.int64) * s_x + cols, mask=ok, other=float("-inf")).to(tl.float32)
        token = cols.to(tl.int64)
        if INDEX:
            token = tl.load(idx_ptr + row.to(tl.int64) * s_i + cols, mask=ok, other=0)
        k = x / t + _gumbel(key, token)
        if THETA:
            k = tl.where(x >= theta, k, float("-inf"))
        k = tl.where(ok, k, float("-inf"))
        m = tl.max(k, axis=0)
        at = tl.min(tl.where(k == m, cols, V), axis=0).to(tl.int64)  # the block's first maximum
        take = m > best
        arg = tl.where(take, at, arg)
        best = tl.where(take, m, best)
    if GREEDY:
        arg = tl.where(temp > 0, arg, tl.load(greedy_ptr + row))
    tl.store(tok_ptr + row, arg)
    tl.store(key_ptr + row, best)


def sample_tokens(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    theta: torch.Tensor | None,
    seed: torch.Tensor,
    counter: torch.Tensor,
    index: torch.Tensor | None = None,
    greedy: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """See sampling.sample_tokens. logits and index [R, V] with unit stride on V; temperature, seed, counter
    [R] (any stride: an input block's columns); theta, greedy [R] contiguous."""
    r, v = logits.shape
    token = torch.empty(r, dtype=torch.int64, device=logits.device)
    key = torch.empty(r, dtype=torch.float32, device=logits.device)
    idx = token if index is None else index  # unread without an index
    _sample_kernel[(r,)](
        logits, temperature, key if theta is None else theta, seed, counter, idx,
        token if greedy is None else greedy, token, key,
        v, logits.stride(0), idx.stride(0), temperature.stride(0), seed.stride(0), counter.stride(0),
        BLOCK=min(2048, triton.next_power_of_2(v)), THETA=theta is not None, INDEX=index is not None,
        GREEDY=greedy is not None, num_warps=8 if v > 1024 else 1,
    )  # fmt: skip
    return token, key


# ---- A row's target: the unfiltered normaliser, and the threshold and normaliser after top-k, top-p ------
# PyTorch: a float32 copy of [R, V] logits, the division and logsumexp's max, subtract, exp, sum, log; after
# the sort, about 15 launches (the k-th value, masks, softmax, cumsum, the cut, its value, the logsumexp).
@triton.jit(do_not_specialize=["V", "PER", "s_x", "s_t"])
def _logz_kernel(x_ptr, temp_ptr, out_ptr, V, PER, s_x, s_t, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    temp = tl.load(temp_ptr + (row // PER) * s_t)
    t = tl.where(temp > 0, temp, 1.0)
    m = tl.full([], float("-inf"), tl.float32)
    s = tl.full([], 0.0, tl.float32)
    for start in range(0, V, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        z = tl.load(x_ptr + row.to(tl.int64) * s_x + cols, mask=cols < V, other=float("-inf")).to(tl.float32) / t
        top = tl.maximum(m, tl.max(z, axis=0))
        s = s * tl.exp(m - top) + tl.sum(tl.exp(z - top), axis=0)
        m = top
    tl.store(out_ptr + row, m + tl.log(s))


def row_logz(logits: torch.Tensor, temperature: torch.Tensor, per: int = 1) -> torch.Tensor:
    """See sampling.row_logz. logits [R, V] with unit stride on V; temperature [R // per] (any stride)."""
    r, v = logits.shape
    out = torch.empty(r, dtype=torch.float32, device=logits.device)
    _logz_kernel[(r,)](
        logits, temperature, out, v, per, logits.stride(0), temperature.stride(0), BLOCK=2048, num_warps=8
    )
    return out


@triton.jit(do_not_specialize=["V", "PER", "s_v", "s_t", "s_k", "s_p"])
def _threshold_kernel(
    v_ptr, temp_ptr, topk_ptr, topp_ptr, theta_ptr, logz_ptr, V, PER, s_v, s_t, s_k, s_p, BLOCK: tl.constexpr
):
    """One row's values sorted in descending order: the top-k mass, then the cut where the cumulative
    probability reaches top_p, then the normaliser of what is kept (sampling.target_threshold)."""
    row = tl.program_id(0)
    seq = row // PER
    temp = tl.load(temp_ptr + seq * s_t)
    t = tl.where(temp > 0, temp, 1.0)
    k = tl.load(topk_ptr + seq * s_k)
    k = tl.minimum(tl.maximum(k, 1), V)
    top_p = tl.load(topp_ptr + seq * s_p) - TOP_P_SLACK
    base = v_ptr + row.to(tl.int64) * s_v
    top = tl.load(base).to(tl.float32) / t  # the largest z
    kth = tl.load(base + (k - 1)).to(tl.float32)
    mass = tl.full([], 0.0, tl.float32)  # the top-k's sum of exp(z - top)
    for start in range(0, V, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        x = tl.load(base + cols, mask=cols < V, other=float("-inf")).to(tl.float32)
        mass += tl.sum(tl.where(x >= kth, tl.exp(x / t - top), 0.0), axis=0)
    cut = tl.full([], 0, tl.int32)  # positions whose cumulative probability is still below top_p
    carry = tl.full([], 0.0, tl.float32)
    for start in range(0, V, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        ok = cols < V
        x = tl.load(base + cols, mask=ok, other=float("-inf")).to(tl.float32)
        e = tl.where(x >= kth, tl.exp(x / t - top), 0.0) / mass
        cum = carry + tl.cumsum(e, axis=0)
        cut += tl.sum((ok & (cum < top_p)).to(tl.int32), axis=0)
        carry += tl.sum(e, axis=0)
    cut = tl.minimum(cut, V - 1)
    theta = tl.maximum(tl.load(base + cut).to(tl.float32), kth)
    kept = tl.full([], 0.0, tl.float32)
    for start in range(0, V, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        x = tl.load(base + cols, mask=cols < V, other=float("-inf")).to(tl.float32)
        kept += tl.sum(tl.where(x >= theta, tl.exp(x / t - top), 0.0), axis=0)
    tl.store(theta_ptr + row, theta)
    tl.store(logz_ptr + row, top + tl.log(kept))


def target_threshold(logits: torch.Tensor, rows: sampling.SamplingRows, per: int = 1) -> Target:
    """See sampling.target_threshold: PyTorch's sort of every row, then one program per sorted row."""
    r, v = logits.shape
    vals = logits.sort(dim=-1, descending=True).values  # [R, V] in the logits' dtype
    theta = torch.empty(r, dtype=torch.float32, device=logits.device)
    logz = torch.empty(r, dtype=torch.float32, device=logits.device)
    _threshold_kernel[(r,)](
        vals, rows.temperature, rows.top_k, rows.top_p, theta, logz, v, per, vals.stride(0),
        rows.temperature.stride(0), rows.top_k.stride(0), rows.top_p.stride(0), BLOCK=2048, num_warps=8,
    )  # fmt: skip
    return Target(theta=theta, logz=logz)


# ---- The draft's children draws --------------------------------------------------------------------------
# PyTorch: the temperature, log-softmax, floor and renormalisation, the noise's hash, a sort and four
# gathers and wheres: 40-odd launches a level. One program per expanded node (W <= 256 in registers).
@triton.jit
def _children_kernel(
    lp_ptr, ids_ptr, temp_ptr, seed_ptr, counter_ptr, kid_ptr, score_ptr, logq_ptr, q_ptr,
    level, F, W, s_t, s_s, s_c, K: tl.constexpr, BW: tl.constexpr,
):  # fmt: skip
    pid = tl.program_id(0)
    b = pid // F
    f = pid % F
    w = tl.arange(0, BW)
    ok = w < W
    lp = tl.load(lp_ptr + pid * W + w, mask=ok, other=float("-inf"))
    ids = tl.load(ids_ptr + pid * W + w, mask=ok, other=0)
    t = tl.load(temp_ptr + b * s_t)
    drawn = t > 0
    z = lp / tl.where(drawn, t, 1.0)
    top = tl.max(z, axis=0)
    lq = z - top - tl.log(tl.sum(tl.exp(z - top), axis=0))
    lq = tl.where(ok & ((lq > LOG_Q_FLOOR) | (drawn == 0)), lq, float("-inf"))
    top = tl.max(lq, axis=0)
    lq = lq - top - tl.log(tl.sum(tl.exp(lq - top), axis=0))
    tl.store(q_ptr + pid * W + w, tl.exp(lq), mask=ok)
    key = _row_key(tl.load(seed_ptr + b * s_s), tl.load(counter_ptr + b * s_c), DRAFT)
    keys = lq + _gumbel(key, ((level * K + f) * W + w).to(tl.int64))
    used = w >= W
    for j in tl.static_range(K):
        best = tl.max(tl.where(used, float("-inf"), keys), axis=0)
        at = tl.min(tl.where((keys == best) & (used == 0), w, BW), axis=0)  # the first unused maximum
        used = used | (w == at)
        pick = tl.where(drawn, at, j)
        lp_j = tl.sum(tl.where(w == j, lp, 0.0), axis=0)
        lq_j = tl.max(tl.where(w == j, lq, float("-inf")), axis=0)
        tl.store(kid_ptr + pid * K + j, tl.sum(tl.where(w == pick, ids, 0), axis=0))
        tl.store(score_ptr + pid * K + j, tl.where(drawn & (lq_j == float("-inf")), float("-inf"), lp_j))
        lq_pick = tl.max(tl.where(w == pick, lq, float("-inf")), axis=0)
        tl.store(logq_ptr + pid * K + j, tl.where(drawn, lq_pick, lp_j))


def draft_children(
    logp: torch.Tensor,
    ids: torch.Tensor,
    temperature: torch.Tensor,
    seed: torch.Tensor,
    counter: torch.Tensor,
    level: int,
    k: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """See sampling.draft_children. logp [B, F, W] float32, ids [B, F, W] int64; temperature, seed, counter [B]
    (any stride)."""
    b, f, w = logp.shape
    dev = logp.device
    kid = torch.empty((b, f, k), dtype=torch.int64, device=dev)
    score = torch.empty((b, f, k), dtype=torch.float32, device=dev)
    logq = torch.empty((b, f, k), dtype=torch.float32, device=dev)
    q = torch.empty((b, f, w), dtype=torch.float32, device=dev)
    _children_kernel[(b * f,)](
        logp.float().contiguous(), ids.contiguous(), temperature, seed, counter, kid, score, logq, q,
        level, f, w, temperature.stride(0), seed.stride(0), counter.stride(0),
        K=k, BW=triton.next_power_of_2(w), num_warps=1,
    )  # fmt: skip
    return kid, score, logq, q


# ---- The sampled tree acceptance ----------------------------------------------------------------------------
# PyTorch (sampling.accept_sampled) decides every row at once: the children table, the targets at the sets,
# about 25 launches per sibling rank, the path, the bonus's gathers and two draws: about 110 launches. Here
# one program per tree walks from the root as the host rule does: at each row its children in sibling order
# (the set's residual in registers), the accepted child's row next; then the bonus at the last row, one
# pass over its logits (the set's tokens left out, their residual's keys beside), and the result's tokens.
@triton.jit(do_not_specialize=["T", "V", "W", "s_tb", "s_xb", "s_xt", "s_sb", "s_st", "s_qb", "s_qt"])
def _accept_kernel(
    ids_ptr, par_ptr, pos_ptr, s_tb,
    x_ptr, s_xb, s_xt,
    sid_ptr, sq_ptr, s_sb, s_st, s_qb, s_qt,
    theta_ptr, logz_ptr,
    temp_ptr, rule_ptr, seed_ptr, counter_ptr, s_t, s_r, s_s, s_c,
    res_ptr, src_ptr,
    T, V, W,
    THETA: tl.constexpr, BT: tl.constexpr, BW: tl.constexpr, BV: tl.constexpr,
):  # fmt: skip
    b = tl.program_id(0)
    i = tl.arange(0, BT)
    ok = i < T
    par = tl.load(par_ptr + b * s_tb + i, mask=ok, other=0).to(tl.int32)
    pos = tl.load(pos_ptr + b * s_tb + i, mask=ok, other=0).to(tl.int32)
    node = ok & (par != i)
    w = tl.arange(0, BW)
    okw = w < W
    temp = tl.load(temp_ptr + b * s_t)
    t = tl.where(temp > 0, temp, 1.0)
    rule_q = tl.load(rule_ptr + b * s_r) == RULE_Q
    seed = tl.load(seed_ptr + b * s_s)
    counter = tl.load(counter_ptr + b * s_c)
    key_accept = _row_key(seed, counter, ACCEPT)
    key_token = _row_key(seed, counter, TOKEN)
    xb = x_ptr + b.to(tl.int64) * s_xb
    row = tl.full([], 0, tl.int32)
    count = tl.full([], 0, tl.int32)
    path = tl.zeros([BT], dtype=tl.int32)  # path[k]: the row at depth k (k <= count)
    r = tl.zeros([BW], dtype=tl.float32)  # the residual at the set of the row last decided
    p = tl.zeros([BW], dtype=tl.float32)  # its target at the set
    outside = tl.full([], 0.0, tl.float32)
    going = tl.full([], 1, tl.int32)
    while going != 0:
        sid = tl.load(sid_ptr + b * s_sb + row * s_st + w, mask=okw, other=0)
        sq = tl.load(sq_ptr + b * s_qb + row * s_qt + w, mask=okw, other=0.0)
        x = tl.load(xb + row.to(tl.int64) * s_xt + sid, mask=okw, other=float("-inf")).to(tl.float32)
        keep = okw & (sq > 0)
        if THETA:
            keep = keep & (x >= tl.load(theta_ptr + b * T + row))
        p = tl.where(keep, tl.exp(x / t - tl.load(logz_ptr + b * T + row)), 0.0)
        outside = tl.maximum(1.0 - tl.sum(p, axis=0), 0.0)
        r = p
        left = tl.where(okw, sq, 0.0)
        kids = node & (par == row)
        rank = tl.cumsum(kids.to(tl.int32), axis=0) - 1
        accepted = tl.full([], 0, tl.int32)
        stopped = tl.full([], 0, tl.int32)
        chosen = row
        for s in range(0, tl.sum(kids.to(tl.int32), axis=0)):
            c = tl.min(tl.where(kids & (rank == s), i, BT), axis=0)  # the s-th child's row
            at = w == tl.sum(tl.where(i == c, pos, 0), axis=0)  # its entry in the set
            u = _uniform(key_accept, c.to(tl.int64))
            lsum = tl.sum(left, axis=0)
            qi = tl.where(rule_q, left / tl.maximum(lsum, 1e-30), at.to(tl.float32))
            qx = tl.sum(tl.where(at, qi, 0.0), axis=0)
            z = outside + tl.sum(r, axis=0)
            live = (accepted == 0) & (stopped == 0)
            take = live & (u * qx * z < tl.sum(tl.where(at, r, 0.0), axis=0))
            chosen = tl.where(take, c, chosen)
            accepted = accepted | take.to(tl.int32)
            rest = tl.maximum(r - qi * z, 0.0)
            fine = outside + tl.sum(rest, axis=0) > 0
            out = live & (take == 0)
            r = tl.where(out & fine, rest, r)
            stopped = stopped | (out & (fine == 0)).to(tl.int32)
            left = tl.where(out & at, 0.0, left)
        count += accepted
        path = tl.where(i == count, chosen, path)
        row = chosen
        going = accepted
    # the bonus at the path's last row: its residual (the target itself when rounding left no mass)
    r = tl.where(outside + tl.sum(r, axis=0) > 0, r, p)
    sid = tl.load(sid_ptr + b * s_sb + row * s_st + w, mask=okw, other=0)
    held = okw & (tl.load(sq_ptr + b * s_qb + row * s_qt + w, mask=okw, other=0.0) > 0)
    logz = tl.load(logz_ptr + b * T + row)
    k_in = tl.where(held & (r > 0), tl.log(tl.where(r > 0, r, 1.0)) + logz + _gumbel(key_token, sid), float("-inf"))
    best_in = tl.max(k_in, axis=0)
    tok_in = tl.sum(tl.where(w == tl.min(tl.where(k_in == best_in, w, BW), axis=0), sid, 0), axis=0)
    theta = float("-inf")
    if THETA:
        theta = tl.load(theta_ptr + b * T + row)
    xr = xb + row.to(tl.int64) * s_xt
    best_out = tl.full([], float("-inf"), tl.float32)
    tok_out = tl.full([], 0, tl.int64)
    for start in range(0, V, BV):
        cols = start + tl.arange(0, BV)
        x = tl.load(xr + cols, mask=cols < V, other=float("-inf")).to(tl.float32)
        in_set = tl.max(((cols[:, None] == sid[None, :]) & held[None, :]).to(tl.int32), axis=1) > 0
        k = tl.where(
            (cols < V) & (in_set == 0) & (x >= theta), x / t + _gumbel(key_token, cols.to(tl.int64)), float("-inf")
        )
        m = tl.max(k, axis=0)
        at = tl.min(tl.where(k == m, cols, V), axis=0).to(tl.int64)
        take = m > best_out
        tok_out = tl.where(take, at, tok_out)
        best_out = tl.where(take, m, best_out)
    bonus = tl.where(best_in > best_out, tok_in, tok_out)
    # the result: tokens along the path, the bonus at `count`, filler as reference.path_result's
    src = tl.where(i <= count, path, i)
    after = tl.sum(tl.where(i[None, :] == (i + 1)[:, None], path[None, :], 0), axis=1)  # [BT] path[k + 1]
    nxt = tl.where(i + 1 <= count, after, i + 1)
    nxt = tl.where(i + 1 < T, nxt, 0)
    tok = tl.where(i == count, bonus, tl.load(ids_ptr + b * s_tb + nxt, mask=ok, other=0))
    tl.store(src_ptr + b * T + i, src.to(tl.int64), mask=ok)
    tl.store(res_ptr + b * (T + 1) + 1 + i, tok, mask=ok)
    tl.store(res_ptr + b * (T + 1), count.to(tl.int64))


def accept_sampled(
    ids: torch.Tensor,
    parent_rows: torch.Tensor,
    anc: torch.Tensor,
    depth: torch.Tensor,
    logits: torch.Tensor,
    sets: sampling.TreeSets,
    target: Target,
    rows: sampling.SamplingRows,
    siblings: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """See sampling.accept_sampled (anc, depth and siblings unused: the walk follows the tree's rows). ids,
    parent_rows, sets.pos [B, T] int64 sharing one row stride (an input block's columns), unit stride on T;
    logits [B, T, V] and sets.ids, sets.q [B, T, W] with unit stride on the last dimension; the [B] inputs
    any stride."""
    b, t, v = logits.shape
    w = sets.ids.shape[-1]
    result = torch.empty((b, t + 1), dtype=torch.int64, device=ids.device)
    src = torch.empty((b, t), dtype=torch.int64, device=ids.device)
    theta = target.logz if target.theta is None else target.theta  # unread without a theta
    _accept_kernel[(b,)](
        ids, parent_rows, sets.pos, ids.stride(0),
        logits, logits.stride(0), logits.stride(1),
        sets.ids, sets.q, sets.ids.stride(0), sets.ids.stride(1), sets.q.stride(0), sets.q.stride(1),
        theta, target.logz,
        rows.temperature, sets.rule, rows.seed, rows.counter,
        rows.temperature.stride(0), sets.rule.stride(0), rows.seed.stride(0), rows.counter.stride(0),
        result, src, t, v, w,
        THETA=target.theta is not None, BT=max(16, triton.next_power_of_2(t)), BW=triton.next_power_of_2(w),
        BV=256, num_warps=4,  # the set test is [BV, W] a block: 64 lanes a thread at W 32
    )  # fmt: skip
    return result, src
