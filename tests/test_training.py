"""Training pipeline on tiny random models: vocab map, ShareGPT decoding, TTT masks, batched greedy
generation, a short training run whose loss falls, and the speculative evaluation loop."""

from __future__ import annotations

import copy
import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch

from common.config import LlamaConfig
from common.engine.draft import Eagle3Drafter
from common.engine.verifier import Verifier, VerifierConfig
from common.kernels import reference
from common.kernels.ttt import attention as ttt_attention
from common.model.eagle3 import Eagle3Config, Eagle3Head
from common.model.eagle3_io import load_eagle3, save_eagle3
from common.model.llama import Batch, KVCache, LlamaModel
from common.weights import Checkpoint
from training.evaluate import EvalConfig, evaluate_set
from training.features import pad_batch
from training.filters import is_english
from training.generate import generate_batch, load_sequences, save_shard
from training.sources import first_human_turn, iter_json_array
from training.train import TrainConfig, Trainer, TTTInputs, draft_vocab, make_optimizer, optimize_step
from training.ttt import DenseMaskAttention, FusedAttention, TTTTargets, ttt_mask

CPU = torch.device("cpu")
# 8 layers: eagle_layers() = (2, 4, 5) are distinct (with 6, L//2 == L-3 and aux would be 2H wide)
CFG = LlamaConfig(
    vocab_size=512,
    hidden_size=64,
    intermediate_size=128,
    num_layers=8,
    num_heads=4,
    num_kv_heads=2,
    head_dim=16,
    max_position=256,
)


def tiny_base(seed: int = 0) -> LlamaModel:
    torch.manual_seed(seed)
    m = LlamaModel(CFG)
    with torch.no_grad():
        for p in m.parameters():
            p.normal_(0, 0.08)
        for name, p in m.named_parameters():
            if "norm" in name:
                p.fill_(1.0)
        m.embed_tokens.weight.normal_(0, 0.5)  # tied lm_head: peaked next-token distributions to learn
    return m.eval().requires_grad_(False)


# ---- vocabulary map ----
def test_vocab_map_hand_example():
    cfg = Eagle3Config(
        hidden_size=8,
        intermediate_size=16,
        num_heads=2,
        num_kv_heads=1,
        head_dim=4,
        vocab_size=12,
        draft_vocab_size=3,
        target_hidden_size=8,
    )
    head = Eagle3Head(cfg)
    head.set_vocab_map(torch.tensor([3, 7, 9]))
    assert head.d2t.tolist() == [3, 6, 7]
    assert torch.nonzero(head.t2d).flatten().tolist() == [3, 7, 9]
    assert head.to_base_ids(torch.tensor([0, 1, 2])).tolist() == [3, 7, 9]


def test_draft_vocab_counts_response_tokens_only(tmp_path):
    # prompt tokens (5) must not count; response tokens 7 x3, 9 x2, 3 x1
    save_shard(tmp_path / "gen-00000.npz", [[5, 5, 5, 5], [5]], [[7, 7, 9, 3], [7, 9]], ["a", "b"])
    seqs = load_sequences(tmp_path)
    assert draft_vocab(seqs, 3, 12).tolist() == [3, 7, 9]
    assert draft_vocab(seqs, 2, 12).tolist() == [7, 9]


# ---- prompts ----
def test_truncated_sharegpt_decoding(tmp_path):
    text = (
        '[\n  {"id": "a", "conversations": [{"from": "human", "value": "Hello there"}, '
        '{"from": "gpt", "value": "Hi"}]},\n'
        '  {"id": "b", "conversations": [{"from": "gpt", "value": "I start"}]},\n'
        '  {"id": "c", "conversations": [{"from": "human", "value": "  "}]},\n'
        '  {"id": "d", "conversations": [{"from": "human", "value": "Tell me a story about [brackets] and '
        '\\"quotes\\""}]},\n'
        '  {"id": "e", "conversations": [{"from": "human", "value": "This one is cut off'
    )
    objs = list(iter_json_array(text))
    assert [o["id"] for o in objs] == ["a", "b", "c", "d"]
    turns = [first_human_turn(o) for o in objs]
    assert turns == ["Hello there", None, None, 'Tell me a story about [brackets] and "quotes"']
    assert list(iter_json_array('[{"id": 1}, {"id": 2}]')) == [{"id": 1}, {"id": 2}]


def test_is_english():
    assert is_english("Write a short essay about the sea.")
    assert not is_english("我想撰写一篇机器学习论文")
    assert not is_english("Напиши эссе")


