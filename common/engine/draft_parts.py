"""The EAGLE-3 drafter's parts (common/engine/draft.py runs them): a sequence's state, the outputs of its step
functions, a launch behind a verify, the children of expanded nodes (the sampled draws' rule and its proof),
and the host's reading of the tree block into Trees."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from common import kernels
from common.config import SamplingConfig
from common.engine.base import Chained, ProposeAfter
from common.engine.cuda_graphs import pick_bucket
from common.tree import DraftQ, Tree, drop_subtrees


@dataclass
class DraftSeq:
    length: int  # committed pairs in the draft KV cache
    sampling: SamplingConfig  # temperature > 0: its children are drawn from q (the q rule); 0: the top-k tree
    seed: int  # its draws' (common.sampling.sequence_seed: independent of the verifier's)


@dataclass(frozen=True)
class Children:
    """The K children of each expanded node, in sampling order (_children)."""

    ids: torch.Tensor  # [B, F, K] draft ids
    score: torch.Tensor  # [B, F, K] log-probability added to the parent's score (the tree's shape)
    logq: torch.Tensor  # [B, F, K] log-probability each child was drawn with (the probs channel)
    q: torch.Tensor | None  # [B, F, W] q over the node's W best draft tokens (sampling rows; None: no sampling)


@dataclass(frozen=True)
class DraftOut:
    """_expand_step's outputs (static buffers under a graph)."""

    tree: torch.Tensor  # [B, 4, N] float64: base ids, parents (-1 = root), probs, q row (-1: none)
    q_ids: torch.Tensor  # [B, Q, W] int64 draft ids of q at the root (row 0) and each expanded node (host: to base)
    q_probs: torch.Tensor  # [B, Q, W] float32 their probabilities


@dataclass(frozen=True)
class AfterVerify:
    """Trees launched on the device after a verify (Eagle3Drafter.launch_after), until read_after reads them."""

    items: list[ProposeAfter]  # row i: the verify's item i (the caller's list: a chained launch over it reuses inputs)
    tree: torch.Tensor  # [B, 4, N] _expand_step's tree block, copied out of the graph's buffer
    took: torch.Tensor  # [B] new tokens each row took (the verify's accepted count + 1)
    m: torch.Tensor  # [B] each row's length before them
    ahead: int  # tokens of earlier chained launches the host had not counted when this one launched, at most
    chained: Chained  # the trees, for a verify that reads them on the device
    sampled: list[int]  # rows whose children were drawn from q (they get q)
    q: tuple[torch.Tensor, torch.Tensor] | None  # DraftOut's q_ids, q_probs [len(sampled), Q, W] of those rows
    start: torch.cuda.Event | None  # timing events around the drafting on the drafter's stream (None on CPU)
    done: torch.cuda.Event | None
    eager_s: float  # the launch's wall (on CPU: the whole drafting)
    # what a chained launch over the same items reuses (with chained's depth and keep_max, sampled): the graph key,
    # the inputs the drafting read (packed [BB, L + 5] with the host's columns, hidden [BB, L, 3H]: the graph's
    # buffers, rewritten in place), the noise block, the rows' lengths [B] as the host had them (the context check)
    key: tuple
    inputs: tuple[torch.Tensor, torch.Tensor]
    noise: dict[str, torch.Tensor]
    lengths: np.ndarray

    def seconds(self) -> float:
        """The drafting's device time (once done): between the events on a GPU, the eager wall on CPU."""
        return self.start.elapsed_time(self.done) / 1e3 if self.start is not None else self.eager_s


ACCEPT_TOKENS = 4096  # rows x tokens of the largest captured accept pass (its hidden input: 14 MB in bf16)


@dataclass(frozen=True)
class Frontier:
    """A level's expanded nodes, best first (kernels.draft_level's outputs)."""

    tok: torch.Tensor  # [B, K] draft ids
    score: torch.Tensor  # [B, K] float32 cumulative log-probabilities
    id: torch.Tensor  # [B, K] creation indices among the candidates
    hidden: torch.Tensor  # [B, K, H] the head's output at each node's parent (fed back with the node)
    anc: torch.Tensor  # [B, K, S] bool: the scratch entries each node sees (its ancestors and itself)
    embeds: torch.Tensor  # [B, K, H] the nodes' token embeddings


