"""The engines' step functions, which run eagerly on CPU and are captured as CUDA graphs on a GPU.

Device-side tree logic (ancestors, greedy acceptance, top-N selection) is checked against the numpy
bookkeeping of common.tree and common.acceptance, which is checked by hand in test_tree.py and
test_acceptance.py. The engines are checked padded to graph buckets (what a GPU replays: batch padding
rows in the trash slot, tree padding rows) against the same engines at exact sizes, on the real model.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from common.acceptance import accept_greedy
from common.config import DraftingConfig, SamplingConfig
from common.engine.base import PrefillInput, ProposeAfter, ProposeInput, VerifyInput, finish
from common.engine.cuda_graphs import CudaGraphManager, GraphConfig, batch_buckets_for, pick_bucket
from common.engine.draft import Eagle3Drafter
from common.engine.factory import make_drafter, make_verifier, pick_dtype
from common.engine.oracle import GreedyOracleDrafter
from common.engine.verifier import Verifier, VerifierConfig, prefill_groups
from common.errors import InvalidRequest, UnknownSequence
from common.kernels.reference import accept_greedy_device, tree_ancestors
from common.kernels.reference import select_top_nodes as select_top_nodes_device
from common.model.eagle3 import Eagle3Config, Eagle3Head
from common.tree import NO_TREE, Tree, ancestor_mask, depths, select_top_nodes

CPU = torch.device("cpu")
PROMPTS = [
    [1, 9690, 198, 2683, 359, 253, 5356, 5646, 11173, 3365, 2, 198, 1, 4093, 198],
    [1, 4093, 198, 4898, 314, 260, 6376, 4461, 47, 2, 198, 1, 520, 9531, 198],
    [1, 520, 9531, 198, 504],
]


# ---- helpers ----
def random_tree(rng: np.random.Generator, n: int) -> np.ndarray:
    """parents [n] with parents[i] < i (or -1)."""
    return np.array([-1 if i == 0 or rng.random() < 0.3 else int(rng.integers(0, i)) for i in range(n)])


def tied_candidates(rng: np.random.Generator, c: int) -> tuple[np.ndarray, np.ndarray]:
    """Candidates in creation order whose scores never exceed their parent's, with many exact ties."""
    parents = random_tree(rng, c)
    scores = np.zeros(c, dtype=np.float32)
    for i, p in enumerate(parents):
        scores[i] = (0.0 if p < 0 else scores[p]) - rng.choice([0.0, 0.5, 1.0, 1.5])
    return scores, parents


def parent_rows(parents: np.ndarray, t: int) -> torch.Tensor:
    """The verifier's row layout: row 0 the root, node i at row i + 1; root and padding rows are their
    own parent."""
    rows = np.arange(t)
    rows[1 : parents.shape[0] + 1] = parents + 1
    return torch.from_numpy(rows)


# ---- pure functions ----
def test_pick_bucket_and_config() -> None:
    assert pick_bucket(3, (1, 2, 4, 8)) == 4
    assert pick_bucket(1, (4, 1)) == 1
    assert pick_bucket(9, (1, 2, 4, 8)) is None
    assert batch_buckets_for(12) == (1, 2, 4, 8, 12)
    assert batch_buckets_for(40) == (1, 2, 4, 8, 16, 24, 32, 40)
    assert batch_buckets_for(3, (1, 2, 4)) == (1, 2, 3)
    for bad in (dict(batch_buckets=(0, 2)), dict(tree_buckets=(1,)), dict(warmup_iters=0)):
        with pytest.raises(ValueError):
            GraphConfig(**bad)


def test_manager_runs_steps_eagerly_on_cpu() -> None:
    mgr = CudaGraphManager(CPU)
    assert not mgr.capture("k", lambda x: x.sum(-1), {"x": torch.zeros(4, 2)})
    out = mgr.run("k", lambda x: x.sum(-1), {"x": torch.tensor([[1, 2], [3, 4]])})
    assert out.tolist() == [3, 7] and not mgr.is_captured("k")
    with mgr.on_stream():
        pass


def test_tree_ancestors_and_depths_match_numpy() -> None:
    rng = np.random.default_rng(0)
    for n in (1, 2, 5, 17, 40):
        trees = [random_tree(rng, n) for _ in range(3)]
        t = n + 1 + 3  # three padding rows
        anc = tree_ancestors(torch.stack([parent_rows(p, t) for p in trees]))  # [3, T, T]
        for b, parents in enumerate(trees):
            assert np.array_equal(anc[b, : n + 1, : n + 1].numpy(), ancestor_mask(parents))
            assert np.array_equal((anc[b].sum(-1) - 1)[1 : n + 1].numpy(), depths(parents))
            assert np.array_equal(anc[b, n + 1 :].numpy(), np.eye(t, dtype=bool)[n + 1 :])  # padding: itself


def test_device_greedy_acceptance_docstring_example() -> None:
    a, b, c, d, x, y, z = 10, 11, 12, 13, 20, 21, 22
    ids = torch.tensor([[0, a, b, c, d]])
    rows = parent_rows(np.array([-1, -1, 0, 1]), 5)[None]
    path = accept_greedy_device(ids, rows, tree_ancestors(rows), torch.tensor([[b, x, d, y, z]]))
    assert path.count.tolist() == [2] and path.src_rows.tolist() == [[0, 2, 4, 3, 4]] and path.bonus.tolist() == [z]


