"""The verifier engine's parts (common/engine/verifier.py runs them): its configuration, a sequence's state, the
outputs of its step functions, the samplers its graphs are captured for, the column layout of a sampled verify
block, and the host-side grouping of prefills and depth of trees."""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

import numpy as np
import torch

from common import kernels
from common.config import SamplingConfig
from common.engine.base import Chained, PrefillInput
from common.kernels.sampling import RULE_ONEHOT, RULE_Q, SamplingRows
from common.tree import Tree, node_positions, row_sets


def prefill_groups(lengths: list[int], waste: float = 1.5, max_rows: int | None = None) -> list[list[int]]:
    """Indices of prompts (or chunks) to prefill in one forward each: longest first, a group growing while
    its padded size (members x its longest) stays within `waste` x its real tokens and it has fewer than
    max_rows members (the most rows a captured prefill graph takes: a larger group would run eagerly).
    Example: lengths [30, 500, 28, 4, 3] -> [[1], [0, 2, 3], [4]]: 500 alone (2 x 500 > 1.5 x 530); 30, 28
    and 4 pad to 3 x 30 = 90 for 62 tokens (<= 93); 3 more would make 120 for 65 (> 97.5). With max_rows 2:
    [[1], [0, 2], [3, 4]]."""
    if waste < 1:
        raise ValueError(f"waste must be >= 1, got {waste}")
    groups: list[list[int]] = []
    real = 0
    for i in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
        g = groups[-1] if groups else None
        room = g is not None and (max_rows is None or len(g) < max_rows)
        if room and (len(g) + 1) * lengths[g[0]] <= waste * (real + lengths[i]):
            g.append(i)
            real += lengths[i]
        else:
            groups.append([i])
            real = lengths[i]
    return groups


PREFILLING = -1  # VerifierSeq.pending while a prompt's chunks (or its launched prefill's read) are due


@dataclass
class VerifierSeq:
    length: int  # tokens whose K/V are in the cache (or queued there by a launched prefill)
    pending: int  # last chosen token, not yet in the cache (the next tree's root); PREFILLING before the first
    sampling: SamplingConfig
    draw: np.ndarray  # [3] int64 its sampling and seed as the steps read them (SamplingRows.pack)


@dataclass(frozen=True)
class PrefillLaunch:
    """A prefill queued on the device beside the rounds (Verifier.prefill_launch); prefill_read reads it."""

    items: list[PrefillInput]  # [N] the sequences it created or continued (freed when it fails)
    rows: list[tuple[int, torch.Tensor]]  # (item index, its features [T, 3H] on the device), in the tokens' order
    tokens: tuple[torch.Tensor, torch.cuda.Event | None]  # [N] the chosen tokens on the host, once the event passed


@dataclass(frozen=True)
class VerifierConfig:
    max_sequences: int = 8
    max_context: int = 2048
    max_tree_nodes: int = 64
    dtype: str = "float32"
    device: str = "cpu"
    # W: tokens per tree row a captured sampled verify follows (the draft's q width; wider trees run eagerly)
    q_width: int = 32
    # slots beyond max_sequences for prompts prefilled while a call runs (CoreConfig.prefill_ahead): no batch bucket
    # counts them, they join a call once running sequences leave it
    prefill_ahead: int = 0

    def __post_init__(self) -> None:
        if self.max_sequences < 1 or self.prefill_ahead < 0:
            raise ValueError(
                f"max_sequences must be >= 1 and prefill_ahead >= 0, got {self.max_sequences}, {self.prefill_ahead}"
            )
        if self.max_context < 16:
            raise ValueError(f"max_context must be >= 16, got {self.max_context}")
        if self.max_tree_nodes < 1:
            raise ValueError(f"max_tree_nodes must be >= 1, got {self.max_tree_nodes}")
        if self.dtype not in ("float32", "bfloat16", "float16"):
            raise ValueError(f"dtype must be float32, bfloat16 or float16, got {self.dtype!r}")
        if not 1 <= self.q_width <= 256:
            raise ValueError(f"q_width must be in [1, 256], got {self.q_width}")


