"""Which drafted tokens the base model accepts, and how its KV cache is compacted afterwards.

Plain Python/numpy, one tree at a time: the specification of the engines' acceptance on the device
(common.kernels.reference.accept_tree, common.kernels.speculative.accept_sampled_tree), which the tests
compare with it. The caller supplies the base model's choices or distributions per tree row (row 0 =
root, row i + 1 = node i, see common/tree.py) and gets back the accepted path.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from common.tree import DraftQ, children_lists


@dataclass(frozen=True)
class Acceptance:
    """Result of verifying one tree."""

    path: list[int]  # [num_accepted] accepted node indices, depth 1 first
    tokens: list[int]  # [num_accepted + 1] the accepted nodes' tokens, then the bonus token

    @property
    def num_accepted(self) -> int:
        return len(self.path)


class Draws(Protocol):
    """The random numbers of the sampled rules: the uniform of each node's acceptance test, and the bonus."""

    def accept(self, node: int) -> float: ...  # uniform [0, 1) of the test of node `node` (tree row node + 1)
    def token(self, p: np.ndarray) -> int: ...  # a token drawn from p [V] (normalised)


@dataclass
class GeneratorDraws:
    """Draws from a numpy generator, in the order the rules ask for them."""

    rng: np.random.Generator

    def accept(self, node: int) -> float:
        return float(self.rng.random())

    def token(self, p: np.ndarray) -> int:
        return int(self.rng.choice(p.shape[0], p=p))


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
    tokens: np.ndarray, parents: np.ndarray, target_probs: Callable[[int], np.ndarray], draws: Draws
) -> Acceptance:
    """Lossless multi-draft rejection sampling with the drafts treated as one-hot proposals.

    The dynamic tree picks children deterministically (top-k), so each child is a point-mass proposal:
    at a row with target distribution p, child x is accepted with probability p(x); on rejection
    p <- normalize(p with x removed) and the next child is tried; if every child is rejected the token
    is sampled from the residual p. Summed over the branches, every token keeps exactly probability
    p(token): the output distribution equals the base model's (SpecInfer's rule with q = one-hot).

    target_probs(row) returns the processed (temperature, top-k, top-p) distribution at a row, [V].
    """

    def row_rule(row: int, children: list[int], p: np.ndarray) -> tuple[int | None, np.ndarray]:
        target = p.copy()
        for c in children:
            x = int(tokens[c])
            mass = p.sum()
            if mass <= 0:
                break
            if draws.accept(c) * mass < p[x]:
                return c, p
            p[x] = 0.0
        # every candidate rejected and nothing left cannot happen when p > 0: then the target itself
        return None, (p if p.sum() > 0 else target)

    return _descend(tokens, parents, target_probs, draws, row_rule)