def test_device_greedy_acceptance_matches_host_rule() -> None:
    """Random trees with few distinct tokens (so that paths get long), padded rows, against
    common.acceptance.accept_greedy."""
    rng = np.random.default_rng(1)
    for n in (1, 3, 9, 30):
        b, t = 8, n + 3
        trees = [random_tree(rng, n) for _ in range(b)]
        tokens = rng.integers(0, 3, size=(b, n))
        target = torch.from_numpy(rng.integers(0, 3, size=(b, t)))
        ids = torch.zeros(b, t, dtype=torch.long)
        ids[:, 1 : n + 1] = torch.from_numpy(tokens)
        rows = torch.stack([parent_rows(p, t) for p in trees])
        path = accept_greedy_device(ids, rows, tree_ancestors(rows), target)
        for i in range(b):
            want = accept_greedy(tokens[i], trees[i], target[i].numpy())
            got_tokens = ids[i, path.src_rows[i, 1 : path.count[i] + 1]].tolist() + [int(path.bonus[i])]
            assert len(got_tokens) >= len(want.tokens)  # the deepest accepted path, at least the host's
            # with distinct siblings the accepted path is unique, so both rules find the same one
            if _distinct_siblings(trees[i], tokens[i]):
                assert got_tokens == want.tokens
                assert (path.src_rows[i, 1 : path.count[i] + 1] - 1).tolist() == want.path


def _distinct_siblings(parents: np.ndarray, tokens: np.ndarray) -> bool:
    seen = set()
    for p, tok in zip(parents.tolist(), tokens.tolist()):
        if (p, tok) in seen:
            return False
        seen.add((p, tok))
    return True


def test_device_selection_equals_select_top_nodes_with_ties() -> None:
    rng = np.random.default_rng(2)
    b, c, n = 6, 50, 20
    cands = [tied_candidates(rng, c) for _ in range(b)]
    keep = np.array([20, 1, 7, 20, 13, 2])
    scores = torch.from_numpy(np.stack([s for s, _ in cands]))
    parents = torch.from_numpy(np.stack([p for _, p in cands]))
    kept, new_parents = select_top_nodes_device(scores, parents, torch.from_numpy(keep), n)
    for i, (s, p) in enumerate(cands):
        want_kept, want_parents = select_top_nodes(s, p, int(keep[i]))
        assert kept[i, : keep[i]].tolist() == want_kept.tolist()
        assert new_parents[i, : keep[i]].tolist() == want_parents.tolist()


def test_device_selection_docstring_example() -> None:
    kept, par = select_top_nodes_device(
        torch.tensor([[-0.1, -2.0, -0.5, -0.5]]), torch.tensor([[-1, -1, 0, 0]]), torch.tensor([3]), 4
    )
    assert kept[0, :3].tolist() == [0, 2, 3] and par[0, :3].tolist() == [-1, 0, 0]


# ---- engines on the real model ----
def _head(checkpoint) -> Eagle3Head:
    torch.manual_seed(0)
    cfg = Eagle3Config.for_base(checkpoint.config, draft_vocab_size=4096)
    head = Eagle3Head(cfg)
    head.set_vocab_map(torch.arange(cfg.draft_vocab_size) * 7)  # a non-trivial draft -> base map
    return head.eval()


def test_factory_and_dtype_on_cpu(checkpoint) -> None:
    assert pick_dtype("cpu") == "float32" and pick_dtype("cuda:0") == "bfloat16"
    assert pick_dtype("cuda", "float32") == "float32" and pick_dtype("cpu", "auto") == "float32"
    with pytest.raises(ValueError):
        pick_dtype("cpu", "int8")
    v = make_verifier(checkpoint, VerifierConfig(max_sequences=1, max_context=32, max_tree_nodes=4), graphs=True)
    assert not v.graphs.enabled and not v.graphs.pad
    d = make_drafter(
        _head(checkpoint),
        v.model.embed_tokens,
        DraftingConfig(top_k=2, steps=2, verify_tree_size=4),
        1,
        32,
        "cpu",
        graphs=True,
    )
    assert not d.graphs.enabled and not d.graphs.pad


@pytest.fixture(scope="module")
def verifiers(checkpoint):
    cfg = VerifierConfig(max_sequences=4, max_context=256, max_tree_nodes=24)
    exact = Verifier(checkpoint, cfg)
    padded = Verifier(
        checkpoint, cfg, graphs=True, graph_cfg=GraphConfig(batch_buckets=(1, 2, 4), tree_buckets=(8, 16))
    )
    return exact, padded


def _count_runs(engine) -> list:
    """Record the graph key of every step call (each one feeds its inputs first), a verifier's prefills too."""
    keys: list = []
    for graphs in (engine.graphs, getattr(engine, "prefill_graphs", None)):
        if graphs is None:
            continue
        feed = graphs.feed

        def counting(key, inputs, feed=feed):
            keys.append(key)
            return feed(key, inputs)

        graphs.feed = counting
    return keys


