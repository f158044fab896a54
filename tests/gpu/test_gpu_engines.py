"""The engines on a GPU: capture succeeds, replayed graphs (Triton kernels inside) give the outputs of the
same steps run eagerly with the PyTorch reference kernels, and float32 greedy speculative decoding equals
plain decoding (8 prompts x 64 tokens).

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

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

DEV = torch.device("cuda")
GRAPHS = GraphConfig(batch_buckets=(1, 2, 4, 8), tree_buckets=(16, 32, 61))
DRAFTING = DraftingConfig()  # top_k 10, steps 6, tree 60


@pytest.fixture(scope="module")
def ckpt():
    from common.weights import load_checkpoint

    return load_checkpoint()


@pytest.fixture(scope="module")
def prompts(ckpt):
    from bench.engine_bench import encode_prompts

    return encode_prompts(ckpt, 8)


def _head(ckpt, dtype: torch.dtype) -> Eagle3Head:
    torch.manual_seed(0)
    head = Eagle3Head(Eagle3Config.for_base(ckpt.config, draft_vocab_size=8192))
    head.set_vocab_map(torch.arange(8192))
    head.to(device=DEV, dtype=dtype).eval()
    return head


@pytest.fixture(scope="module")
def f32(ckpt):
    cfg = VerifierConfig(max_sequences=8, max_context=512, max_tree_nodes=64, dtype="float32", device="cuda")
    verifier = Verifier(ckpt, cfg, graphs=True, graph_cfg=GRAPHS)
    head = _head(ckpt, torch.float32)
    drafter = Eagle3Drafter(head, verifier.model.embed_tokens, DRAFTING, 8, 512, DEV, graphs=True, graph_cfg=GRAPHS)
    return verifier, drafter, head


def test_capture_succeeds(f32) -> None:
    verifier, drafter, _ = f32
    for eng in (verifier, drafter):
        rep = eng.graphs.report
        assert rep.failed == [], rep.failed
    # every bucket has its graph: verify (deep and shallow trees) per batch x tree bucket, decode per batch
    # bucket, prefill per rows x tokens bucket; the drafter's proposal per batch bucket x new-token count
    # 1..steps + 1, and its expansion
    prefill = len(verifier.prefill_batch_buckets) * len(verifier.prefill_buckets)  # rows x tokens buckets
    per_batch = 2 * len(verifier.tree_buckets) + 1
    assert len(verifier.graphs.report.captured) == len(verifier.batch_buckets) * per_batch + prefill
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
    assert verifier.graphs.report.failed == [] and drafter.graphs.report.failed == []


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


def test_float32_speculative_equals_plain(f32, prompts) -> None:
    from bench.engine_bench import run_plain, run_spec

    verifier, drafter, _ = f32
    plain = run_plain(verifier, prompts, 64, 1).outputs
    oracle = GreedyOracleDrafter(verifier.model, DRAFTING.steps, DEV)
    for conc in (1, 8):
        assert run_spec(verifier, drafter, prompts, 64, conc, 60).outputs == plain
    assert run_spec(verifier, oracle, prompts, 64, 8, 60).outputs == plain


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