# ---- generation ----
def test_batched_greedy_matches_unbatched():
    m = tiny_base()
    rng = np.random.default_rng(0)
    prompts = [rng.integers(3, 512, size=n).tolist() for n in (5, 11, 2, 8)]
    batched = generate_batch(m, prompts, 12, eos_id=2, device=CPU)
    for p, out in zip(prompts, batched, strict=True):
        single = generate_batch(m, [p], 12, eos_id=2, device=CPU)[0]
        assert out == single
        # and equal to a plain causal forward, token by token
        seq = list(p)
        for tok in out:
            ids = torch.tensor([seq])
            t = len(seq)
            cache = KVCache.allocate(CFG.num_layers, 1, t, CFG.num_kv_heads, CFG.head_dim, torch.float32, CPU)
            pos = torch.arange(t)[None]
            o = m(
                Batch.masked(ids, pos, torch.tensor([0]), pos, torch.ones(t, t, dtype=torch.bool).tril()[None, None]),
                cache,
            )
            assert int(m.logits(o.hidden[0, -1]).argmax()) == tok
            seq.append(tok)


# ---- TTT ----
def test_soft_cross_entropy_is_minus_p_log_q_over_the_masked_rows():
    """training.ttt.soft_cross_entropy (sum(p) lse - sum(p x), p from logits and their log-sum-exp) against
    -sum p log_softmax(x) computed the plain way, values and gradients; and one row by hand: uniform logits
    over 4 ids, p one-hot -> log 4; a masked row does not count."""
    from training.ttt import soft_cross_entropy

    x = torch.zeros(1, 2, 4, requires_grad=True)
    tl = torch.tensor([[[30.0, 0.0, 0.0, 0.0], [0.0, 0.0, 0.0, 5.0]]])  # row 0: p ~ one-hot
    loss = soft_cross_entropy(x, tl, tl.logsumexp(-1), torch.tensor([[1.0, 0.0]]))
    assert abs(loss.item() - math.log(4)) < 1e-6
    g = torch.Generator().manual_seed(0)
    x = (3 * torch.randn(3, 5, 50, generator=g)).requires_grad_()
    tl = 3 * torch.randn(3, 5, 50, generator=g)
    pmask = (torch.rand(3, 5, generator=g) < 0.7).float()
    got = soft_cross_entropy(x, tl, tl.logsumexp(-1), pmask)
    ce = -(torch.softmax(tl, -1) * torch.log_softmax(x, -1)).sum(-1)
    want = (ce * pmask).sum() / pmask.sum()
    torch.testing.assert_close(got, want)
    torch.testing.assert_close(torch.autograd.grad(got, x)[0], torch.autograd.grad(want, x)[0])


def test_ttt_mask_diagonal():
    m = ttt_mask(5, 2, CPU)  # [5, 15]
    r = 4
    seen = torch.nonzero(m[r]).flatten().tolist()
    # step-0 rows <= r-2, step-1 row r-1 (col 5 + 3), step-2 row r (col 10 + 4)
    assert seen == [0, 1, 2, 5 + 3, 10 + 4]
    assert m[0].tolist().count(True) == 1  # row 0 at step 2 sees only itself


def random_head(seed: int) -> Eagle3Head:
    """A 64-token draft head on the tiny base with N(0, 0.1) weights (seeded)."""
    torch.manual_seed(seed)
    head = Eagle3Head(Eagle3Config.for_base(CFG, 64))
    with torch.no_grad():
        for p in head.parameters():
            p.normal_(0, 0.1)
    head.set_vocab_map(torch.arange(64))
    return head


def test_ttt_matches_drafter_chain():
    """TTT step j at row r computes exactly what the drafter computes for a depth-j chain node."""
    base = tiny_base()
    head = random_head(seed=3)
    hcfg = head.cfg
    head.eval()
    from training.ttt import ttt_forward

    # a sequence whose continuation the drafter will follow: chain of draft argmax tokens
    seq = torch.randint(3, 64, (1, 12))
    t = seq.shape[1] - 1
    from training.features import base_features

    f = base_features(base, seq)
    embeds = base.embed_tokens(seq[:, 1:])
    valid = torch.ones(1, t, dtype=torch.bool)
    tg = TTTTargets.of(torch.zeros(1, t, 64), torch.zeros(1, t, dtype=torch.long), valid, valid)
    # record each step's log-probabilities from the lm_head's output
    outs = []
    hook = head.lm_head.register_forward_hook(lambda m, i, o: outs.append(torch.log_softmax(o.detach(), dim=-1)))
    with torch.no_grad():
        ttt_forward(head, embeds, f.aux[:, :-1], tg, steps=3)
    hook.remove()
    assert len(outs) == 3
    # drafter: committed prefix of m pairs, then chain nodes use the TRUE next tokens (top_k=1 chain
    # feeds its own argmax; here we compare the head computation directly with the same tokens)
    m_pairs = 6
    c = hcfg
    cache = KVCache.allocate(1, 1, 32, c.num_kv_heads, c.head_dim, torch.float32, CPU)
    with torch.no_grad():
        pos = torch.arange(m_pairs)[None]
        b = Batch.masked(
            pos, pos, torch.tensor([0]), pos, torch.ones(m_pairs, m_pairs, dtype=torch.bool).tril()[None, None]
        )
        o = head(embeds[:, :m_pairs], f.aux[:, :m_pairs], b, cache)
        h = o.hidden[:, -1:]
        anc = []
        for d in range(1, 3):
            r = m_pairs + d - 1  # row of this node in TTT indexing, step d
            write = 32 - 8 + d  # any scratch column
            anc.append(write)
            mask = torch.zeros(1, 1, 1, 32, dtype=torch.bool)
            mask[..., :m_pairs] = True
            mask[..., anc] = True
            b = Batch.masked(torch.tensor([[0]]), torch.tensor([[r]]), torch.tensor([0]), torch.tensor([[write]]), mask)
            o = head(embeds[:, r : r + 1], h, b, cache)
            assert torch.allclose(o.logp[0, 0], outs[d][0, r], atol=1e-5), d
            h = o.hidden