def test_padded_verifier_matches_exact(verifiers) -> None:
    exact, padded = verifiers
    keys = _count_runs(padded)
    sampling = [SamplingConfig(), SamplingConfig(), SamplingConfig(temperature=0.8, top_p=0.9, seed=7)]
    ids = ["a", "b", "c"]
    firsts, prefilled = [], []
    for v in (exact, padded):
        prefilled.append([v.prefill(PrefillInput(s, p, smp)) for s, p, smp in zip(ids, PROMPTS, sampling)])
        firsts.append([out.next_token for out in prefilled[-1]])
    assert firsts[0] == firsts[1]
    for w, g in zip(*prefilled):  # the padded prefill step (a row of a token bucket) = the exact one
        torch.testing.assert_close(g.hidden, w.hidden, rtol=1e-4, atol=1e-3)
    oracle = GreedyOracleDrafter(exact.model, 4, CPU)
    items = [ProposeInput(s, p[1:] + [f], None, True, p[:1], 16) for s, p, f in zip(ids, PROMPTS, firsts[0])]
    rng = np.random.default_rng(3)
    for rnd in range(3):
        trees = oracle.propose(items)
        if rnd == 2:  # random trees: rejection early, compaction of odd paths, different sizes
            trees = [
                Tree(tokens=rng.integers(0, 1000, size=n), parents=random_tree(rng, n), probs=np.ones(n, np.float32))
                for n in (3, 11, 6)
            ]
        batch = [VerifyInput(s, t) for s, t in zip(ids, trees)]
        want, got = exact.verify(batch), padded.verify(batch)
        for w, g in zip(want, got):
            assert w.tokens == g.tokens
            torch.testing.assert_close(g.hidden, w.hidden, rtol=1e-4, atol=1e-3)
        if rnd < 2:  # the greedy oracle's path is accepted whole
            assert len(want[0].tokens) == 5 and len(want[1].tokens) == 5
        items = [ProposeInput(s, w.tokens, w.hidden, False, [], 16) for s, w in zip(ids, want)]
    prefills, verifies = [k for k in keys if k[0] == "prefill"], [k for k in keys if k[0] == "verify"]
    assert [k[:2] for k in prefills] == [("prefill", 1)] * 3 and {k[2] for k in prefills} <= {32, 64}
    assert len(verifies) == 3 and all(k[1] == 4 for k in verifies)  # batch of 3 padded to 4
    for sub in (ids, ["c", "a"], ["b"]):
        assert exact.decode(sub) == padded.decode(sub)
    decodes = {k[:2] for k in keys if k[0] == "decode"}
    assert ("decode", 2) in decodes and ("decode", 1) in decodes
    for s in ids:  # the caches hold the same committed entries
        (es, est), (ps, pst) = exact.seqs.get(s), padded.seqs.get(s)
        assert est.length == pst.length and est.pending == pst.pending
        torch.testing.assert_close(
            padded.cache.kv[:, ps, : pst.length], exact.cache.kv[:, es, : est.length], rtol=1e-4, atol=1e-3
        )
    exact.release(ids)
    padded.release(ids)


def test_verifier_plain_equals_speculative(verifiers) -> None:
    _, padded = verifiers
    prompt, n = PROMPTS[0], 24
    out = [padded.prefill(PrefillInput("p", prompt, SamplingConfig())).next_token]
    while len(out) < n:
        out += padded.decode(["p"])
    padded.release(["p"])
    oracle = GreedyOracleDrafter(padded.model, 4, CPU)
    first = padded.prefill(PrefillInput("s", prompt, SamplingConfig())).next_token
    spec, item = [first], ProposeInput("s", prompt[1:] + [first], None, True, prompt[:1], 16)
    while len(spec) < n:
        res = padded.verify([VerifyInput("s", oracle.propose([item])[0])])[0]
        spec += res.tokens
        item = ProposeInput("s", res.tokens, res.hidden, False, [], 16)
    padded.release(["s"])
    assert spec[:n] == out


@pytest.fixture(scope="module")
def drafters(checkpoint, verifiers):
    exact_v, _ = verifiers
    head = _head(checkpoint)
    drafting = DraftingConfig(top_k=4, steps=4, verify_tree_size=20)
    embed = exact_v.model.embed_tokens
    exact = Eagle3Drafter(head, embed, drafting, 4, 256, CPU)
    padded = Eagle3Drafter(
        head, embed, drafting, 4, 256, CPU, graphs=True, graph_cfg=GraphConfig(batch_buckets=(1, 2, 4))
    )
    return exact, padded


def _same_trees(want: list[Tree], got: list[Tree]) -> None:
    for w, g in zip(want, got):
        assert w.tokens.tolist() == g.tokens.tolist()
        assert w.parents.tolist() == g.parents.tolist()
        np.testing.assert_allclose(g.probs, w.probs, rtol=1e-4, atol=1e-6)


def test_padded_drafter_matches_exact(drafters, checkpoint) -> None:
    exact, padded = drafters
    keys = _count_runs(padded)
    width = 3 * checkpoint.config.hidden_size
    gen = torch.Generator().manual_seed(5)
    rng = np.random.default_rng(5)

    def hidden(k: int) -> torch.Tensor:
        return torch.randn(k, width, generator=gen)

    ids = ["x", "y", "z"]
    items = [
        ProposeInput(s, p[1:] + [42], hidden(len(p)), True, p[:1], keep) for s, p, keep in zip(ids, PROMPTS, (20, 9, 0))
    ]  # max_nodes 0 = the drafter's size
    for rnd in range(5):
        _same_trees(exact.propose(items), padded.propose(items))
        lengths = [1 + (rnd + j) % 5 for j in range(3)]  # 1 .. steps + 1 new tokens
        items = [
            ProposeInput(s, rng.integers(0, 5000, size=k).tolist(), hidden(k), False, [], 20)
            for s, k in zip(ids, lengths)
        ]
    # one sequence alone (bucket 1), then a start joining a running one (eager accepts, expand step)
    single = [ProposeInput("y", [7, 8], hidden(2), False, [], 20)]
    _same_trees(exact.propose(single), padded.propose(single))
    mixed = [
        ProposeInput("x", [9], hidden(1), False, [], 20),
        ProposeInput("w", PROMPTS[2][1:] + [3], hidden(len(PROMPTS[2])), True, PROMPTS[2][:1], 20),
    ]
    _same_trees(exact.propose(mixed), padded.propose(mixed))
    propose_keys = {k for k in keys if k[0] == "propose"}  # ("propose", batch, new tokens, depth, sampled)
    assert {k[2] for k in propose_keys} >= {3, 4, 5} and ("propose", 1, 2, 4, False) in propose_keys
    assert all(k[1] == 4 for k in propose_keys if k != ("propose", 1, 2, 4, False))  # batch of 3 padded to 4
    assert ("expand", 4, 4, False) in keys and ("expand", 2, 4, False) in keys
    # the accept passes over prompts: rows and tokens padded to buckets (the 3 starts to 4 rows)
    accepts = {k for k in keys if k[0] == "accept"}
    assert accepts and all(k[2] in padded.accept_buckets for k in accepts)
    assert any(k[1] == 4 for k in accepts) and any(k[1] == 1 for k in accepts)  # 3 starts; 1 start beside 1
    for d in (exact, padded):
        assert d.release(ids + ["w"]) == 4


