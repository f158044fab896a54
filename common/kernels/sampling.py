"""Sampling on the device in plain PyTorch: the counter-based random numbers every engine draws with, a
batch's target distributions (temperature, top-k, top-p), Gumbel-max token draws, the draft's children
draws and the sampled tree acceptance. The CPU path and the oracle of the Triton twins
(common/kernels/triton_sampling.py); common.kernels picks the path, as for the model's operations.

Random numbers are a pure function of integers: (seed, counter, stream, index) -> 32 hashed bits, with
Chris Wellons' hash-prospector mixer 16-21f0aaad-15-735a2d97-15, in int64 arithmetic that never overflows
(values below 2^32 times constants below 2^31): CPU, CUDA and Triton give the same bits, a CUDA graph
replays them with new counters from its input block, and a sequence's draws do not depend on its batch.
  seed     a sequence's own (common.sampling.sequence_seed), in [0, 2^63)
  counter  the position the call's draws hang off: the prefill's last prompt token, a decode step's or a
           verify's root (every call of a sequence starts at a new one, so no draw is ever reused)
  stream   TOKEN: the Gumbel noise of a token drawn over the vocabulary (index: the token id);
           ACCEPT: a tree node's acceptance test (index: its tree row); DRAFT: the draft's children draws
           (index: (level * K + node) * W + rank, common.engine.draft)

Rows and sequences: a verify has T rows per sequence (its tree's); the per-sequence inputs (SamplingRows)
are read at row // per (per = T), never expanded on the device.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from common.config import SamplingConfig
from common.kernels.reference import follow_path, path_result
from common.sampling import TOP_P_SLACK

M32 = 0xFFFFFFFF
MIX_A, MIX_B = 0x21F0AAAD, 0x735A2D97  # both below 2^31: x * c < 2^63 for x < 2^32
TOKEN, ACCEPT, DRAFT = 0x243F6A88, 0x05A308D3, 0x13198A2E  # stream salts (pi's hex digits, below 2^31)
LOG_Q_FLOOR = -60.0  # a draft log q below this counts as outside q: its probability could round to 0 on the wire
RULE_GREEDY, RULE_ONEHOT, RULE_Q = 0, 1, 2  # a sequence's acceptance in a verify with sampling rows


def mix32(x: torch.Tensor) -> torch.Tensor:
    """A bijection of [0, 2^32) onto itself with full avalanche; x int64."""
    x = x ^ (x >> 16)
    x = (x * MIX_A) & M32
    x = x ^ (x >> 15)
    x = (x * MIX_B) & M32
    return x ^ (x >> 15)


def row_key(seed: torch.Tensor, counter: torch.Tensor, stream: int) -> torch.Tensor:
    """The per-row part of the hash: seed, counter [R] int64 -> key [R] in [0, 2^32)."""
    k = mix32((seed & M32) ^ stream)
    k = mix32(k ^ (seed >> 32))
    return mix32(k ^ (counter & M32))


def uniform(key: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """Uniform (0, 1) float32 of each (key, index), broadcast: 23 of the hash's bits b, (b + 0.5) / 2^23, exact
    in float32 (b + 0.5 < 2^23 has a half; 24 bits would round the largest to 1.0: an infinite Gumbel key)."""
    bits = mix32(key ^ mix32(index & M32))
    return ((bits >> 9).float() + 0.5) * 2.0**-23


def gumbel(key: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """Gumbel(0, 1) noise -log(-log(u)) of uniform(key, index)."""
    return -torch.log(-torch.log(uniform(key, index)))


@dataclass(frozen=True)
class SamplingRows:
    """How each sequence of a batch draws, on the device: unpacked from the three int64 columns an engine's
    input block carries per sequence (pack writes them on the host)."""

    temperature: torch.Tensor  # [B] float32; 0: greedy (its token is the caller's argmax)
    top_k: torch.Tensor  # [B] int64 in [1, V]; V keeps every token
    top_p: torch.Tensor  # [B] float32; above 1 keeps every token
    seed: torch.Tensor  # [B] int64 in [0, 2^63)
    counter: torch.Tensor  # [B] int64: the position the sequence's draws hang off

    COLUMNS = 3  # seed, top_k, then temperature and top_p as a float32 pair

    @staticmethod
    def pack(cfg: SamplingConfig, seed: int, vocab: int) -> np.ndarray:
        """One sequence's columns [3] int64 on the host (top_k 0 and top_p 1, off, become V and 2)."""
        out = np.empty(3, dtype=np.int64)
        out[0] = seed
        out[1] = cfg.top_k if 0 < cfg.top_k < vocab else vocab
        out[2:3] = np.array([cfg.temperature, cfg.top_p if cfg.top_p < 1 else 2.0], dtype=np.float32).view(np.int64)
        return out

    @classmethod
    def unpack(cls, cols: torch.Tensor, counter: torch.Tensor) -> SamplingRows:
        """cols [B, 3] int64 (any row stride, unit column stride) as pack wrote them; counter [B]. Views only:
        no copy on the device."""
        floats = cols[:, 2:3].view(torch.float32)  # [B, 2]
        return cls(temperature=floats[:, 0], top_k=cols[:, 1], top_p=floats[:, 1], seed=cols[:, 0], counter=counter)

    def repeat(self, n: int) -> SamplingRows:
        """Each sequence's n times (the rows of a batch's trees: row b * n + t is tree b's row t)."""
        fields = (self.temperature, self.top_k, self.top_p, self.seed, self.counter)
        return SamplingRows(*(x.repeat_interleave(n) for x in fields))

    def safe_temperature(self) -> torch.Tensor:
        """[B] the temperature, 1 on greedy rows (whose draw is not used): no division by zero."""
        return torch.where(self.temperature > 0, self.temperature, 1.0)


