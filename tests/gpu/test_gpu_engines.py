"""The engines on a GPU: capture succeeds, replayed graphs (Triton kernels inside) give the outputs of the
same steps run eagerly with the PyTorch reference kernels, and float32 greedy speculative decoding equals
plain decoding (8 prompts x 64 tokens). Sampling on the device: the acceptance's kernels make the host
rule's decisions on the same random numbers, sampled graphs equal the reference, a seed reproduces a
sequence, greedy rows beside sampling rows are unchanged, the drafting after a sampled verify chains, and
one-hot sampled rounds chained on the device commit the tokens of one round a call.

    PYTHONPATH=. python -m pytest -q tests/gpu -m gpu
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from common.config import DraftingConfig, SamplingConfig
from common.engine.base import LaunchAfter, PrefillInput, ProposeAfter, ProposeInput, VerifyInput, finish
from common.engine.cuda_graphs import GraphConfig
from common.engine.draft import ACCEPT_TOKENS, Eagle3Drafter
from common.engine.oracle import GreedyOracleDrafter
from common.engine.verifier import Verifier, VerifierConfig
from common.model.eagle3 import Eagle3Config, Eagle3Head
from common.tree import NO_TREE, Tree

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

DEV = torch.device("cuda")
# few buckets, so that the float32 captures take little of a bounded GPU run (the shapes the tests reach)
GRAPHS = GraphConfig(
    batch_buckets=(1, 4), tree_buckets=(16, 32, 61), depth_buckets=(3,), prefill_buckets=(64, 256),
    prefill_batch_buckets=(1, 8),
)  # fmt: skip
DRAFTING = DraftingConfig(sampling_rule="q")  # top_k 10, steps 6, tree 60; the q rule (one-hot: a test of its own)


@pytest.fixture(scope="module")
def ckpt():
    from common.weights import load_checkpoint

    return load_checkpoint()


@pytest.fixture(scope="module")
def prompts():
    from bench.engine_bench import prompts as held_out
    from common.model_path import default_model_path
    from common.tokenizer import Tokenizer

    return held_out(Tokenizer(default_model_path()))[:8]


def _plain(verifier: Verifier, prompts: list[list[int]], n: int) -> list[list[int]]:
    """n greedy tokens of each prompt by plain decoding (n - 1 steps in one call)."""
    ids = [f"plain{i}" for i in range(len(prompts))]
    outs = verifier.prefill_batch([PrefillInput(s, p, SamplingConfig()) for s, p in zip(ids, prompts)])
    rest = verifier.decode_many(ids, n - 1).tokens
    verifier.release(ids)
    return [[o.next_token, *r] for o, r in zip(outs, rest)]


def _speculative(verifier: Verifier, drafter, prompts: list[list[int]], n: int, conc: int) -> list[list[int]]:
    """n greedy tokens of each prompt by rounds of propose and verify, conc sequences at a time; the EAGLE
    drafter's trees after the first round are drafted behind each verify (the device chain)."""
    out = []
    for start in range(0, len(prompts), conc):
        group = prompts[start : start + conc]
        ids = [f"spec{start + i}" for i in range(len(group))]
        outs = verifier.prefill_batch([PrefillInput(s, p, SamplingConfig()) for s, p in zip(ids, group)])
        got = {s: [o.next_token] for s, o in zip(ids, outs)}
        trees = drafter.propose([ProposeInput.after_prefill(s, p, o, 60) for s, p, o in zip(ids, group, outs)])
        while min(len(t) for t in got.values()) < n:
            launch = LaunchAfter(drafter, [ProposeAfter(s, 60) for s in ids]) if drafter.name == "eagle3" else None
            results = finish(verifier.verify_steps([VerifyInput(s, t) for s, t in zip(ids, trees)], launch))
            for s, r in zip(ids, results):
                got[s] += r.tokens
            if launch is not None and launch.handle is not None:
                trees = drafter.read_after(launch.handle, list(range(len(ids))))
            else:
                trees = drafter.propose([ProposeInput.after_verify(s, r, 60) for s, r in zip(ids, results)])
        verifier.release(ids)
        drafter.release(ids)
        out += [got[s][:n] for s in ids]
    return out


def _head(ckpt, dtype: torch.dtype) -> Eagle3Head:
    torch.manual_seed(0)
    head = Eagle3Head(Eagle3Config.for_base(ckpt.config, draft_vocab_size=8192))
    head.set_vocab_map(torch.arange(8192))
    head.to(device=DEV, dtype=dtype).eval()
    return head