def test_a_long_accept_pass_runs_in_captured_passes(drafters, checkpoint, monkeypatch) -> None:
    """Prompts (starts) and catch-ups longer than a captured accept pass takes at their rows go in several
    passes of a captured size, each after the ones before it in the cache: the trees are the exact drafter's
    (one pass over everything). Here a captured pass takes 64 rows x tokens: 2 rows -> 32 tokens a pass."""
    exact, _ = drafters
    monkeypatch.setattr("common.engine.draft_parts.ACCEPT_TOKENS", 64)
    padded = Eagle3Drafter(
        exact.head,
        exact.embed,
        exact.drafting,
        4,
        256,
        CPU,
        graphs=True,
        graph_cfg=GraphConfig(batch_buckets=(1, 2, 4)),
    )
    keys = _count_runs(padded)
    width = 3 * checkpoint.config.hidden_size
    gen = torch.Generator().manual_seed(11)
    rng = np.random.default_rng(11)
    prompts = [rng.integers(0, 5000, size=n).tolist() for n in (40, 71)]  # 40 -> 2 passes, 71 -> 3
    starts = [
        ProposeInput(s, p[1:] + [42], torch.randn(len(p), width, generator=gen), True, p[:1], 20)
        for s, p in zip("ab", prompts)
    ]
    _same_trees(exact.propose(starts), padded.propose(starts))
    assert [k for k in keys if k[0] == "accept"] == [("accept", 2, 32, 4)] * 3
    keys.clear()
    # a catch-up of both (more new tokens than a propose graph takes): 33 and 9 -> passes of 32, then 1 and 0
    more = [
        ProposeInput(s, rng.integers(0, 5000, size=k).tolist(), torch.randn(k, width, generator=gen), False, [], 20)
        for s, k in zip("ab", (33, 9))
    ]
    _same_trees(exact.propose(more), padded.propose(more))
    assert [k for k in keys if k[0] == "accept"] == [("accept", 2, 32, 4), ("accept", 2, 32, 4)]
    assert exact.release(["a", "b"]) == padded.release(["a", "b"]) == 2


def test_a_shallow_item_gets_the_tree_of_a_shallow_drafter(drafters, checkpoint) -> None:
    """max_depth 2 in a call that expands 4 levels keeps exactly the tree a 2-step drafter proposes
    (deeper candidates are masked out of the selection); the graph runs at the depth bucket 2 when the
    deepest item asks for 2."""
    exact, padded = drafters
    shallow = Eagle3Drafter(exact.head, exact.embed, DraftingConfig(top_k=4, steps=2, verify_tree_size=20), 4, 256, CPU)
    width = 3 * checkpoint.config.hidden_size
    gen = torch.Generator().manual_seed(9)
    h = [torch.randn(len(p), width, generator=gen) for p in PROMPTS[:2]]
    start = [ProposeInput(s, p[1:] + [42], x, True, p[:1], 12) for s, p, x in zip("ab", PROMPTS, h)]
    want = shallow.propose([start[0]])
    mixed = [ProposeInput(**{**it.__dict__, "max_depth": d}) for it, d in zip(start, (2, 4))]
    got = padded.propose(mixed)
    _same_trees(want, got[:1])
    _same_trees(exact.propose([start[1]]), got[1:])  # the deep item is untouched by its neighbour
    assert int(depths(got[0].parents).max()) <= 2
    keys = _count_runs(padded)
    nxt = [ProposeInput("a", [5], torch.randn(1, width, generator=gen), False, [], 12, max_depth=2)]
    _same_trees(shallow.propose([ProposeInput(**{**nxt[0].__dict__, "max_depth": 0})]), padded.propose(nxt))
    assert ("propose", 1, 1, 2, False) in keys
    with pytest.raises(InvalidRequest, match="max_depth"):
        padded.propose([ProposeInput("a", [5], torch.randn(1, width), False, [], 12, max_depth=5)])
    assert padded.release(["a", "b"]) == 2 and shallow.release(["a"]) == 1 and exact.release(["b"]) == 1