@pytest.mark.parametrize("t", [13, 3])
def test_fused_ttt_attention_matches_dense_mask(t):
    """common.kernels.ttt (flash causal block + diagonal, log-sum-exp merge, hand-written backward) is the
    dense-mask attention: output and the gradients of q and of every cache entry, float32, steps 0..4
    (t = 3: steps 3 and 4 have no block-0 key at all)."""
    torch.manual_seed(0)
    b, h, kvh, d = 2, 6, 2, 16
    for j in range(5):
        q = torch.randn(b, t, h, d, requires_grad=True)
        kv = torch.randn(3, (j + 1) * t + 4, 2, kvh, d, requires_grad=True)  # 3 slots, spare columns
        slots = torch.tensor([2, 0])
        window = ttt_mask(t, j, CPU)[None].expand(b, t, (j + 1) * t)
        bias = reference.attention_bias(torch.zeros(b, dtype=torch.long), window, (j + 1) * t, h // kvh, q.dtype)
        dense = reference.attention(q, kv, slots, (j + 1) * t, bias)  # [B, T, H * D]
        fused = ttt_attention(q, [kv[slots, s * t : (s + 1) * t] for s in range(j + 1)])  # step s: [B, T, ...]
        assert torch.allclose(fused, dense, atol=1e-5, rtol=1e-5), j
        grad = torch.randn_like(dense)
        for gd, gf in zip(torch.autograd.grad(dense, (q, kv), grad), torch.autograd.grad(fused, (q, kv), grad)):
            assert torch.allclose(gf, gd, atol=1e-5, rtol=1e-5), (j, (gf - gd).abs().max())


def random_ttt_inputs(hcfg: Eagle3Config, b: int, t: int, seed: int) -> TTTInputs:
    g = torch.Generator().manual_seed(seed)
    valid = torch.rand(b, t, generator=g) < 0.9
    return TTTInputs(
        embeds=torch.randn(b, t, hcfg.hidden_size, generator=g),
        aux=torch.randn(b, t, 3 * hcfg.target_hidden_size, generator=g),
        targets=TTTTargets.of(
            3 * torch.randn(b, t, hcfg.draft_vocab_size, generator=g),
            base_top=torch.randint(0, hcfg.draft_vocab_size, (b, t), generator=g),
            in_draft=torch.rand(b, t, generator=g) < 0.8,
            valid=valid,
        ),
    )


def test_fused_train_step_equals_dense_mask_step():
    """One training step (6 TTT steps, forward, backward, clipping, AdamW) with the fused attention gives
    the dense-mask step's losses, accuracies, gradients and updated weights (float32, CPU)."""
    head = random_head(seed=5)
    hcfg = head.cfg
    cfg = TrainConfig(draft_vocab=64, ttt_steps=6, grad_clip=1e9)  # no clipping: compare raw gradients
    inputs = random_ttt_inputs(hcfg, b=3, t=19, seed=1)
    heads = {"dense": copy.deepcopy(head), "fused": copy.deepcopy(head)}
    outcome = {}
    for name, attn in (("dense", DenseMaskAttention()), ("fused", FusedAttention())):
        outcome[name] = optimize_step(heads[name], make_optimizer(heads[name], cfg), inputs, cfg, 1e-3, attn)
    rd, rf = outcome["dense"].result, outcome["fused"].result
    assert torch.allclose(rf.loss, rd.loss, atol=1e-6, rtol=1e-6)
    assert np.allclose(rf.step_loss, rd.step_loss, atol=1e-6, rtol=1e-6)
    assert rf.step_acc == rd.step_acc and rf.step_rows == rd.step_rows
    for (name, pd), pf in zip(heads["dense"].named_parameters(), heads["fused"].parameters()):
        assert torch.allclose(pf.grad, pd.grad, atol=1e-6, rtol=1e-4), name
        # AdamW's first step moves a weight by about lr * grad / (|grad| + eps): where a gradient is near eps
        # (1e-8) a difference of 1e-10 in it moves the weight by up to ~lr * 1e-2 differently (seen on one CPU:
        # -7.65e-9 against -7.77e-9 gave 3.7e-6). The weights must agree to 1% of the lr; the gradients above
        # are the exact comparison.
        assert torch.allclose(pf, pd, atol=1e-5, rtol=1e-5), name


def test_a_non_finite_gradient_stops_the_step_before_the_update():
    """A NaN in the head's gradients raises before AdamW touches a weight (a run stops at once instead of
    training NaN weights for minutes, as a broken compiled step once did on a GPU)."""
    head = random_head(seed=8)
    cfg = TrainConfig(draft_vocab=64, ttt_steps=2)
    inputs = random_ttt_inputs(head.cfg, b=2, t=9, seed=4)
    bad = TTTInputs(embeds=inputs.embeds.clone(), aux=inputs.aux, targets=inputs.targets)
    bad.embeds[0, 3, 0] = float("nan")
    before = {n: p.detach().clone() for n, p in head.named_parameters()}
    with pytest.raises(RuntimeError, match="non-finite"):
        optimize_step(head, make_optimizer(head, cfg), bad, cfg, 1e-3)
    assert all(torch.equal(p, before[n]) for n, p in head.named_parameters())
    optimize_step(head, make_optimizer(head, cfg), inputs, cfg, 1e-3)  # finite: the step runs
    assert any(not torch.equal(p, before[n]) for n, p in head.named_parameters())


def test_ttt_bench_reports_how_far_each_paths_gradients_are_from_the_first():
    """training.ttt_step's grad diff: ~0 for the fused path against the dense one (float32, CPU), and large
    against gradients that are not the step's (what a wrong backward with a right first loss looks like)."""
    from training.ttt_step import PATHS, parse_args, run, time_path

    args = ["--out", "unused", "--batch", "1", "--seq", "12", "--steps", "2", "--warmup", "0", "--iters", "1"]
    report = run(parse_args(args))
    row = report["results"][0]
    assert "grad_diff" not in row["dense"] and row["fused"]["grad_diff"] < 1e-4
    head = random_head(seed=9)
    inputs = random_ttt_inputs(head.cfg, b=1, t=8, seed=5)
    cfg = TrainConfig(draft_vocab=64, ttt_steps=2)
    _, grads = time_path(head, inputs, cfg, PATHS["dense"], 0, 1)
    wrong = {n: g.flip(0) if g.dim() else -g for n, g in grads.items()}
    out, _ = time_path(head, inputs, cfg, PATHS["fused"], 0, 1, reference=wrong)
    assert out["grad_diff"] > 0.5


# ---- training ----
def test_engine_generate_equals_the_model_loop(tmp_path):
    """The generate stage's engine path (continuous batching over 2 slots for 6 prompts, batched prefill,
    3 decode steps a call) gives generate_batch's greedy responses, each cut at max_new_tokens or after its
    eos; a prompt whose first token is eos stops there."""
    from common.engine.verifier import Verifier, VerifierConfig
    from training.generate import engine_generate

    base = tiny_base()
    sd = {k: v.clone() for k, v in base.state_dict().items() if not k.startswith("rope")}
    ver = Verifier(
        Checkpoint(name="tiny", config=CFG, state_dict=sd, path=tmp_path),
        VerifierConfig(max_sequences=2, max_context=64, max_tree_nodes=8),
    )
    rng = np.random.default_rng(3)
    prompts = [rng.integers(3, 512, size=n).tolist() for n in (5, 11, 2, 8, 3, 7)]
    want = generate_batch(base, prompts, 10, eos_id=2, device=CPU)
    assert engine_generate(ver, prompts, 10, eos_id=2, steps=3) == want
    eos = [want[0][0]]  # with the first response's first token as eos, that response is [eos]
    assert engine_generate(ver, prompts[:1], 10, eos_id=eos[0], steps=3) == [eos]
    assert len(ver.seqs) == 0  # every slot released


def make_workdir(tmp_path: Path, base: LlamaModel, n: int = 48) -> Path:
    """Sequences generated greedily by the tiny base from random prompts."""
    rng = np.random.default_rng(1)
    prompts = [rng.integers(3, 512, size=int(rng.integers(3, 8))).tolist() for _ in range(n)]
    resp = generate_batch(base, prompts, 20, eos_id=2, device=CPU)
    (tmp_path / "gen").mkdir()
    save_shard(tmp_path / "gen" / "gen-00000.npz", prompts, resp, [str(i) for i in range(n)])
    return tmp_path


def test_tiny_training_loss_falls(tmp_path):
    base = tiny_base()
    w = make_workdir(tmp_path, base, n=32)
    seqs = load_sequences(w / "gen")
    cfg = TrainConfig(
        draft_vocab=256, steps=30, batch_size=8, max_len=32, lr=3e-3, warmup=3, ttt_steps=6, save_every=15, log_every=10
    )
    trainer = Trainer(base, seqs, w, cfg, CPU)
    recs = [trainer.train_step() for _ in range(30)]
    first = np.mean([r["loss"] for r in recs[:5]])
    last = np.mean([r["loss"] for r in recs[-5:]])
    assert last < 0.8 * first, (first, last)
    assert len(recs[-1]["step_acc"]) == 6
    trainer.save_state()
    trainer.export()
    head, hcfg = load_eagle3(w / "head")
    assert hcfg.draft_vocab_size == 256
    # resume continues from the saved step
    again = Trainer(base, seqs, w, cfg, CPU)
    assert again.step == 30
    assert torch.equal(again.head.fc.weight, trainer.head.fc.weight)


def test_run_resumes_and_exports(tmp_path):
    base = tiny_base()
    w = make_workdir(tmp_path, base, n=16)
    seqs = load_sequences(w / "gen")
    cfg = TrainConfig(draft_vocab=128, steps=4, batch_size=4, max_len=24, ttt_steps=2, save_every=2, log_every=2)
    assert not Trainer(base, seqs, w, cfg, CPU).run(deadline=0.0)  # budget already spent: saves, stops
    assert Trainer(base, seqs, w, cfg, CPU).run()
    assert (w / "train" / "DONE").exists() and (w / "head" / "config.json").exists()
    lines = (w / "train" / "train_log.jsonl").read_text().splitlines()
    assert json.loads(lines[-1])["step"] == 4
    assert json.loads(lines[-1])["samples_per_s"] > 0  # throughput for the model card
    done = json.loads((w / "train" / "DONE").read_text())
    assert done["samples"] == 4 * 4 and done["samples_per_s"] > 0  # 4 steps of batch 4, across the resume


# ---- evaluation loop ----
def test_eval_equals_greedy(tmp_path):
    base = tiny_base()
    sd = {k: v.clone() for k, v in base.state_dict().items() if not k.startswith("rope")}
    ckpt = Checkpoint(name="tiny", config=CFG, state_dict=sd, path=tmp_path)
    ver = Verifier(ckpt, VerifierConfig(max_sequences=4, max_context=64, max_tree_nodes=64))
    torch.manual_seed(0)
    head = Eagle3Head(Eagle3Config.for_base(CFG, 256))
    from training.train import init_head

    init_head(head, base, torch.arange(256))
    head.eval()

    def make(dcfg):
        return Eagle3Drafter(head, ver.model.embed_tokens, dcfg, 4, 64, CPU)

    rng = np.random.default_rng(2)
    prompts = [rng.integers(3, 512, size=6).tolist() for _ in range(5)]
    res = evaluate_set(
        ver, make, prompts, EvalConfig(max_new_tokens=10, batch_size=4, check_equal=True), eos=2, name="t"
    )
    for k in ("tree", "chain"):
        assert res[k]["equal_to_greedy"]
        assert res[k]["mean_accept_len"] >= 1.0
        assert len(res[k]["accept_rate_by_depth"]) == 6


@pytest.mark.parametrize("bad", [dict(batch_size=0), dict(ttt_steps=0), dict(lr=0.0), dict(minutes=-1.0)])
def test_train_config_validates(bad):
    with pytest.raises(ValueError):
        TrainConfig(**bad)


def test_pooled_sets_weigh_their_rounds():
    """Two sets' tree results pooled by hand: 10 tokens in 4 rounds (accepted 0, 1, 2, 3: hist [1, 1, 1, 1]) and 6 in
    4 (1, 1, 0, 0: hist [2, 2]) -> 16 tokens in 8 rounds, 2.0; hist [3, 3, 1, 1]: 5 of 8 accept one, 2 of 5 a second,
    1 of 2 a third."""
    from training.evaluate import pooled

    a = {
        "sequences": 1,
        "rounds": 4,
        "tokens": 10,
        "accept_rate_by_depth": [0.75, 0.67, 0.5],
        "accepted_hist": [1, 1, 1, 1],
        "wall_s": 1.0,
    }
    b = {"sequences": 2, "rounds": 4, "tokens": 6, "accept_rate_by_depth": [0.5, 0.0, 0.0], "accepted_hist": [2, 2]}
    b["wall_s"] = 3.0
    got = pooled([{"tree": a}, {"tree": b}])
    assert set(got) == {"tree"}
    t = got["tree"]
    assert (t["sequences"], t["rounds"], t["tokens"], t["mean_accept_len"]) == (3, 8, 16, 2.0)
    assert t["accepted_hist"] == [3, 3, 1, 1]
    assert t["accept_rate_by_depth"] == pytest.approx([5 / 8, 2 / 5, 1 / 2])
    assert (t["wall_s"], t["tokens_per_s"]) == (4.0, 4.0)  # 16 tokens in the sets' 1 + 3 s


def test_eval_of_the_heldout_categories(tmp_path, capsys):
    """`eval --sets heldout` on the embedded model and the shipped head: one prompt a category, four tokens; every
    category and their pool reported for both trees, acceptance within [1, depth + 1], outputs equal to greedy."""
    from bench.load import CATEGORIES
    from training.pipeline import Context, build_parser, stage_eval

    head = Path(__file__).resolve().parents[1] / "models" / "eagle3-smollm2"
    argv = ["eval", "--workdir", str(tmp_path), "--head", str(head), "--sets", "heldout", "--eval-limit", "1"]
    args = build_parser().parse_args([*argv, "--max-new-tokens", "4", "--eval-batch", "2", "--check-equal"])
    assert stage_eval(Context(args))
    results = json.loads((tmp_path / "eval.json").read_text())["results"]
    assert set(results) == {f"heldout-{c}" for c in CATEGORIES} | {"heldout-all"}
    for name, r in results.items():
        for tree, depth in (("tree", 6), ("chain", 6)):
            assert 1.0 <= r[tree]["mean_accept_len"] <= depth + 1, (name, tree)
    assert results["heldout-all"]["tree"]["sequences"] == 6
    assert "heldout-summarization" in capsys.readouterr().out
    with pytest.raises(ValueError, match="unknown eval set 'heldout-poetry'"):
        stage_eval(Context(build_parser().parse_args(["eval", "--workdir", str(tmp_path), "--sets", "heldout-poetry"])))


def test_the_compiled_step_traces_each_ttt_step_once_whatever_the_batch(monkeypatch):
    """ttt_forward's compiled steps (dynamo with a counting backend on CPU: the graphs run eagerly) trace one graph
    per TTT step on the first batch and none for later batches of other sizes, with the eager step's losses. With
    dynamo's duck sizing a first batch of 2 rows was tied to the K/V pair's dimension of 2, and the batch of 3
    traced the steps again (on a GPU 64 rows and the head dimension: a training stage's second batch hit the
    recompile limit)."""
    from torch._dynamo.testing import CompileCounter

    import training.ttt as ttt

    torch._dynamo.reset()
    counter = CompileCounter()
    monkeypatch.setattr(ttt, "compiled_step", lambda: ttt.compile_step(counter))
    head = random_head(seed=3)
    try:
        for i, (b, t) in enumerate([(2, 12), (3, 10), (5, 9)]):
            x = random_ttt_inputs(head.cfg, b, t, seed=i)
            got = ttt.ttt_forward(head, x.embeds, x.aux, x.targets, steps=3, compile=True)
            assert counter.frame_count == 3, (b, t)
            want = ttt.ttt_forward(head, x.embeds, x.aux, x.targets, steps=3, compile=False)
            assert torch.allclose(got.loss, want.loss, rtol=1e-5) and got.step_acc == want.step_acc
    finally:
        torch._dynamo.reset()


def test_a_saved_head_regrows_its_draft_vocabulary(tmp_path):
    """--init-head rebuilds the draft vocabulary from the responses (here 64 tokens to 96); a token both had keeps
    the saved head's lm_head row, a new one gets the base's row, every other weight is the saved head's."""
    base = tiny_base()
    w = make_workdir(tmp_path, base, n=16)
    seqs = load_sequences(w / "gen")
    saved = random_head(3)
    saved.set_vocab_map(torch.arange(448, 512))  # the saved vocabulary: base ids 448..511
    save_eagle3(saved, Eagle3Config.for_base(CFG, 64), tmp_path / "saved", aux_layers=base.aux_layers)
    saved, _ = load_eagle3(tmp_path / "saved")  # as saved (bf16)
    row_of = {t: i for i, t in enumerate(range(448, 512))}
    cfg = TrainConfig(draft_vocab=96, steps=1, batch_size=4, max_len=24, ttt_steps=2)
    head = Trainer(base, seqs, w, cfg, CPU, init_from=tmp_path / "saved").head
    vocab = head.base_ids().tolist()
    assert vocab == draft_vocab(seqs, 96, CFG.vocab_size).tolist()
    assert {t in row_of for t in vocab} == {True, False} and not set(row_of) <= set(vocab)  # kept, new and dropped
    for row, t in enumerate(vocab):
        want = saved.lm_head.weight[row_of[t]] if t in row_of else base.lm_head.weight[t]
        assert torch.equal(head.lm_head.weight[row], want.float()), (row, t)
    assert torch.equal(head.t2d.nonzero().flatten(), torch.tensor(vocab))
    for name in ("fc.weight", "midlayer.self_attn.q_proj.weight", "norm.weight"):
        assert torch.equal(head.state_dict()[name], saved.state_dict()[name].float()), name


def test_source_weights_repeat_a_sources_sequences_and_weigh_its_tokens(tmp_path):
    """--source-weights sharegpt=3,magpie=0: each epoch holds three copies of every ShareGPT sequence, none of
    Magpie's and one of the rest, and the draft vocabulary counts the tokens of each sequence as often."""
    from training.sources import parse_source_weights, source_of
    from training.train import response_counts, sequence_copies

    assert [source_of(i) for i in ("5laNzPs_36", "gsm8k-317", "chatterbot-coding-17", "magpie-00049-01748")] == [
        "sharegpt",
        "gsm8k",
        "chatterbot",
        "magpie",
    ]
    weights = parse_source_weights("sharegpt=3, magpie=0")
    assert weights == (("magpie", 0), ("sharegpt", 3))
    for bad in ("shargpt=3", "sharegpt=-1", "sharegpt=1.5", "sharegpt"):
        with pytest.raises(ValueError, match=bad.split("=")[0]):
            parse_source_weights(bad)
    (tmp_path / "gen").mkdir()
    ids = ["aB_0", "gsm8k-1", "magpie-00000-00001", "cD_1"]  # ShareGPT, GSM8K, Magpie, ShareGPT
    prompts, responses = [[5, 6], [5, 7], [5, 8], [5, 9]], [[10, 11, 11], [12, 13], [14, 15, 16], [10, 17]]
    save_shard(tmp_path / "gen" / "gen-00000.npz", prompts, responses, ids)
    seqs = load_sequences(tmp_path / "gen")
    copies = sequence_copies(seqs, weights)
    assert copies.tolist() == [3, 1, 0, 3]
    counts = response_counts(seqs, 20, copies=copies)
    assert counts[10:18].tolist() == [6, 6, 1, 1, 0, 0, 0, 3]  # 10: in two ShareGPT responses, x3; 11: twice in one
    cfg = TrainConfig(draft_vocab=4, steps=1, batch_size=2, max_len=8, ttt_steps=2, source_weights=weights)
    trainer = Trainer(tiny_base(), seqs, tmp_path, cfg, CPU)
    assert sorted(trainer.index.tolist()) == [0, 0, 0, 1, 3, 3, 3]
    assert trainer.head.base_ids().tolist() == [10, 11, 12, 17]  # 6, 6, 3 (17), 1 (12 and 13 tie)


def test_a_saved_heads_vocabulary_swaps_a_token_only_for_a_clearly_more_frequent_one(tmp_path):
    """--vocab-swap-ratio K: a head continued from a saved one of the same size keeps its draft tokens, except where a
    token outside the vocabulary is more than K times as frequent as the kept token it replaces."""
    from training.train import kept_vocab, response_counts

    counts, saved = np.array([10, 1, 8, 3, 2]), np.array([1, 3])
    assert kept_vocab(counts, saved, 2.0).tolist() == [0, 2]  # 10 > 2 x 1 and 8 > 2 x 3
    assert kept_vocab(counts, saved, 3.0).tolist() == [0, 3]  # 8 < 3 x 3: the swaps stop
    assert kept_vocab(counts, saved, 11.0).tolist() == [1, 3]
    assert kept_vocab(np.array([5, 5, 5, 5]), np.array([2, 3]), 1.0).tolist() == [2, 3]  # a tie keeps the old token
    base = tiny_base()
    w = make_workdir(tmp_path, base, n=16)
    seqs = load_sequences(w / "gen")
    saved = random_head(3)
    saved.set_vocab_map(torch.arange(448, 512))
    save_eagle3(saved, Eagle3Config.for_base(CFG, 64), tmp_path / "saved", aux_layers=base.aux_layers)
    counts = response_counts(seqs, CFG.vocab_size)
    for ratio in (1.0, 1e9):
        cfg = TrainConfig(draft_vocab=64, steps=1, batch_size=4, max_len=24, ttt_steps=2, vocab_swap_ratio=ratio)
        head = Trainer(base, seqs, tmp_path / f"r{ratio}", cfg, CPU, init_from=tmp_path / "saved").head
        vocab = head.base_ids().tolist()
        assert vocab == kept_vocab(counts, np.arange(448, 512), ratio).tolist()
        assert (vocab == list(range(448, 512))) == (ratio == 1e9), ratio


def test_ttt_rows_padded_to_a_multiple_of_8_leave_the_step_unchanged(tmp_path):
    """A batch's TTT rows are padded to a multiple of 8 (one compiled graph per TTT step on a GPU); the padding is
    masked out, so the first step's loss and accuracies equal the unpadded batch's."""
    pb = pad_batch([(np.arange(10), 3), (np.arange(13), 4)], 24, CPU, rows_multiple=8)
    assert pb.ids.shape == (2, 17) and pb.lengths.tolist() == [10, 13] and pb.ids[0, 10:].eq(0).all()
    assert pad_batch([(np.arange(30), 3)], 24, CPU, rows_multiple=8).ids.shape == (1, 25)  # cut at 24, rows to 24
    base = tiny_base()
    w = make_workdir(tmp_path, base, n=16)
    seqs = load_sequences(w / "gen")
    recs = []
    for m in (1, 8):
        cfg = TrainConfig(draft_vocab=128, steps=2, batch_size=4, max_len=23, ttt_steps=3, rows_multiple=m)
        recs.append(Trainer(base, seqs, tmp_path / f"rows{m}", cfg, CPU).train_step())
    assert recs[0]["tokens"] == recs[1]["tokens"] and recs[0]["step_acc"] == recs[1]["step_acc"]
    assert math.isclose(recs[0]["loss"], recs[1]["loss"], rel_tol=1e-5), (recs[0]["loss"], recs[1]["loss"])


def test_vocabulary_coverage_by_hand(tmp_path, capsys):
    """training.vocab: the most frequent tokens (ties by lower id) and the share of held-out response tokens a
    vocabulary holds, by hand and through the command over a shard."""
    from training.train import top_tokens
    from training.vocab import coverage, main

    assert top_tokens(np.array([0, 5, 5, 9]), 2).tolist() == [1, 3]
    assert coverage(np.array([1, 3, 0, 6]), np.array([1, 3])) == 0.9
    (tmp_path / "gen").mkdir()
    # responses (after the 1-token prompts): rows 0-2 choose, row 3 is held out; 7 and 8 chosen at size 2
    rows = [[1, 7, 7, 8], [1, 7, 8], [1, 8, 9], [1, 7, 9, 9, 5]]
    save_shard(tmp_path / "gen" / "gen-00000.npz", [r[:1] for r in rows], [r[1:] for r in rows], ["a", "b", "c", "d"])
    assert main(["--gen", str(tmp_path / "gen"), "--sizes", "2,3", "--held-out", "0.25", "--vocab-size", "16"]) == 0
    out = capsys.readouterr().out
    assert "| 2 | 25.0% |" in out and "| 3 | 75.0% |" in out  # row 3's 7, 9, 9, 5: {7, 8} holds 1, {7, 8, 9} 3


def test_vocabulary_coverage_against_other_responses_by_hand(tmp_path, capsys):
    """training.vocab --against: a head's vocabulary and the one --vocab-swap-ratio would give it, measured per group
    on responses (here written beforehand, so no generation runs)."""
    from training.vocab import main

    (tmp_path / "gen").mkdir()
    responses = [[10, 11, 11], [12, 13], [14, 15, 16], [10, 17]]  # counts: 10 and 11 twice, the rest once
    save_shard(tmp_path / "gen" / "gen-00000.npz", [[5]] * 4, responses, ["a", "b", "c", "d"])
    saved = Eagle3Head(Eagle3Config.for_base(CFG, 2))
    saved.set_vocab_map(torch.tensor([10, 12]))
    save_eagle3(saved, saved.cfg, tmp_path / "head", aux_layers=(2, 4, 5))
    against = tmp_path / "evalset.jsonl"
    against.write_text('{"source": "s", "prompt_ids": [1, 2]}\n{"source": "t", "prompt_ids": [3]}\n')
    (tmp_path / "r.json").write_text('[{"group": "s", "response": [10, 10, 13]}, {"group": "t", "response": [12, 5]}]')
    argv = ["--gen", str(tmp_path / "gen"), "--head", str(tmp_path / "head"), "--against", str(against)]
    argv += ["--responses", str(tmp_path / "r.json"), "--swap-ratios", "1,3", "--vocab-size", "512"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "| s | t | all |" in out and f"| {tmp_path / 'head'} | 66.7 | 50.0 | 60.0 |" in out
    assert "| --vocab-swap-ratio 1 (1 new) | 66.7 | 0.0 | 40.0 |" in out  # 11 (twice) in for 12 (once): [10, 11]
    assert "| --vocab-swap-ratio 3 (0 new) | 66.7 | 50.0 | 60.0 |" in out  # 2 is not more than 3 x 1