@dataclass(frozen=True)
class Target:
    """Each row's target distribution p(v) = exp(logit_v / T - logz) for logit_v >= theta, else 0."""

    theta: torch.Tensor | None  # [R] float32: the smallest kept logit (None: every token, no filter)
    logz: torch.Tensor  # [R] float32: the log-normaliser of the kept tokens' exp(logit / T)


def target_threshold(logits: torch.Tensor, rows: SamplingRows, per: int = 1) -> Target:
    """Temperature, then top-k, then top-p (vLLM's order, common.sampling.target_distribution): logits [R, V],
    row r of sequence r // per. Both filters keep every token tied with the last one kept, so each keeps the
    tokens at or above a logit: top-k the k-th largest, top-p the first in descending order where the
    cumulative probability (after top-k) reaches top_p. One sort of each row.
    Example: logits [2, 1, 1, 0] at T 1, top_p 0.7: p [.48, .18, .18, .07 ...] sorted, cumulative .48, .66,
    .84 -> the cut is the third (the first reaching .7), a 1: theta 1, both 1s kept (ties)."""
    each = rows.repeat(per) if per > 1 else rows
    v = logits.shape[-1]
    vals = logits.sort(dim=-1, descending=True).values.float()  # [R, V]
    kth = vals.gather(1, (each.top_k - 1).clamp(0, v - 1)[:, None])  # [R, 1]
    z = (vals / each.safe_temperature()[:, None]).masked_fill(vals < kth, -torch.inf)
    cum = torch.softmax(z, dim=-1).cumsum(dim=-1)
    cut = (cum < each.top_p[:, None] - TOP_P_SLACK).sum(-1, keepdim=True).clamp(max=v - 1)  # [R, 1]
    theta = torch.maximum(vals.gather(1, cut), kth)  # [R, 1]
    logz = torch.logsumexp(z.masked_fill(vals < theta, -torch.inf), dim=-1)
    return Target(theta=theta[:, 0], logz=logz)


def row_logz(logits: torch.Tensor, temperature: torch.Tensor, per: int = 1) -> torch.Tensor:
    """logits [R, V], temperature [R // per] (> 0) -> [R] float32 logsumexp(logits / T): the unfiltered
    normaliser."""
    t = torch.where(temperature > 0, temperature, 1.0).repeat_interleave(per)
    return torch.logsumexp(logits.float() / t[:, None], dim=-1)