def test_drafting_after_a_verify_equals_a_propose_of_its_outcome(verifiers, drafters) -> None:
    """The device chain (Drafter.launch_after): trees drafted from a verify's acceptance on the device, read
    for the rows that go on, equal the trees of a propose of the verify's outputs (the exact drafter, and the
    padded one: batch padding, the accept pass padded to steps + 1 tokens). Rounds: the oracle's trees (the
    whole path accepted: steps + 1 new tokens), random trees (rejections, 1-3 new tokens) in a round where
    one sequence stops (its row not read: its draft state stays as before the round), then the oracle's
    trees again for the others."""
    v, _ = verifiers
    exact, padded = drafters
    chained = Eagle3Drafter(exact.head, exact.embed, exact.drafting, 4, 256, CPU)
    oracle = GreedyOracleDrafter(v.model, 4, CPU)
    ids = ["p", "q", "r"]
    outs = [v.prefill(PrefillInput(s, p, SamplingConfig())) for s, p in zip(ids, PROMPTS)]
    starts = [ProposeInput.after_prefill(s, p, o, 20) for s, p, o in zip(ids, PROMPTS, outs)]
    for d in (exact, padded, chained):
        d.propose(starts)
    trees = oracle.propose(starts)  # round 0 verifies the oracle's trees, and so does round 2
    rng = np.random.default_rng(11)
    live = ids
    for rnd in range(3):
        if rnd == 1:  # random trees of 2-7 nodes: mostly rejected
            trees = [
                Tree(rng.integers(0, 1000, size=n), random_tree(rng, n), np.ones(n, np.float32)) for n in (7, 2, 5)
            ]
        handles = []

        def then(acc, live=live, handles=handles):
            handles.extend(d.launch_after([ProposeAfter(s, 20) for s in live], acc) for d in (padded, chained))

        results = finish(v.verify_steps([VerifyInput(s, t) for s, t in zip(live, trees)], then))
        if rnd != 1:
            assert [len(r.tokens) for r in results] == [5] * len(live)  # steps + 1: the padded accept's width
        rows = [0, 2] if rnd == 1 else list(range(len(live)))  # round 1: q stops
        items = [ProposeInput.after_verify(live[i], results[i], 20) for i in rows]
        want = exact.propose(items)
        for d, h in zip((padded, chained), handles):
            _same_trees(want, d.read_after(h, rows))
        trees = oracle.propose(items)
        live = [live[i] for i in rows]
    for s in ids:
        assert chained.seqs.get(s)[1].length == padded.seqs.get(s)[1].length == exact.seqs.get(s)[1].length
    # the device chain follows a batch with a sampling sequence too (then is called), but not an unknown one
    v.prefill(PrefillInput("t", PROMPTS[2], SamplingConfig(temperature=0.7, seed=1)))
    called = []
    tree = Tree(np.array([5]), np.array([-1]), np.ones(1, np.float32))
    finish(v.verify_steps([VerifyInput("p", tree), VerifyInput("t", tree)], called.append))
    assert len(called) == 1
    called.clear()
    finish(v.verify_steps([VerifyInput("p", tree)], called.append))
    assert chained.launch_after([ProposeAfter("nobody", 20)], called[0]) is None
    for d in (exact, padded, chained):
        assert d.release(ids) == 3
    v.release(ids + ["t"])


def test_a_prompt_taken_in_drafts_behind_its_first_verify_what_a_propose_would(verifiers, drafters) -> None:
    """Drafter.take: prompts taken in without a tree (the exact drafter's and the padded one's accept passes),
    verified as rows of no tree (one token each), then drafted behind that verify on the device: the trees equal
    a propose of the prompt (its tree unused) and then of the verify's outputs; the lengths agree."""
    v, _ = verifiers
    exact, padded = drafters
    taker = Eagle3Drafter(exact.head, exact.embed, exact.drafting, 4, 256, CPU)
    ids = ["p", "q"]
    outs = [v.prefill(PrefillInput(s, p, SamplingConfig())) for s, p in zip(ids, PROMPTS)]
    starts = [ProposeInput.after_prefill(s, p, o, 20) for s, p, o in zip(ids, PROMPTS, outs)]
    exact.propose(starts)
    assert taker.take(starts) and padded.take(starts)
    assert [taker.seqs.get(s)[1].length for s in ids] == [exact.seqs.get(s)[1].length for s in ids]
    handles = []

    def then(acc):
        handles.extend(d.launch_after([ProposeAfter(s, 20) for s in ids], acc) for d in (taker, padded))

    results = finish(v.verify_steps([VerifyInput(s, NO_TREE) for s in ids], then))
    assert [len(r.tokens) for r in results] == [1, 1]
    want = exact.propose([ProposeInput.after_verify(s, r, 20) for s, r in zip(ids, results)])
    for d, h in zip((taker, padded), handles):
        _same_trees(want, d.read_after(h, [0, 1]))
        assert [d.seqs.get(s)[1].length for s in ids] == [exact.seqs.get(s)[1].length for s in ids]
    for d in (exact, padded, taker):
        assert d.release(ids) == 2
    v.release(ids)


def test_multi_step_decode_equals_single_steps(verifiers) -> None:
    """decode_many chains the step on the device: the same tokens as one call per token, for a batch
    padded to its bucket; a sampling sequence in the batch takes every step too (its draws on the device)."""
    exact, padded = verifiers
    ids = ["m0", "m1", "m2"]
    for s, p in zip(ids, PROMPTS):
        exact.prefill(PrefillInput(s, p, SamplingConfig()))
        padded.prefill(PrefillInput(s, p, SamplingConfig()))
    want = [[] for _ in ids]
    for _ in range(7):
        for w, t in zip(want, exact.decode(ids)):
            w.append(t)
    assert padded.decode_many(ids, 7).tokens == want
    assert [padded.seqs.get(s)[1].length for s in ids] == [exact.seqs.get(s)[1].length for s in ids]
    assert padded.decode(ids) == exact.decode(ids)  # the state after the chained steps is consistent
    padded.prefill(PrefillInput("m3", PROMPTS[0], SamplingConfig(temperature=0.7, seed=1)))
    assert [len(t) for t in padded.decode_many(["m0", "m3"], 5).tokens] == [5, 5]
    with pytest.raises(InvalidRequest, match="steps must be >= 1"):
        padded.decode_many(["m0"], 0)
    exact.release(ids)
    padded.release(ids + ["m3"])