def torch_dtype(name: str) -> torch.dtype:
    return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[name]


SHALLOW_DEPTH = 8  # trees at most this deep (every dynamic tree of up to 8 steps) take 3 doubling rounds
SIBLINGS = 16  # children per row a captured sampled verify takes (the draft's top_k is 10; wider: eager)


class Sampler(Enum):
    """How a step chooses its tokens: a captured variant of the decode and verify steps each."""

    GREEDY = "greedy"  # every row greedy: the argmax, no sampling kernels (today's greedy graphs)
    TEMPERATURE = "temperature"  # a row samples, none with top-k or top-p: its target needs no sort
    FILTERED = "filtered"  # a row samples with top-k or top-p: a sort of every row's logits

    @classmethod
    def of(cls, samplings: list[SamplingConfig]) -> Sampler:
        hot = [s for s in samplings if not s.greedy]
        if not hot:
            return cls.GREEDY
        return cls.FILTERED if any(s.top_k > 0 or s.top_p < 1 for s in hot) else cls.TEMPERATURE


@dataclass(frozen=True)
class SampledColumns:
    """The sampled verify's int64 block [B, C] for trees of T rows and sets of W tokens (W even): columns
    [0, T) the root token, then the tree's tokens; [T, 2T) each row's parent row (the root and padding rows
    their own); [2T, 3T) each row's position in its parent row's set (common.tree.row_sets); n (the root's
    cache position); the slot; the rule (common.kernels.sampling.RULE_*); the sampling columns
    (SamplingRows, 3); the sets' ids [T * W] and their q [T * W] as float32 pairs [T * W / 2].
    C = 3T + 6 + 3TW / 2."""

    t: int
    w: int

    FIXED = 3 + SamplingRows.COLUMNS  # n, slot, rule, the sampling columns

    @classmethod
    def of(cls, columns: int, w: int) -> SampledColumns:
        return cls(t=(columns - cls.FIXED) * 2 // (6 + 3 * w), w=w)

    @property
    def pos(self) -> int:
        return 2 * self.t

    @property
    def n(self) -> int:
        return 3 * self.t

    @property
    def draw(self) -> int:  # after n, the slot and the rule
        return self.n + 3

    @property
    def ids(self) -> int:
        return self.draw + SamplingRows.COLUMNS

    @property
    def q(self) -> int:
        return self.ids + self.t * self.w

    @property
    def end(self) -> int:
        return self.q + self.t * self.w // 2


def tree_depth(parent_rows: np.ndarray) -> int:
    """The deepest row of a batch of trees in the verifier's row layout ([B, T], a root or padding row
    names itself): rows climb to their parents together, one step a level, over the batch flattened
    (row r of tree b is b * T + r), dropping those that reach a row naming itself.
    [[0, 0, 0, 1, 2, 5]] -> rows 1..4 climb to [0, 0, 1, 2]; rows 3, 4 (now at 1, 2) to [0, 0] -> 2"""
    b, t = parent_rows.shape
    up = (parent_rows + (t * np.arange(b))[:, None]).ravel()  # [B * T] each row's parent, flattened
    at = np.flatnonzero(up != np.arange(b * t))  # rows that have a parent (not roots or padding)
    depth = 0
    while at.shape[0]:
        depth += 1
        at = up[at]  # one level up
        at = at[up[at] != at]  # those not at a root yet
    return depth


@dataclass(frozen=True)
class VerifyStep:
    """Outputs of _verify_step (static buffers under a graph)."""

    result: torch.Tensor  # [B, T + 1] int64: accepted count, then the accepted tokens and the bonus
    kept: torch.Tensor  # [B, T, 3H] EAGLE features of the root and the accepted nodes, in path order


@dataclass(frozen=True)
class PrefillStep:
    """Outputs of _prefill_step (static buffers under a graph)."""

    logits: torch.Tensor  # [B, V] at each row's last real token
    greedy: torch.Tensor  # [B] their argmax (greedy rows read it; sampling rows draw from logits)
    aux: torch.Tensor  # [B, T, 3H] EAGLE features of every position


@dataclass(frozen=True)
class DecodeStep:
    """Outputs of _decode_step (static buffers under a graph)."""

    token: torch.Tensor  # [B] the next token (the argmax, or the draw of a sampling row)
    aux: torch.Tensor  # [B, 3H] EAGLE features of the step's row


CPU_CALIBRATION_ROWS = 16  # tree rows measured at start-up on a CPU (see Verifier.step_costs)


@dataclass(frozen=True)
class VerifyGraph:
    """The graph a verify call's rounds replay: its key and step, its tree bucket, the sampled layout (None:
    greedy) and the most children a chained round's one-hot trees may have (kids)."""

    key: tuple
    step: object
    tb: int
    cols: SampledColumns | None
    kids: int


def chained_block(
    prev: torch.Tensor,
    result: torch.Tensor,
    trees: Chained,
    tb: int,
    cols: SampledColumns | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """The next verify block of a chained round, built on the device: prev [BB, C] the block the last round
    verified (T = tb; cols None: verifier._verify_step's layout [BB, 2T + 3], else the sampled one of cols: its
    rows are greedy or one-hot, whose sets the verify builds from the trees), result [B, T + 1] its acceptance
    (count c, then the c accepted tokens and the bonus), trees the next trees of its first K rows (K <= B). Each
    of the B rows' root becomes its last token and its length grows by c + 1; row k < K gets its first keep[k]
    nodes (node j at row j + 1, its parent row parents[j] + 1), the other rows of those K a tree of padding (each
    its own parent); rows past K keep none. Example, tb 4: prev root 7 at n 10, result [1, 8, 9, ...], a tree
    [5, 6] with parents [-1, 0], keep 2 -> root 9 at n 12, tokens [9, 5, 6, 0], parent rows [0, 0, 1, 3]. Written
    into out when given (it may be prev: the graph's input buffer, which the next replay reads), else a new block."""
    n_col = 2 * tb if cols is None else cols.n
    return kernels.chained_block(prev, result, trees.tokens, trees.parents, trees.keep, tb, n_col, out)


def pack_trees(a: np.ndarray, trees: list[Tree], sizes: np.ndarray, tb: int) -> None:
    """The trees' tokens and parent rows into a verify block a [bb, >= 2 tb], all at once: node j of tree i is
    row j + 1 (columns j + 1 and tb + j + 1), its parent row parents[j] + 1 (-1, the root: row 0). sizes [B]:
    the trees' sizes. Example: trees [a, b] (parents [-1, 0]) and [c] ([-1]) -> items [0, 0, 1], rows [1, 2, 1]:
    a[0, 1:3] = [a, b], a[0, tb + 1 : tb + 3] = [0, 1], a[1, 1] = c, a[1, tb + 1] = 0"""
    if not sizes.sum():  # every tree a root alone
        return
    item, node = node_positions(sizes)  # [N] each
    a[item, node + 1] = np.concatenate([t.tokens for t in trees])
    a[item, tb + node + 1] = np.concatenate([t.parents for t in trees]) + 1


def pack_sampled(a: np.ndarray, trees: list[Tree], states: list[VerifierSeq], cols: SampledColumns) -> None:
    """Each row's rule and sampling, and the q rule rows' sets (common.tree.row_sets), into a sampled block
    a [bb, C] whose trees are packed (trees and states: its rows'); a one-hot row's sets the verify builds."""
    b = len(trees)
    hot = [i for i, st in enumerate(states) if not st.sampling.greedy]
    a[:b, cols.draw : cols.ids] = np.stack([st.draw for st in states])
    a[hot, cols.n + 2] = [RULE_Q if trees[i].q is not None else RULE_ONEHOT for i in hot]
    drawn = [i for i in hot if trees[i].q is not None]
    if not drawn:
        return
    sets = row_sets([trees[i] for i in drawn], cols.t, cols.w)
    a[drawn, cols.pos : cols.n] = sets.pos
    a[drawn, cols.ids : cols.q] = sets.ids.reshape(len(drawn), -1)
    a[drawn, cols.q : cols.end] = sets.q.reshape(len(drawn), -1).view(np.int64)