def sample_tokens(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    theta: torch.Tensor | None,
    seed: torch.Tensor,
    counter: torch.Tensor,
    index: torch.Tensor | None = None,
    greedy: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """A token of each row drawn from its target (Gumbel-max: the argmax of logit / T + Gumbel noise over the
    tokens kept, logit >= theta). logits [R, V] (-inf: excluded); temperature [R] (0: greedy, see greedy);
    theta [R] or None (every token); seed, counter [R]; index [R, V] int64: the token id of each column
    (None: the column itself, a whole vocabulary); greedy [R]: the token of rows whose temperature is 0.
    Returns (column [R] int64, its key [R] float32: the winning logit / T + noise, -inf when nothing is
    kept), the noise of token v being gumbel(row_key(seed, counter, TOKEN), v): draws over disjoint parts
    of one vocabulary with the same row key are one Gumbel-max draw over their union."""
    v = logits.shape[-1]
    x = logits.float()
    t = torch.where(temperature > 0, temperature, 1.0)
    tokens = torch.arange(v, device=logits.device)[None, :] if index is None else index
    keys = x / t[:, None] + gumbel(row_key(seed, counter, TOKEN)[:, None], tokens)
    if theta is not None:
        keys = torch.where(x >= theta[:, None], keys, -torch.inf)
    best, column = keys.max(dim=-1)
    if greedy is not None:
        column = torch.where(temperature > 0, column, greedy)
    return column, best


def draft_children(
    logp: torch.Tensor,
    ids: torch.Tensor,
    temperature: torch.Tensor,
    seed: torch.Tensor,
    counter: torch.Tensor,
    level: int,
    k: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The K children of F expanded nodes of a batch with sampling rows (common.engine.draft._children gives
    the rule and why it is lossless). logp, ids [B, F, W]: each node's W best draft tokens, descending;
    temperature [B] (0: a top-k row); seed, counter [B] the draft's; level: the nodes' level (0: the root).
    Node f's noise at rank w: gumbel(row_key(seed, counter, DRAFT), (level * K + f) * W + w).
    Returns ids, score, logq [B, F, K] and q [B, F, W] (probabilities over the W): sampled rows draw K
    without replacement from q = softmax(logp / T) cut at LOG_Q_FLOOR (Gumbel-top-K, ties to the lower rank),
    scored by rank (-inf past q's support), logq the drawn tokens'; top-k rows keep the K best."""
    b, f, w = logp.shape
    drawn = (temperature > 0)[:, None, None]  # [B, 1, 1]
    lq = torch.log_softmax(logp / torch.where(drawn, temperature[:, None, None], 1.0), dim=-1)  # descending
    lq = torch.where((lq > LOG_Q_FLOOR) | ~drawn, lq, -torch.inf)  # a prefix of ranks
    lq = lq - torch.logsumexp(lq, dim=-1, keepdim=True)
    rank = torch.arange(w, device=logp.device)
    index = (level * k + torch.arange(f, device=logp.device))[:, None] * w + rank[None, :]  # [F, W]
    noise = gumbel(row_key(seed, counter, DRAFT)[:, None, None], index[None])  # [B, F, W]
    order = torch.sort(lq + noise, dim=-1, descending=True, stable=True).indices[..., :k]  # sampling order
    pick = torch.where(drawn, order, rank[:k].expand(b, f, k))
    score = torch.where(drawn & (lq[..., :k] == -torch.inf), -torch.inf, logp[..., :k])
    logq = torch.where(drawn, lq.gather(-1, pick), logp[..., :k])
    return ids.gather(-1, pick), score, logq, lq.exp()


# ---- The sampled tree acceptance -------------------------------------------------------------------------
@dataclass(frozen=True)
class TreeSets:
    """What the sampled acceptance tracks at each tree row: a set of tokens (common.tree.row_sets packs them):
    a q rule row's the draft's q (its ids and probabilities), a one-hot row's its children's distinct tokens.
    The target's mass at the set is followed token by token; off the set it only rescales."""

    ids: torch.Tensor  # [B, T, W] int64 the set's tokens (entries past it: anything, q 0)
    q: torch.Tensor  # [B, T, W] float32: q rule rows the draft's q; one-hot rows 1; 0: not in the set
    pos: torch.Tensor  # [B, T] int64: node row i's position in its parent row's set (0 for the root, padding)
    rule: torch.Tensor  # [B] int64: RULE_Q the q rule, else one-hot


def children_table(parent_rows: torch.Tensor, s: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's children in sibling (row) order: parent_rows [B, T] (the root and padding rows name
    themselves) -> child [B, T, S] (their rows; past a row's count: 0) and count [B, T] (at most S).
    Example: parent_rows [0, 0, 0, 1] (root r, nodes a b under r, c under a), S 2 -> child [[1, 2], [3, 0],
    [0, 0], [0, 0]], count [2, 1, 0, 0]."""
    b, t = parent_rows.shape
    rows = torch.arange(t, device=parent_rows.device)
    node = parent_rows != rows[None, :]  # [B, T]
    earlier = (parent_rows[:, :, None] == parent_rows[:, None, :]) & (rows[None, :] < rows[:, None])[None]
    rank = (earlier & node[:, None, :]).sum(-1)  # [B, T] earlier siblings
    count = torch.zeros_like(parent_rows).scatter_add_(1, parent_rows, node.long())
    base = torch.arange(b, device=parent_rows.device)[:, None] * (t * s)  # [B, 1] each tree's cells
    cell = torch.where(node & (rank < s), base + parent_rows * s + rank, b * t * s)  # [B, T]; b T S: a spare one
    child = torch.zeros(b * t * s + 1, dtype=parent_rows.dtype, device=parent_rows.device)
    child = child.scatter(0, cell.view(-1), rows.repeat(b))[: b * t * s].view(b, t, s)
    return child, count.clamp(max=s)


@dataclass(frozen=True)
class Walk:
    """sibling_walk's outputs, per tree row."""

    accepted: torch.Tensor  # [R] bool: a child was accepted
    rank: torch.Tensor  # [R] int64: its rank among the row's children (where accepted)
    residual: torch.Tensor  # [R, W] float32: the set's residual mass where none was (the bonus draws from it)


def sibling_walk(
    p: torch.Tensor,
    outside: torch.Tensor,
    q: torch.Tensor,
    child: torch.Tensor,
    pos: torch.Tensor,
    count: torch.Tensor,
    rule_q: torch.Tensor,
    seed: torch.Tensor,
    counter: torch.Tensor,
) -> Walk:
    """The sampled acceptance at every tree row at once: each row's children in sibling order, as if the walk
    had reached it (a walk reaches a row at most once, and each row's tests have their own random numbers,
    so deciding every row up front and following the accepted children afterwards is the walk).

    p [R, W] the row's target at its set's tokens (0 outside the set); outside [R] the target's mass off the
    set; q [R, W] the draft's q at the set (q rule rows); child [R, S] the children's tree rows in sibling
    order; pos [R, S] each child's position in the set; count [R] children (ranks >= count are padding);
    rule_q [R] bool (else one-hot); seed, counter [R].
    The residual r (in units of p, off-set mass `outside` untouched) and its mass Z = outside + sum(r):
    child i with token x at pos j is accepted when u * q_i(x) * Z < r_j (u = uniform(row_key(seed, counter,
    ACCEPT), child row)), i.e. with probability min(1, p'(x) / q_i(x)) for the normalised residual p';
    q rule: q_i = q without the earlier children, renormalised; one-hot: q_i is the point mass at x.
    On rejection r <- max(r - q_i Z, 0) (common.acceptance.accept_sampled_q: normalize(max(p' - q_i, 0))),
    and the next child is tried; a rejection leaving no mass (rounding: it had probability 0) ends the row
    with r as it was. Example (one-hot, p at the set [.5, .3], outside .2, u .9 then .5): child 0: .9 * 1 *
    1 >= .5, rejected, r [0, .3], Z .5; child 1: .5 * .5 < .3, accepted at rank 1."""
    r = p.clone()
    left = q.clone()
    width = torch.arange(p.shape[1], device=p.device)
    key = row_key(seed, counter, ACCEPT)  # [R]
    accepted = torch.zeros_like(outside, dtype=torch.bool)
    stopped = torch.zeros_like(accepted)
    rank = torch.zeros_like(count)
    for i in range(child.shape[1]):
        at = width[None, :] == pos[:, i : i + 1]  # [R, W] the child's entry
        u = uniform(key, child[:, i])
        lsum = left.sum(-1)
        qi = torch.where(rule_q[:, None], left / lsum.clamp(min=1e-30)[:, None], at.float())  # [R, W]
        qx = (qi * at).sum(-1)
        z = outside + r.sum(-1)
        live = (i < count) & ~accepted & ~stopped
        take = live & (u * qx * z < (r * at).sum(-1))
        rank = torch.where(take, i, rank)
        accepted = accepted | take
        rest = (r - qi * z[:, None]).clamp(min=0)
        ok = outside + rest.sum(-1) > 0
        out = live & ~take
        r = torch.where((out & ok)[:, None], rest, r)
        stopped = stopped | (out & ~ok)
        left = torch.where(out[:, None] & at, 0.0, left)
    return Walk(accepted=accepted, rank=rank, residual=r)


def accept_sampled(
    ids: torch.Tensor,
    parent_rows: torch.Tensor,
    anc: torch.Tensor,
    depth: torch.Tensor,
    logits: torch.Tensor,
    sets: TreeSets,
    target: Target,
    rows: SamplingRows,
    siblings: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Lossless acceptance of a batch of sampled trees (common.acceptance.accept_sampled and accept_sampled_q,
    the host rules this follows decision for decision). ids, parent_rows, depth [B, T] and anc [B, T, T] as
    reference.accept_tree takes them; logits [B, T, V] the base model's at every row; target [B * T] each
    row's (target_threshold or row_logz); rows [B] (counter: the root's position n); siblings: S, at least
    every row's children.
    Every row decides as if the walk reached it (sibling_walk), the path follows the accepted children from
    the root (reference.follow_path), and the bonus is drawn at the path's last row from its residual:
    Gumbel-max over the vocabulary without the row's set, and over the set's residual mass with the same
    tokens' noise (one draw over their union). Returns reference.accept_tree's (result [B, T + 1],
    src [B, T]) for every row, as if every row sampled."""
    b, t, v = logits.shape
    w = sets.ids.shape[-1]
    temp = rows.safe_temperature()[:, None]  # [B, 1]
    theta = None if target.theta is None else target.theta.view(b, t)
    logz = target.logz.view(b, t)
    x = logits.gather(2, sets.ids).float()  # [B, T, W]
    member = sets.q > 0
    keep = member if theta is None else member & (x >= theta[..., None])
    p = torch.where(keep, torch.exp(x / temp[..., None] - logz[..., None]), 0.0)
    outside = (1 - p.sum(-1)).clamp(min=0)  # [B, T] the target's mass off the set
    s = siblings
    child, count = children_table(parent_rows, s)  # [B, T, S], [B, T]
    pos = sets.pos.gather(1, child.view(b, -1)).view(b, t, s)
    each = rows.repeat(t)
    walk = sibling_walk(
        p.view(b * t, w),
        outside.view(-1),
        sets.q.reshape(b * t, w),
        child.view(b * t, s),
        pos.view(b * t, s),
        count.view(-1),
        (sets.rule == RULE_Q).repeat_interleave(t),
        each.seed,
        each.counter,
    )
    accepted = walk.accepted.view(b, t)
    chosen = child.view(b * t, s).gather(1, walk.rank[:, None]).view(b, t)  # [B, T] where accepted
    node_rows = torch.arange(t, device=ids.device)[None, :]
    right = (parent_rows != node_rows) & accepted.gather(1, parent_rows) & (chosen.gather(1, parent_rows) == node_rows)
    path = follow_path(right | (node_rows == 0), anc, depth)
    # the bonus at the path's last row e: its residual r over the set (where every child was rejected), or the
    # target itself when rounding left no mass
    at = torch.arange(b, device=ids.device)
    e = path.best
    r = walk.residual.view(b, t, w)[at, e]  # [B, W]
    r = torch.where((outside[at, e] + r.sum(-1) > 0)[:, None], r, p[at, e])
    held = member[at, e]
    set_ids = sets.ids[at, e]  # [B, W]
    off_set = torch.nn.functional.pad(logits[at, e], (0, 1))
    off_set = off_set.scatter(1, torch.where(held, set_ids, v), -torch.inf)[:, :v]  # [B, V] the set's tokens out
    theta_e = None if theta is None else theta[at, e]
    out_tok, out_key = sample_tokens(off_set, temp[:, 0], theta_e, rows.seed, rows.counter)
    # the set's keys: log r + logz + the same noise (units of the off-set keys, logit / T + noise)
    mass = torch.where(held & (r > 0), torch.log(r) + logz[at, e][:, None], -torch.inf)
    ones = torch.ones_like(temp[:, 0])
    col, in_key = sample_tokens(mass, ones, None, rows.seed, rows.counter, set_ids)
    bonus = torch.where(in_key > out_key, set_ids.gather(1, col[:, None])[:, 0], out_tok)
    return path_result(ids, path.count, path.src_rows, bonus), path.src_rows