@pytest.fixture(scope="module")
def f32(ckpt):
    cfg = VerifierConfig(
        max_sequences=8, max_context=512, max_tree_nodes=64, dtype="float32", device="cuda", prefill_ahead=2
    )
    verifier = Verifier(ckpt, cfg, graphs=True, graph_cfg=GRAPHS)
    head = _head(ckpt, torch.float32)
    drafter = Eagle3Drafter(head, verifier.model.embed_tokens, DRAFTING, 8, 512, DEV, graphs=True, graph_cfg=GRAPHS)
    return verifier, drafter, head


def test_capture_succeeds(f32) -> None:
    verifier, drafter, _ = f32
    for graphs in (verifier.graphs, verifier.prefill_graphs, drafter.graphs):
        assert graphs.report.failed == [], graphs.report.failed
    # every bucket has its graph: verify (deep and shallow trees, and sampled) per batch x tree bucket,
    # decode per batch bucket and Sampler; prefill (a pool and stream of its own) per rows x tokens bucket; the
    # drafter's proposal per batch bucket x new-token count 1..steps + 1, and its expansion
    prefill = len(verifier.prefill_batch_buckets) * len(verifier.prefill_buckets)  # rows x tokens buckets
    assert len(verifier.prefill_graphs.report.captured) == prefill
    # verify: greedy deep and shallow, sampled (temperature only; top-k or top-p) shallow; decode: 3 samplers
    per_batch = 4 * len(verifier.tree_buckets) + 3
    assert len(verifier.graphs.report.captured) == len(verifier.batch_buckets) * per_batch
    # (top-k variants at every depth bucket, the q rule's sampled variant at the drafter's depth)
    per_depth = drafter.max_new + 1  # a propose graph per count of new tokens, and the expansion
    variants = len(drafter.depth_buckets) + 1
    accepts = sum(b * t <= ACCEPT_TOKENS for b in drafter.batch_buckets for t in drafter.accept_buckets)
    assert len(drafter.graphs.report.captured) == len(drafter.batch_buckets) * variants * per_depth + accepts


def test_capture_succeeds_bf16(ckpt) -> None:
    cfg = VerifierConfig(max_sequences=4, max_context=512, max_tree_nodes=64, dtype="bfloat16", device="cuda")
    verifier = Verifier(ckpt, cfg, graphs=True, graph_cfg=GRAPHS)
    drafter = Eagle3Drafter(
        _head(ckpt, torch.bfloat16), verifier.model.embed_tokens, DRAFTING, 4, 512, DEV, graphs=True, graph_cfg=GRAPHS
    )
    for graphs in (verifier.graphs, verifier.prefill_graphs, drafter.graphs):
        assert graphs.report.failed == [], graphs.report.failed


def test_outputs_equal_eager(ckpt, f32, prompts, monkeypatch) -> None:
    """Graphs (captured with the Triton kernels) against the same steps run eagerly at exact sizes with
    the PyTorch reference kernels: with SPECDEC_KERNELS' mode set to reference, every eager call takes
    the reference path while the captured graphs replay what they captured."""
    import common.kernels as kernels

    gv, gd, head = f32
    cfg = VerifierConfig(max_sequences=8, max_context=512, max_tree_nodes=64, dtype="float32", device="cuda")
    ev = Verifier(ckpt, cfg)
    ed = Eagle3Drafter(head, ev.model.embed_tokens, DRAFTING, 8, 512, DEV)
    monkeypatch.setattr(kernels, "_MODE", "reference")
    ids = [f"e{i}" for i in range(3)]
    items = []
    for s, p in zip(ids, prompts):
        want = ev.prefill(PrefillInput(s, p, SamplingConfig()))
        got = gv.prefill(PrefillInput(s, p, SamplingConfig()))
        assert want.next_token == got.next_token  # a replayed prefill graph (rows and tokens bucketed)
        torch.testing.assert_close(got.hidden, want.hidden, rtol=1e-3, atol=1e-3)
        # the eager prefill's features are what both drafters see
        items.append(ProposeInput.after_prefill(s, p, want, 60))
    oracle = GreedyOracleDrafter(ev.model, 6, DEV)
    for rnd in range(4):
        trees_e, trees_g = ed.propose(items), gd.propose(items)
        for te, tg in zip(trees_e, trees_g):
            assert te.tokens.tolist() == tg.tokens.tolist() and te.parents.tolist() == tg.parents.tolist()
            np.testing.assert_allclose(tg.probs, te.probs, rtol=1e-3, atol=1e-5)
        oracle_trees = oracle.propose(items)  # the oracle must see every round's tokens
        if rnd % 2:
            trees_e = oracle_trees  # forces long accepted paths and KV compaction
        batch = [VerifyInput(s, t) for s, t in zip(ids, trees_e)]
        want, got = ev.verify(batch), gv.verify(batch)
        for w, g in zip(want, got):
            assert w.tokens == g.tokens
            torch.testing.assert_close(g.hidden, w.hidden, rtol=1e-3, atol=1e-3)
        # later rounds mix depths: a shallow item in a deeper graph, and a round of depth bucket 2 or 4
        depths = [(0, 2, 3), (2, 2, 1), (4, 0, 3)][rnd % 3]
        items = [ProposeInput(s, w.tokens, w.hidden, False, [], 60, max_depth=d) for s, w, d in zip(ids, want, depths)]
    for sub in (ids, ids[:1]):
        assert ev.decode(sub) == gv.decode(sub)
    for eng in (ev, gv, ed, gd, oracle):
        eng.release(ids)


