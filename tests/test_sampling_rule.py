"""The q rule (common.acceptance.accept_sampled_q) and the one-hot rule are lossless.

* hand-computed steps of the q rule on a three-token vocabulary;
* the kept children of every node of a sampled tree are a prefix of its sampling order;
* a chi-square test of the first TWO committed tokens against the target's own chain, for both rules,
  on a six-token vocabulary, with trees built the way common/engine/draft.py builds them (a numpy model
  of its expansion: sampled children scored by rank, EAGLE-2 frontier, top-N selection); the same test
  rejects a tree shape that looks at the drawn tokens (so it can fail);
* the real model's first tokens (SmolLM2 float32 with the shipped head on CPU) against its own p.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import numpy as np
import pytest

from common.acceptance import accept_sampled, accept_sampled_q
from common.config import SamplingConfig
from common.sampling import target_distribution
from common.tree import DraftQ, children_lists, drop_subtrees, select_top_nodes, validate_q


# ---- helpers ----
class ScriptedRng:
    """A generator whose uniforms are given, and whose choice returns the most likely token and records
    the distribution it was asked to sample (so a test can check the residual)."""

    def __init__(self, uniforms: list[float]) -> None:
        self.uniforms = list(uniforms)
        self.asked: list[np.ndarray] = []

    def random(self) -> float:
        return self.uniforms.pop(0)

    def choice(self, n: int, p: np.ndarray) -> int:
        self.asked.append(np.asarray(p))
        return int(np.argmax(p))


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
        accept_sampled_q(np.array([0]), np.array([-1]), q, lambda row: np.ones(3) / 3, np.random.default_rng(0))


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


def _two_tokens(rule: str, trials: int, score_by_rank: bool = True, cut_q: float = 1.0) -> float:
    """p-value of the first two committed tokens against the target chain p(t1 | r) p(t2 | t1)."""
    v, k, steps, keep, width = 6, 2, 3, 5, 4
    gen = np.random.default_rng(7)
    draft_logits, target_logits = gen.normal(size=(v, v)) * 1.5, gen.normal(size=(v, v)) * 1.5
    cfg = SamplingConfig(temperature=0.7, top_p=0.9)
    target = np.array([target_distribution(target_logits[x], cfg) for x in range(v)])  # [V, V]
    logq = np.log(np.exp(draft_logits) / np.exp(draft_logits).sum(1, keepdims=True))
    draft_rng, verify_rng = np.random.default_rng(11), np.random.default_rng(12)
    root = 0
    counts = np.zeros((v, v))
    for _ in range(trials):
        out: list[int] = []
        last = root
        while len(out) < 2:
            t = draft_tree(
                logq,
                last,
                k,
                steps,
                keep,
                width,
                cfg.temperature,
                draft_rng if rule == "q" else None,
                score_by_rank,
                cut_q,
            )
            context = [last] + t.tokens.tolist()  # row r's token: the root, then node r - 1

            def p_at(row: int, context: list[int] = context) -> np.ndarray:
                return target[context[row]]

            if rule == "q":
                acc = accept_sampled_q(t.tokens, t.parents, t.q, p_at, verify_rng)
            else:
                acc = accept_sampled(t.tokens, t.parents, p_at, verify_rng)
            out += acc.tokens
            last = out[-1]
        counts[out[0], out[1]] += 1
    expected = trials * target[root][:, None] * target  # [V, V]
    assert counts[expected == 0].sum() == 0  # tokens outside top-p never come out
    return chi2_pvalue(counts.ravel(), expected.ravel())


@pytest.mark.parametrize("rule, cut_q", [("q", 1.0), ("q", 0.8), ("onehot", 1.0)])
def test_rule_is_lossless_on_a_small_vocabulary(rule: str, cut_q: float) -> None:
    assert _two_tokens(rule, 10000, cut_q=cut_q) > 1e-3


def test_the_lossless_test_catches_a_shape_that_looks_at_the_draws() -> None:
    """Scoring a drawn child by its own log q lets the tree keep a later draw and drop an earlier one:
    the output is then biased, and the same test must say so."""
    assert _two_tokens("q", 10000, score_by_rank=False) < 1e-3


# ---- the real drafter and the real model (SmolLM2 float32, the shipped head, CPU) ----
@pytest.fixture(scope="module")
def real():
    import torch

    from common.engine.base import PrefillInput
    from common.engine.verifier import Verifier, VerifierConfig
    from common.model.eagle3_io import load_eagle3
    from common.model_path import default_model_path
    from common.tokenizer import Tokenizer
    from common.weights import load_checkpoint
    from services.draft.__main__ import DEFAULT_HEAD

    verifier = Verifier(load_checkpoint(), VerifierConfig(max_sequences=2, max_context=256))
    head = load_eagle3(DEFAULT_HEAD, dtype=torch.float32)[0].eval()
    prompt = Tokenizer(default_model_path()).encode_chat([("user", "What should I cook tonight?")])
    pre = verifier.prefill(PrefillInput("r", prompt, SamplingConfig()))
    # the target's logits after the first token: a prefill of prompt + [first], sampled so that its logits
    # reach _choose (its choice is not used)
    logits = []
    choose = verifier._choose
    verifier._choose = lambda row, st: logits.append(row.clone()) or choose(row, st)
    verifier.prefill(PrefillInput("r2", prompt + [pre.next_token], SamplingConfig(temperature=1.0, seed=0)))
    verifier._choose = choose
    return verifier, head, prompt, pre, logits[0].numpy()


def _propose(real, rule: str, samplings: list[SamplingConfig]):
    from common.config import DraftingConfig
    from common.engine.base import ProposeInput
    from common.engine.draft import Eagle3Drafter

    verifier, head, prompt, pre, _ = real
    drafter = Eagle3Drafter(head, verifier.model.embed_tokens, DraftingConfig(sampling_rule=rule), 8, 256, "cpu")
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


def _first_tokens(real, rule: str, trials: int) -> np.ndarray:
    """Counts [V] of the first token of round one, accepted at the root of the real drafter's trees."""
    verifier, _, _, _, logits = real
    cfg = SamplingConfig(temperature=0.7, top_p=0.9)
    p = target_distribution(logits, cfg)
    rng = np.random.default_rng(5)
    counts = np.zeros(p.shape[0])
    if rule == "onehot":  # one top-k tree: the trials differ in the verifier's draws
        drafter, items = _propose(real, rule, [cfg])
        trees = drafter.propose(items) * trials
    else:  # a fresh sampled tree per trial, 8 per propose call
        drafter, items = _propose(real, rule, [SamplingConfig(0.7, 0.9, seed=i) for i in range(8)])
        trees = []
        for start in range(0, trials, 8):
            seeded = [replace(it, sampling=SamplingConfig(0.7, 0.9, seed=start + i)) for i, it in enumerate(items)]
            trees += drafter.propose(seeded)
            drafter.release([it.seq_id for it in items])
    for t in trees[:trials]:
        if rule == "q":
            acc = accept_sampled_q(t.tokens, t.parents, t.q, lambda row: p, rng)
        else:
            acc = accept_sampled(t.tokens, t.parents, lambda row: p, rng)
        counts[acc.tokens[0]] += 1
    return counts, p


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
