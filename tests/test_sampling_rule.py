"""The sampled acceptance is lossless: the q rule (common.acceptance.accept_sampled_q) and the one-hot rule
(accept_sampled), as the engines run them on the device (common.kernels.speculative.accept_sampled_tree,
its PyTorch code run eagerly on CPU: the acceptance, its residuals and bonus draws, and the target's
temperature and top-p, from each sequence's seed).

* hand-computed steps of the q rule on a three-token vocabulary (the host rule, the specification);
* the kept children of every node of a sampled tree are a prefix of its sampling order;
* a chi-square test of the first TWO committed tokens against the target's own chain, for both rules,
  on a six-token vocabulary, with trees built the way common/engine/draft.py builds them (a numpy model
  of its expansion: sampled children scored by rank, EAGLE-2 frontier, top-N selection), accepted on the
  device; the same test rejects a tree shape that looks at the drawn tokens and an acceptance that is
  given the wrong q (so it can fail);
* the real model's first tokens (SmolLM2 float32 with the shipped head on CPU, the drafter's draws on the
  device) against its own p.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, replace

import numpy as np
import pytest
import torch

from common.acceptance import accept_sampled_q
from common.config import SamplingConfig
from common.kernels import reference
from common.kernels.sampling import RULE_ONEHOT, RULE_Q, SamplingRows, TreeSets
from common.kernels.speculative import accept_sampled_tree
from common.sampling import target_distribution
from common.tree import (
    DraftQ,
    Tree,
    children_lists,
    drop_subtrees,
    node_positions,
    row_sets,
    select_top_nodes,
    validate_q,
    widest,
)


# ---- helpers ----
class ScriptedRng:
    """Draws (common.acceptance.Draws) whose uniforms are given in order, and whose bonus is the most likely
    token, recording the distribution it was asked to sample (so a test can check the residual)."""

    def __init__(self, uniforms: list[float]) -> None:
        self.uniforms = list(uniforms)
        self.asked: list[np.ndarray] = []

    def accept(self, node: int) -> float:
        return self.uniforms.pop(0)

    def token(self, p: np.ndarray) -> int:
        self.asked.append(np.asarray(p))
        return int(np.argmax(p))


def device_accept(
    trees: list[Tree],
    roots: list[int],
    logits_of: Callable[[np.ndarray], np.ndarray],
    cfg: SamplingConfig,
    seeds: list[int],
    counter: int,
    device: str = "cpu",
) -> list[list[int]]:
    """The engines' sampled acceptance (accept_sampled_tree: its PyTorch code on CPU, its kernels on a GPU)
    of a batch of trees, each below its root token: trees with q by the q rule, the others by the one-hot
    rule, the target cfg applied to logits_of(tokens [B, T]) -> [B, T, V] (row t's logits given its token)
    on the device, each tree's draws from its seed and the counter. Returns each tree's committed tokens
    (the accepted ones, the bonus)."""
    b = len(trees)
    sizes = np.array([t.size for t in trees], dtype=np.int64)
    t = 1 + int(sizes.max())
    ids = np.zeros((b, t), dtype=np.int64)
    ids[:, 0] = roots
    parent_rows = np.tile(np.arange(t), (b, 1))
    item, node = node_positions(sizes)
    if item.shape[0]:
        ids[item, node + 1] = np.concatenate([tr.tokens for tr in trees])
        parent_rows[item, node + 1] = np.concatenate([tr.parents for tr in trees]) + 1
    kids = max(widest(trees), 1)
    sets = row_sets(trees, t, max([kids] + [tr.q.ids.shape[1] for tr in trees if tr.q is not None]))

    def on(a: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(np.ascontiguousarray(a)).to(device)

    logits = on(logits_of(ids).astype(np.float32))  # [B, T, V]
    packed = np.stack([SamplingRows.pack(cfg, seed, logits.shape[-1]) for seed in seeds])  # as an engine packs
    rows = SamplingRows.unpack(on(packed), torch.full((b,), counter, device=device))
    rule = [RULE_Q if tr.q is not None else RULE_ONEHOT for tr in trees]
    sets_on = TreeSets(ids=on(sets.ids), q=on(sets.q), pos=on(sets.pos), rule=on(np.array(rule)))
    with torch.inference_mode():
        parent_t = on(parent_rows)
        anc, depth = reference.tree_mask(parent_t)
        result, _ = accept_sampled_tree(on(ids), parent_t, anc, depth, logits, sets_on, rows, kids, True)
    return [r[1 : r[0] + 2] for r in result.tolist()]


def chi2_pvalue(observed: np.ndarray, expected: np.ndarray) -> float:
    """Pearson's chi-square test of counts against expected counts; cells expected below 5 are pooled.
    The p-value by the Wilson-Hilferty approximation (no scipy here; good to a few percent at df >= 3)."""
    small = expected < 5
    obs = np.append(observed[~small], observed[small].sum())
    exp = np.append(expected[~small], expected[small].sum())
    keep = exp > 0
    obs, exp = obs[keep], exp[keep]
    stat = float(((obs - exp) ** 2 / exp).sum())
    df = obs.shape[0] - 1
    z = ((stat / df) ** (1 / 3) - (1 - 2 / (9 * df))) / math.sqrt(2 / (9 * df))
    return 0.5 * math.erfc(z / math.sqrt(2))


# ---- hand-computed steps ----
def test_q_rule_accepts_with_p_over_q() -> None:
    # p [.5, .3, .2], q [.6, .4, 0], children [0, 1]: child 0 is accepted when u < .5 / .6 = .833
    p, q = np.array([0.5, 0.3, 0.2]), DraftQ(rows=np.array([0]), ids=np.array([[0, 1]]), probs=np.array([[0.6, 0.4]]))
    tokens, parents = np.array([0, 1]), np.array([-1, -1])
    acc = accept_sampled_q(tokens, parents, q, lambda row: p, ScriptedRng([0.8]))
    assert acc.path == [0] and acc.tokens == [0, 0]  # row 1 has no children: its bonus (argmax of p)


def test_q_rule_residual_after_each_sibling() -> None:
    # u .9 rejects child 0: p <- normalize(max(p - q_1, 0)) = [0, 0, 1]; child 1: q_2 = [0, 1, 0] and
    # p(1) = 0, never accepted: p <- max([0, 0, 1] - [0, 1, 0], 0) = [0, 0, 1] -> bonus 2
    p, q = np.array([0.5, 0.3, 0.2]), DraftQ(rows=np.array([0]), ids=np.array([[0, 1]]), probs=np.array([[0.6, 0.4]]))
    rng = ScriptedRng([0.9, 0.0])
    acc = accept_sampled_q(np.array([0, 1]), np.array([-1, -1]), q, lambda row: p, rng)
    assert acc.path == [] and acc.tokens == [2]
    np.testing.assert_allclose(rng.asked[0], [0, 0, 1])


def test_q_rule_second_sibling_uses_q_without_the_first() -> None:
    # p [.2, .5, .3], q [.5, .3, .2], children [0, 1]; u .5 > .2/.5 rejects child 0:
    # p <- normalize([0, .2, .1]) = [0, 2/3, 1/3]; q_2 = [0, .3, .2] / .5 = [0, .6, .4];
    # child 1 is accepted when u < (2/3) / .6 > 1: always, even at u .99
    p = np.array([0.2, 0.5, 0.3])
    q = DraftQ(rows=np.array([0]), ids=np.array([[2, 0, 1]]), probs=np.array([[0.2, 0.5, 0.3]]))
    acc = accept_sampled_q(np.array([0, 1]), np.array([-1, -1]), q, lambda row: p, ScriptedRng([0.5, 0.99]))
    assert acc.path == [1]
    # with p [.2, .3, .5] instead: residual [0, .0, .3] -> [0, 0, 1]; child 1 never accepted
    p2 = np.array([0.2, 0.3, 0.5])
    rng = ScriptedRng([0.5, 0.0])
    acc = accept_sampled_q(np.array([0, 1]), np.array([-1, -1]), q, lambda row: p2, rng)
    assert acc.tokens == [2]
    np.testing.assert_allclose(rng.asked[0], [0, 0, 1])


def test_q_rule_needs_q_where_there_are_children() -> None:
    q = DraftQ(rows=np.array([1]), ids=np.array([[0, 1]]), probs=np.array([[0.5, 0.5]]))
    with pytest.raises(ValueError, match="row 0"):
        accept_sampled_q(np.array([0]), np.array([-1]), q, lambda row: np.ones(3) / 3, ScriptedRng([0.5]))


# ---- a numpy model of the drafter's sampled tree (common/engine/draft.py _expand_step) ----
@dataclass(frozen=True)
class Drafted:
    tokens: np.ndarray  # [N]
    parents: np.ndarray  # [N]
    q: DraftQ | None
    ranks: np.ndarray  # [N] each node's place in its parent's sampling order


def draft_tree(
    logq: np.ndarray,
    root: int,
    k: int,
    steps: int,
    keep: int,
    width: int,
    temperature: float,
    rng: np.random.Generator | None,
    score_by_rank: bool = True,
    cut_q: float = 1.0,
) -> Drafted:
    """The drafter's tree over a Markov draft: logq [V, V], row x the draft's log-probabilities of the
    token after x. rng None: the top-k tree (the one-hot rule's); else K children drawn from q (the W
    best tokens at `temperature`; cut at cut_q of mass, as the drafter cuts q at LOG_Q_FLOOR, to exercise
    dropping draws from outside q with their subtrees) by Gumbel-top-K, scored as the top-k tree scores
    its children, by rank (score_by_rank), or, wrongly, by their own log q.
    Candidates are created as the drafter creates them: the root's K, then K per frontier node per level;
    the frontier is the K best of a level, the tree the `keep` best (common.tree.select_top_nodes)."""
    tok, score, parent, qrow, rank, drawn = [], [], [], [], [], []
    q_ids, q_probs = [], []

    def expand(node: int, token: int, base: float) -> None:  # node: creation index, -1 = root
        lp = logq[token]
        best = np.argsort(-lp, kind="stable")[:width]  # [W] descending
        lq = lp[best] / (temperature if rng is not None else 1.0)
        lq = lq - np.logaddexp.reduce(lq)
        if rng is not None:
            before = np.cumsum(np.exp(lq)) - np.exp(lq)
            lq = np.where(before < cut_q - 1e-6, lq, -np.inf)
            lq = lq - np.logaddexp.reduce(lq)
        q_ids.append(best)
        q_probs.append(np.exp(lq))
        if node >= 0:
            qrow[node] = len(q_ids) - 1
        order = np.arange(k) if rng is None else np.argsort(-(lq + rng.gumbel(size=width)), kind="stable")[:k]
        for i, j in enumerate(order):
            tok.append(int(best[j]))
            by_rank = lp[best[i]] if lq[i] > -np.inf or rng is None else -np.inf
            score.append(base + (by_rank if score_by_rank or rng is None else lq[j]))
            parent.append(node)
            qrow.append(-1)
            rank.append(i)
            drawn.append(lq[j])

    expand(-1, root, 0.0)
    front = list(range(k))
    for _ in range(1, steps):
        start = len(tok)
        for f in front:
            expand(f, tok[f], score[f])
        level = np.arange(start, len(tok))
        front = level[np.argsort(-np.array(score)[level], kind="stable")[:k]].tolist()
    kept, new_parents = select_top_nodes(np.array(score), np.array(parent), keep)
    inside, new_parents = drop_subtrees(new_parents, np.array(drawn)[kept] == -np.inf)
    kept = kept[inside]
    tokens = np.array(tok)[kept]
    rows = np.unique(new_parents + 1)
    q = None
    if rng is not None:
        src = [0 if r == 0 else qrow[kept[r - 1]] for r in rows]
        q = DraftQ(rows=rows, ids=np.array(q_ids)[src], probs=np.array(q_probs)[src])
    return Drafted(tokens=tokens, parents=new_parents, q=q, ranks=np.array(rank)[kept])


def test_drop_subtrees_worked_example() -> None:
    # node 1 was drawn from outside q: it goes, and so do node 3 below it and node 4 below that
    kept, parents = drop_subtrees(np.array([-1, -1, 0, 1, 3]), np.array([0, 1, 0, 0, 0], dtype=bool))
    assert kept.tolist() == [0, 2] and parents.tolist() == [-1, 0]


def test_kept_children_are_a_prefix_of_their_sampling_order() -> None:
    """Worked example of the property: a node keeping its 1st and 3rd draws but not its 2nd would be
    ranks [0, 2]; every node's kept ranks must be [0, 1, ..., c - 1]. Random drafts, many trees."""
    rng = np.random.default_rng(1)
    for trial in range(200):
        table = np.log(rng.dirichlet(np.full(12, 0.3), size=12))
        keep = int(rng.integers(1, 20))
        t = draft_tree(table, 0, k=3, steps=4, keep=keep, width=6, temperature=0.8, rng=rng, cut_q=0.8)
        for kids in children_lists(t.parents):
            assert t.ranks[kids].tolist() == list(range(len(kids))), trial
        validate_q(t.tokens, t.parents, t.q)


def _two_tokens(rule: str, trials: int, score_by_rank: bool = True, cut_q: float = 1.0, wrong_q: bool = False) -> float:
    """p-value of the first two committed tokens against the target chain p(t1 | r) p(t2 | t1), every
    round's trees (one per trial, a batch) accepted on the device. wrong_q: the acceptance is told that the
    children were drawn from a uniform q over the same tokens (they were drawn from the draft's)."""
    v, k, steps, keep, width = 6, 2, 3, 5, 4
    gen = np.random.default_rng(7)
    draft_logits, target_logits = gen.normal(size=(v, v)) * 1.5, gen.normal(size=(v, v)) * 1.5
    cfg = SamplingConfig(temperature=0.7, top_p=0.9)
    target = np.array([target_distribution(target_logits[x], cfg) for x in range(v)])  # [V, V]
    logq = np.log(np.exp(draft_logits) / np.exp(draft_logits).sum(1, keepdims=True))
    draft_rng = np.random.default_rng(11)
    top_k_trees = {}  # the one-hot rule's tree of each root (deterministic)

    def tree_of(root: int) -> Tree:
        if rule != "q":
            if root not in top_k_trees:
                top_k_trees[root] = draft_tree(logq, root, k, steps, keep, width, cfg.temperature, None)
            t = top_k_trees[root]
        else:
            t = draft_tree(logq, root, k, steps, keep, width, cfg.temperature, draft_rng, score_by_rank, cut_q)
        q = t.q
        if wrong_q:
            q = DraftQ(rows=q.rows, ids=q.ids, probs=(q.probs > 0) / (q.probs > 0).sum(1, keepdims=True))
        return Tree(tokens=t.tokens, parents=t.parents, probs=np.ones(t.tokens.shape[0], np.float32), q=q)

    out: list[list[int]] = [[] for _ in range(trials)]
    for counter in range(2):  # a round commits at least one token
        todo = [i for i in range(trials) if len(out[i]) < 2]
        roots = [out[i][-1] if out[i] else 0 for i in todo]
        got = device_accept([tree_of(r) for r in roots], roots, lambda ids: target_logits[ids], cfg, todo, counter)
        for i, tokens in zip(todo, got):
            out[i] += tokens
    counts = np.zeros((v, v))
    for tokens in out:
        counts[tokens[0], tokens[1]] += 1
    expected = trials * target[0][:, None] * target  # [V, V]
    assert counts[expected == 0].sum() == 0  # tokens outside top-p never come out
    return chi2_pvalue(counts.ravel(), expected.ravel())


@pytest.mark.parametrize("rule, cut_q", [("q", 1.0), ("q", 0.8), ("onehot", 1.0)])
def test_rule_is_lossless_on_a_small_vocabulary(rule: str, cut_q: float) -> None:
    assert _two_tokens(rule, 10000, cut_q=cut_q) > 1e-3


def test_the_lossless_test_catches_a_shape_that_looks_at_the_draws() -> None:
    """Scoring a drawn child by its own log q lets the tree keep a later draw and drop an earlier one:
    the output is then biased, and the same test must say so."""
    assert _two_tokens("q", 10000, score_by_rank=False) < 1e-3


def test_the_lossless_test_catches_an_acceptance_with_the_wrong_q() -> None:
    """The q rule divides by the q the children were drawn from: told another one (uniform over the same
    tokens), the device acceptance is biased, and the same test must say so."""
    assert _two_tokens("q", 10000, wrong_q=True) < 1e-3


# ---- the real drafter and the real model (SmolLM2 float32, the shipped head, CPU) ----
@pytest.fixture(scope="module")
def real(checkpoint):
    from common.engine.base import PrefillInput
    from common.engine.verifier import Verifier, VerifierConfig
    from common.model.eagle3_io import load_eagle3
    from common.model_path import default_model_path
    from common.tokenizer import Tokenizer
    from services.draft.__main__ import DEFAULT_HEAD

    verifier = Verifier(checkpoint, VerifierConfig(max_sequences=2, max_context=256))
    head = load_eagle3(DEFAULT_HEAD, dtype=torch.float32)[0].eval()
    prompt = Tokenizer(default_model_path()).encode_chat([("user", "What should I cook tonight?")])
    pre = verifier.prefill(PrefillInput("r", prompt, SamplingConfig()))
    # the target's logits after the first token: the prefill step over prompt + [first] in the spare slot
    context = prompt + [pre.next_token]
    block = verifier._prefill_block(1, len(context))
    block[0, : len(context)] = torch.tensor(context)
    block[0, len(context) + 2] = len(context)
    with torch.inference_mode():
        logits = verifier._prefill_step(block).logits[0].numpy()
    return verifier, head, prompt, pre, logits


def _propose(real, rule: str, samplings: list[SamplingConfig], drafting=None):
    from common.config import DraftingConfig
    from common.engine.base import ProposeInput
    from common.engine.draft import Eagle3Drafter

    verifier, head, prompt, pre, _ = real
    drafting = drafting or DraftingConfig(sampling_rule=rule)
    drafter = Eagle3Drafter(head, verifier.model.embed_tokens, drafting, len(samplings), 256, "cpu")
    items = [ProposeInput.after_prefill(f"s{i}", prompt, pre, 60, s) for i, s in enumerate(samplings)]
    return drafter, items


def test_drafter_draws_children_from_q_and_keeps_greedy_trees(real) -> None:
    hot = SamplingConfig(temperature=0.7, top_p=0.9, seed=3)
    drafter, items = _propose(real, "q", [SamplingConfig(), hot, hot, SamplingConfig(temperature=0.7, seed=4)])
    greedy, a, b, c = drafter.propose(items)
    top_k, _ = _propose(real, "onehot", [SamplingConfig(), hot])
    want_greedy, want_onehot = top_k.propose(_)
    assert greedy.q is None and want_greedy.q is None and want_onehot.q is None  # top-k trees, one-hot rule
    assert greedy.tokens.tolist() == want_greedy.tokens.tolist() == want_onehot.tokens.tolist()
    assert greedy.parents.tolist() == want_greedy.parents.tolist()
    # the greedy row of a batch with sampling rows (the sampled step) = a batch of top-k rows alone (its variant)
    assert np.allclose(greedy.probs, want_greedy.probs, rtol=1e-5)
    assert a.tokens.tolist() == b.tokens.tolist() and a.parents.tolist() == b.parents.tolist()  # same seed
    assert a.tokens.tolist() != c.tokens.tolist()
    for t in (a, c):
        validate_q(t.tokens, t.parents, t.q)  # distinct children, all in their row's q
        for i, parent in enumerate(t.parents):  # probs: q of each drawn token at its parent's row
            ids, probs = t.q.at(int(parent) + 1)
            assert probs[ids.tolist().index(int(t.tokens[i]))] == pytest.approx(float(t.probs[i]), rel=1e-4)


def _first_tokens(real, rule: str, trials: int) -> tuple[np.ndarray, np.ndarray]:
    """Counts [V] of the first token of round one, accepted on the device at the root of the real drafter's
    trees (its depth-1 tree: the root's children, drawn on the device under the q rule; the first token
    depends on nothing deeper). The acceptance runs over the tokens that p or a tree names (a compact
    vocabulary, the target given as log p: the filters are tested on the full vocabulary elsewhere)."""
    from common.config import DraftingConfig

    cfg = SamplingConfig(temperature=0.7, top_p=0.9)
    p = target_distribution(real[4], cfg)
    shallow = DraftingConfig(top_k=10, steps=1, verify_tree_size=10, sampling_rule=rule)
    if rule == "onehot":  # one top-k tree: the trials differ in the verifier's draws
        drafter, items = _propose(real, rule, [cfg], shallow)
        trees = drafter.propose(items) * trials
    else:  # a fresh sampled tree per trial (each sequence its seed: the same trees whatever the calls' size)
        drafter, items = _propose(real, rule, [cfg] * 160, shallow)
        trees = []
        for start in range(0, trials, 160):
            seeded = [replace(it, sampling=SamplingConfig(0.7, 0.9, seed=start + i)) for i, it in enumerate(items)]
            trees += drafter.propose(seeded)
            drafter.release([it.seq_id for it in items])
        trees = trees[:trials]
    vocab = np.unique(np.concatenate([np.flatnonzero(p > 0)] + [t.tokens for t in trees] +
                                     [t.q.ids.ravel() for t in trees if t.q is not None]))  # fmt: skip
    compact = [
        Tree(np.searchsorted(vocab, t.tokens), t.parents, t.probs,
             None if t.q is None else DraftQ(t.q.rows, np.searchsorted(vocab, t.q.ids), t.q.probs))
        for t in trees
    ]  # fmt: skip
    with np.errstate(divide="ignore"):
        logp = np.log(p[vocab])  # [V'] -inf outside p's support

    def logits_of(ids: np.ndarray) -> np.ndarray:
        return np.broadcast_to(logp, (*ids.shape, logp.shape[0]))

    got = device_accept(compact, [0] * trials, logits_of, SamplingConfig(temperature=1.0), list(range(trials)), 0)
    return np.bincount(vocab[[g[0] for g in got]], minlength=p.shape[0]), p


@pytest.mark.parametrize("rule, trials", [("q", 1600), ("onehot", 4000)])
def test_real_first_tokens_follow_the_target(real, rule: str, trials: int) -> None:
    counts, p = _first_tokens(real, rule, trials)
    assert counts[p == 0].sum() == 0
    assert chi2_pvalue(counts, trials * p) > 1e-3


def test_q_travels_as_packed_bytes() -> None:
    """The draft service's DraftTree bytes read back as the same q on the verifier, checked there."""
    from common.errors import InvalidRequest
    from common.tree import Tree
    from services.tree_wire import draft_q, draft_tree, tree_msg, tree_of
    from specdec.v1 import internal_pb2 as pb

    ids, probs = np.array([[7, 9, 3], [4, 7, 8]]), np.array([[0.5, 0.3, 0.2], [0.6, 0.4, 0]])
    q = DraftQ(rows=np.array([0, 1]), ids=ids, probs=probs)  # the root's q, then node 0's
    tree = Tree(tokens=np.array([9, 7, 4]), parents=np.array([-1, -1, 0]), probs=np.array([0.3, 0.5, 0.6]), q=q)
    msg = pb.DraftTree()
    tree_msg(tree, msg)
    got = tree_of(msg, max_nodes=8, vocab_size=10)
    np.testing.assert_array_equal(got.tokens, tree.tokens)
    np.testing.assert_array_equal(got.parents, tree.parents)
    np.testing.assert_allclose(got.probs, tree.probs)
    np.testing.assert_array_equal(got.q.ids, q.ids)
    np.testing.assert_allclose(got.q.probs, q.probs)
    assert draft_q(draft_tree([1], [-1])) is None  # a top-k tree: the one-hot rule
    bad = {
        "drawn from its q": Tree(tree.tokens, tree.parents, tree.probs, DraftQ(q.rows, ids + 1, probs)),
        "no q": Tree(tree.tokens, tree.parents, tree.probs, DraftQ(q.rows[:1], q.ids[:1], q.probs[:1])),
        "sum to 1": Tree(tree.tokens, tree.parents, tree.probs, DraftQ(q.rows, q.ids, q.probs * 2)),
        "distinct tokens": Tree(np.array([9, 9, 4]), tree.parents, tree.probs, q),
    }
    for needle, t in bad.items():
        msg = pb.DraftTree()
        tree_msg(t, msg)
        with pytest.raises(InvalidRequest, match=needle):
            tree_of(msg, max_nodes=8, vocab_size=10)
    with pytest.raises(InvalidRequest, match="q bytes"):
        draft_q(pb.DraftTree(q_width=3, q_rows=b"\0\0\0\0", q_ids=b"\0" * 8, q_probs=b"\0" * 8))
    with pytest.raises(InvalidRequest, match="not a whole number"):
        tree_of(pb.DraftTree(token_ids=b"\0" * 6, parents=b"\0" * 6), max_nodes=8, vocab_size=10)
