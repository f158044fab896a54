"""Sampling steps on the device, composed of common.kernels' operations: a batch's next tokens (plain
decoding, the prefill's first token) and the lossless acceptance of sampled trees (the verify step). Both
run inside the verifier's captured graphs: static shapes, no host synchronisation, random numbers from
each sequence's seed and counter (common.kernels.sampling). On a GPU each is two Triton kernels: one for
the target (its threshold searched without a sort when a row has top-k or top-p), one for the draw or the
acceptance.

Greedy rows keep the argmax the caller computed (bit for bit the greedy step's).
"""

from __future__ import annotations

import torch

from common import kernels
from common.kernels.sampling import SamplingRows, Target, TreeSets


def target(logits: torch.Tensor, rows: SamplingRows, per: int, filtered: bool) -> Target:
    """Each row's target: logits [R, V], row r of sequence r // per. filtered False: no sequence has top-k or
    top-p (no theta, one pass for the normaliser); True: each row's threshold (sampling.target_threshold)."""
    if filtered:
        return kernels.target_threshold(logits, rows, per)
    return Target(theta=None, logz=kernels.row_logz(logits, rows.temperature, per))


def sample_next(logits: torch.Tensor, greedy: torch.Tensor, rows: SamplingRows, filtered: bool) -> torch.Tensor:
    """The next token of each row [R] int64: greedy [R] (the caller's argmax, contiguous) where the temperature
    is 0, else a draw from the row's target over logits [R, V] (sample_tokens with its seed and counter)."""
    theta = kernels.target_threshold(logits, rows).theta if filtered else None
    token, _ = kernels.sample_tokens(logits, rows.temperature, theta, rows.seed, rows.counter, greedy=greedy)
    return token


def accept_sampled_tree(
    ids: torch.Tensor,
    parent_rows: torch.Tensor,
    anc: torch.Tensor,
    depth: torch.Tensor,
    logits: torch.Tensor,
    sets: TreeSets,
    rows: SamplingRows,
    siblings: int,
    filtered: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The sampled acceptance of a batch of trees (common.kernels.accept_sampled, which gives the rule), each
    row's target computed first: logits [B, T, V] the base model's at every tree row; rows [B] (counter: the
    root's position); siblings: S, at least every row's children. Returns (result [B, T + 1], src [B, T])
    as reference.accept_tree, for every row as if every row sampled."""
    b, t, v = logits.shape
    tgt = target(logits.view(b * t, v), rows, t, filtered)
    return kernels.accept_sampled(ids, parent_rows, anc, depth, logits, sets, tgt, rows, siblings)
