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
class Tree:
    """A draft tree as it travels between services."""

    tokens: np.ndarray  # [N] int64 token ids
    parents: np.ndarray  # [N] int64 parent node index, -1 for the root
    probs: np.ndarray  # [N] float32 draft probability of each node given its parent

    @property
    def size(self) -> int:
        return int(self.tokens.shape[0])


def validate_tree(
    tokens: np.ndarray, parents: np.ndarray, probs: np.ndarray, *, max_nodes: int, vocab_size: int
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
    return Tree(tokens=tokens, parents=parents, probs=probs)


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
