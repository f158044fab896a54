"""Acceptance and KV compaction against hand-computed expectations, and losslessness of sampling."""

import numpy as np

from common.acceptance import GeneratorDraws, accept_greedy, accept_sampled, compaction_plan
from common.config import SamplingConfig
from common.sampling import target_distribution

A, B, C, D, X, Y, Z = 10, 11, 12, 13, 20, 21, 22
TOKENS = np.array([A, B, C, D])
PARENTS = np.array([-1, -1, 0, 1])


def test_greedy_follows_the_matching_branch():
    # root wants b (node 1), node 1 wants d (node 3), node 3 wants z -> bonus
    acc = accept_greedy(TOKENS, PARENTS, np.array([B, X, D, Y, Z]))
    assert acc.path == [1, 3]
    assert acc.tokens == [B, D, Z]


def test_greedy_rejects_everything():
    acc = accept_greedy(TOKENS, PARENTS, np.array([X, A, A, A, A]))
    assert acc.path == [] and acc.tokens == [X]


def test_greedy_needs_the_parent_accepted():
    # node 2 (c) matches what node 0 wants, but node 0 itself is rejected at the root
    acc = accept_greedy(TOKENS, PARENTS, np.array([X, C, C, C, C]))
    assert acc.tokens == [X]


def test_compaction_plan_worked_example():
    move = compaction_plan([1, 3], base_len=10)  # nodes at 12 and 14 -> 11 and 12
    assert (move.src, move.dst) == ([12, 14], [11, 12])
    assert compaction_plan([0, 2], base_len=5).src == [8]  # node 0 already at 6; node 2 (at 8) -> 7
    assert compaction_plan([], base_len=5).src == []


def test_sampled_acceptance_is_lossless():
    """The first committed token is distributed exactly as the target p, whatever the drafts are."""
    p = np.array([0.5, 0.3, 0.15, 0.05])
    tokens = np.array([1, 3, 0])  # three siblings under the root, in draft order
    parents = np.array([-1, -1, -1])
    rng = GeneratorDraws(np.random.default_rng(0))
    n = 40000
    counts = np.zeros(4)
    for _ in range(n):
        acc = accept_sampled(tokens, parents, lambda row: p if row == 0 else np.full(4, 0.25), rng)
        counts[acc.tokens[0]] += 1
    freq = counts / n
    assert np.abs(freq - p).max() < 0.01, freq


def test_target_distribution_top_k_top_p():
    logits = np.log(np.array([0.5, 0.3, 0.15, 0.05]))
    p = target_distribution(logits, SamplingConfig(temperature=1.0, top_k=2))
    assert np.allclose(p, [0.625, 0.375, 0, 0])
    p = target_distribution(logits, SamplingConfig(temperature=1.0, top_p=0.8))
    assert np.allclose(p, [0.625, 0.375, 0, 0])  # 0.5 + 0.3 reaches 0.8
    p = target_distribution(logits, SamplingConfig(temperature=1.0, top_p=0.81))
    assert np.allclose(p, np.array([0.5, 0.3, 0.15, 0]) / 0.95)


def test_target_distribution_keeps_ties_of_the_last_token_kept():
    """Both filters keep every token tied with the last one they keep (the device keeps tokens at or above
    one logit): [2, 1, 1, 0] at top_p .6 reaches .6 at the first 1 (.48 + .18 = .66), so both 1s stay;
    top_k 2 keeps them too."""
    logits = np.array([2.0, 1.0, 1.0, 0.0])
    e = np.exp(logits[:3])
    for cfg in (SamplingConfig(temperature=1.0, top_p=0.6), SamplingConfig(temperature=1.0, top_k=2)):
        np.testing.assert_allclose(target_distribution(logits, cfg), np.append(e / e.sum(), 0))