def test_drafting_after_a_verify_on_graphs(f32, prompts) -> None:
    """The device chain on captured graphs, each engine on its own stream: the trees launched behind each
    verify (Drafter.launch_after, read once the verify's outcome has been read) equal an eager drafter's
    propose of the verify's outputs. Four rounds of 3 sequences, the oracle's trees every other round (the
    whole path accepted: 7 new tokens, the padded accept's width), and one sequence stopping in round 2
    (its row not read: its draft state stays as it was)."""
    gv, gd, head = f32
    ed = Eagle3Drafter(head, gv.model.embed_tokens, DRAFTING, 8, 512, DEV)  # eager, exact sizes
    oracle = GreedyOracleDrafter(gv.model, DRAFTING.steps, DEV)
    ids = ["c0", "c1", "c2"]
    outs = gv.prefill_batch([PrefillInput(s, p, SamplingConfig()) for s, p in zip(ids, prompts)])
    starts = [ProposeInput.after_prefill(s, p, o, 60) for s, p, o in zip(ids, prompts, outs)]
    trees, _, oracle_trees = gd.propose(starts), ed.propose(starts), oracle.propose(starts)
    live = ids
    for rnd in range(4):
        launch = LaunchAfter(gd, [ProposeAfter(s, 60) for s in live])
        results = finish(
            gv.verify_steps([VerifyInput(s, t) for s, t in zip(live, oracle_trees if rnd % 2 else trees)], launch)
        )
        assert launch.handle is not None
        if rnd % 2:
            assert all(len(r.tokens) == DRAFTING.steps + 1 for r in results)
        rows = [0, 2] if rnd == 2 else list(range(len(live)))
        items = [ProposeInput.after_verify(live[i], results[i], 60) for i in rows]
        want, trees = ed.propose(items), gd.read_after(launch.handle, rows)
        for w, g in zip(want, trees):
            assert w.tokens.tolist() == g.tokens.tolist() and w.parents.tolist() == g.parents.tolist()
            np.testing.assert_allclose(g.probs, w.probs, rtol=1e-3, atol=1e-5)
        assert launch.handle.seconds() > 0
        oracle_trees = oracle.propose(items)
        live = [live[i] for i in rows]
    for s in ids:
        assert gd.seqs.get(s)[1].length == ed.seqs.get(s)[1].length
    for eng in (gv, gd, ed, oracle):
        eng.release(ids)


def test_prompts_taken_in_on_graphs_draft_behind_their_first_verify(f32, prompts) -> None:
    """Drafter.take on captured graphs: the prompts' accept passes queued on the drafter's stream behind the
    prefill, nothing waited for; verified as rows of no tree (one token each) with their trees launched behind that
    verify: those trees equal an eager drafter's propose of the prompts (trees unused) and then of the outputs."""
    gv, gd, head = f32
    ed = Eagle3Drafter(head, gv.model.embed_tokens, DRAFTING, 8, 512, DEV)  # eager, exact sizes
    ids = ["t0", "t1", "t2"]
    outs = gv.prefill_batch([PrefillInput(s, p, SamplingConfig()) for s, p in zip(ids, prompts)])
    starts = [ProposeInput.after_prefill(s, p, o, 60) for s, p, o in zip(ids, prompts, outs)]
    ed.propose(starts)
    assert gd.take(starts)
    launch = LaunchAfter(gd, [ProposeAfter(s, 60) for s in ids])
    results = finish(gv.verify_steps([VerifyInput(s, NO_TREE) for s in ids], launch))
    assert launch.handle is not None and [len(r.tokens) for r in results] == [1, 1, 1]
    want = ed.propose([ProposeInput.after_verify(s, r, 60) for s, r in zip(ids, results)])
    for w, g in zip(want, gd.read_after(launch.handle, [0, 1, 2])):
        assert w.tokens.tolist() == g.tokens.tolist() and w.parents.tolist() == g.parents.tolist()
        np.testing.assert_allclose(g.probs, w.probs, rtol=1e-3, atol=1e-5)
    for s in ids:
        assert gd.seqs.get(s)[1].length == ed.seqs.get(s)[1].length
    for eng in (gv, gd, ed):
        eng.release(ids)


