"""Launch-count regression guard: a decode step on CUDA is bound by kernel launches, so count per decoder
layer, in a single-token decode step on CPU, the top-level ATen calls that do work (each is one kernel or
one cuBLAS call on CUDA) plus the fused operations of common.kernels (each is one Triton kernel on CUDA;
here they run their PyTorch reference inside a marked range that counts once). Views, reshapes and
same-dtype .to() count zero. On the GPU, bench/decode_probe.py counts the real kernels (276 per decode
step of the 30-layer model on an H100 before RoPE moved into the attention kernel: 9 per layer and 6
more; a whole draft proposal, 10/6/60, 238 before its bookkeeping kernels). The sampling variants are
counted against their greedy twins: what sampling adds must stay a few launches."""

import pytest
import torch
from torch.profiler import ProfilerActivity, profile

from common.config import LlamaConfig
from common.model.eagle3 import Eagle3Config, Eagle3Head
from common.model.llama import Batch, KVCache, LlamaModel

# ATen calls that launch nothing (metadata only, or no-ops when the dtype already matches)
FREE = {
    "aten::view",
    "aten::_unsafe_view",
    "aten::reshape",
    "aten::_reshape_alias",
    "aten::t",
    "aten::transpose",
    "aten::permute",
    "aten::expand",
    "aten::slice",
    "aten::select",
    "aten::unsqueeze",
    "aten::squeeze",
    "aten::as_strided",
    "aten::alias",
    "aten::detach",
    "aten::unflatten",
    "aten::flatten",
    "aten::split",
    "aten::chunk",
    "aten::split_with_sizes",
    "aten::unbind",
    "aten::empty",
    "aten::empty_strided",
    "aten::lift_fresh",
    "aten::narrow",
    "aten::to",
    "aten::contiguous",
    "aten::result_type",
    "aten::is_nonzero",
}
MAX_PER_LAYER = 8  # 2 add+norm, 4 matmuls, RoPE + KV write + attention, SwiGLU


def _cfg(layers: int) -> LlamaConfig:
    return LlamaConfig(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=128,
        num_layers=layers,
        num_heads=6,
        num_kv_heads=2,
        head_dim=16,
        rope_theta=10000.0,
        rms_eps=1e-5,
        max_position=64,
    )


def _decode_batch() -> Batch:
    return Batch(
        input_ids=torch.tensor([[3]]),
        positions=torch.tensor([[5]]),
        slots=torch.tensor([1]),
        write_pos=torch.tensor([[5]]),
        prefix_len=torch.tensor([5]),
        window=torch.ones(1, 1, 1, dtype=torch.bool),
    )


@pytest.fixture(autouse=True)
def fused_ops_count_once(monkeypatch):
    """Each common.kernels operation runs inside a profiler range named specdec::<op>, counted as one."""
    import common.kernels as kernels

    fused = ("add_rms_norm", "rope_kv_write", "swiglu", "attention", "topk_logprobs", "rope_attention")
    tree = ("rms_norm_cat", "draft_level", "select_tree", "tree_mask", "accept_tree", "move_rows", "onehot_sets")
    draws = ("sample_tokens", "row_logz", "target_threshold", "draft_children", "accept_sampled")
    for name in fused + tree + draws:
        fn = getattr(kernels, name)

        def marked(*args, _fn=fn, _name=name, **kw):
            with torch.profiler.record_function(f"specdec::{_name}"):
                return _fn(*args, **kw)

        monkeypatch.setattr(kernels, name, marked)
    # as on the GPU, where the Triton attention needs no per-forward mask (the reference builds its own)
    monkeypatch.setattr(kernels, "attention_plan", lambda *args: None)


def _top_level_ops(fn) -> list[str]:
    with torch.no_grad():
        fn()  # builds the fused weights
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            fn()
    ops = []
    for e in prof.events():
        if not (e.name.startswith("aten::") or e.name.startswith("specdec::")) or e.name in FREE:
            continue
        parent = e.cpu_parent
        while parent is not None and parent.name in FREE:
            parent = parent.cpu_parent
        if parent is None or not (parent.name.startswith("aten::") or parent.name.startswith("specdec::")):
            ops.append(e.name)
    return ops


