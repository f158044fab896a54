"""Triton kernels of common.kernels.sampling, one launch (three for the acceptance) where PyTorch needs tens:
the random numbers are computed in the kernels (the same int64 arithmetic as sampling.mix32, so the same
bits), and each program keeps its row (or its chunk of one) in registers. Shapes and meaning are the
reference functions'; numerics match them up to the order of float32 sums.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from common.kernels import sampled_layout, sampling
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


# The threshold and normaliser without a sort. Over a row's values x (float32 of the logits' dtype, no NaN):
#   kth   = the largest value v of the row with #{x >= v} >= k (the k-th largest)
#   e(x)  = exp((x - max) / t) for x >= kth, else 0;  M = the sum of e;  S(v) = the sum of e(x) over x >= v
#   theta = the largest value v of the row with S(v) / M >= p = top_p - TOP_P_SLACK (kth when none does)
#   logz  = max / t + log S(theta)
# That is the reference's theta, max(vals[cut], kth), cut = #{i: cumsum(e / M)[i] < p} in descending order
# (clamped to V - 1): vals[cut] is the first value reaching p and S(vals[cut]) >= p (S of a value is the
# cumulative sum at its last tie, at or past the cut), while every larger value's S is a cumulative sum
# before the cut, below p; values under kth add nothing (S there is S(kth)), so the largest passing value is
# at least kth; when no position reaches p the clamp gives max(the row's smallest, kth) = kth. Ties all pass
# or all fail: x >= theta keeps them all. Here the sums run lane by lane and then as a tree, not in sorted
# order, so the float32 rounding of S / M and of the reference's cumulative sum can differ: theta can differ
# only at a boundary, where a value's S / M lies within that rounding of p (seen with a top_p near 1, whose
# cut falls among the tail's tiny masses).
#
# Both cuts are the largest key whose value passes a test non-increasing in v (#{x >= v} >= k; S(v) / M >= p):
# an interval search over the dtype's monotone integer key (_key: 2^16 keys for bfloat16 and float16, 2^32
# for float32), [lo, hi] with lo known to pass and hi + 1 to fail. A pass over the row tests NB keys spread
# over the interval (NB sums a lane) and keeps the part between the last passing and the first failing: at
# most ceil(log_{NB+1}(hi - lo + 1)) passes. A row's passes, each reading its V values once: the max, the min
# and the unfiltered M; top-k: the count search over [min, max], then M; top-p: the mass search over [kth,
# max], its lo raised by a tail bound (below). bfloat16 rows of randn * 3, V 49,152, t 0.7, NB 2: filters
# off 1 pass; top-p 0.9 6 (11 without the tail bound); top-k 50 12; both 16.
@triton.jit
def _key(x, DT: tl.constexpr, BITS: tl.constexpr):
    """The monotone unsigned key (int64) of float32 values exactly representable in DT (BITS wide): the bits
    with the sign flipped, every bit for negatives; -0.0 sits just below +0.0. Other values are rounded."""
    bits = x.to(DT).to(tl.int16, bitcast=True) if BITS == 16 else x.to(tl.int32, bitcast=True)
    bits = bits.to(tl.int64)
    half = tl.full([], 1 << (BITS - 1), tl.int64)
    return tl.where(bits >= 0, bits, bits ^ (half - 1)) + half


@triton.jit
def _value(key, DT: tl.constexpr, BITS: tl.constexpr):
    """_key's inverse as float32. The keys of NaN bit patterns: below -inf's give -inf (every value passes
    what -inf does), above +inf's stay NaN (no value is >= NaN, as none is above such a key)."""
    half = tl.full([], 1 << (BITS - 1), tl.int64)
    s = key - half
    bits = tl.where(s >= 0, s, s ^ (half - 1))
    if BITS == 16:
        v = bits.to(tl.int16).to(DT, bitcast=True).to(tl.float32)
    else:
        v = bits.to(tl.int32).to(tl.float32, bitcast=True)
    return tl.where((v != v) & (key < half), float("-inf"), v)