def test_decode_features_equal_a_prefill_of_the_same_tokens(verifiers) -> None:
    """with_hidden: row j of a sequence's features is the EAGLE feature of the token fed at step j (the
    pending root, then each decoded token but the last), as a prefill of the whole context computes it;
    so the draft can follow a sequence the policy decodes plainly."""
    _, padded = verifiers
    pre = padded.prefill(PrefillInput("f", PROMPTS[0], SamplingConfig()))
    padded.prefill(PrefillInput("g", PROMPTS[1], SamplingConfig()))
    out = padded.decode_many(["f", "g"], 4, with_hidden=True)
    assert out.hidden.shape == (2, 4, padded.model.cfg.hidden_size * 3)
    fed = PROMPTS[0] + [pre.next_token] + out.tokens[0][:3]  # the context whose last 4 rows were decoded
    ref = padded.prefill(PrefillInput("ref", fed, SamplingConfig())).hidden[-4:]
    torch.testing.assert_close(out.hidden[0], ref, rtol=1e-4, atol=1e-4)
    assert padded.decode_many(["f"], 2).hidden is None
    padded.release(["f", "g", "ref"])


def test_chunked_prefill_equals_one_prefill(verifiers) -> None:
    """A prompt in chunks of 5, 1 and the rest (each written after the cache, attending to it as a prefix)
    gives the first token, the features of every position and the decoding after it of one prefill of the
    whole prompt; a sequence whose last chunk has not come is refused by decode and verify, a second
    prefill of a complete sequence is refused, and a chunk past the context frees the sequence."""
    _, padded = verifiers
    prompt = PROMPTS[0] + PROMPTS[1]
    whole = padded.prefill(PrefillInput("w", prompt, SamplingConfig()))
    parts = [prompt[:5], prompt[5:6], prompt[6:]]
    outs = [padded.prefill(PrefillInput("c", p, SamplingConfig(), more=i < 2)) for i, p in enumerate(parts)]
    assert [o.next_token for o in outs[:2]] == [None, None] and outs[2].next_token == whole.next_token
    torch.testing.assert_close(torch.cat([o.hidden for o in outs]), whole.hidden, rtol=1e-4, atol=1e-4)
    assert padded.decode_many(["c"], 6).tokens == padded.decode_many(["w"], 6).tokens
    with pytest.raises(InvalidRequest, match="already exists"):
        padded.prefill(PrefillInput("c", [1, 2], SamplingConfig()))
    padded.prefill(PrefillInput("p", prompt[:4], SamplingConfig(), more=True))
    with pytest.raises(InvalidRequest, match="still being prefilled"):
        padded.decode_many(["p"], 1)
    with pytest.raises(InvalidRequest, match="still being prefilled"):
        padded.verify([VerifyInput("p", Tree(np.array([5]), np.array([-1]), np.ones(1, np.float32)))])
    with pytest.raises(InvalidRequest, match="the context holds 256"):
        padded.prefill(PrefillInput("p", [1] * 252, SamplingConfig(), more=True))
    with pytest.raises(UnknownSequence):  # the failed chunk freed it
        padded.decode_many(["p"], 1)
    padded.release(["w", "c"])


def test_prefill_groups_docstring_example() -> None:
    assert prefill_groups([30, 500, 28, 4, 3]) == [[1], [0, 2, 3], [4]]
    assert prefill_groups([7, 7, 7]) == [[0, 1, 2]] and prefill_groups([]) == []
    assert prefill_groups([9, 1], waste=1.0) == [[0], [1]]
    assert prefill_groups([30, 500, 28, 4, 3], max_rows=2) == [[1], [0, 2], [3, 4]]
    assert prefill_groups([5] * 5, max_rows=2) == [[0, 1], [2, 3], [4]] and prefill_groups([5] * 5) == [[0, 1, 2, 3, 4]]
    with pytest.raises(ValueError):
        prefill_groups([1], waste=0.5)


def test_batched_prefill_equals_one_prefill_each(verifiers) -> None:
    """Three prompts or chunks of different lengths in one call (padded rows, each after its own cache: a new
    sequence, a second chunk, and a new one of another length) give each one's separate prefill; a call
    with a bad item frees every sequence it created or continued, and nothing else."""
    _, padded = verifiers
    a, b = PROMPTS[0], PROMPTS[1] + PROMPTS[0]
    want = {s: padded.prefill(PrefillInput(s + "-ref", p, SamplingConfig())) for s, p in (("a", a), ("b", b))}
    padded.prefill(PrefillInput("b", b[:4], SamplingConfig(), more=True))
    outs = padded.prefill_batch([PrefillInput("a", a, SamplingConfig()), PrefillInput("b", b[4:], SamplingConfig())])
    assert [o.next_token for o in outs] == [want["a"].next_token, want["b"].next_token]
    # padded rows change the float32 matmuls' blocking: the file's padded-vs-exact tolerance (atol 1e-3; at
    # 1e-4 one element of 25,920 failed by 2.7e-5 on one CI CPU, 2026-11-25); the tokens above are exact
    torch.testing.assert_close(outs[0].hidden, want["a"].hidden, rtol=1e-4, atol=1e-3)
    torch.testing.assert_close(outs[1].hidden, want["b"].hidden[4:], rtol=1e-4, atol=1e-3)
    assert padded.decode_many(["a", "b"], 4).tokens == padded.decode_many(["a-ref", "b-ref"], 4).tokens
    padded.release(["b", "a-ref", "b-ref"])  # 4 slots
    padded.prefill(PrefillInput("c", a[:3], SamplingConfig(), more=True))
    bad = [
        PrefillInput("c", a[3:], SamplingConfig()),
        PrefillInput("d", a, SamplingConfig()),
        PrefillInput("a", [1], SamplingConfig()),
    ]
    with pytest.raises(InvalidRequest, match="already exists"):
        padded.prefill_batch(bad)
    for gone in ("c", "d"):
        with pytest.raises(UnknownSequence):
            padded.decode_many([gone], 1)
    assert len(padded.decode_many(["a"], 1).tokens[0]) == 1  # the existing sequence it named is untouched
    padded.release(["a"])


