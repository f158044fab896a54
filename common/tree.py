"""Token-tree bookkeeping in plain numpy: validation, depths, attention masks, dynamic-tree selection.

A tree holds N drafted nodes below an implicit root (the sequence's last committed token). Nodes are
stored so that a parent always precedes its children; parent -1 is the root. In the verifier's
forward the root is row 0 and node i is row i + 1.

Worked example used throughout (root r):

        r
       / \\
      a   b          tokens  = [a, b, c, d]
      |   |          parents = [-1, -1, 0, 1]
      c   d          depths  = [1, 1, 2, 2]
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from common.errors import InvalidRequest


@dataclass(frozen=True)
class DraftQ:
    """The distribution q a sampled tree's children were drawn from, at each row that has children
    (common.acceptance.accept_sampled_q). Sparse: the draft samples from its top-M tokens only, so q is
    exactly M ids and their probabilities per row. Example: rows [0, 2] -> the root's q is ids[0],
    node 1's (row 2) is ids[1]; rows without children carry none."""

    rows: np.ndarray  # [R] int64 tree rows (0 = root, i + 1 = node i), ascending
    ids: np.ndarray  # [R, M] int64 token ids
    probs: np.ndarray  # [R, M] float32 their probabilities (each row sums to 1)

    def at(self, row: int) -> tuple[np.ndarray, np.ndarray] | None:
        """(ids [M], probs [M]) of q at `row`, or None when the row has none."""
        i = int(np.searchsorted(self.rows, row))
        if i == self.rows.shape[0] or self.rows[i] != row:
            return None
        return self.ids[i], self.probs[i]


@dataclass(frozen=True)
class Tree:
    """A draft tree as it travels between services."""

    tokens: np.ndarray  # [N] int64 token ids
    parents: np.ndarray  # [N] int64 parent node index, -1 for the root
    probs: np.ndarray  # [N] float32 draft probability of each node given its parent
    # children drawn from q in node order, without replacement: the verifier uses the q rule; None: the
    # children were picked deterministically (top-k) and the one-hot rule applies
    q: DraftQ | None = None

    @property
    def size(self) -> int:
        return int(self.tokens.shape[0])


# a row that drafts nothing this round: its verify decodes one token (a plain row, a joiner taken in)
NO_TREE = Tree(
    tokens=np.zeros(0, dtype=np.int64), parents=np.zeros(0, dtype=np.int64), probs=np.zeros(0, dtype=np.float32)
)


def validate_tree(
    tokens: np.ndarray,
    parents: np.ndarray,
    probs: np.ndarray,
    *,
    max_nodes: int,
    vocab_size: int,
    q: DraftQ | None = None,
) -> Tree:
    """Check a tree from the wire and return it. Raises InvalidRequest naming what is wrong.

    Requiring parents[i] < i rules out cycles and self-loops: every path climbs to the root.
    """
    tokens = np.asarray(tokens, dtype=np.int64)
    parents = np.asarray(parents, dtype=np.int64)
    probs = np.asarray(probs, dtype=np.float32)
    n = tokens.shape[0]
    if n > max_nodes:
        raise InvalidRequest(f"tree has {n} nodes, more than the limit of {max_nodes}")
    if parents.shape[0] != n:
        raise InvalidRequest(f"tree has {n} tokens but {parents.shape[0]} parent indices")
    if probs.shape[0] not in (0, n):
        raise InvalidRequest(f"tree has {n} tokens but {probs.shape[0]} draft probabilities")
    if n and (tokens.min() < 0 or tokens.max() >= vocab_size):
        bad = int(tokens[(tokens < 0) | (tokens >= vocab_size)][0])
        raise InvalidRequest(f"tree token id {bad} is outside the vocabulary [0, {vocab_size})")
    idx = np.arange(n)
    out_of_range = (parents < -1) | (parents >= n)
    if out_of_range.any():
        i = int(idx[out_of_range][0])
        raise InvalidRequest(f"tree node {i} has parent index {int(parents[i])} outside [-1, {n})")
    not_before = parents >= idx
    if not_before.any():
        i = int(idx[not_before][0])
        raise InvalidRequest(
            f"tree node {i} has parent {int(parents[i])} that does not precede it (cycle or bad order)"
        )
    if probs.shape[0] == 0:
        probs = np.ones(n, dtype=np.float32)
    return Tree(tokens=tokens, parents=parents, probs=probs, q=validate_q(tokens, parents, q) if q else None)