def _model_ops(layers: int) -> list[str]:
    torch.manual_seed(0)
    cfg = _cfg(layers)
    model = LlamaModel(cfg).eval()
    cache = KVCache.allocate(layers, 2, 16, cfg.num_kv_heads, cfg.head_dim, torch.float32, torch.device("cpu"))
    batch = _decode_batch()
    return _top_level_ops(lambda: model(batch, cache))


def test_decoder_layer_kernel_count():
    few, many = _model_ops(6), _model_ops(10)
    per_layer = (len(many) - len(few)) / 4
    assert per_layer <= MAX_PER_LAYER, (per_layer, sorted(many))


def _head(vocab: int, draft_vocab: int, max_position: int) -> Eagle3Head:
    torch.manual_seed(0)
    cfg = Eagle3Config(
        hidden_size=64,
        intermediate_size=128,
        num_heads=6,
        num_kv_heads=2,
        head_dim=16,
        vocab_size=vocab,
        draft_vocab_size=draft_vocab,
        target_hidden_size=64,
        max_position=max_position,
    )
    head = Eagle3Head(cfg).eval()
    head.set_vocab_map(torch.arange(draft_vocab))
    return head


def test_eagle3_head_kernel_count():
    head = _head(128, 32, 64)
    cfg = head.cfg
    cache = KVCache.allocate(1, 2, 16, cfg.num_kv_heads, cfg.head_dim, torch.float32, torch.device("cpu"))
    batch = _decode_batch()
    embeds, hidden = torch.randn(1, 1, 64), torch.randn(1, 1, 192)
    ops = _top_level_ops(lambda: head(embeds, hidden, batch, cache))
    # fc, the 2 input norms into one buffer, the layer (<= MAX_PER_LAYER, its final add+norm included),
    # lm_head, log_softmax
    assert len(ops) <= MAX_PER_LAYER + 4, sorted(ops)


def test_draft_proposal_kernel_count():
    """A whole proposal (the accept pass over 4 new tokens, then a 10/6/60 tree): per head pass 13 launches
    (fc on the accept pass), one bookkeeping kernel per level, the tree's selection, and a few
    elementwise ops for positions. 238 kernels on an H100 before the bookkeeping kernels (224 here)."""
    from common.config import DraftingConfig
    from common.engine.base import ProposeInput
    from common.engine.draft import Eagle3Drafter

    head = _head(512, 128, 256)
    drafter = Eagle3Drafter(head, torch.nn.Embedding(512, 64), DraftingConfig(), 4, 128, "cpu")
    drafter.propose([ProposeInput("a", list(range(5, 25)), torch.randn(20, 192), True, [1], 0)])
    packed, hidden = drafter._pack([ProposeInput("a", [5, 6, 7, 8], torch.randn(4, 192), False, [], 0)], 1, 4)
    with torch.inference_mode():
        ops = _top_level_ops(lambda: drafter._propose_step(packed, hidden, depth=6))
    assert len(ops) <= 92, sorted(ops)


def test_sampled_draft_proposal_kernel_count():
    """The same proposal in a batch with a sampling row (the q rule's variant): one children draw a level (the
    noise hashed in the kernel, no host numpy), the frontiers stacked for the tree's q rows and q's two
    concatenations; the draws' probabilities and q rows come out of the tree's selection (317 kernels on
    an H100 against 95 greedy before the draws moved into kernels)."""
    from common.config import DraftingConfig, SamplingConfig
    from common.engine.base import ProposeInput
    from common.engine.draft import Eagle3Drafter, noise_block

    head = _head(512, 128, 256)
    drafter = Eagle3Drafter(head, torch.nn.Embedding(512, 64), DraftingConfig(), 4, 128, "cpu")
    hot = SamplingConfig(temperature=0.7, seed=1)
    drafter.propose([ProposeInput("a", list(range(5, 25)), torch.randn(20, 192), True, [1], 0, sampling=hot)])
    packed, hidden = drafter._pack([ProposeInput("a", [5, 6, 7, 8], torch.randn(4, 192), False, [], 0)], 1, 4)
    noise = noise_block(1, [drafter.seqs.get("a")[1]])
    with torch.inference_mode():
        greedy = _top_level_ops(lambda: drafter._propose_step(packed, hidden, depth=6))
        sampled = _top_level_ops(lambda: drafter._propose_step(packed, hidden, **noise, depth=6))
    assert len(sampled) - len(greedy) <= drafter.drafting.steps + 3, sorted(sampled)


