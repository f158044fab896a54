"""The fused operations in plain PyTorch: the CPU path, the autograd path (training) and the oracle the
Triton kernels are tested against. Each function computes in float32 and rounds once at the end, as the
kernels do, so both paths round alike."""

from __future__ import annotations

from dataclasses import dataclass

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
    rotated = rope(view[:, :, : h + kvh], cos, sin, positions)  # [B, T, H + KVH, D]
    view[:, :, :h] = rotated[:, :, :h]
    new = torch.stack((rotated[:, :, h:], view[:, :, h + kvh :]), dim=2)  # [B, T, 2, KVH, D]
    kv[slots[:, None].expand(b, t), write_pos] = new.to(kv.dtype)


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """x [B, T, N, D] heads rotated at positions [B, T] (rotate-half layout, computed in float32), in x's
    dtype; out of place (training-time test differentiates through it)."""
    half = x.shape[-1] // 2
    c, s = cos[positions][:, :, None, :half], sin[positions][:, :, None, :half]  # [B, T, 1, D/2]
    xf = x.float()
    x1, x2 = xf[..., :half], xf[..., half:]
    return torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1).to(x.dtype)


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


def rms_norm_cat(a: torch.Tensor, wa: torch.Tensor, b: torch.Tensor, wb: torch.Tensor, eps: float) -> torch.Tensor:
    """a, b [..., H] -> [..., 2H]: rms_norm(a) * wa | rms_norm(b) * wb, in a's dtype."""
    return torch.cat((add_rms_norm(a, None, wa, eps)[0], add_rms_norm(b, None, wb, eps)[0]), dim=-1)


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
    """One level of the draft's tree expansion (common.engine.draft._expand_step).

    kid_ids, kid_score, kid_logq [B, F, K]: the K children of each of F expanded nodes (draft ids, score
    added to the parent's, log q of the draw); front_score, front_id [B, F] the expanded nodes' cumulative
    scores and creation indices (None at the root: score 0, parent -1); hidden [B, F, H] the head's output
    at each expanded node; front_anc [B, F, S] bool their ancestor masks over the S = scratch entries
    (None at the root: none); embed [Vd, H] the draft vocabulary's embeddings.
    Writes the F * K children as candidates [offset, offset + F K) of cand = (ids int64, cumulative score
    float32, log q float32, parent's creation index int64), each [B, C].
    own_base None: nothing more (the last level). Else returns the next frontier, the K best children by
    cumulative score (ties: the one created first), best first: ids [B, K], scores [B, K], creation
    indices [B, K] (created + the child's index in the level), their parents' hidden states [B, K, H],
    ancestor masks [B, K, S] (the parent's, with the child's own scratch entry own_base + rank set) and
    their embeddings [B, K, H].
    Example (F 1, K 2, the root): kid_score [[[-.5, -.1]]] -> candidate scores [-.5, -.1], parents
    [-1, -1]; frontier ids [kid 1, kid 0], creation indices [created + 1, created], own scratch entries
    own_base, own_base + 1."""
    b, f, k = kid_ids.shape
    n = f * k
    score = kid_score if front_score is None else front_score[:, :, None] + kid_score  # [B, F, K]
    parent = kid_ids.new_full((b, f, k), -1) if front_id is None else front_id[:, :, None].expand(b, f, k)
    tok_c, score_c, logq_c, par_c = cand
    tok_c[:, offset : offset + n] = kid_ids.reshape(b, n)
    score_c[:, offset : offset + n] = score.reshape(b, n)
    logq_c[:, offset : offset + n] = kid_logq.reshape(b, n)
    par_c[:, offset : offset + n] = parent.reshape(b, n)
    if own_base is None:
        return None
    flat = score.reshape(b, n)
    best = torch.sort(flat, dim=1, descending=True, stable=True).indices[:, :k]  # [B, K]
    src = best // k  # [B, K] the expanded node each child hangs below
    tok = kid_ids.reshape(b, n).gather(1, best)
    own = torch.arange(scratch, device=tok.device)[None, :] == own_base + torch.arange(k, device=tok.device)[:, None]
    anc = own[None].expand(b, k, scratch)  # [B, K, S]
    if front_anc is not None:
        anc = anc | front_anc.gather(1, src[:, :, None].expand(b, k, scratch))
    h = hidden.gather(1, src[:, :, None].expand(b, k, hidden.shape[-1]))
    return tok, flat.gather(1, best), created + best, h, anc, F.embedding(tok, embed)