def malformed_trees(tokens: np.ndarray, parents: np.ndarray, sizes: np.ndarray, vocab_size: int) -> np.ndarray:
    """Which trees of a batch fail validate_tree's checks of their contents, in one numpy pass: a token
    outside [0, vocab_size), or a parent that is neither -1 nor an earlier node of the same tree (the
    checks of sizes and lengths are the caller's). Returns [B] bool.

    tokens  [N] the trees' tokens, one tree after the other (N = sizes.sum())
    parents [N] each node's parent index within its own tree
    sizes   [B] nodes per tree
    Example: sizes [2, 3], parents [-1, 0 | -1, 2, 0], tokens [5, 6 | 7, 8, 9], vocab 10
             -> local indices [0, 1 | 0, 1, 2] -> [False, True] (node 1 of the second tree names node 2)
    """
    tree, local = node_positions(sizes)  # [N] each: [0, 0, 1, 1, 1], [0, 1, 0, 1, 2]
    bad = (tokens < 0) | (tokens >= vocab_size) | (parents < -1) | (parents >= local)  # [N]
    return np.bincount(tree[bad], minlength=len(sizes)) > 0


def node_positions(sizes: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Where each node of a batch of trees, stored one tree after the other, belongs: (its tree [N], its
    index within that tree [N]), N = sizes.sum().  sizes [2, 3] -> [0, 0, 1, 1, 1], [0, 1, 0, 1, 2]"""
    sizes = np.asarray(sizes, dtype=np.int64)
    tree = np.repeat(np.arange(sizes.shape[0]), sizes)  # [N]
    starts = np.cumsum(sizes) - sizes  # [B] first node of each tree: [0, 2]
    return tree, np.arange(tree.shape[0]) - starts[tree]


def validate_q(tokens: np.ndarray, parents: np.ndarray, q: DraftQ) -> DraftQ:
    """Check a sampled tree's q: one row per row with children, ascending, probabilities that are a
    distribution, and children that are distinct tokens of q's support (drawn without replacement).
    Raises InvalidRequest."""
    rows = np.asarray(q.rows, dtype=np.int64)
    ids = np.asarray(q.ids, dtype=np.int64)
    probs = np.asarray(q.probs, dtype=np.float32)
    if ids.ndim != 2 or ids.shape != probs.shape or ids.shape[0] != rows.shape[0]:
        raise InvalidRequest(f"q has {rows.shape[0]} rows, ids {ids.shape} and probs {probs.shape}")
    if rows.shape[0] and ((np.diff(rows) <= 0).any() or rows[0] < 0 or rows[-1] > tokens.shape[0]):
        raise InvalidRequest("q rows must be ascending tree rows")
    if not np.isfinite(probs).all() or (probs < 0).any() or (np.abs(probs.sum(1) - 1) > 1e-3).any():
        raise InvalidRequest("q probabilities must be finite, non-negative and sum to 1 per row")
    held = np.sort(np.where(probs > 0, ids, -1 - np.arange(ids.shape[1])), axis=1)  # [R, M] unheld ids distinct
    if ids.shape[1] and (np.diff(held, axis=1) == 0).any():
        raise InvalidRequest("q names a token twice in a row")
    out = DraftQ(rows=rows, ids=ids, probs=probs)
    for row, kids in enumerate(children_lists(parents)):
        if not kids:
            continue
        at = out.at(row)
        if at is None:
            raise InvalidRequest(f"tree row {row} has children but no q")
        support = dict(zip(at[0].tolist(), (at[1] > 0).tolist()))
        want = tokens[kids].tolist()
        if len(set(want)) != len(want) or not all(support.get(t, False) for t in want):
            raise InvalidRequest(f"the children of tree row {row} are not distinct tokens drawn from its q")
    return out


def depths(parents: np.ndarray) -> np.ndarray:
    """Depth of each node, children of the root at depth 1.  [-1, -1, 0, 1] -> [1, 1, 2, 2]"""
    d = np.zeros(parents.shape[0], dtype=np.int64)
    for i, p in enumerate(parents):
        d[i] = 1 if p < 0 else d[p] + 1
    return d


def ancestor_mask(parents: np.ndarray) -> np.ndarray:
    """[N+1, N+1] bool: mask[i, j] is True when row j is row i or one of its ancestors.

    Row 0 is the root, row i+1 is node i. For the worked example:
        r a b c d
    r [ 1 0 0 0 0 ]
    a [ 1 1 0 0 0 ]
    b [ 1 0 1 0 0 ]
    c [ 1 1 0 1 0 ]
    d [ 1 0 1 0 1 ]
    """
    n = parents.shape[0]
    mask = np.zeros((n + 1, n + 1), dtype=bool)
    mask[0, 0] = True
    for i, p in enumerate(parents):
        mask[i + 1] = mask[p + 1]  # parents precede children, so the parent's row is complete
        mask[i + 1, i + 1] = True
    return mask


def children_lists(parents: np.ndarray) -> list[list[int]]:
    """Children of each row (0 = root, i+1 = node i), as node indices in tree order.
    [-1, -1, 0, 1] -> [[0, 1], [2], [3], [], []]"""
    kids: list[list[int]] = [[] for _ in range(parents.shape[0] + 1)]
    for i, p in enumerate(parents):
        kids[p + 1].append(i)
    return kids


def drop_subtrees(parents: np.ndarray, drop: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Remove the nodes marked in drop [N] and all their descendants. Returns (the kept node indices
    [n], their parents re-indexed into them).
    Example: parents [-1, -1, 0, 1, 3], drop [0, 1, 0, 0, 0] (node 1 and below: 3, 4)
             -> kept [0, 2], parents [-1, 0]"""
    gone = np.asarray(drop, dtype=bool).copy()
    for i, p in enumerate(parents):  # parents precede children
        gone[i] |= p >= 0 and gone[p]
    kept = np.flatnonzero(~gone)
    position = np.full(parents.shape[0], -1, dtype=np.int64)
    position[kept] = np.arange(kept.shape[0])
    return kept, np.where(parents[kept] < 0, -1, position[np.maximum(parents[kept], 0)])


def path_to_root(parents: np.ndarray, node: int) -> list[int]:
    """Node indices from depth 1 down to `node`.  node 3 in the example -> [1, 3]"""
    path = []
    while node >= 0:
        path.append(node)
        node = int(parents[node])
    return path[::-1]


def select_top_nodes(scores: np.ndarray, parents: np.ndarray, keep: int) -> tuple[np.ndarray, np.ndarray]:
    """EAGLE-2's final rerank: keep the `keep` candidates of highest cumulative log-probability.

    scores  [C] cumulative log-probabilities of the candidates, in creation order
    parents [C] creation index of each candidate's parent, -1 for the root
    Returns (kept creation indices [keep] in creation order, their parents re-indexed into the kept list).

    A child's score never exceeds its parent's, so a kept node's parent is kept too; ties (a child with
    log-probability 0) are broken towards the earlier-created node, which is the parent.
    Example: scores [-0.1, -2.0, -0.5, -3.0], parents [-1, -1, 0, 1], keep 3
             -> kept [0, 1, 2], parents [-1, -1, 0]
    """
    keep = min(keep, scores.shape[0])
    order = np.lexsort((np.arange(scores.shape[0]), -scores))[:keep]  # by score desc, then creation
    kept = np.sort(order)
    position = np.full(scores.shape[0], -1, dtype=np.int64)
    position[kept] = np.arange(keep)
    new_parents = np.where(parents[kept] < 0, -1, position[np.maximum(parents[kept], 0)])
    if (new_parents[parents[kept] >= 0] < 0).any():
        raise ValueError("tree selection dropped a parent while keeping its child")
    return kept, new_parents


def widest(trees: list[Tree]) -> int:
    """The most children one row of these trees has (0 for trees without nodes).
    Example: parents [-1, -1, 0] and [-1] -> the first tree's root has 2 -> 2."""
    sizes = np.array([t.size for t in trees], dtype=np.int64)
    if not sizes.sum():
        return 0
    item, _ = node_positions(sizes)
    parent = np.concatenate([t.parents for t in trees]) + 1  # [N] parent rows
    return int(np.bincount(item * (int(sizes.max()) + 1) + parent).max())


@dataclass(frozen=True)
class RowSets:
    """The tokens the sampled acceptance follows at each tree row of a batch (common.kernels.speculative's
    TreeSets on the device): at a row of a tree with q, its q (ids and probabilities); at a row of a one-hot
    tree, its children's distinct tokens in node order (probability 1). Entries past a row's set: 0."""

    ids: np.ndarray  # [B, T, W] int64
    q: np.ndarray  # [B, T, W] float32 (0: not in the set)
    pos: np.ndarray  # [B, T] int64: row i + 1 (node i)'s position in its parent row's set; 0 for row 0 and padding


def row_sets(trees: list[Tree], t: int, width: int) -> RowSets:
    """The sets of a batch of trees padded to t rows and `width` tokens (at least every q's M and every
    row's children).
    Example (one-hot): tokens [7, 9, 7, 5], parents [-1, -1, -1, 0] -> the root's set [7, 9] (node 2 repeats
    7: position 0, like node 0), node 0's [5]; pos of rows 1..4: [0, 1, 0, 0].
    With q at the root, ids [9, 7, 3]: the root's set is [9, 7, 3] and its children's positions follow it."""
    b = len(trees)
    ids = np.zeros((b, t, width), dtype=np.int64)
    q = np.zeros((b, t, width), dtype=np.float32)
    pos = np.zeros((b, t), dtype=np.int64)
    sizes = np.array([tr.size for tr in trees], dtype=np.int64)
    item, node = node_positions(sizes)  # [N] each
    if not item.shape[0]:
        return RowSets(ids=ids, q=q, pos=pos)
    tokens = np.concatenate([tr.tokens for tr in trees])
    parent = np.concatenate([tr.parents for tr in trees]) + 1  # [N] parent rows
    with_q = np.array([tr.q is not None for tr in trees])
    hot = ~with_q[item]  # [N] nodes of one-hot trees
    if hot.any():
        rank = _distinct_rank(item[hot] * t + parent[hot], tokens[hot], node[hot])
        ids[item[hot], parent[hot], rank] = tokens[hot]
        q[item[hot], parent[hot], rank] = 1.0
        pos[item[hot], node[hot] + 1] = rank
    if with_q.any():
        drafted = [i for i in range(b) if with_q[i]]
        for i in drafted:  # a few array copies a tree
            dq = trees[i].q
            ids[i, dq.rows, : dq.ids.shape[1]] = dq.ids
            q[i, dq.rows, : dq.ids.shape[1]] = dq.probs
        sampled = ~hot
        at = ids[item[sampled], parent[sampled]] == tokens[sampled][:, None]  # [n, W] its token in its parent's q
        pos[item[sampled], node[sampled] + 1] = at.argmax(1)
    return RowSets(ids=ids, q=q, pos=pos)


def _distinct_rank(group: np.ndarray, tokens: np.ndarray, node: np.ndarray) -> np.ndarray:
    """[n] each node's place among its group's distinct tokens in node order (a repeated token: its first's).
    group, tokens, node [n]; node ascending within a group.
    Example: group [0, 0, 0, 1], tokens [7, 9, 7, 5], node [0, 1, 2, 3] -> [0, 1, 0, 0]."""
    n = group.shape[0]
    by_token = np.lexsort((node, tokens, group))  # runs of one (group, token), first occurrence first
    new = np.ones(n, dtype=bool)
    new[1:] = (group[by_token][1:] != group[by_token][:-1]) | (tokens[by_token][1:] != tokens[by_token][:-1])
    run = np.cumsum(new) - 1  # [n] run of each sorted node
    firsts = by_token[new]  # [runs] the first node of each run
    order = np.lexsort((node[firsts], group[firsts]))  # the firsts by group, then node
    g = group[firsts][order]
    starts = np.ones(order.shape[0], dtype=bool)
    starts[1:] = g[1:] != g[:-1]
    at = np.arange(order.shape[0])
    first_rank = np.empty(order.shape[0], dtype=np.int64)
    first_rank[order] = at - np.maximum.accumulate(np.where(starts, at, 0))
    rank = np.empty(n, dtype=np.int64)
    rank[by_token] = first_rank[run]
    return rank