def _children(
    logp: torch.Tensor,
    ids: torch.Tensor,
    temp: torch.Tensor | None,
    seed: torch.Tensor | None,
    counter: torch.Tensor,
    level: int,
    k: int,
) -> Children:
    """The children of F expanded nodes per sequence. logp, ids [B, F, W]: the W best draft tokens of
    each node, descending; temp [B] each sequence's temperature (0: top-k children); seed [B] its draws'
    seed, counter [B] the committed length, level the nodes' (0: the root): node f's Gumbel noise is
    hashed from them (common.kernels.draft_children). temp and seed None: every row is a top-k row and q
    is None (a batch without sampling sequences: its graph has no draws at all).

    Top-k rows keep the K best, scored by their log-probability (EAGLE-2). Sampled rows draw K tokens
    from q = softmax(logp / T) over the W (Gumbel-top-K: the keys log q + g in descending order are
    draws without replacement, in sampling order; tokens with log q below common.kernels.sampling's
    LOG_Q_FLOOR are outside q:
    they come last with key -inf, score -inf and q 0, and the host drops them), and the i-th draw is
    scored as the top-k tree scores its i-th child, by the i-th LARGEST draft log-probability, not by
    its own: a child's score then depends on its parent alone, never on what was drawn. (Scoring by
    the i-th largest log q at the temperature instead measured the same within noise; cutting q by the
    request's top-p, which shrinks the trees, measured worse: docs/benchmarks.md.)
    Why the verifier's q rule stays lossless (common.acceptance.accept_sampled_q, condition 2): child i
    of v sits in the final tree iff fewer than `keep` candidates outrank it (higher score, or equal and
    created earlier). Children i' >= i of v and everything below them score <= s(v, i) and are created
    after child i, so they never outrank it; and a frontier (top-K) that one of them enters only displaces
    a candidate scoring no more than s(v, i), whose descendants cannot outrank child i either. So which
    candidates outrank child i, hence whether v keeps it, is fixed before its draw: the kept children of
    every node are a prefix of its sampling order whose length is a stopping time (test_sampling_rule.py
    checks the prefix on random trees, and the resulting distribution).
    Example (K 2, W 3, temperature 0.5): logp [-.1, -1, -3] -> log q [-.15, -1.95, -5.95]; keys
    log q + g = [-.9, .4, -4.5] -> ids of [1, 0], scores [-.1, -1] (the two largest logp, in rank
    order), logq of the drawn [-1.95, -.15]."""
    if temp is None or seed is None:
        return Children(ids=ids[..., :k], score=logp[..., :k], logq=logp[..., :k], q=None)
    kid, score, logq, q = kernels.draft_children(logp, ids, temp, seed, counter, level, k)
    return Children(ids=kid, score=score, logq=logq, q=q)


@dataclass(frozen=True)
class Root:
    """The head's output at each sequence's last committed pair: where the tree grows from."""

    hidden: torch.Tensor  # [B, H] fed back with the depth-1 nodes
    logp: torch.Tensor  # [B, W] the W best draft log-probabilities, descending (W: Eagle3Drafter._width)
    ids: torch.Tensor  # [B, W] their draft-vocabulary ids