def test_float32_speculative_equals_plain(f32, prompts) -> None:
    verifier, drafter, _ = f32
    plain = _plain(verifier, prompts, 64)
    oracle = GreedyOracleDrafter(verifier.model, DRAFTING.steps, DEV)
    for conc in (1, 8):
        assert _speculative(verifier, drafter, prompts, 64, conc) == plain
    assert _speculative(verifier, oracle, prompts, 64, 8) == plain


def test_prefill_groups_of_one_graph_each_read_their_own_prompt(f32, prompts) -> None:
    """Three prompts that prefill_groups puts in three forwards of the same captured graph (one row, 64 columns),
    all queued before the one read: each group's input is its own (the graph's staging buffer is rewritten by the
    next group's feed while the copy before it may still wait behind a replay), so each prompt gets the token,
    features and cache its own prefill gives."""
    verifier, _, _ = f32
    chosen = [prompts[0][:2], prompts[1][:30], prompts[2][:8]]  # prefill_groups -> [[1], [2], [0]]
    want = [verifier.prefill(PrefillInput(f"ref{i}", p, SamplingConfig())) for i, p in enumerate(chosen)]
    got = verifier.prefill_batch([PrefillInput(f"grp{i}", p, SamplingConfig()) for i, p in enumerate(chosen)])
    assert [o.next_token for o in got] == [w.next_token for w in want]
    for o, w in zip(got, want):
        torch.testing.assert_close(o.hidden, w.hidden)
    refs, grps = [f"ref{i}" for i in range(3)], [f"grp{i}" for i in range(3)]
    assert verifier.decode_many(grps, 4).tokens == verifier.decode_many(refs, 4).tokens
    verifier.release(refs + grps)


def test_steps_yield_until_the_device_is_done(f32, prompts) -> None:
    """On a GPU, propose_steps, verify_steps and decode_many_steps yield an event once their work is launched
    (the services' event loop polls it while it answers other calls); driven as steps, with the other engine
    working while they wait, they give what the blocking calls give on a twin sequence with the same prompt."""
    verifier, drafter, _ = f32
    greedy = SamplingConfig()
    (pa,) = verifier.prefill_batch([PrefillInput("steps-a", prompts[0], greedy)])
    proposing = drafter.propose_steps([ProposeInput.after_prefill("steps-a", prompts[0], pa, 60)])
    event = next(proposing)
    assert isinstance(event, torch.cuda.Event)
    (pb,) = verifier.prefill_batch([PrefillInput("steps-b", prompts[0], greedy)])  # while a's drafting runs
    with pytest.raises(StopIteration) as done:
        event.synchronize()
        next(proposing)
    (tree_a,) = done.value.value
    (tree_b,) = drafter.propose([ProposeInput.after_prefill("steps-b", prompts[0], pb, 60)])
    assert tree_a.tokens.tolist() == tree_b.tokens.tolist() and tree_a.parents.tolist() == tree_b.parents.tolist()
    verifying = verifier.verify_steps([VerifyInput("steps-a", tree_a)])
    event = next(verifying)
    assert isinstance(event, torch.cuda.Event)
    while not event.query():
        pass
    with pytest.raises(StopIteration) as done:
        next(verifying)
    (out_a,) = done.value.value
    (out_b,) = verifier.verify([VerifyInput("steps-b", tree_b)])
    assert out_a.tokens == out_b.tokens and len(out_a.tokens) >= 1
    torch.testing.assert_close(out_a.hidden, out_b.hidden)
    decoding = verifier.decode_many_steps(["steps-a"], 4, with_hidden=True)
    event = next(decoding)
    assert isinstance(event, torch.cuda.Event)
    event.synchronize()
    with pytest.raises(StopIteration) as done:
        next(decoding)
    dec_a, dec_b = done.value.value, verifier.decode_many(["steps-b"], 4, with_hidden=True)
    assert dec_a.tokens == dec_b.tokens
    torch.testing.assert_close(dec_a.hidden, dec_b.hidden)
    for eng in (verifier, drafter):
        eng.release(["steps-a", "steps-b"])


def test_triton_and_reference_kernels_agree_bf16(ckpt, prompts, monkeypatch) -> None:
    """One prefill and decode in bf16 with the Triton kernels and with the reference: same tokens for
    most steps (bf16 rounds differently), reported as an agreement rate."""
    import common.kernels as kernels

    cfg = VerifierConfig(max_sequences=2, max_context=512, max_tree_nodes=8, dtype="bfloat16", device="cuda")
    v = Verifier(ckpt, cfg)
    outs = []
    for mode in ("auto", "reference"):
        monkeypatch.setattr(kernels, "_MODE", mode)
        seq = [v.prefill(PrefillInput(mode, prompts[0], SamplingConfig())).next_token]
        for _ in range(32):
            seq += v.decode([mode])
        v.release([mode])
        outs.append(seq)
    agree = np.mean([a == b for a, b in zip(*outs)])
    assert agree >= 0.8, (agree, outs)