def test_prefill_groups_read_back_in_the_callers_order(verifiers) -> None:
    """Prompts that go in several forwards (prefill_groups: longest first) are read in one synchronisation and
    handed back in the order asked: each row's token and features are its own prompt's."""
    _, padded = verifiers
    short, long = PROMPTS[2][:2], PROMPTS[0] + PROMPTS[1]  # 2 and 30 tokens: a group each
    assert prefill_groups([len(short), len(long)]) == [[1], [0]]
    want = [padded.prefill(PrefillInput(s, p, SamplingConfig())) for s, p in (("s-ref", short), ("l-ref", long))]
    outs = padded.prefill_batch([PrefillInput("s", short, SamplingConfig()), PrefillInput("l", long, SamplingConfig())])
    assert [o.next_token for o in outs] == [w.next_token for w in want]
    assert [o.hidden.shape[0] for o in outs] == [2, 30]
    for o, w in zip(outs, want):  # the file's padded-vs-exact tolerance
        torch.testing.assert_close(o.hidden, w.hidden, rtol=1e-4, atol=1e-3)
    assert padded.decode_many(["s", "l"], 3).tokens == padded.decode_many(["s-ref", "l-ref"], 3).tokens
    padded.release(["s", "l", "s-ref", "l-ref"])


def test_tree_depth_and_bounded_ancestors() -> None:
    """tree_depth finds the deepest row; with that bound, fewer doubling rounds give the same ancestors."""
    from common.engine.verifier import tree_depth

    assert tree_depth(np.array([[0, 0, 0, 1, 2, 5]])) == 2  # the docstring's worked example
    rng = np.random.default_rng(7)
    for n in (1, 3, 12, 40):
        trees = [random_tree(rng, n) for _ in range(4)]
        rows = torch.stack([parent_rows(p, n + 3) for p in trees])
        want = max(int(depths(p).max()) for p in trees)
        assert tree_depth(rows.numpy()) == want
        assert torch.equal(tree_ancestors(rows, want), tree_ancestors(rows))


def test_a_chained_rounds_block_is_the_last_ones_with_its_acceptance_and_the_drafted_trees() -> None:
    """chained_block's docstring example, worked by hand (tb 4, layout [B, 2T + 3]: tokens, parent rows, n, slot,
    greedy), with a second row that does not draft (past the trees' K: the tree it verified last is dropped) and a
    padding row of the bucket."""
    from common.engine.base import Chained
    from common.engine.verifier_parts import chained_block

    prev = torch.tensor(
        [
            [7, 3, 4, 0, 0, 0, 1, 3, 10, 5, 1],  # a tree [3, 4] under root 7 at n 10, slot 5
            [2, 13, 0, 0, 0, 0, 2, 3, 20, 6, 1],  # a tree [13] under root 2 at n 20: this round's, not the next
            [0, 0, 0, 0, 0, 1, 2, 3, 0, 9, 1],  # padding (the trash slot)
        ]
    )
    result = torch.tensor([[1, 8, 9, 0, 0], [0, 4, 0, 0, 0]])  # [B, T + 1]: s0 took 8 then the bonus 9; s1 took 4
    trees = Chained(
        tokens=torch.tensor([[5, 6, 11, 12]]),
        parents=torch.tensor([[-1, 0, 0, 1]]),
        keep=torch.tensor([2]),
        keep_max=2,
        depth=2,
        ready=None,
        kids=2,
    )
    got = chained_block(prev, result, trees, 4)
    assert got.tolist() == [
        [9, 5, 6, 0, 0, 0, 1, 3, 12, 5, 1],
        [4, 0, 0, 0, 0, 1, 2, 3, 21, 6, 1],
        [0, 0, 0, 0, 0, 1, 2, 3, 0, 9, 1],
    ]
    assert prev[0, 0] == 7  # a new block: the graph's input buffer it came from is left alone


def test_a_chained_tree_narrower_than_the_bucket_keeps_none_of_the_last_rounds_nodes() -> None:
    """tb 4, the last round's tree [3, 4, 5] (a chain under root 7), the next tree one node wide (a depth-1 draft
    of fewer nodes than the bucket's rows): rows 2 and 3 become padding, not the old nodes 4 and 5."""
    from common.engine.base import Chained
    from common.engine.verifier_parts import chained_block

    prev = torch.tensor([[7, 3, 4, 5, 0, 0, 1, 2, 10, 5, 1]])
    result = torch.tensor([[0, 8, 0, 0, 0]])  # nothing accepted: the bonus 8 is the next root
    trees = Chained(torch.tensor([[11]]), torch.tensor([[-1]]), torch.tensor([1]), 1, 1, None, 1)
    assert chained_block(prev, result, trees, 4).tolist() == [[8, 11, 0, 0, 0, 0, 2, 3, 11, 5, 1]]