def select_top_nodes(
    scores: torch.Tensor, parents: torch.Tensor, keep: torch.Tensor, n: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Batched, static-shape common.tree.select_top_nodes.

    scores  [B, C] cumulative log-probabilities in creation order
    parents [B, C] creation index of each candidate's parent, -1 for the root
    keep    [B]    nodes to keep per row (<= n)
    Returns kept [B, n] creation indices and new_parents [B, n] (re-indexed into kept); the first keep[b]
    entries of row b are its tree in creation order, the rest is filler the caller drops.

    Worked example: scores [-0.1, -2.0, -0.5, -0.5], parents [-1, -1, 0, 0], keep 3, n 4
        stable descending sort      order [0, 2, 3, 1]   (ties 2, 3 keep creation order)
        first keep of it are kept   {0, 2, 3};  key = order where rank < keep else order + C
                                    key [0, 2, 3, 5] -> sorted [0, 2, 3, 5] -> kept [0, 2, 3, 1]
        position of each kept node  0 -> 0, 2 -> 1, 3 -> 2
        new_parents                 [-1, 0, 0, ...]
    """
    b, c = scores.shape
    order = torch.sort(scores, dim=1, descending=True, stable=True).indices[:, :n]  # [B, n] best first
    rank = torch.arange(n, device=scores.device)
    key = torch.where(rank[None, :] < keep[:, None], order, order + c)  # kept ones sort first
    kept = torch.sort(key, dim=1).values % c  # [B, n] creation order
    position = torch.full((b, c), -1, dtype=torch.long, device=scores.device)  # [B, C]
    position.scatter_(1, kept, rank[None, :].expand(b, n).contiguous())
    par = parents.gather(1, kept)  # [B, n]
    new_parents = torch.where(par < 0, -1, position.gather(1, par.clamp(min=0)))
    return kept, new_parents


def candidate_depth(c: int, k: int, device: torch.device) -> torch.Tensor:
    """[C] the depth of each candidate of a draft tree in creation order: K at depth 1, then K * K a level."""
    i = torch.arange(c, device=device)
    return torch.where(i < k, 1, 2 + (i - k).clamp(min=0) // (k * k))


@dataclass(frozen=True)
class Drawn:
    """What select_tree needs of a batch with sampling rows (common.engine.draft: the q rule)."""

    logq: torch.Tensor  # [B, C] log q each candidate was drawn with (draft_level's third record)
    temperature: torch.Tensor  # [B] a row samples when > 0
    fronts: torch.Tensor  # [B, F] the expanded nodes' creation indices, level by level: q row f + 1 is fronts[f]'s


def select_tree(
    tok: torch.Tensor,
    score: torch.Tensor,
    parent: torch.Tensor,
    d2t: torch.Tensor,
    keep: torch.Tensor,
    row_depth: torch.Tensor,
    k: int,
    n: int,
    drawn: Drawn | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The draft tree of each row: the keep[b] best candidates (select_top_nodes) no deeper than
    row_depth[b], in creation order.

    tok, score, parent [B, C]: the candidates as draft_level writes them (draft ids, cumulative scores,
    parents' creation indices); d2t [Vd] the draft -> base id offsets; keep, row_depth [B]; k: children
    per node (the candidate layout); n: tree rows (>= keep).
    Returns tree [B, 4, N] float64 (base ids, parents re-indexed into the tree with -1 the root, the
    probability of each node given its parent exp(score - parent's score), and -1: no q row) and kept
    [B, N] int64 (creation indices); entries past keep[b] are filler (0, -1, 0, -1 and kept 0).
    drawn (a batch with sampling rows): a sampling row's probability is its draw's, exp(logq) (0: drawn from
    outside q), and every row's q rows name each expanded node's: 1 + its place in drawn.fronts (-1: none).
    Example: fronts [[4, 0]] -> candidate 4's q row is 1, candidate 0's 2, the others' -1."""
    b, c = score.shape
    select = score.masked_fill(candidate_depth(c, k, score.device)[None, :] > row_depth[:, None], float("-inf"))
    kept, new_parents = select_top_nodes(select, parent, keep, n)  # [B, N]
    par = parent.gather(1, kept)
    parent_score = torch.where(par < 0, 0.0, score.gather(1, par.clamp(min=0)))
    probs = torch.exp(score.gather(1, kept) - parent_score)  # [B, N] float32
    q_row = torch.full_like(probs, -1)
    if drawn is not None:
        probs = torch.where((drawn.temperature > 0)[:, None], drawn.logq.gather(1, kept).exp(), probs)
        hit = kept[:, :, None] == drawn.fronts[:, None, :]  # [B, N, F]
        place = torch.arange(1, drawn.fronts.shape[1] + 1, device=score.device)
        q_row = torch.where(hit.any(-1), (hit * place).sum(-1), -1).float()
    ids = tok.gather(1, kept)
    tree = torch.stack([t.double() for t in (ids + d2t[ids], new_parents, probs, q_row)], 1)
    filler = (torch.arange(n, device=score.device)[None, :] >= keep[:, None])[:, None, :]  # [B, 1, N]
    fill = torch.tensor([0.0, -1.0, 0.0, -1.0], dtype=torch.float64, device=score.device)[None, :, None]
    return torch.where(filler, fill, tree), kept.masked_fill(filler[:, 0], 0)


# ---- Tree verification: the tree's mask, greedy acceptance and the accepted path's K/V ----------------
def tree_ancestors(parent_rows: torch.Tensor, max_depth: int | None = None) -> torch.Tensor:
    """parent_rows [B, T] (row 0 = root, row i+1 = node i; the root and padding rows name themselves)
    -> [B, T, T] bool, anc[b, i, j] = row j is row i or one of its ancestors (common.tree.ancestor_mask).

    Pointer doubling, ceil(log2(T - 1)) rounds with static shapes: after round r every row holds its
    ancestors up to distance 2^r, and jump[i] is its 2^r-th ancestor (the root points at itself).
    Worked example (tokens [a, b, c, d], parents [-1, -1, 0, 1], then one padding row p):
        row          r  a  b  c  d  p
        parent_rows  0  0  0  1  2  5
        start        anc = self + parent:  r {r}  a {a,r}  b {b,r}  c {c,a}  d {d,b}  p {p}
        round 1      anc[c] |= anc[jump[c] = a] -> {c,a,r};  jump[c] <- jump[a] = r   (d likewise)
        depth = |anc| - 1:  r 0  a 1  b 1  c 2  d 2  p 0
    """
    b, t = parent_rows.shape
    anc = torch.eye(t, dtype=torch.bool, device=parent_rows.device).expand(b, t, t).clone()  # [B, T, T]
    anc.scatter_(2, parent_rows[:, :, None], True)
    jump = parent_rows  # [B, T]
    # ceil(log2(D)) rounds cover depth D: T - 1 when no bound is known
    depth = max_depth if max_depth is not None else t - 1
    for _ in range(max(depth - 1, 0).bit_length()):
        anc = anc | anc.gather(1, jump[:, :, None].expand(b, t, t))
        jump = jump.gather(1, jump)
    return anc


@dataclass(frozen=True)
class TreePath:
    """The accepted path of each tree of a batch, on the device."""

    count: torch.Tensor  # [B] accepted drafted nodes
    src_rows: torch.Tensor  # [B, T] row that lands at tree position k: the root, the path, then k itself
    best: torch.Tensor  # [B] the path's last row (the root when nothing was accepted)


@dataclass(frozen=True)
class GreedyPath:
    """Greedy acceptance of a batch of trees, on the device."""

    count: torch.Tensor  # [B] accepted drafted nodes
    src_rows: torch.Tensor  # [B, T] row that lands at tree position k: the root, the path, then k itself
    bonus: torch.Tensor  # [B] the base model's choice after the last accepted node


def follow_path(right: torch.Tensor, anc: torch.Tensor, depth: torch.Tensor) -> TreePath:
    """The path of rows that are right, from the root: right [B, T] (row 0 right; a row is right when its
    parent accepts it), anc [B, T, T] from tree_ancestors, depth [B, T]. A row is accepted when it and all
    its ancestors are right; the deepest accepted row ends the path (ties: the first row, as the host rule's
    first matching child). Example: right [1, 0, 1, 0, 1] over tokens [a, b, c, d], parents [-1, -1, 0, 1]
    (rows r a b c d): accepted 1 0 1 0 1, depth 0 1 1 2 2 -> best row 4 (d), count 2, src_rows
    [0, 2, 4, 3, 4] (root, b, d, then positions 3 and 4 keep their own rows)."""
    t = right.shape[1]
    rows = torch.arange(t, device=right.device)
    accepted = ~(anc & ~right[:, None, :]).any(-1)  # [B, T]
    score = torch.where(accepted, depth * t + (t - 1 - rows)[None, :], -1)
    best = score.argmax(-1)  # [B]
    count = depth.gather(1, best[:, None])[:, 0]  # [B]
    on_path = anc.gather(1, best[:, None, None].expand(-1, 1, t))[:, 0]  # [B, T] root and path rows
    ordered = torch.where(on_path, rows[None, :], t + rows[None, :]).sort(-1).values  # path rows first
    src_rows = torch.where(rows[None, :] <= count[:, None], ordered, rows[None, :])
    return TreePath(count=count, src_rows=src_rows, best=best)


def accept_greedy_device(
    ids: torch.Tensor,
    parent_rows: torch.Tensor,
    anc: torch.Tensor,
    target: torch.Tensor,
    depth: torch.Tensor | None = None,
) -> GreedyPath:
    """Batched common.acceptance.accept_greedy. ids, parent_rows, target [B, T] (row 0 the root; target
    the base argmax at each row); anc [B, T, T] from tree_ancestors; depth [B, T] = anc.sum(-1) - 1 when
    the caller has it.

    A node row is right when its token is its parent row's target; the path follows them (follow_path).
    Padding rows (their own parent, after the root) are never right.
    Worked example (tokens [a, b, c, d], parents [-1, -1, 0, 1], target [b, x, d, y, z]):
        row           r  a  b  c  d
        right         1  0  1  0  1        (a != target[r] = b;  d == target[b] = d)
        accepted      1  0  1  0  1        depth 0 1 1 2 2  -> best row 4 (d), count 2
        src_rows      [0, 2, 4, 3, 4]      root, b, d, then positions 3 and 4 keep their own rows
        bonus         target[4] = z        tokens b, d, z
    """
    t = ids.shape[1]
    rows = torch.arange(t, device=ids.device)
    node = parent_rows != rows[None, :]  # [B, T] a real node row
    right = (ids == target.gather(1, parent_rows)) & node
    right = right | (rows == 0)[None, :]
    depth = anc.sum(-1) - 1 if depth is None else depth  # [B, T]
    path = follow_path(right, anc, depth)
    return GreedyPath(count=path.count, src_rows=path.src_rows, bonus=target.gather(1, path.best[:, None])[:, 0])


def path_result(ids: torch.Tensor, count: torch.Tensor, src_rows: torch.Tensor, bonus: torch.Tensor) -> torch.Tensor:
    """[B, T + 1] int64: the accepted count c, then the c accepted tokens and the bonus (entries 1 .. c + 1;
    the rest is filler). ids, src_rows [B, T]; count, bonus [B].
    Example: ids [r, a, b, c, d], src_rows [0, 2, 4, 3, 4], count 2, bonus z -> [2, b, d, z, d, r]."""
    tokens = ids.gather(1, src_rows)  # [B, T] root, path...
    tokens = torch.cat((tokens[:, 1:], tokens[:, :1]), dim=1)  # path, ... (shift out root)
    tokens = tokens.scatter(1, count[:, None], bonus[:, None])
    return torch.cat((count[:, None], tokens), dim=1)


def tree_mask(parent_rows: torch.Tensor, max_depth: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """parent_rows [B, T] -> (anc [B, T, T] bool from tree_ancestors, depth [B, T] int64 = anc.sum(-1) - 1).
    max_depth: a bound on the trees' depth (fewer doubling rounds), None for any."""
    anc = tree_ancestors(parent_rows, max_depth)
    return anc, anc.sum(-1) - 1


def onehot_sets(ids: torch.Tensor, parent_rows: torch.Tensor, w: int) -> tuple[torch.Tensor, ...]:
    """common.tree.row_sets of one-hot trees, on the device (inside the sampled verify's graph): ids, parent_rows
    [K, T] a verify block's tree columns (the root and padding rows name themselves) -> (pos [K, T], the sets' ids
    [K, T * W], their q [K, T * W / 2] as float32 pairs in int64), W even. A row's set is its children's distinct
    tokens in row order (q 1 each); a node's pos its token's place in its parent's set. A row with more than W
    distinct children (a greedy row's tree, whose sets nobody reads) writes none past its W-th: never another
    row's cells, never past the end.
    Example: ids [r, 7, 9, 7, 5], parent rows [0, 0, 0, 0, 1], W 2 -> the root's set [7, 9], row 1's [5]; pos
    [0, 0, 1, 0, 0] (row 3 repeats 7: row 1's place)."""
    k, t = ids.shape
    rows = torch.arange(t, device=ids.device)
    node = parent_rows != rows[None, :]  # [K, T]
    sib = (parent_rows[:, :, None] == parent_rows[:, None, :]) & node[:, :, None] & node[:, None, :]  # [K, T, T]
    same = sib & (ids[:, :, None] == ids[:, None, :])  # [K, j, i]: i a sibling of j with its token
    earlier = rows[None, :] < rows[:, None]  # [T, T]: i before j
    first = ~(same & earlier).any(-1)  # [K, T] no earlier sibling has its token
    distinct = (sib & earlier & first[:, None, :]).sum(-1)  # [K, T] distinct tokens among the earlier siblings
    rank = distinct.gather(1, same.int().argmax(-1))  # [K, T] its token's first's (a node is its own sibling)
    # roots and padding rows write 0 to cell 0 (amax: a child's token or 1 there wins; a repeat writes its first's)
    fits = node & (rank < w)  # [K, T]
    cell = torch.where(fits, parent_rows * w + rank, 0)  # [K, T]
    set_ids = ids.new_zeros(k, t * w).scatter_reduce(1, cell, torch.where(fits, ids, 0), "amax")
    q = torch.zeros(k, t * w, dtype=torch.float32, device=ids.device).scatter_reduce(1, cell, fits.float(), "amax")
    return torch.where(fits, rank, 0), set_ids, q.view(torch.int64)


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
    """The next verify block of a chained round (common.engine.verifier_parts.chained_block says what each row
    becomes): prev [BB, C] the block verified last, result [B, T + 1] its acceptance, tokens and parents [K, N]
    the next trees of its first K rows (K <= B <= BB), keep [K] the nodes each keeps, tb the tree rows T, n_col the
    column of the root's length. Returns the block: out, written (it may be prev), or a new tensor (prev
    untouched)."""
    b, k = result.shape[0], tokens.shape[0]
    nodes = min(tokens.shape[1], tb - 1)
    block = prev.clone()
    count = result[:, 0] + 1  # [B]
    block[:b, 0] = result.gather(1, count[:, None])[:, 0]  # the bonus token: the next root
    block[:b, n_col] += count
    rows = torch.arange(1, nodes + 1, device=prev.device)  # [nodes] tree rows 1..nodes
    kept = rows[None, :] <= keep[:, None]  # [K, nodes]
    block[:k, 1 : 1 + nodes] = torch.where(kept, tokens[:, :nodes].long(), 0)
    block[:k, tb + 1 : tb + 1 + nodes] = torch.where(kept, parents[:, :nodes].long() + 1, rows[None, :])
    pad = torch.arange(1, tb, device=prev.device)  # [tb - 1] rows 1.. as their own parents: padding
    block[:k, 1 + nodes : tb] = 0  # trees narrower than the bucket: no node of the last round's past them
    block[:k, tb + 1 + nodes : 2 * tb] = pad[nodes:]
    block[k:b, 1:tb] = 0  # rows past K: no tree (not the one they verified last)
    block[k:b, tb + 1 : 2 * tb] = pad
    return block if out is None else out.copy_(block)


def accept_inputs(
    packed: torch.Tensor,
    hidden: torch.Tensor,
    result: torch.Tensor,
    kept: torch.Tensor,
    after: tuple[torch.Tensor, torch.Tensor] | None,
    length: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The inputs of a drafting launched behind a verify, written in place (the propose graph's input buffers):
    packed [BB, L + 5] holds the host's columns (length L, count L + 1, slot L + 2, keep L + 3, depth L + 4); its
    first B rows get the verify's accepted tokens and bonus from result [B, T + 1] (count c, then the c tokens and
    the bonus) in columns [0, n) (the c + 1 of them, then 0), c + 1 in column L + 1 and, for a chained launch,
    after = (m, took) of the launch before it: its lengths m + took in column L (the host has not counted them);
    hidden [BB, L, 3H] gets kept [B, n, 3H] (the features of those tokens), 0 elsewhere. Returns (took [B] the
    rows' new tokens c + 1, m [B] each row's length before them, keep [B] its keep column), new tensors.
    Example, L 3, n 2: result [[1, 8, 9, 0]], length 10 in the host's column -> packed[0] [8, 9, 0, 10, 2, ...],
    took [2], m [10]."""
    b, n = kept.shape[:2]
    took = result[:, 0] + 1  # [B]
    cols = torch.arange(n, device=packed.device)[None, :]  # [1, n]
    packed[:b, :n] = torch.where(cols < took[:, None], result[:, 1 : 1 + n], 0)
    packed[:b, length + 1] = took
    if after is not None:
        packed[:b, length] = after[0] + after[1]
    hidden.zero_()
    hidden[:b, :n] = kept.to(hidden.dtype)
    return took, packed[:b, length].clone(), packed[:b, length + 3].clone()


def accept_tree(
    ids: torch.Tensor,
    parent_rows: torch.Tensor,
    anc: torch.Tensor,
    depth: torch.Tensor,
    target: torch.Tensor,
    greedy: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Greedy acceptance of a batch of trees and what the verifier keeps of it. ids, parent_rows, target,
    depth [B, T] and anc [B, T, T] as accept_greedy_device takes them; greedy [B] (nonzero: the sequence
    is greedy). Returns
      result [B, T + 1] int64: the accepted count c, then the accepted tokens and the bonus token (entries
             1 .. c + 1; the rest is filler);
      src    [B, T] int64: the row whose K/V and features land at tree position k (the root, the path,
             then k itself), and k itself for every position of a row that is not greedy (its path is the
             sampled acceptance's: common.kernels.speculative).
    Docstring example of accept_greedy_device, greedy: result [2, b, d, z, ...], src [0, 2, 4, 3, 4]."""
    t = ids.shape[1]
    path = accept_greedy_device(ids, parent_rows, anc, target, depth)
    rows = torch.arange(t, device=ids.device)
    src = torch.where(greedy[:, None] != 0, path.src_rows, rows[None, :])  # [B, T]
    return path_result(ids, path.count, path.src_rows, path.bonus), src


def move_rows(kv: torch.Tensor, slots: torch.Tensor, n: torch.Tensor, src: torch.Tensor) -> None:
    """In every layer of kv [L, S, C, ...], the cache row at n[b] + src[b, k] of slot slots[b] moves to
    n[b] + k (the accepted path next to the root): all rows are read before any is written, so a path row
    may land where another path row came from (common.acceptance.compaction_plan). src [B, T]."""
    b, t = src.shape
    rows = torch.arange(t, device=src.device)
    slot_idx = slots[:, None].expand(b, t)
    kv[:, slot_idx, n[:, None] + rows[None, :]] = kv[:, slot_idx, n[:, None] + src]