def trees_of(
    res: np.ndarray, keeps: list[int], sampled: list[int], q: tuple[np.ndarray, np.ndarray] | None, d2t: np.ndarray
) -> list[Tree]:
    """res [B, 4, N] from _expand_step -> one Tree per sequence with its first keep nodes; the rows
    `sampled` also get q (q_ids in draft ids, q_probs [len(sampled), Q, W]) at each tree row with children;
    d2t [Vd]: the head's draft -> base id offsets.
    Example: parents [-1, -1, 0], q rows of the nodes [1, 2, -1] -> tree rows with children [0, 1],
    q rows [0, 1] (the root's is 0)."""
    b, n = len(keeps), res.shape[2]
    # the batch's columns converted once (rows are views of them): at 64 sequences a round reads 64 trees
    tokens, parents_all, probs = res[:b, 0].astype(np.int64), res[:b, 1].astype(np.int64), res[:b, 2].astype(np.float32)
    cols = np.arange(n)
    kept = cols[None, :] < np.asarray(keeps)[:, None]  # [B, N]
    if (kept & (parents_all >= cols[None, :])).any():
        raise ValueError("tree selection dropped a parent while keeping its child")
    where = {i: j for j, i in enumerate(sampled)}  # row -> its q row
    trees = []
    for i, keep in enumerate(keeps):
        j = where.get(i)
        if j is None:  # top-k children: the first keep nodes
            trees.append(Tree(tokens=tokens[i, :keep], parents=parents_all[i, :keep], probs=probs[i, :keep]))
            continue
        # drop the draws from outside q (probability 0) and what hangs below them
        nodes, parents = drop_subtrees(parents_all[i, :keep], res[i, 2, :keep] == 0)
        rows = np.unique(parents + 1)  # [R] tree rows with children, ascending
        q_rows = np.where(rows == 0, 0, res[i, 3, nodes[np.maximum(rows - 1, 0)]]).astype(np.int64)
        if (q_rows < 0).any():
            raise ValueError("a kept node has children but was never expanded")
        q_ids = q[0][j, q_rows]  # [R, W] draft ids
        draft_q = DraftQ(rows=rows, ids=q_ids + d2t[q_ids], probs=q[1][j, q_rows])
        trees.append(Tree(tokens=tokens[i, nodes], parents=parents, probs=probs[i, nodes], q=draft_q))
    return trees


def accept_block(b: int, length: int, trash: int) -> torch.Tensor:
    """An all-padding accept block [b, L + 5]: length 0, one new token, the trash slot, keep 1, depth 1."""
    a = np.zeros((b, length + 5), dtype=np.int64)
    a[:, length + 1] = 1
    a[:, length + 2] = trash
    a[:, length + 3] = 1
    a[:, length + 4] = 1
    return torch.from_numpy(a)


def expand_block(b: int, trash: int) -> torch.Tensor:
    """An all-padding expand block [b, 4]: length 0, the trash slot, keep 1, depth 1."""
    a = np.zeros((b, 4), dtype=np.int64)
    a[:, 1] = trash
    a[:, 2] = 1
    a[:, 3] = 1
    return torch.from_numpy(a)


def gather_index(counts: list[int], bb: int, length: int) -> np.ndarray:
    """[bb, L] the row of each accept input among the items' rows laid one after the other (counts[i] rows of
    item i), the zero row (sum(counts)) for padding. Example: counts [2, 1], bb 3, L 3 ->
    [[0, 1, 3], [2, 3, 3], [3, 3, 3]]."""
    src = np.full((bb, length), sum(counts), dtype=np.int64)
    offset = 0
    for i, k in enumerate(counts):
        src[i, :k] = offset + np.arange(k)
        offset += k
    return src


def accept_span(rows: int, longest: int, buckets: tuple[int, ...], pad: bool) -> int:
    """New tokens a row takes per accept pass of `rows` (a batch bucket) when the longest item brings
    `longest`: all of them when their rows x tokens bucket has a graph (or nothing is padded to buckets: pad),
    else the largest tokens bucket that has one at these rows, in as many passes as it takes. An eager
    pass costs about 16 ms of launches on an H100 and allocates its logits at full size (16 rows x 512
    tokens: 0.8 GB), and its first run in a process may compile kernels; several replays cost what their
    matmuls cost.
    Example: buckets (32, ..., 512), ACCEPT_TOKENS 4096: 16 rows, 300 tokens -> 256 (passes of 256 and
    44); 8 rows, 300 tokens -> 300 (one pass, bucket 512)."""
    fitting = [t for t in buckets if rows * t <= ACCEPT_TOKENS]
    if not pad or not fitting or (pick_bucket(longest, buckets) or longest) in fitting:
        return longest
    return fitting[-1]


def noise_block(b: int, states: list[DraftSeq] | None = None) -> dict[str, torch.Tensor]:
    """temp [b] float32 and seed [b] int64 of the sequences (the rest: padding, top-k rows, temperature
    0): what a sampled variant's draws read. {} when none samples (the steps' top-k variant); states
    None: the block of padding rows a sampled variant captures."""
    if states is not None and all(st.sampling.greedy for st in states):
        return {}
    temp = np.zeros(b, dtype=np.float32)
    seed = np.zeros(b, dtype=np.int64)
    for i, st in enumerate(states or []):
        temp[i], seed[i] = st.sampling.temperature, st.seed
    return {"temp": torch.from_numpy(temp), "seed": torch.from_numpy(seed)}