def test_one_hot_sets_built_on_the_device_are_the_hosts() -> None:
    """common.kernels.reference.onehot_sets (a sampled verify's one-hot sets) = common.tree.row_sets of the same one-hot
    trees, on random trees with repeated sibling tokens, padding rows and the docstring's example."""
    from common.engine.verifier_parts import pack_trees
    from common.kernels.reference import onehot_sets
    from common.tree import row_sets

    ids = torch.tensor([[3, 7, 9, 7, 5]])
    pos, set_ids, q = onehot_sets(ids, torch.tensor([[0, 0, 0, 0, 1]]), 2)
    assert pos.tolist() == [[0, 0, 1, 0, 0]] and set_ids.tolist() == [[7, 9, 5, 0] + [0] * 6]
    assert q.view(torch.float32).tolist() == [[1, 1, 1, 0] + [0] * 6]
    rng = np.random.default_rng(3)
    t, w = 24, 16
    trees = []
    for n in (0, 1, 5, 12, 23):
        parents = random_tree(rng, n).astype(np.int64)
        trees.append(Tree(rng.integers(0, 4, n), parents, np.ones(n, dtype=np.float32)))  # 4 tokens: repeats
    sizes = np.array([tr.size for tr in trees])
    a = np.zeros((len(trees), 2 * t), dtype=np.int64)
    a[:, t:] = np.arange(t)
    pack_trees(a, trees, sizes, t)
    pos, set_ids, q = onehot_sets(torch.from_numpy(a[:, :t]), torch.from_numpy(a[:, t:]), w)
    want = row_sets(trees, t, w)
    assert pos.tolist() == want.pos.tolist()
    assert set_ids.tolist() == want.ids.reshape(len(trees), -1).tolist()
    assert q.view(torch.float32).tolist() == want.q.reshape(len(trees), -1).tolist()


def test_one_hot_sets_of_a_row_wider_than_the_sets_stay_in_their_cells() -> None:
    """A row with more distinct children than W (a greedy row's tree in a sampled verify: its sets are built and
    never read) writes its first W children's tokens and no cell past them: the next row's set and the end of the
    sets are untouched. ids [r, 7, 9, 5, 4], every node a child of the root but 4, whose parent is row 1; W 2 ->
    the root's set [7, 9] (5 does not fit: pos 0, written nowhere), row 1's [4]."""
    from common.kernels.reference import onehot_sets

    pos, set_ids, q = onehot_sets(torch.tensor([[3, 7, 9, 5, 4]]), torch.tensor([[0, 0, 0, 0, 1]]), 2)
    assert pos.tolist() == [[0, 0, 1, 0, 0]]
    assert set_ids.tolist() == [[7, 9, 4, 0] + [0] * 6]
    assert q.view(torch.float32).tolist() == [[1, 1, 1, 0] + [0] * 6]
    # row 1 with three children: its third would land in row 2's first cell without the bound
    pos, set_ids, _ = onehot_sets(torch.tensor([[3, 7, 6, 5, 4]]), torch.tensor([[0, 0, 1, 1, 1]]), 2)
    assert set_ids.tolist() == [[7, 0, 6, 5] + [0] * 6] and pos.tolist() == [[0, 0, 0, 1, 0]]


def test_each_round_is_handed_over_as_it_is_read(verifiers, drafters) -> None:
    """verify_rounds_steps(each=...): each chained round's outputs reach the caller once read, in order, with the
    call's launched rounds, and are the outputs the call returns; when each is called for round r, the verifier
    has counted rounds 0..r of every sequence (its room shrinks by each round's tokens)."""
    from common.engine.base import LaunchAfter

    v, _ = verifiers
    exact, _ = drafters
    ids = ["e1", "e2"]
    outs = [v.prefill(PrefillInput(s, p, SamplingConfig())) for s, p in zip(ids, PROMPTS)]
    trees = exact.propose([ProposeInput.after_prefill(s, p, o, 8) for s, p, o in zip(ids, PROMPTS, outs)])
    room = v.room(ids)
    seen = []

    def each(r: int, launched: int, results: list) -> None:
        used = [sum(len(x[i].tokens) for _, _, x in seen) + len(results[i].tokens) for i in range(len(ids))]
        assert v.room(ids) == [a - u for a, u in zip(room, used)]
        seen.append((r, launched, results))

    chain = LaunchAfter(exact, [ProposeAfter(s, 8) for s in ids])
    got = finish(v.verify_rounds_steps([VerifyInput(s, t) for s, t in zip(ids, trees)], 3, chain, each))
    assert len(got) == 3 and [(r, n) for r, n, _ in seen] == [(0, 3), (1, 3), (2, 3)]
    assert all(x is y for (_, _, x), y in zip(seen, got))
    for h in chain.handles:
        exact.settle_after(h)
    exact.release(ids)
    v.release(ids)


def test_a_caller_that_asks_for_more_rounds_gets_them_launched_behind_the_last(verifiers, drafters) -> None:
    """each returning True launches one more round behind the last (while the chain goes on): a call of 2 rounds
    whose caller asks after rounds 0 and 1 runs 4, launched as it reads (2, 3, 4, 4 when each round is read),
    with the tokens of a call of 4 rounds over the same trees."""
    from common.engine.base import LaunchAfter

    v, _ = verifiers
    exact, _ = drafters
    runs = []
    for tag, rounds, asking in (("a", 2, 2), ("b", 4, 0)):
        ids = [f"{tag}1", f"{tag}2"]
        outs = [v.prefill(PrefillInput(s, p, SamplingConfig())) for s, p in zip(ids, PROMPTS)]
        trees = exact.propose([ProposeInput.after_prefill(s, p, o, 8) for s, p, o in zip(ids, PROMPTS, outs)])
        seen = []

        def each(r: int, launched: int, results: list, asking=asking, seen=seen) -> bool:
            seen.append(launched)
            return r < asking

        chain = LaunchAfter(exact, [ProposeAfter(s, 8) for s in ids])
        got = finish(v.verify_rounds_steps([VerifyInput(s, t) for s, t in zip(ids, trees)], rounds, chain, each))
        runs.append(([[o.tokens for o in outs] for outs in got], seen))
        for h in chain.handles[:-1]:
            exact.settle_after(h)
        exact.release(ids)
        v.release(ids)
    (asked, seen), (whole, _) = runs
    assert seen == [2, 3, 4, 4] and len(asked) == 4
    assert asked == whole