@triton.jit
def _sums(base, V, v, a, top, MASS: tl.constexpr, BLOCK: tl.constexpr):
    """One pass over the row: for each threshold of v [N], the count (MASS false) or the sum of
    exp2((x - top) * a) of the row's values x >= it. [N] float32 (counts exact below 2^24)."""
    acc = tl.zeros([v.shape[0], BLOCK], tl.float32)
    for start in range(0, V, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        x = tl.load(base + cols, mask=cols < V, other=float("nan")).to(tl.float32)  # NaN: passes nothing
        ge = x[None, :] >= v[:, None]
        if MASS:
            acc += tl.where(ge, tl.exp2((x - top) * a)[None, :], 0.0)
        else:
            acc += ge.to(tl.float32)
    return tl.sum(acc, axis=1)


@triton.jit
def _search(
    base, V, lo, hi, need, norm, known, a, top,
    DT: tl.constexpr, BITS: tl.constexpr, MASS: tl.constexpr, NB: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    """The largest key in [lo, hi] whose value v has _sums(v) / norm >= need, given that lo's does (its sum:
    known) and hi + 1's does not. Returns (that key, its sum: known when it is lo)."""
    j = (tl.arange(0, NB) + 1).to(tl.int64)
    while lo < hi:
        step = (hi - lo + NB) // (NB + 1)
        c = tl.minimum(lo + j * step, hi)  # [NB] ascending keys in (lo, hi]
        f = _sums(base, V, _value(c, DT, BITS), a, top, MASS, BLOCK)  # non-increasing along c
        ok = f / norm >= need  # a prefix: sums over nested sets in one order round monotonically
        at = tl.max(tl.where(ok, c, lo), axis=0)
        known = tl.where(at > lo, tl.min(tl.where(ok, f, float("inf")), axis=0), known)
        hi = tl.min(tl.where(ok, hi, c - 1), axis=0)
        lo = at
    return lo, known


@triton.jit(do_not_specialize=["V", "PER", "s_x", "s_t", "s_k", "s_p"])
def _threshold_kernel(
    x_ptr, temp_ptr, topk_ptr, topp_ptr, theta_ptr, logz_ptr, V, PER, s_x, s_t, s_k, s_p,
    BITS: tl.constexpr, NB: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0)
    seq = row // PER
    DT: tl.constexpr = x_ptr.dtype.element_ty
    temp = tl.load(temp_ptr + seq * s_t)
    t = tl.where(temp > 0, temp, 1.0)
    a = 1.4426950408889634 / t  # exp((x - max) / t) = exp2((x - max) * a)
    k = tl.minimum(tl.maximum(tl.load(topk_ptr + seq * s_k), 1), V)
    top_p = tl.load(topp_ptr + seq * s_p)
    base = x_ptr + row.to(tl.int64) * s_x
    # the first pass, lane by lane: the max, the min, the unfiltered mass (rescaled as the lane's max grows)
    mv = tl.full([BLOCK], float("-inf"), tl.float32)
    lv = tl.full([BLOCK], float("inf"), tl.float32)
    sv = tl.zeros([BLOCK], tl.float32)
    for start in range(0, V, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        x = tl.load(base + cols, mask=cols < V, other=float("-inf")).to(tl.float32)
        m = tl.maximum(mv, x)
        r = tl.where(m > float("-inf"), m, 0.0)  # finite while the lane has seen only -inf
        sv = sv * tl.exp2((mv - r) * a) + tl.exp2((x - r) * a)
        mv = m
        lv = tl.minimum(lv, tl.where(cols < V, x, float("inf")))
    top = tl.max(mv, axis=0)
    hi = _key(top, DT, BITS)  # both searches' hi: nothing is above the max
    kth = tl.min(lv, axis=0)
    mass = tl.sum(sv * tl.exp2((mv - top) * a), axis=0)  # M, the kept mass: every token so far
    if k < V:
        key, _ = _search(base, V, _key(kth, DT, BITS), hi, k.to(tl.float32), 1.0, mass, a, top,
                         DT, BITS, False, NB, BLOCK)  # fmt: skip
        kth = _value(key, DT, BITS)
        mass = tl.sum(_sums(base, V, tl.full([1], 0.0, tl.float32) + kth, a, top, True, BLOCK), axis=0)
    theta = kth
    if top_p <= 1.0:  # above 1: off (SamplingRows packs 2)
        p = top_p - TOP_P_SLACK
        lo = _key(kth, DT, BITS)  # S(kth) / M = 1 >= p
        if p <= 0.999:
            # The tail bound: the values at or below L = max + log2((1 - p) M / (2 V)) / a < max, fewer than
            # V, each e <= (1 - p) M / (2 V), hold less than (1 - p) M / 2, so the smallest value above L has
            # S / M > p + (1 - p) / 2: a margin of 5e-4 or more over p, far above the sums' float32 rounding.
            # lo: L's key rounded down; the answer lies above it, so the search finds its S.
            lo = tl.maximum(lo, _key(top + tl.log2((1.0 - p) * mass / (2.0 * V)) / a, DT, BITS) - 1)
        key, mass = _search(base, V, lo, hi, p, mass, mass, a, top, DT, BITS, True, NB, BLOCK)
        theta = _value(key, DT, BITS)
    tl.store(theta_ptr + row, theta)
    tl.store(logz_ptr + row, top / t + tl.log(mass))


def target_threshold(logits: torch.Tensor, rows: sampling.SamplingRows, per: int = 1) -> Target:
    """See sampling.target_threshold: no sort, one program per row (the searches above). logits [R, V] in a
    16- or 32-bit float dtype (copied when V's stride is not 1); the rows' columns any stride."""
    if logits.stride(-1) != 1:
        logits = logits.contiguous()
    r, v = logits.shape
    theta = torch.empty(r, dtype=torch.float32, device=logits.device)
    logz = torch.empty(r, dtype=torch.float32, device=logits.device)
    # BLOCK 4096 over 16 warps: 8 values a thread a step (one 16-byte load of a 16-bit dtype), 12 steps a pass
    # at V 49,152; NB 2 on a GPU (two sums a lane, a third of the interval a pass: 11 passes at most over 2^16
    # keys). On an H200 (graph replays of 1 to 976 rows), against BLOCK 2048 / 8 warps, 4096 / 8, 8192 / 16
    # and NB 1, 4, 8, these were the fastest or within 5% with top-p, top-k or both (12% with no filter).
    # Triton's interpreter (CPU tests) pays per operation, not per value: NB 16 there, for fewer passes.
    _threshold_kernel[(r,)](
        logits, rows.temperature, rows.top_k, rows.top_p, theta, logz, v, per, logits.stride(0),
        rows.temperature.stride(0), rows.top_k.stride(0), rows.top_p.stride(0),
        BITS=8 * logits.element_size(), NB=2 if logits.is_cuda else 16, BLOCK=min(4096, triton.next_power_of_2(v)),
        num_warps=16,
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
# three launches. _walk_kernel, one program (one warp) per tree, walks from the root as the host rule does:
# at each row its children in sibling order (the set's residual in registers), the accepted child's row
# next; it writes the result's count and path tokens, src, and for the bonus the path's last row and the
# best key of its set's residual (and that token). _out_kernel, (tree, chunk of BONUS_CHUNK columns)
# programs, draws over the last row's logits with the set's tokens left out: each chunk's best key and its
# first column. _bonus_kernel, one program per tree, takes the chunks' best (the largest key, then the
# smallest column: the first maximum of one pass) against the set's, and writes the bonus.
@triton.jit(do_not_specialize=["T", "W", "s_tb", "s_xb", "s_xt", "s_sb", "s_st", "s_qb", "s_qt"])
def _walk_kernel(
    ids_ptr, par_ptr, pos_ptr, s_tb,
    x_ptr, s_xb, s_xt,
    sid_ptr, sq_ptr, s_sb, s_st, s_qb, s_qt,
    theta_ptr, logz_ptr,
    temp_ptr, rule_ptr, seed_ptr, counter_ptr, s_t, s_r, s_s, s_c,
    res_ptr, src_ptr, last_ptr, best_ptr,
    T, W,
    THETA: tl.constexpr, BT: tl.constexpr, BW: tl.constexpr,
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
    after = tl.zeros([BT], dtype=tl.int32)  # after[k]: path[k + 1] (k < count)
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
        after = tl.where(i + 1 == count, chosen, after)  # unchanged unless accepted (then path[count])
        row = chosen
        going = accepted
    # the bonus's part at the path's last row's set: its residual (the target itself when rounding left no
    # mass), keys log r + logz + the tokens' noise (units of the off-set keys, logit / T + noise)
    r = tl.where(outside + tl.sum(r, axis=0) > 0, r, p)
    sid = tl.load(sid_ptr + b * s_sb + row * s_st + w, mask=okw, other=0)
    held = okw & (tl.load(sq_ptr + b * s_qb + row * s_qt + w, mask=okw, other=0.0) > 0)
    logz = tl.load(logz_ptr + b * T + row)
    k_in = tl.where(held & (r > 0), tl.log(tl.where(r > 0, r, 1.0)) + logz + _gumbel(key_token, sid), float("-inf"))
    best_in = tl.max(k_in, axis=0)
    tok_in = tl.sum(tl.where(w == tl.min(tl.where(k_in == best_in, w, BW), axis=0), sid, 0), axis=0)
    tl.store(last_ptr + 2 * b, row.to(tl.int64))
    tl.store(last_ptr + 2 * b + 1, tok_in)
    tl.store(best_ptr + b, best_in)
    # the result: tokens along the path, filler as reference.path_result's; the bonus at `count` comes later
    src = tl.where(i <= count, path, i)
    nxt = tl.where(i + 1 <= count, after, i + 1)
    nxt = tl.where(i + 1 < T, nxt, 0)
    tok = tl.load(ids_ptr + b * s_tb + nxt, mask=ok, other=0)
    tl.store(src_ptr + b * T + i, src.to(tl.int64), mask=ok)
    tl.store(res_ptr + b * (T + 1) + 1 + i, tok, mask=ok & (i != count))
    tl.store(res_ptr + b * (T + 1), count.to(tl.int64))


@triton.jit(do_not_specialize=["T", "V", "W", "s_xb", "s_xt", "s_sb", "s_st", "s_qb", "s_qt", "s_t", "s_s", "s_c"])
def _out_kernel(
    x_ptr, s_xb, s_xt,
    sid_ptr, sq_ptr, s_sb, s_st, s_qb, s_qt,
    theta_ptr, temp_ptr, seed_ptr, counter_ptr, s_t, s_s, s_c,
    last_ptr, key_ptr, col_ptr,
    T, V, W,
    THETA: tl.constexpr, BW: tl.constexpr, CHUNK: tl.constexpr,
):  # fmt: skip
    b = tl.program_id(0)
    c = tl.program_id(1)
    row = tl.load(last_ptr + 2 * b)  # int64
    temp = tl.load(temp_ptr + b * s_t)
    t = tl.where(temp > 0, temp, 1.0)
    key_token = _row_key(tl.load(seed_ptr + b * s_s), tl.load(counter_ptr + b * s_c), TOKEN)
    theta = float("-inf")
    if THETA:
        theta = tl.load(theta_ptr + b * T + row)
    cols = c * CHUNK + tl.arange(0, CHUNK)
    ok = cols < V
    x = tl.load(x_ptr + b.to(tl.int64) * s_xb + row * s_xt + cols, mask=ok, other=float("-inf")).to(tl.float32)
    # the set's tokens (q > 0) left out: one scalar test a set entry, no [CHUNK, W] broadcast
    in_set = cols < 0
    for j in tl.static_range(BW):
        sj = tl.load(sid_ptr + b * s_sb + row * s_st + j, mask=j < W, other=-1)
        qj = tl.load(sq_ptr + b * s_qb + row * s_qt + j, mask=j < W, other=0.0)
        in_set = in_set | (cols == tl.where((qj > 0) & (sj >= 0) & (sj < V), sj, -1).to(tl.int32))
    k = tl.where(ok & (in_set == 0) & (x >= theta), x / t + _gumbel(key_token, cols.to(tl.int64)), float("-inf"))
    m = tl.max(k, axis=0)
    # the chunk's first maximum (chunk 0's column 0 when every key is -inf: the one pass's token then)
    at = tl.min(tl.where(k == m, cols, V), axis=0)
    nc = tl.num_programs(1)
    tl.store(key_ptr + b * nc + c, m)
    tl.store(col_ptr + b * nc + c, at)


@triton.jit(do_not_specialize=["T", "NC"])
def _bonus_kernel(res_ptr, last_ptr, best_ptr, key_ptr, col_ptr, T, NC, BNC: tl.constexpr):
    b = tl.program_id(0)
    j = tl.arange(0, BNC)
    k = tl.load(key_ptr + b * NC + j, mask=j < NC, other=float("-inf"))
    best_out = tl.max(k, axis=0)
    col = tl.load(col_ptr + b * NC + j, mask=j < NC, other=0)
    tok_out = tl.min(tl.where((j < NC) & (k == best_out), col, 2147483647), axis=0).to(tl.int64)
    bonus = tl.where(tl.load(best_ptr + b) > best_out, tl.load(last_ptr + 2 * b + 1), tok_out)
    count = tl.load(res_ptr + b * (T + 1))
    tl.store(res_ptr + b * (T + 1) + 1 + count, bonus)


# Columns a program of _out_kernel: at V 49,152, 24 chunks a tree (B 1 keeps 24 SMs busy, B 16 384 programs),
# each 8 warps with 8 columns a thread (one 16-byte load of bfloat16 logits), its W set tests per column
# and one reduction. Smaller chunks spread B 1 wider but repeat each program's fixed work (the row key, W set
# loads); not yet timed against 1024 or 4096 on a GPU.
BONUS_CHUNK = 2048


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
    any stride. Three launches, fixed shapes (CUDA graphs)."""
    b, t, v = logits.shape
    w = sets.ids.shape[-1]
    dev = ids.device
    if not sampled_layout(ids, parent_rows, logits, sets):  # the walk reads ids, parents and positions at one stride
        raise ValueError(
            f"ids, parent_rows and sets.pos need one row stride (got {ids.stride(0)}, {parent_rows.stride(0)}, "
            f"{sets.pos.stride(0)}) and unit strides along the last dimensions"
        )
    chunk = min(BONUS_CHUNK, triton.next_power_of_2(v))
    nc = triton.cdiv(v, chunk)
    result = torch.empty((b, t + 1), dtype=torch.int64, device=dev)
    src = torch.empty((b, t), dtype=torch.int64, device=dev)
    last = torch.empty((b, 2), dtype=torch.int64, device=dev)  # the path's last row, the set's best token
    best_in = torch.empty(b, dtype=torch.float32, device=dev)  # the set's best key
    key = torch.empty((b, nc), dtype=torch.float32, device=dev)  # each chunk's best key off the set
    col = torch.empty((b, nc), dtype=torch.int32, device=dev)  # and its column
    theta = target.logz if target.theta is None else target.theta  # unread without a theta
    bw = triton.next_power_of_2(w)
    _walk_kernel[(b,)](
        ids, parent_rows, sets.pos, ids.stride(0),
        logits, logits.stride(0), logits.stride(1),
        sets.ids, sets.q, sets.ids.stride(0), sets.ids.stride(1), sets.q.stride(0), sets.q.stride(1),
        theta, target.logz,
        rows.temperature, sets.rule, rows.seed, rows.counter,
        rows.temperature.stride(0), sets.rule.stride(0), rows.seed.stride(0), rows.counter.stride(0),
        result, src, last, best_in, t, w,
        THETA=target.theta is not None, BT=max(16, triton.next_power_of_2(t)), BW=bw,
        num_warps=1,  # a few rows of [T] and [W] vectors: warp shuffles, no shared-memory reductions
    )  # fmt: skip
    _out_kernel[(b, nc)](
        logits, logits.stride(0), logits.stride(1),
        sets.ids, sets.q, sets.ids.stride(0), sets.ids.stride(1), sets.q.stride(0), sets.q.stride(1),
        theta, rows.temperature, rows.seed, rows.counter,
        rows.temperature.stride(0), rows.seed.stride(0), rows.counter.stride(0),
        last, key, col, t, v, w,
        THETA=target.theta is not None, BW=bw, CHUNK=chunk, num_warps=max(1, min(8, chunk // 256)),
    )  # fmt: skip
    _bonus_kernel[(b,)](result, last, best_in, key, col, t, nc, BNC=max(2, triton.next_power_of_2(nc)), num_warps=1)
    return result, src