def test_move_rows_in_a_cache_past_two_billion_elements():
    """The accepted path's K/V move in the last layer of a cache whose layer offsets pass 2**31 elements (the
    verifier's at --max-context 4096 with 64 sequences: 30 x 65 x 4,218 x 384 = 3.2e9). With 32-bit offsets
    the kernel wrote outside the cache (an illegal memory access that took the verifier down, 2026-11-25)."""
    from common.kernels import reference, triton_ops

    layers, slots, row = 3, 2, 2 * 3 * 64
    capacity = (2**31 // (slots * row)) // 2 + 64  # layer 2 starts past 2**31 elements (6.4 GB in bf16)
    kv = torch.empty((layers, slots, capacity, 2, 3, 64), dtype=torch.bfloat16, device=DEV)
    assert kv.stride(0) * (layers - 1) > 2**31
    n = torch.tensor([capacity - 16], device=DEV)
    slot = torch.tensor([1], device=DEV)
    src = torch.tensor([[0, 2, 4, 3, 4, 5]], device=DEV)
    window = kv[:, 1, capacity - 16 :]  # the rows the move reads and writes, in every layer
    window.copy_(torch.randn(window.shape, generator=torch.Generator(device=DEV).manual_seed(3), device=DEV))
    want = window.clone()
    small = want.clone().unsqueeze(1)  # [L, 1, 16, ...]: the same move on a small cache, by the PyTorch reference
    reference.move_rows(small, torch.tensor([0], device=DEV), torch.tensor([0], device=DEV), src)
    triton_ops.move_rows(kv, slot, n, src)
    torch.cuda.synchronize()
    assert torch.equal(kv[:, 1, capacity - 16 :], small[:, 0])
    assert torch.equal(kv[2, 1, capacity - 14], want[2, 4])  # layer 2: row 4 -> 2 moved, past 2**31


# ---- sampling on the device ----
HOT = SamplingConfig(temperature=0.8, top_p=0.9, seed=3)


def test_device_acceptance_is_the_host_rule_on_the_gpu() -> None:
    """The sampled acceptance's kernels (the target's sort and threshold, the fused walk, bonus and result)
    make the host rule's decisions (common.acceptance) on the same random numbers, tree for tree: both
    rules, top-p and top-k (tests/test_device_sampling.py's trees and logits, on CUDA)."""
    from tests.test_device_sampling import CFGS, host_rule_differences

    for with_q in (False, True):
        for cfg in CFGS:
            assert host_rule_differences(with_q, cfg, "cuda", n=400) == [], (with_q, cfg)


def test_sampled_graphs_equal_eager(ckpt, f32, prompts, monkeypatch) -> None:
    """Sampling sequences (top-p, temperature only, and the one-hot rule's trees) beside a greedy one: the
    sampling graphs (Triton kernels) commit what the same steps commit run eagerly with the PyTorch
    reference, from the same seeds: the prefill's draw, verify rounds of the drafter's trees (the q rule,
    drawn in its sampled graph) and of the oracle's (one-hot), and multi-step decoding."""
    import common.kernels as kernels

    gv, gd, head = f32
    cfg = VerifierConfig(max_sequences=8, max_context=512, max_tree_nodes=64, dtype="float32", device="cuda")
    ev = Verifier(ckpt, cfg)
    ed = Eagle3Drafter(head, ev.model.embed_tokens, DRAFTING, 8, 512, DEV)
    monkeypatch.setattr(kernels, "_MODE", "reference")
    ids = ["q0", "q1", "q2"]
    samplings = [HOT, SamplingConfig(temperature=0.7, seed=4), SamplingConfig()]
    items = []
    for s, p, smp in zip(ids, prompts, samplings):
        want = ev.prefill(PrefillInput(s, p, smp))
        assert gv.prefill(PrefillInput(s, p, smp)).next_token == want.next_token
        items.append(ProposeInput.after_prefill(s, p, want, 60, smp))
    oracle = GreedyOracleDrafter(ev.model, 6, DEV)
    for rnd in range(4):
        trees_e, trees_g = ed.propose(items), gd.propose(items)
        oracle_trees = oracle.propose(items)
        for te, tg in zip(trees_e, trees_g):
            assert te.tokens.tolist() == tg.tokens.tolist() and te.parents.tolist() == tg.parents.tolist()
            assert (te.q is None) == (tg.q is None)
            if te.q is not None:
                assert te.q.ids.tolist() == tg.q.ids.tolist()
                np.testing.assert_allclose(tg.q.probs, te.q.probs, rtol=1e-3, atol=1e-6)
        trees = oracle_trees if rnd % 2 else trees_e  # odd rounds: no q, the one-hot rule
        batch = [VerifyInput(s, t) for s, t in zip(ids, trees)]
        want, got = ev.verify(batch), gv.verify(batch)
        for w, g in zip(want, got):
            assert w.tokens == g.tokens
            torch.testing.assert_close(g.hidden, w.hidden, rtol=1e-3, atol=1e-3)
        items = [ProposeInput.after_verify(s, w, 60) for s, w in zip(ids, want)]
    assert ev.decode_many(ids, 6).tokens == gv.decode_many(ids, 6).tokens
    for eng in (ev, gv, ed, gd, oracle):
        eng.release(ids)


def test_sampling_reproduces_and_keeps_greedy_rows_on_graphs(f32, prompts) -> None:
    """On the captured graphs: twins with one seed commit the same tokens through verify rounds of the
    drafter's trees and multi-step decoding (every step: a batch with sampling rows no longer decodes one
    step a call); a tree of no nodes beside real trees commits one token; and a greedy sequence beside
    sampling ones commits the tokens of its twin in an all-greedy batch (the greedy graphs)."""
    verifier, drafter, _ = f32
    ids = ["g", "h", "s1", "s2", "s3"]  # g beside sampling rows, h its twin alone; s1, s2 twins
    samplings = [SamplingConfig(), SamplingConfig(), HOT, HOT, SamplingConfig(temperature=1.0, top_k=50, seed=9)]
    outs = verifier.prefill_batch([PrefillInput(s, prompts[0], c) for s, c in zip(ids, samplings)])
    assert outs[0].next_token == outs[1].next_token and outs[2].next_token == outs[3].next_token
    items = [ProposeInput.after_prefill(s, prompts[0], o, 60, c) for s, o, c in zip(ids, outs, samplings)]
    trees_of = dict(zip(ids, drafter.propose(items)))
    empty = Tree(np.zeros(0, np.int64), np.zeros(0, np.int64), np.zeros(0, np.float32))
    committed = {s: [o.next_token] for s, o in zip(ids, outs)}
    mixed = ["g", "s1", "s2", "s3"]
    for rnd in range(3):
        trees_of["s2"] = trees_of["s1"]  # the same tree for the twins
        if rnd == 1:
            trees_of["s3"] = empty
        res = verifier.verify([VerifyInput(s, trees_of[s]) for s in mixed])
        (alone,) = verifier.verify([VerifyInput("h", trees_of["g"])])
        assert res[0].tokens == alone.tokens
        torch.testing.assert_close(res[0].hidden, alone.hidden, rtol=1e-4, atol=1e-4)
        assert res[1].tokens == res[2].tokens
        if rnd == 1:
            assert len(res[3].tokens) == 1
        done = dict(zip([*mixed, "h"], [*res, alone]))
        for s, r in done.items():
            committed[s] += r.tokens
        trees_of = dict(zip(done, drafter.propose([ProposeInput.after_verify(s, r, 60) for s, r in done.items()])))
    dec = verifier.decode_many(["g", "s1", "s2", "s3"], 8, with_hidden=True)
    alone = verifier.decode_many(["h"], 8, with_hidden=True)
    assert [len(t) for t in dec.tokens] == [8] * 4
    assert dec.tokens[0] == alone.tokens[0] and dec.tokens[1] == dec.tokens[2]
    torch.testing.assert_close(dec.hidden[0], alone.hidden[0], rtol=1e-4, atol=1e-4)
    assert committed["g"] == committed["h"]
    assert committed["s1"] == committed["s2"]
    for eng in (verifier, drafter):
        eng.release(ids)


def test_drafting_after_a_sampled_verify_on_graphs(f32, prompts) -> None:
    """The device chain with sampling rows: launch_after draws their children on the device behind the verify
    (no host noise), and the trees read after equal an eager drafter's propose of the verify's outputs, q
    included, for three rounds of a greedy and two sampling sequences."""
    gv, gd, head = f32
    ed = Eagle3Drafter(head, gv.model.embed_tokens, DRAFTING, 8, 512, DEV)
    ids = ["d0", "d1", "d2"]
    samplings = [SamplingConfig(), HOT, SamplingConfig(temperature=0.6, seed=5)]
    outs = gv.prefill_batch([PrefillInput(s, p, c) for s, p, c in zip(ids, prompts, samplings)])
    starts = [ProposeInput.after_prefill(s, p, o, 60, c) for s, p, o, c in zip(ids, prompts, outs, samplings)]
    trees, _ = gd.propose(starts), ed.propose(starts)
    for _ in range(3):
        launch = LaunchAfter(gd, [ProposeAfter(s, 60) for s in ids])
        results = finish(gv.verify_steps([VerifyInput(s, t) for s, t in zip(ids, trees)], launch))
        assert launch.handle is not None
        want = ed.propose([ProposeInput.after_verify(s, r, 60) for s, r in zip(ids, results)])
        trees = gd.read_after(launch.handle, [0, 1, 2])
        for w, g in zip(want, trees):
            assert w.tokens.tolist() == g.tokens.tolist() and w.parents.tolist() == g.parents.tolist()
            np.testing.assert_allclose(g.probs, w.probs, rtol=1e-3, atol=1e-5)
            assert (w.q is None) == (g.q is None)
            if w.q is not None:
                assert w.q.ids.tolist() == g.q.ids.tolist()
        assert trees[0].q is None and trees[1].q is not None
    for eng in (gv, gd, ed):
        eng.release(ids)


def test_chained_one_hot_rounds_on_graphs_equal_one_round_a_call(f32, prompts) -> None:
    """The engine core on the captured graphs with the one-hot rule: a greedy and three sampling sequences (top-p,
    temperature alone, top-k) commit the same tokens with up to four rounds a verifier call (the chained rounds'
    sets built on the device) as with one (the host packs them), and the first did chain."""
    from common.engine.core import CoreConfig, EngineCore
    from common.policy import FixedPolicy, Shape
    from common.sequence import Request

    verifier, _, head = f32
    onehot = DraftingConfig(sampling_rule="onehot")
    drafter = Eagle3Drafter(head, verifier.model.embed_tokens, onehot, 8, 512, DEV, graphs=True, graph_cfg=GRAPHS)
    samplings = [SamplingConfig(), HOT, SamplingConfig(temperature=0.7, seed=5), SamplingConfig(1.0, top_k=50, seed=9)]
    settled, settle = [], drafter.settle_after
    drafter.settle_after = lambda h: settled.append(h) or settle(h)
    got = []
    for rounds in (4, 1):
        core = EngineCore(verifier, drafter, FixedPolicy(Shape(6, 60)), CoreConfig(4, rounds_per_step=rounds))
        for i, s in enumerate(samplings):
            core.add(Request(f"c{i}", prompts[i], s, max_new=64))
        out: dict[str, list[int]] = {}
        for _ in range(500):
            for o in core.step():
                out[o.seq_id] = out.get(o.seq_id, []) + o.tokens
            if not core.seqs:
                break
        got.append(out)
        if rounds == 4:
            chained = len(settled)
    assert chained > 0 and len(settled) == chained
    assert got[0] == got[1] and all(len(t) == 64 for t in got[0].values())


def test_prompts_prefilled_beside_a_call_on_graphs_equal_plain(f32, prompts) -> None:
    """The engine core on the captured graphs, two sequences at a time and two prompts prefilled beside a call (on
    the prefill stream while the rounds run on the verifier's): six requests, one arriving at each mid-call publish
    and one before each step, all commit plain decoding's tokens (float32), and prompts were prefilled inside calls."""
    from common.engine.core import CoreConfig, EngineCore
    from common.policy import FixedPolicy, Shape
    from common.sequence import Request

    verifier, drafter, _ = f32
    n = 32
    plain = _plain(verifier, prompts[:6], n)
    todo = [Request(f"b{i}", p, SamplingConfig(), max_new=n) for i, p in enumerate(prompts[:6])]
    inside, beside = [False], []
    verify, launch = verifier.verify_rounds_steps, verifier.prefill_launch

    def counted(items, rounds=1, then=None, each=None):
        inside[0] = True
        out = yield from verify(items, rounds, then, each)
        inside[0] = False
        return out

    def noted(items):
        beside.append(inside[0])
        return launch(items)

    verifier.verify_rounds_steps, verifier.prefill_launch = counted, noted
    cfg = CoreConfig(2, rounds_per_step=2, call_rounds=8, prefill_ahead=2)
    core = EngineCore(verifier, drafter, FixedPolicy(Shape(3, 8)), cfg)
    out: dict[str, list[int]] = {}

    def take(outs):
        for o in outs:
            out[o.seq_id] = out.get(o.seq_id, []) + o.tokens
        if todo:
            core.add(todo.pop(0))

    core.publish = take
    try:
        for _ in range(500):
            if todo:
                core.add(todo.pop(0))
            take(core.step())
            if not core.seqs and not todo:
                break
    finally:
        del verifier.verify_rounds_steps, verifier.prefill_launch
    assert [out[f"b{i}"] for i in range(6)] == plain
    assert any(beside), beside


def sampled_acceptance_both_ways(device: str, dtype: torch.dtype, graphed: bool, v: int = 4096) -> tuple[list, list]:
    """The committed tokens and the compaction's source rows (src) of a batch of sampled trees (one-hot and q,
    tests.test_device_sampling's random trees with tokens of a v-token vocabulary) under random logits in `dtype`
    that favour the drafted tokens, accepted by the Triton kernel (common.kernels.triton_sampling.accept_sampled)
    and by the PyTorch path (common.kernels.sampling's, which common.kernels.accept_sampled takes when the sets
    are not laid out as the trees), each from the same target (speculative.target, top-p 0.9); graphed: the
    PyTorch path captured in a CUDA graph and replayed, as inside the sampled verify."""
    from common.engine.verifier_parts import pack_trees
    from common.kernels import reference, speculative, triton_sampling
    from common.kernels import sampling as torch_sampling
    from common.kernels.sampling import RULE_ONEHOT, RULE_Q, SamplingRows, TreeSets
    from common.tree import row_sets, widest
    from tests.test_device_sampling import _random_trees

    gen = np.random.default_rng(5)
    trees = _random_trees(gen, 24, v, False) + _random_trees(gen, 24, v, True)
    b, t = len(trees), 10
    a = np.zeros((b, 2 * t), dtype=np.int64)
    a[:, t:] = np.arange(t)
    a[:, 0] = gen.integers(0, v, b)
    pack_trees(a, trees, np.array([tr.size for tr in trees]), t)
    w = max([widest(trees), 2] + [tr.q.ids.shape[1] for tr in trees if tr.q is not None])
    w += w % 2
    sets = row_sets(trees, t, w)
    ids, parents = (torch.from_numpy(np.ascontiguousarray(x)).to(device) for x in (a[:, :t], a[:, t:]))  # [B, T] each
    rule = torch.tensor([RULE_Q if tr.q is not None else RULE_ONEHOT for tr in trees], device=device)
    # the layout the kernel reads (common.kernels.accept_sampled's check): one row stride for trees and positions
    assert ids.stride(0) == parents.stride(0) == sets.pos.shape[1] and ids.stride(1) == 1
    tree_sets = TreeSets(
        ids=torch.from_numpy(sets.ids).to(device),
        q=torch.from_numpy(sets.q).to(device),
        pos=torch.from_numpy(sets.pos).to(device),
        rule=rule,
    )
    cfg = SamplingConfig(temperature=0.7, top_p=0.9)
    draw = np.stack([SamplingRows.pack(cfg, int(s), v) for s in gen.integers(0, 2**62, b)])
    rows = SamplingRows.unpack(torch.from_numpy(draw).to(device), torch.full((b,), 300, device=device))
    logits = torch.randn(b, t, v, generator=torch.Generator().manual_seed(9)) * 3
    for i, tr in enumerate(trees):  # the drafted tokens likely under the target: paths get accepted
        for tok, par in zip(tr.tokens.tolist(), tr.parents.tolist()):
            logits[i, par + 1, tok] += float(gen.uniform(6, 12))
    logits = logits.to(dtype).to(device)
    kids = max(widest(trees), 1)
    with torch.inference_mode():
        anc, depth = reference.tree_mask(parents)
        target = speculative.target(logits.view(b * t, v), rows, t, True)
        args = (ids, parents, anc, depth, logits, tree_sets, target, rows, kids)
        fused, fused_src = triton_sampling.accept_sampled(*args)
        if not graphed:
            plain, plain_src = torch_sampling.accept_sampled(*args)
        else:
            side = torch.cuda.Stream()  # warm-up on a side stream (as torch.cuda.graphs asks), then capture
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                torch_sampling.accept_sampled(*args)
            torch.cuda.current_stream().wait_stream(side)
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                plain, plain_src = torch_sampling.accept_sampled(*args)
            graph.replay()
            torch.cuda.synchronize()
    # each tree's committed tokens and the rows its K/V compaction moves (src)
    kept = [
        [(r[1 : r[0] + 2], s) for r, s in zip(x.tolist(), y.tolist())]
        for x, y in ((fused, fused_src), (plain, plain_src))
    ]
    return kept[0], kept[1]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("graphed", [False, True])
def test_the_sampled_acceptance_kernel_and_its_pytorch_path_agree(dtype, graphed) -> None:
    """The Triton acceptance and the PyTorch path commit the same tokens and move the same K/V rows on the GPU, in
    float32 and bf16, the PyTorch path eager and replayed from a graph (the engine takes it, inside the sampled
    verify's graph, whenever the sets are not laid out as the trees)."""
    fused, plain = sampled_acceptance_both_ways("cuda", dtype, graphed)
    differ = [i for i, (x, y) in enumerate(zip(fused, plain)) if x != y]
    assert not differ, [(i, fused[i], plain[i]) for i in differ[:5]]