def accept_sampled_q(
    tokens: np.ndarray,
    parents: np.ndarray,
    q: DraftQ,
    target_probs: Callable[[int], np.ndarray],
    draws: Draws,
) -> Acceptance:
    """Lossless recursive rejection sampling over siblings drawn from the draft's q without replacement.

    At a row with target p whose children x_1, x_2, ... (node order = sampling order) were drawn from q
    one after another without replacement: q_i is q with x_1..x_{i-1} removed and renormalised; x_i is
    accepted with probability min(1, p(x_i) / q_i(x_i)); on rejection p <- normalize(max(p - q_i, 0))
    and the next sibling is tried; when every child is rejected the bonus is drawn from the last p.
    Worked example: p = [.5, .3, .2], q = [.6, .4, 0], two children; they come in order [0, 1] with
    probability .6 and [1, 0] with probability .4.
        [0, 1]: child 0, q_1 = [.6, .4, 0]: accept w.p. .5/.6;  else p <- normalize([0, 0, .2]) = [0, 0, 1]
                child 1, q_2 = [0, 1, 0]:   accept w.p. 0;      else p stays [0, 0, 1] -> bonus 2
                -> token 0 w.p. 5/6, token 2 w.p. 1/6
        [1, 0]: child 1, accept w.p. .3/.4; else p <- [0, 0, 1]; child 0 never -> token 1 .75, token 2 .25
        overall: P(0) = .6 * 5/6 = .5,  P(1) = .4 * .75 = .3,  P(2) = .6/6 + .4/4 = .2   = p
    Why the output is p (SpecInfer, Miao et al. 2023, with sampling without replacement): at one
    step, P(output x_i = y) = q_i(y) min(1, p(y) / q_i(y)) = min(p, q_i)(y), the rejection mass is
    sum(max(p - q_i, 0)), and continuing with p' = normalize(max(p - q_i, 0)) gives
    min(p, q_i) + max(p - q_i, 0) = p, whatever x_i was (p' does not depend on it). By induction over
    the siblings, the token leaving a row is distributed as its p, given anything decided before the
    row was reached. This needs two things of the draft, or the sum breaks:
      1. the children really are drawn from q in node order, without replacement (Gumbel-top-k of
         log q: the keys in descending order are such a sequence of draws);
      2. whether a row keeps its i-th child is decided without looking at the i-th or later draws
         (or anything drafted below them): the kept children of every row are a PREFIX of its
         sampling order, and the length of that prefix is a stopping time. A rule that kept x_i
         because of its value would bias it: with p = [.5, .5], q = [.9, .1] and "keep x_1 only if
         it is token 1", token 1 comes out with probability .45 + .1 = .55.
    common/engine/draft.py meets 2. by scoring the i-th drawn child of v with v's score plus the i-th
    largest draft log-probability at v, which depends on v alone, not on what was drawn (its _children).

    q [R, M]: the draft's q at every row with children (DraftQ); target_probs(row) -> p at that row [V].
    """

    def row_rule(row: int, children: list[int], p: np.ndarray) -> tuple[int | None, np.ndarray]:
        if not children:
            return None, p
        q_ids, q_probs = _q_at(q, row)
        left = q_probs.copy()  # [M] q without the siblings already drawn
        for c in children:
            x = int(tokens[c])
            j = int(np.flatnonzero(q_ids == x)[0])
            qi = left / left.sum()  # [M] q_i
            if draws.accept(c) * qi[j] < p[x]:
                return c, p
            residual = p.copy()
            residual[q_ids] = np.maximum(p[q_ids] - qi, 0.0)
            if residual.sum() <= 0:  # rejection had probability 0 (p = q_i); rounding got here
                break
            p = residual / residual.sum()
            left[j] = 0.0
        return None, p

    return _descend(tokens, parents, target_probs, draws, row_rule)


RowRule = Callable[[int, list[int], np.ndarray], tuple[int | None, np.ndarray]]


def _descend(
    tokens: np.ndarray,
    parents: np.ndarray,
    target_probs: Callable[[int], np.ndarray],
    draws: Draws,
    row_rule: RowRule,
) -> Acceptance:
    """The walk both sampling rules share: from the root, row_rule(row, its children, p [V] float64) says
    which child is accepted, or None and the distribution left to draw the bonus from; an accepted child's
    row is next."""
    kids = children_lists(parents)
    path: list[int] = []
    row = 0
    while True:
        accepted, p = row_rule(row, kids[row], np.array(target_probs(row), dtype=np.float64))
        if accepted is None:
            bonus = draws.token(p / p.sum())
            return Acceptance(path=path, tokens=[int(tokens[c]) for c in path] + [bonus])
        path.append(accepted)
        row = accepted + 1


def _q_at(q: DraftQ, row: int) -> tuple[np.ndarray, np.ndarray]:
    """q at a row with children as (ids [M] int64, probs [M] float64); ValueError when it has none."""
    at = q.at(row)
    if at is None:
        raise ValueError(f"tree row {row} has children but the tree carries no q for it")
    return np.asarray(at[0], dtype=np.int64), np.asarray(at[1], dtype=np.float64)


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