@pytest.fixture(scope="module")
def verifier(checkpoint):
    """The real model's verifier, its forward counted as one range (its layers are bounded above)."""
    from common.engine.verifier import Verifier, VerifierConfig

    v = Verifier(checkpoint, VerifierConfig(max_sequences=2, max_context=64, max_tree_nodes=8))
    forward = v.model.forward

    def one_range(*args, **kw):
        with torch.profiler.record_function("specdec::model"):
            return forward(*args, **kw)

    v.model.forward = one_range
    return v


def test_verify_step_kernel_count(verifier):
    """A verify step around the model: the tree mask, positions, the greedy head, acceptance, the K/V
    move and the kept features (about 35 launches on an H100 before the tree kernels, 9 now)."""
    packed = verifier._verify_block(2, 9)
    packed[0, 1:5], packed[0, 10:14] = torch.tensor([5, 6, 7, 8]), torch.tensor([0, 1, 1, 2])  # a 4-node tree
    packed[0, 18:20] = torch.tensor([3, 0])  # length 3, slot 0
    with torch.inference_mode():
        ops = _top_level_ops(lambda: verifier._verify_step(packed))
    assert len(ops) <= 11, sorted(ops)


def test_sampled_steps_kernel_count(verifier):
    """With a sampling row, a decode step adds its draw (one kernel; with top-k or top-p the sort and the
    threshold's kernel before it) to the greedy step, and a verify step adds the rows' targets (one kernel,
    or the sort and one), the fused acceptance and the selection of greedy rows' results (6 in all), and the
    one-hot rows' sets built from their trees (one kernel, on a GPU after two fills, and the choice of them
    over the block's three set columns, written back into them: 8 more): greedy rows keep the greedy step's
    kernels and results."""
    from common.engine.verifier import Sampler

    with torch.inference_mode():
        decode = {
            s: _top_level_ops(lambda s=s: verifier._decode_step(verifier._decode_block(2, s), s)) for s in Sampler
        }
        greedy = _top_level_ops(lambda: verifier._verify_step(verifier._verify_block(2, 9)))
        verify = {}
        for s in (Sampler.TEMPERATURE, Sampler.FILTERED):
            _, step = verifier._sampled_variant(2, 9, s, True, 32, 8)
            verify[s] = _top_level_ops(lambda step=step: step(verifier._sampled_block(2, 9, 32)))
    assert len(decode[Sampler.TEMPERATURE]) == len(decode[Sampler.GREEDY]) + 1, decode
    assert len(decode[Sampler.FILTERED]) == len(decode[Sampler.GREEDY]) + 2, decode  # + the sort's own on a GPU
    for s, ops in verify.items():
        assert len(ops) <= len(greedy) + 14, (s, sorted(ops))


def test_the_sampled_acceptance_gets_the_layout_of_its_fused_kernel(verifier, monkeypatch):
    """The sampled verify hands kernels.accept_sampled tensors its fused kernel reads (kernels.sampled_layout: one
    row stride, the block's): otherwise it would take the PyTorch path on a GPU, one launch per operation (a
    one-hot row's sets built as new tensors once did)."""
    import common.kernels as kernels
    from common.engine.verifier import Sampler

    seen, real = [], kernels.accept_sampled

    def spy(ids, parent_rows, anc, depth, logits, sets, *rest):
        seen.append(kernels.sampled_layout(ids, parent_rows, logits, sets))
        return real(ids, parent_rows, anc, depth, logits, sets, *rest)

    monkeypatch.setattr(kernels, "accept_sampled", spy)
    with torch.inference_mode():
        _, step = verifier._sampled_variant(2, 9, Sampler.TEMPERATURE, True, 32, 8)
        step(verifier._sampled_block(2, 9, 32))
    assert seen == [True]
