"""Which drafted tokens the base model accepts, and how its KV cache is compacted afterwards.

Plain Python/numpy: the verifier supplies the base model's choices per tree row (row 0 = root,
row i + 1 = node i, see common/tree.py) and gets back the accepted path.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from common.tree import children_lists


@dataclass(frozen=True)
class Acceptance:
    """Result of verifying one tree."""

    path: list[int]  # [num_accepted] accepted node indices, depth 1 first
    tokens: list[int]  # [num_accepted + 1] the accepted nodes' tokens, then the bonus token

    @property
    def num_accepted(self) -> int:
        return len(self.path)


def accept_greedy(tokens: np.ndarray, parents: np.ndarray, target: np.ndarray) -> Acceptance:
    """Follow the tree while a child equals the base model's argmax, then add the argmax as bonus.

    tokens  [N] drafted tokens
    parents [N] parent node index, -1 = root
    target  [N+1] base argmax at each row (row 0 = root, row i+1 = node i)
    Example: tokens [a, b, c, d], parents [-1, -1, 0, 1], target [b, x, d, y, z]
             root's argmax is b -> accept node 1; node 1's argmax is d -> accept node 3;
             node 3's argmax is z -> bonus.  path [1, 3], tokens [b, d, z]
    """
    kids = children_lists(parents)
    path: list[int] = []
    row = 0
    while True:
        want = int(target[row])
        match = next((c for c in kids[row] if int(tokens[c]) == want), None)
        if match is None:
            return Acceptance(path=path, tokens=[int(tokens[c]) for c in path] + [want])
        path.append(match)
        row = match + 1


def accept_sampled(
    tokens: np.ndarray, parents: np.ndarray, target_probs: Callable[[int], np.ndarray], rng: np.random.Generator
) -> Acceptance:
    """Lossless multi-draft rejection sampling with the drafts treated as one-hot proposals.

    The dynamic tree picks children deterministically (top-k), so each child is a point-mass proposal:
    at a row with target distribution p, child x is accepted with probability p(x); on rejection
    p <- normalize(p with x removed) and the next child is tried; if every child is rejected the token
    is sampled from the residual p. Summed over the branches, every token keeps exactly probability
    p(token): the output distribution equals the base model's (SpecInfer's rule with q = one-hot).

    target_probs(row) returns the processed (temperature, top-k, top-p) distribution at a row, [V].
    """
    kids = children_lists(parents)
    path: list[int] = []
    row = 0
    while True:
        p = np.array(target_probs(row), dtype=np.float64)
        accepted = None
        for c in kids[row]:
            x = int(tokens[c])
            mass = p.sum()
            if mass <= 0:
                break
            if rng.random() * mass < p[x]:
                accepted = c
                break
            p[x] = 0.0
        if accepted is None:
            if p.sum() <= 0:  # every candidate rejected and nothing left: cannot happen when p > 0
                p = np.array(target_probs(row), dtype=np.float64)
            bonus = int(rng.choice(p.shape[0], p=p / p.sum()))
            return Acceptance(path=path, tokens=[int(tokens[c]) for c in path] + [bonus])
        path.append(accepted)
        row = accepted + 1


@dataclass(frozen=True)
class KVMove:
    """KV entries to copy after acceptance: dst[i] <- src[i] (absolute positions in one sequence)."""

    src: list[int]  # [num_moves]
    dst: list[int]  # [num_moves]


def compaction_plan(path: list[int], base_len: int) -> KVMove:
    """Move the accepted nodes' KV entries next to the root's.

    During verification the root sits at position base_len and node i at base_len + 1 + i. After
    accepting path [p1, p2, ...] the k-th accepted node must sit at base_len + k.
    Example: base_len 10, path [1, 3]  (nodes at 12 and 14)  -> src [12, 14], dst [11, 12]
    Copying in order is safe: dst base_len + k <= src base_len + 1 + p_k, and every later source lies
    beyond every earlier destination because path indices increase.
    """
    src, dst = [], []
    for k, node in enumerate(path, start=1):
        if node + 1 != k:
            src.append(base_len + 1 + node)
            dst.append(base_len + k)
    return KVMove(src=src, dst=dst)
