"""Sampling on the device (common.kernels.sampling and speculative, their PyTorch code on CPU) against its
specification on the host: the target's filters (common.sampling.target_distribution), the draws, the
draft's children draws, and the sampled acceptance decision for decision (common.acceptance, given the
device's own random numbers). tests/test_sampling_rule.py checks the resulting distributions."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from common.acceptance import accept_sampled, accept_sampled_q
from common.config import SamplingConfig
from common.kernels import sampling
from common.kernels.sampling import ACCEPT, TOKEN, SamplingRows, children_table, gumbel, mix32, row_key, uniform
from common.sampling import target_distribution
from common.tree import DraftQ, Tree
from tests.test_sampling_rule import chi2_pvalue, device_accept


def _rows(cfg: SamplingConfig, seeds: list[int], vocab: int, counter: int = 0) -> SamplingRows:
    packed = np.stack([SamplingRows.pack(cfg, s, vocab) for s in seeds])
    return SamplingRows.unpack(torch.from_numpy(packed), torch.full((len(seeds),), counter))


def test_random_numbers_are_a_fixed_function_of_their_key() -> None:
    """The same bits on every device and version (a seed reproduces an output): pinned values, uniform in
    (0, 1), and the seed's high word, the counter and the stream all change them."""
    key = row_key(torch.tensor([7]), torch.tensor([100]), TOKEN)
    assert key.tolist() == [994819030]
    assert mix32(key ^ mix32(torch.arange(4))).tolist() == [2133617034, 1897892256, 3658203725, 1041367572]
    u = uniform(key, torch.arange(4))
    assert u.tolist() == [(b // 512 + 0.5) / 2**23 for b in (2133617034, 1897892256, 3658203725, 1041367572)]
    many = uniform(key, torch.arange(200000))
    assert many.min() > 0 and many.max() < 1 and abs(float(many.mean()) - 0.5) < 0.005
    assert uniform(torch.tensor([0]), torch.tensor([0])).item() > 0  # the extremes, exact: 2^-24 and 1 - 2^-24
    top = torch.tensor([(2**23 - 1 + 0.5) / 2**23], dtype=torch.float32)
    assert top.item() < 1 and torch.isfinite(-torch.log(-torch.log(top))).all()
    others = [
        row_key(torch.tensor([7 + 2**40]), torch.tensor([100]), TOKEN),
        row_key(torch.tensor([7]), torch.tensor([101]), TOKEN),
        row_key(torch.tensor([7]), torch.tensor([100]), ACCEPT),
    ]
    assert all(not torch.equal(uniform(k, torch.arange(4)), u) for k in others)


@pytest.mark.parametrize(
    "cfg",
    [
        SamplingConfig(temperature=0.7),
        SamplingConfig(temperature=0.7, top_p=0.9),
        SamplingConfig(temperature=1.3, top_k=5),
        SamplingConfig(temperature=0.5, top_k=20, top_p=0.6),
    ],
)
def test_target_threshold_is_the_host_target(cfg: SamplingConfig) -> None:
    """theta and logz give target_distribution's p, on logits with ties (rounded to bfloat16, as the model's
    are on a GPU) where both filters keep every tie of their last token."""
    gen = torch.Generator().manual_seed(0)
    logits = (torch.randn(6, 300, generator=gen) * 3).bfloat16().float()
    tgt = sampling.target_threshold(logits, _rows(cfg, [0] * 6, 300))
    p = torch.where(logits >= tgt.theta[:, None], torch.exp(logits / cfg.temperature - tgt.logz[:, None]), 0.0)
    for row, got in zip(logits.numpy(), p.numpy()):
        np.testing.assert_allclose(got, target_distribution(row, cfg), atol=1e-6)


def test_sampled_tokens_follow_the_target() -> None:
    """sample_tokens (Gumbel-max with each row's noise) against target_distribution: 20,000 draws of one
    row's target, each with its own counter."""
    cfg = SamplingConfig(temperature=0.8, top_p=0.9)
    logits = torch.tensor([[2.0, 1.5, 1.0, 0.3, 0.0, -1.0, -3.0, 0.9]])
    n = 20000
    rows = _rows(cfg, [5] * n, 8)
    rows = SamplingRows(rows.temperature, rows.top_k, rows.top_p, rows.seed, torch.arange(n))
    x = logits.expand(n, 8)
    tokens, _ = sampling.sample_tokens(
        x, rows.temperature, sampling.target_threshold(x, rows).theta, rows.seed, rows.counter
    )
    p = target_distribution(logits[0].numpy(), cfg)
    counts = np.bincount(tokens.numpy(), minlength=8)
    assert counts[p == 0].sum() == 0
    assert chi2_pvalue(counts, n * p) > 1e-3


def test_draft_children_draw_from_q_and_keep_top_k_rows() -> None:
    """A sampled row's first draw follows q = softmax(logp / T) (Gumbel-top-K), its K draws are distinct,
    ranked scores (the i-th largest logp) and logq of the drawn; a temperature-0 row keeps the top K; the
    same seed and counter draw the same children, another counter others."""
    logp = torch.log_softmax(torch.tensor([3.0, 2.5, 2.0, 1.0, 0.5, 0.0, -1.0, -2.0]), 0)
    n, k = 8000, 3
    lp = logp.expand(n, 1, 8).contiguous()
    ids = torch.arange(100, 108).expand(n, 1, 8).contiguous()
    temp = torch.full((n,), 0.7)
    temp[0] = 0.0
    kid, score, logq, q = sampling.draft_children(lp, ids, temp, torch.full((n,), 9), torch.arange(n), 0, k)
    assert kid[0, 0].tolist() == [100, 101, 102] and score[0, 0].tolist() == lp[0, 0, :k].tolist()
    want = torch.softmax(logp / 0.7, 0)
    torch.testing.assert_close(q[1, 0], want)
    counts = np.bincount((kid[1:, 0, 0] - 100).numpy(), minlength=8)
    assert chi2_pvalue(counts, (n - 1) * want.numpy()) > 1e-3
    assert all(len(set(r)) == k for r in kid[:, 0].tolist())
    torch.testing.assert_close(score[1:, 0], lp[1:, 0, :k])
    torch.testing.assert_close(logq[1:, 0], torch.log(want)[kid[1:, 0] - 100])
    again = sampling.draft_children(lp[:4], ids[:4], temp[:4], torch.full((4,), 9), torch.arange(4), 0, k)[0]
    assert torch.equal(again, kid[:4])
    later = sampling.draft_children(lp[:4], ids[:4], temp[:4], torch.full((4,), 9), torch.arange(4) + 10, 0, k)[0]
    assert not torch.equal(later[1:], kid[1:4])


def test_children_table_worked_example() -> None:
    # root r with nodes a, b; c under a; one padding row
    child, count = children_table(torch.tensor([[0, 0, 0, 1, 4]]), 2)
    assert child.tolist() == [[[1, 2], [3, 0], [0, 0], [0, 0], [0, 0]]]
    assert count.tolist() == [[2, 1, 0, 0, 0]]


class DeviceDraws:
    """The device's random numbers for one tree, as common.acceptance.Draws: node i's test reads
    uniform(row_key(seed, counter, ACCEPT), i + 1) (its tree row), the bonus is Gumbel-max over p with the
    TOKEN stream's noise."""

    def __init__(self, seed: int, counter: int) -> None:
        self.accept_key = row_key(torch.tensor([seed]), torch.tensor([counter]), ACCEPT)
        self.token_key = row_key(torch.tensor([seed]), torch.tensor([counter]), TOKEN)

    def accept(self, node: int) -> float:
        return float(uniform(self.accept_key, torch.tensor([node + 1]))[0])

    def token(self, p: np.ndarray) -> int:
        noise = gumbel(self.token_key, torch.arange(p.shape[0])).double().numpy()
        with np.errstate(divide="ignore"):
            return int(np.argmax(np.log(p) + noise))


def _random_trees(gen: np.random.Generator, n: int, v: int, with_q: bool) -> list[Tree]:
    """Random trees of 0..9 nodes: one-hot trees with random (repeating) tokens; q trees whose rows with
    children have a q over 5 distinct tokens (some of probability 0) and distinct children from its support."""
    trees = []
    for _ in range(n):
        size = int(gen.integers(0, 10))
        parents = np.array([int(gen.integers(-1, i)) for i in range(size)], dtype=np.int64)
        if not with_q:
            trees.append(Tree(gen.integers(0, v, size), parents, np.ones(size, np.float32)))
            continue
        tokens = np.zeros(size, dtype=np.int64)
        rows = np.unique(parents + 1)
        ids = np.stack([gen.choice(v, 5, replace=False) for _ in rows]) if size else np.zeros((0, 5), np.int64)
        probs = gen.dirichlet(np.ones(5), size=len(rows)) * (gen.random((len(rows), 5)) > 0.2)
        for r, row in enumerate(rows):
            kids = np.flatnonzero(parents + 1 == row)
            probs[r, : len(kids)] += 0.05  # room for every child in the support
            tokens[kids] = gen.permutation(ids[r, : len(kids)])
        probs = (probs / probs.sum(1, keepdims=True)).astype(np.float32) if size else np.zeros((0, 5), np.float32)
        trees.append(Tree(tokens, parents, np.ones(size, np.float32), DraftQ(rows, ids, probs)))
    return trees


def host_rule_differences(with_q: bool, cfg: SamplingConfig, device: str = "cpu", n: int = 300) -> list[int]:
    """Random trees (nodes 0 to 9, one-hot ones with repeated sibling tokens) under random logits on a
    12-token vocabulary, accepted on the device: the trees whose committed tokens differ from those of
    common.acceptance's rule walking the same tree with the device's random numbers."""
    gen = np.random.default_rng(3 + with_q)
    v = 12
    trees = _random_trees(gen, n, v, with_q)
    logits = gen.normal(size=(n, 10, v)).astype(np.float32) * 2  # [B, rows, V] every tree row's
    roots = gen.integers(0, v, n).tolist()
    seeds = gen.integers(0, 2**62, n).tolist()
    got = device_accept(trees, roots, lambda ids: logits[:, : ids.shape[1]], cfg, seeds, 17, device)
    differ = []
    for i, tree in enumerate(trees):

        def target(row: int, i: int = i) -> np.ndarray:
            return target_distribution(logits[i, row], cfg)

        draws = DeviceDraws(seeds[i], 17)
        if with_q:
            want = accept_sampled_q(tree.tokens, tree.parents, tree.q, target, draws)
        else:
            want = accept_sampled(tree.tokens, tree.parents, target, draws)
        if got[i] != want.tokens:
            differ.append(i)
    return differ


CFGS = [SamplingConfig(temperature=0.8, top_p=0.9), SamplingConfig(temperature=1.2, top_k=6)]


@pytest.mark.parametrize("with_q", [False, True])
@pytest.mark.parametrize("cfg", CFGS)
def test_device_acceptance_is_the_host_rule_on_the_same_draws(with_q: bool, cfg: SamplingConfig) -> None:
    """Tree for tree, the device's committed tokens are the host rule's given the same random numbers."""
    assert host_rule_differences(with_q, cfg) == []
