"""The Triton kernels (common/kernels/triton_ops.py) against the PyTorch reference they replace.

On CPU they run in Triton's interpreter (TRITON_INTERPRET=1, float32 and float16: the interpreter's
bfloat16 matmul is not faithful); on a GPU the same tests run the compiled kernels, bfloat16 included.
Shapes are SmolLM2's per-head shapes (9 query heads, 3 KV heads, head_dim 64) at small lengths.
"""

from __future__ import annotations

import os

import pytest
import torch

from common.config import SamplingConfig

CUDA = torch.cuda.is_available()
if not CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton_ops is first imported

from common.kernels import HAVE_TRITON, reference  # noqa: E402

pytestmark = pytest.mark.skipif(not HAVE_TRITON, reason="triton is not installed")
DEV = torch.device("cuda" if CUDA else "cpu")
DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if CUDA else [])
H, KVH, D = 9, 3, 64


def _interpreter_numpy_fix() -> None:
    """Triton 3.6's interpreter turns a scalar into a Python int with int(array), which NumPy >= 2.4
    refuses for 1-element arrays (dynamic loop bounds fail); index through .item() instead."""
    from triton.runtime import interpreter

    original = interpreter._patch_lang_tensor
    if getattr(original, "numpy_fix", False):
        return

    def patched(tensor, scope):
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0].item()))

    patched.numpy_fix = True
    interpreter._patch_lang_tensor = patched


def ops():
    from common.kernels import triton_ops

    if not CUDA:
        _interpreter_numpy_fix()
    return triton_ops


def tol(dtype: torch.dtype) -> dict:
    return {
        torch.float32: dict(atol=1e-4, rtol=1e-4),
        torch.float16: dict(atol=2e-3, rtol=2e-3),
        torch.bfloat16: dict(atol=2e-2, rtol=2e-2),
    }[dtype]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("with_residual", [False, True])
def test_add_rms_norm(dtype, with_residual):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, 5, 96, generator=g).to(DEV, dtype)
    res = torch.randn(3, 5, 96, generator=g).to(DEV, dtype) if with_residual else None
    w = torch.rand(96, generator=g).to(DEV, dtype) + 0.5
    got, got_sum = ops().add_rms_norm(x, res, w, 1e-5)
    want, want_sum = reference.add_rms_norm(x, res, w, 1e-5)
    torch.testing.assert_close(got_sum, want_sum, **tol(dtype))
    torch.testing.assert_close(got, want, **tol(dtype))


@pytest.mark.parametrize("dtype", DTYPES)
def test_rope_kv_write(dtype):
    """Rotated q in place, rotated k and raw v at (slot, write_pos); other cache entries untouched."""
    from common.model.llama import rope_tables

    g = torch.Generator().manual_seed(1)
    b, t = 2, 3
    cos, sin = (x.to(DEV) for x in rope_tables(D, 64, 10000.0))
    qkv = torch.randn(b, t, (H + 2 * KVH) * D, generator=g).to(DEV, dtype)
    # columns of one packed block, as the engines pass them (strided, not contiguous)
    packed = torch.tensor([[4, 5, 5, 10, 11, 12, 2], [0, 1, 2, 3, 4, 5, 0]], device=DEV)
    positions, write, slots = packed[:, 0:3], packed[:, 3:6], packed[:, 6]
    kv = torch.randn(3, 16, 2, KVH, D, generator=g).to(DEV, dtype)
    got_qkv, got_kv = qkv.clone(), kv.clone()
    ops().rope_kv_write(got_qkv, cos, sin, positions, slots, write, got_kv, H, KVH)
    reference.rope_kv_write(qkv, cos, sin, positions, slots, write, kv, H, KVH)
    torch.testing.assert_close(got_qkv, qkv, **tol(dtype))
    torch.testing.assert_close(got_kv, kv, **tol(dtype))


@pytest.mark.parametrize("dtype", DTYPES)
def test_swiglu(dtype):
    x = torch.randn(4, 2, 2 * 1536, generator=torch.Generator().manual_seed(2)).to(DEV, dtype)
    torch.testing.assert_close(ops().swiglu(x), reference.swiglu(x), **tol(dtype))


def _tree_window(b: int, t: int) -> torch.Tensor:
    """[B, T, T] ancestor masks of random trees (parents precede children)."""
    g = torch.Generator().manual_seed(3)
    win = torch.zeros(b, t, t, dtype=torch.bool)
    for i in range(b):
        win[i, 0, 0] = True
        for r in range(1, t):
            p = int(torch.randint(0, r, (1,), generator=g))
            win[i, r] = win[i, p]
            win[i, r, r] = True
    return win


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", ["decode", "tree", "prefill", "beyond_block"])
def test_attention(dtype, case):
    """Prefix + window visibility: decode (window [[1]]), a 21-row tree over different prefixes per
    sequence, a causal prefill (prefix 0), and a prefix longer than one 64-key block."""
    g = torch.Generator().manual_seed(4)
    b = 3
    if case == "decode":
        t, prefix, window = 1, [5, 0, 17], torch.ones(b, 1, 1, dtype=torch.bool)
    elif case == "tree":
        t, prefix, window = 21, [9, 3, 30], _tree_window(b, 21)
    elif case == "prefill":
        t, prefix, window = 12, [0, 0, 0], torch.ones(12, 12, dtype=torch.bool).tril().expand(b, 12, 12)
    else:
        t, prefix, window = 4, [150, 64, 63], _tree_window(b, 4)
    cap = max(prefix) + window.shape[-1] + 8
    kv = torch.randn(4, cap, 2, KVH, D, generator=g).to(DEV, dtype)
    qkv = torch.randn(b, t, H + 2 * KVH, D, generator=g).to(DEV, dtype)
    q = qkv[:, :, :H]  # strided, as the model passes it
    packed = torch.tensor([[s, p] for s, p in zip((3, 0, 1), prefix)], device=DEV)  # strided columns
    slots, prefix_len = packed[:, 0], packed[:, 1]
    window = window.contiguous().to(DEV)
    got = ops().attention(q, kv, slots, prefix_len, window)
    kv_len = max(prefix) + window.shape[-1]
    bias = reference.attention_bias(prefix_len, window, kv_len, H // KVH, torch.float32)
    want = reference.attention(q.float(), kv.float(), slots, kv_len, bias)
    torch.testing.assert_close(got.float(), want, **tol(dtype))


@pytest.mark.parametrize("batch", [1, 24])
def test_attention_split_and_whole(batch):
    """Decoding at batch 1 splits the keys over 8 programs and merges them; at batch 24 (72 programs)
    one program a sequence reads them all: both equal the reference, over prefixes from 0 to 300 keys."""
    g = torch.Generator().manual_seed(10)
    prefix = torch.randint(0, 300, (batch,), generator=g)
    prefix[0] = 300
    kv = torch.randn(batch + 1, 320, 2, KVH, D, generator=g).to(DEV)
    q = torch.randn(batch, 1, H, D, generator=g).to(DEV)
    slots = torch.randperm(batch + 1, generator=g)[:batch].to(DEV)
    prefix, window = prefix.to(DEV), torch.ones(batch, 1, 1, dtype=torch.bool, device=DEV)
    got = ops().attention(q, kv, slots, prefix, window)
    bias = reference.attention_bias(prefix, window, 301, H // KVH, torch.float32)
    torch.testing.assert_close(got, reference.attention(q, kv, slots, 301, bias), **tol(torch.float32))


@pytest.mark.parametrize("dtype", DTYPES)
def test_topk_logprobs(dtype):
    x = torch.randn(2, 3, 8192, generator=torch.Generator().manual_seed(5)).to(DEV, dtype)
    vals, ids = ops().topk_logprobs(x, 10)
    want_vals, want_ids = reference.topk_logprobs(x, 10)
    torch.testing.assert_close(vals, want_vals, atol=1e-4, rtol=1e-4)
    # the same values in the same order (ids may differ only between equal logits: float16 has ties)
    assert torch.equal(x.gather(-1, ids), x.gather(-1, want_ids))
    assert all(len(set(row)) == 10 for row in ids.reshape(-1, 10).tolist())  # no id twice in a row's top-k


def test_reference_visibility_example():
    """The worked example of reference.visibility."""
    got = reference.visibility(torch.tensor([3]), torch.tensor([[[1, 0], [1, 1]]], dtype=torch.bool), 6)
    assert got.int().tolist() == [[[1, 1, 1, 1, 0, 0], [1, 1, 1, 1, 1, 0]]]


@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_cat(dtype):
    g = torch.Generator().manual_seed(6)
    a, b = (torch.randn(2, 3, 96, generator=g).to(DEV, dtype) for _ in range(2))
    wa, wb = (torch.rand(96, generator=g).to(DEV, dtype) + 0.5 for _ in range(2))
    torch.testing.assert_close(ops().rms_norm_cat(a, wa, b, wb, 1e-5), reference.rms_norm_cat(a, wa, b, wb, 1e-5))


# ---- the draft's tree expansion: K children a node, S scratch entries, hidden width HD ----
K, S, HD = 4, 12, 80


def _level_inputs(b: int, f: int, g: torch.Generator, ties: bool) -> dict:
    """One level's inputs: children scores in steps of 0.5 when ties (many equal cumulative scores)."""
    score = -torch.rand(b, f, K, generator=g)
    if ties:
        score = -(torch.randint(0, 4, (b, f, K), generator=g) * 0.5)
    return dict(
        kid_ids=torch.randint(0, 50, (b, f, K), generator=g).to(DEV),
        kid_score=score.to(DEV),
        kid_logq=(-torch.rand(b, f, K, generator=g)).to(DEV),
        hidden=torch.randn(b, f, HD, generator=g).to(DEV),
    )


def _cand(b: int, c: int) -> tuple[torch.Tensor, ...]:
    return (
        torch.full((b, c), -7, dtype=torch.long, device=DEV),
        torch.full((b, c), 9.0, device=DEV),
        torch.full((b, c), 9.0, device=DEV),
        torch.full((b, c), -7, dtype=torch.long, device=DEV),
    )


@pytest.mark.parametrize("ties", [False, True])
@pytest.mark.parametrize("where", ["root", "inner", "last"])
def test_draft_level(where, ties):
    """The kernel writes the same candidates and returns the same frontier as the reference, exactly
    (ties broken towards the child created first in both)."""
    g = torch.Generator().manual_seed(7)
    b, c = 3, 40
    embed = torch.randn(50, HD, generator=g).to(DEV)
    f = 1 if where == "root" else K
    args = _level_inputs(b, f, g, ties)
    if where == "root":
        args.update(front_score=None, front_id=None, front_anc=None, offset=0, created=0, own_base=0)
    else:
        args.update(
            front_score=(-torch.randint(0, 3, (b, K), generator=g) * 0.5).to(DEV),
            front_id=torch.randint(0, 4, (b, K), generator=g).to(DEV),
            front_anc=(torch.rand(b, K, S, generator=g) < 0.3).to(DEV),
            offset=4,
            created=4,
            own_base=K if where == "inner" else None,
        )
    got_cand, want_cand = _cand(b, c), _cand(b, c)
    got = ops().draft_level(embed=embed, cand=got_cand, scratch=S, **args)
    want = reference.draft_level(embed=embed, cand=want_cand, scratch=S, **args)
    for x, y in zip(got_cand, want_cand):
        assert torch.equal(x, y)
    if where == "last":
        assert got is None and want is None
        return
    for x, y in zip(got, want):
        assert x.dtype == y.dtype and torch.equal(x, y)


def test_draft_level_reference_example():
    """The docstring's example: the root's two children, the better one first in the frontier."""
    cand = _cand(1, 2)
    front = reference.draft_level(
        torch.tensor([[[5, 6]]]),
        torch.tensor([[[-0.5, -0.1]]]),
        torch.tensor([[[-0.5, -0.1]]]),
        None,
        None,
        torch.zeros(1, 1, 3),
        None,
        torch.eye(7),
        tuple(t.cpu() for t in cand),
        offset=0,
        created=3,
        own_base=1,
        scratch=4,
    )
    tok, score, ids, _, anc, emb = front
    assert tok.tolist() == [[6, 5]] and ids.tolist() == [[4, 3]]
    assert torch.allclose(score, torch.tensor([[-0.1, -0.5]]))
    assert anc.int().tolist() == [[[0, 1, 0, 0], [0, 0, 1, 0]]]  # own entries own_base + rank
    assert emb.argmax(-1).tolist() == [[6, 5]]


def _random_candidates(b: int, steps: int, g: torch.Generator) -> tuple[torch.Tensor, ...]:
    """Candidates as the expansion lays them out (K at depth 1, K * K a level below, each level's parents
    among the level above), scores in steps of 0.5 never above the parent's (many ties)."""
    c = K + (steps - 1) * K * K
    score = torch.zeros(b, c)
    parent = torch.full((b, c), -1, dtype=torch.long)
    score[:, :K] = -(torch.randint(0, 3, (b, K), generator=g) * 0.5)
    start, width = 0, K  # the level above: candidates [start, start + width)
    for level in range(1, steps):
        lo = K + (level - 1) * K * K
        par = start + torch.randint(0, width, (b, K * K), generator=g)
        parent[:, lo : lo + K * K] = par
        score[:, lo : lo + K * K] = score.gather(1, par) - torch.randint(0, 4, (b, K * K), generator=g) * 0.5
        start, width = lo, K * K
    tok = torch.randint(0, 50, (b, c), generator=g)
    return tok.to(DEV), score.to(DEV), parent.to(DEV)


def test_select_tree():
    """The kernel's trees equal the reference's, entry for entry (filler included), over keeps and row
    depths that cut the tree at every level."""
    g = torch.Generator().manual_seed(8)
    b, steps = 6, 3
    tok, score, parent = _random_candidates(b, steps, g)
    d2t = torch.randint(0, 30, (50,), generator=g).to(DEV)
    keep = torch.tensor([[1, 1], [4, 2], [9, 3], [20, 3], [12, 1], [30, 2]], device=DEV)  # (keep, depth)
    keep[4, 0] = 4  # depth 1 keeps at most K
    n = 30
    got = ops().select_tree(tok, score, parent, d2t, keep[:, 0], keep[:, 1], K, n)
    want = reference.select_tree(tok, score, parent, d2t, keep[:, 0], keep[:, 1], K, n)
    assert torch.equal(got[1], want[1])
    rows = [0, 1, 3]  # ids, parents, q rows exactly; the probabilities to exp's rounding
    assert torch.equal(got[0][:, rows], want[0][:, rows])
    torch.testing.assert_close(got[0][:, 2], want[0][:, 2], atol=0, rtol=1e-6)
    # a batch with sampling rows: their probabilities are their draws', and every row's expanded nodes
    # name their q rows (fronts: the frontiers' creation indices, level by level)
    logq = torch.rand(score.shape, generator=g).log().to(DEV)
    temp = torch.tensor([0.7, 0.0, 1.0, 0.7, 0.0, 0.5], device=DEV)
    fronts = torch.stack([torch.randperm(K + K * K, generator=g)[: 2 * K] for _ in range(b)]).to(DEV)
    drawn = reference.Drawn(logq=logq, temperature=temp, fronts=fronts)
    got = ops().select_tree(tok, score, parent, d2t, keep[:, 0], keep[:, 1], K, n, drawn)
    want = reference.select_tree(tok, score, parent, d2t, keep[:, 0], keep[:, 1], K, n, drawn)
    assert torch.equal(got[0][:, rows], want[0][:, rows]) and (want[0][:, 3] > 0).any()
    torch.testing.assert_close(got[0][:, 2], want[0][:, 2], atol=0, rtol=1e-6)


def test_select_tree_reference_example():
    """K 2, one level below the root: scores [-.1, -2 | -.5, -.5, -3, -2.5] (the last four below
    candidate 0, 0, 1, 1); keep 3 at depth 2 -> candidates 0, 2, 3 in creation order."""
    score = torch.tensor([[-0.1, -2.0, -0.5, -0.5, -3.0, -2.5]])
    parent = torch.tensor([[-1, -1, 0, 0, 1, 1]])
    tok = torch.tensor([[10, 11, 12, 13, 14, 15]])
    d2t = torch.zeros(20, dtype=torch.long)
    d2t[10:16] = 100
    tree, kept = reference.select_tree(tok, score, parent, d2t, torch.tensor([3]), torch.tensor([2]), 2, 4)
    assert kept.tolist() == [[0, 2, 3, 0]]
    assert tree[0, 0].tolist() == [110, 112, 113, 0]
    assert tree[0, 1].tolist() == [-1, 0, 0, -1]
    assert torch.allclose(
        tree[0, 2], torch.tensor([0.1, 0.4, 0.4, 0.0], dtype=torch.float64).neg().exp() * torch.tensor([1, 1, 1, 0])
    )
    assert tree[0, 3].tolist() == [-1, -1, -1, -1]
    # depth 1 only: the two root children, whatever their grandchildren score
    tree, kept = reference.select_tree(tok, score, parent, d2t, torch.tensor([2]), torch.tensor([1]), 2, 4)
    assert kept[0, :2].tolist() == [0, 1]


@pytest.mark.parametrize("splits", [1, 2, 3, 8])
def test_attention_forced_splits(splits):
    """A 40-row tree (120 query rows a KV head: two row blocks) over prefixes of 0 to 200 keys, the
    keys unsplit, in the window and one prefix range, two, and seven (most of them empty at the short
    prefixes): all equal the reference."""
    g = torch.Generator().manual_seed(11)
    b, t = 2, 40
    prefix = torch.tensor([200, 0], device=DEV)
    kv = torch.randn(b, 256, 2, KVH, D, generator=g).to(DEV)
    q = torch.randn(b, t, H, D, generator=g).to(DEV)
    slots = torch.tensor([1, 0], device=DEV)
    window = _tree_window(b, t).to(DEV)
    got = ops().attention(q, kv, slots, prefix, window, splits=splits)
    bias = reference.attention_bias(prefix, window, 240, H // KVH, torch.float32)
    torch.testing.assert_close(got, reference.attention(q, kv, slots, 240, bias), **tol(torch.float32))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", ["decode", "level", "tree"])
def test_rope_attention(dtype, case):
    """The fused kernel (RoPE, the K/V write and attention in one launch) against rope_kv_write then
    attention of the reference: the output and the cache. decode: one token a sequence;
    level: 10 tokens (a draft level) at one position each, written to scratch entries, seeing ancestors;
    tree: 30 tokens at their depths' positions (90 query rows a KV head: two row blocks, each writing
    the 30 new keys), split over keys at batch 3."""
    from common.model.llama import rope_tables

    g = torch.Generator().manual_seed(9)
    b, cap = 3, 112
    cos, sin = (x.to(DEV) for x in rope_tables(D, 128, 10000.0))
    prefix = torch.tensor([5, 0, 70], device=DEV)
    slots = torch.tensor([2, 0, 1], device=DEV)
    if case == "decode":
        t = 1
        positions, write_pos = prefix[:, None], prefix[:, None]
        window = torch.ones(b, 1, 1, dtype=torch.bool, device=DEV)
    elif case == "tree":
        t = 30
        window = _tree_window(b, t).to(DEV)
        positions = prefix[:, None] + window.sum(-1) - 1  # each node at its depth
        write_pos = prefix[:, None] + torch.arange(t, device=DEV)
    else:
        t = 10
        positions = (prefix[:, None] + 2).expand(b, t)  # one depth: one position, stride 0
        write_pos = (prefix[:, None] + torch.arange(20, device=DEV))[:, 10:20]  # a slice of the scratch
        window = (torch.rand(b, t, 20, generator=g) < 0.4).to(DEV)
        window[:, torch.arange(t), 10 + torch.arange(t)] = True  # each sees itself
    qkv = torch.randn(b, t, (H + 2 * KVH) * D, generator=g).to(DEV, dtype)
    kv = torch.randn(3, cap, 2, KVH, D, generator=g).to(DEV, dtype)
    got_qkv, got_kv = qkv.clone(), kv.clone()
    got = ops().rope_attention(got_qkv, cos, sin, positions, slots, write_pos, got_kv, prefix, window, H, KVH)
    reference.rope_kv_write(qkv, cos, sin, positions, slots, write_pos, kv, H, KVH)
    kv_len = int(prefix.max()) + window.shape[-1]
    q = qkv.view(b, t, H + 2 * KVH, D)[:, :, :H]
    bias = reference.attention_bias(prefix, window, kv_len, H // KVH, torch.float32)
    want = reference.attention(q.float(), kv.float(), slots, kv_len, bias)
    torch.testing.assert_close(got_kv, kv, **tol(dtype))
    torch.testing.assert_close(got.float(), want, **tol(dtype))


def _packed_trees(b: int, t: int, seed: int) -> torch.Tensor:
    """A verify block [B, 2T + 3] as the verifier packs it: random trees of 0 to T - 1 nodes (parents
    before children, tokens from 2 values so that paths get long), then padding rows naming themselves;
    lengths, slots (0 .. B - 1) and greedy flags (every third sequence samples)."""
    g = torch.Generator().manual_seed(seed)
    packed = torch.zeros(b, 2 * t + 3, dtype=torch.int64)
    for i in range(b):
        nodes = int(torch.randint(0, t, (1,), generator=g))
        parents = torch.arange(t)
        for r in range(1, nodes + 1):
            parents[r] = int(torch.randint(0, r, (1,), generator=g))
        packed[i, 1:t] = torch.randint(0, 2, (t - 1,), generator=g)
        packed[i, t : 2 * t] = parents
        packed[i, 2 * t : 2 * t + 3] = torch.tensor([5 + i, i, int(i % 3 != 2)])
    return packed


@pytest.mark.parametrize("t", [5, 33, 64, 65])
def test_tree_mask_and_acceptance(t):
    """The mask, depths, accepted counts, tokens and moved rows of random trees (read from a packed
    block's strided columns, as the verify step does) equal the reference's, sampling rows included."""
    b = 6
    packed = _packed_trees(b, t, seed=t).to(DEV)
    ids, parent_rows, greedy = packed[:, :t], packed[:, t : 2 * t], packed[:, 2 * t + 2]
    anc, depth = ops().tree_mask(parent_rows)
    want_anc, want_depth = reference.tree_mask(parent_rows)
    assert torch.equal(anc, want_anc) and torch.equal(depth, want_depth)
    target = torch.randint(0, 2, (b, t), generator=torch.Generator().manual_seed(1)).to(DEV)
    result, src = ops().accept_tree(ids, parent_rows, anc, depth, target, greedy)
    want_result, want_src = reference.accept_tree(ids, parent_rows, want_anc, want_depth, target, greedy)
    assert torch.equal(src, want_src)
    for i in range(b):  # entries 0 .. count + 1: the count, the accepted tokens and the bonus
        c = int(want_result[i, 0])
        assert result[i, : c + 2].tolist() == want_result[i, : c + 2].tolist()
    assert t == 5 or int(want_result[:, 0].max()) >= 3  # paths go deep: the test sees real compaction


@pytest.mark.parametrize("t", [5, 33, 64])
def test_one_hot_sets_equal_the_reference(t):
    """The one-hot sets of random trees (a packed block's strided columns, as the sampled verify reads them;
    tokens of 5 values: repeated siblings), W 16 and W 2 (rows wider than their sets), equal the reference's."""
    packed = _packed_trees(6, t, seed=40 + t)
    packed[:, 1:t] = torch.randint(0, 5, (6, t - 1), generator=torch.Generator().manual_seed(t))
    packed = packed.to(DEV)
    ids, parent_rows = packed[:, :t], packed[:, t : 2 * t]
    for w in (16, 2):
        got = ops().onehot_sets(ids, parent_rows, w)
        want = reference.onehot_sets(ids, parent_rows, w)
        for a, b in zip(got, want):
            assert torch.equal(a, b), w
    assert int(want[1].count_nonzero()) > 6  # the trees have sets to compare


def test_move_rows_reads_before_writing():
    """Path rows that land where another path row is read from (src [0, 2, 4] moves row 4 to 2 after
    row 2 has moved to 1), in every layer, for two sequences at their own lengths; rows off the path and
    a sampling sequence's (src = k) stay."""
    g = torch.Generator().manual_seed(12)
    kv = torch.randn(2, 3, 16, 2, KVH, D, generator=g).to(DEV)
    slots, n = torch.tensor([2, 0], device=DEV), torch.tensor([3, 7], device=DEV)
    src = torch.tensor([[0, 2, 4, 3, 4, 5], [0, 1, 2, 3, 4, 5]], device=DEV)
    want = kv.clone()
    reference.move_rows(want, slots, n, src)
    got = kv.clone()
    ops().move_rows(got, slots, n, src)
    assert torch.equal(got, want)
    assert torch.equal(got[:, 2, 4], kv[:, 2, 5]) and torch.equal(got[:, 2, 5], kv[:, 2, 7])  # rows 2, 4 -> 1, 2
    assert torch.equal(got[:, 0], kv[:, 0]) and torch.equal(got[:, 1], kv[:, 1])


# ---- sampling (common.kernels.sampling's reference against common.kernels.triton_sampling) ----
def sampling_ops():
    from common.kernels import triton_sampling

    if not CUDA:
        _interpreter_numpy_fix()
    return triton_sampling


@pytest.mark.parametrize("with_index", [False, True])
def test_sample_tokens_and_logz(with_index):
    """Gumbel-max draws (the same random bits in both: the hash is integer arithmetic) with thresholds,
    excluded tokens (-inf) and greedy rows' temperature 1; the token ids of an index input; the normaliser."""
    from common.kernels import sampling

    g = torch.Generator().manual_seed(21)
    r, v = 5, 3000
    x = torch.randn(r, v, generator=g) * 3
    x[1, :100] = -torch.inf
    temp = torch.tensor([0.7, 1.0, 0.3, 1.0, 2.0])
    theta = torch.tensor([-torch.inf, 2.0, -torch.inf, 0.0, 1.0])
    seed, counter = torch.randint(0, 2**62, (r,), generator=g), torch.randint(0, 5000, (r,), generator=g)
    index = torch.randint(0, 49152, (r, v), generator=g) if with_index else None
    args = [t.to(DEV) for t in (x, temp, theta, seed, counter)]
    got_tok, got_key = sampling_ops().sample_tokens(*args, None if index is None else index.to(DEV))
    want_tok, want_key = sampling.sample_tokens(*args, None if index is None else index.to(DEV))
    assert torch.equal(got_tok, want_tok)
    torch.testing.assert_close(got_key, want_key, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(sampling_ops().row_logz(args[0], args[1]), sampling.row_logz(args[0], args[1]))


def test_draft_children():
    """The draft's children draws: sampled rows (drawn tokens, ranked scores, log q, q) and a top-k row."""
    from common.kernels import sampling

    g = torch.Generator().manual_seed(22)
    b, f, w, k = 3, 4, 32, 10
    logp = torch.log_softmax(torch.randn(b, f, 100, generator=g) * 2, -1).topk(w).values
    ids = torch.randint(0, 8000, (b, f, w), generator=g)
    temp = torch.tensor([0.7, 0.0, 1.5])
    seed, counter = torch.randint(0, 2**62, (b,), generator=g), torch.tensor([5, 6, 7])
    args = [t.to(DEV) for t in (logp, ids, temp, seed, counter)]
    got = sampling_ops().draft_children(*args, 2, k)
    want = sampling.draft_children(*args, 2, k)
    assert torch.equal(got[0], want[0])
    for a, e in zip(got[1:], want[1:]):
        torch.testing.assert_close(a, e, rtol=1e-5, atol=1e-6)


def _sampled_trees(b: int, t: int, w: int, v: int, seed: int):
    """A batch of random trees (half q rule, half one-hot) as the sampled verify reads them: ids, parent rows
    and positions in one int64 block's columns, random sets and logits, sampling rows."""
    from common.kernels.sampling import RULE_ONEHOT, RULE_Q, SamplingRows, TreeSets

    g = torch.Generator().manual_seed(seed)
    packed = torch.zeros(b, 3 * t + 2, dtype=torch.int64)
    for i in range(b):
        n = int(torch.randint(0, t, (1,), generator=g))
        parents = torch.arange(t)
        for j in range(1, n + 1):
            parents[j] = int(torch.randint(0, j, (1,), generator=g))
        packed[i, :t] = torch.randint(0, v, (t,), generator=g)
        packed[i, t : 2 * t] = parents
        packed[i, 2 * t : 3 * t] = torch.randint(0, w, (t,), generator=g)
    rule = torch.tensor([RULE_Q if i % 2 else RULE_ONEHOT for i in range(b)])
    q = torch.softmax(torch.randn(b, t, w, generator=g) * 2, -1) * (torch.rand(b, t, w, generator=g) > 0.3)
    ids = torch.stack([torch.stack([torch.randperm(v, generator=g)[:w] for _ in range(t)]) for _ in range(b)])
    logits = torch.randn(b, t, v, generator=g) * 2
    for i in range(b):  # each node's token is its parent's set's at its position, in q's support, likely
        for j in range(1, t):
            par, at = int(packed[i, t + j]), int(packed[i, 2 * t + j])
            if par != j:
                packed[i, j] = ids[i, par, at]
                q[i, par, at] += 0.05
        logits[i].scatter_add_(1, ids[i], torch.full((t, w), 4.0))
    sets = TreeSets(ids=ids, q=q / q.sum(-1, keepdim=True), pos=packed[:, 2 * t : 3 * t], rule=rule)
    cols = torch.stack([torch.from_numpy(SamplingRows.pack(cfg, 11 + i, v)) for i, cfg in enumerate(_CFGS[:b])])
    rows = SamplingRows.unpack(cols, torch.arange(b) + 40)
    return packed, sets, logits, rows


_CFGS = [SamplingConfig(temperature=0.8, top_p=0.9), SamplingConfig(temperature=1.2, top_k=7)] * 3


def _trees_on(packed, sets, logits, rows, dev: torch.device = DEV):
    """_sampled_trees' batch on dev, the sets' positions a view of the packed block's columns as the engine's
    (the fused acceptance reads ids, parent rows and positions with one row stride)."""
    import dataclasses

    packed = packed.to(dev)
    t = sets.pos.shape[1]
    sets = dataclasses.replace(_on(sets, dev), pos=packed[:, 2 * t : 3 * t])
    return packed, sets, logits.to(dev), _on(rows, dev)


def _on(x, dev: torch.device = DEV):
    """x (a tensor, or a dataclass of tensors or None) on dev."""
    import dataclasses

    if x is None or isinstance(x, torch.Tensor):
        return x if x is None else x.to(dev)
    return type(x)(**{f.name: _on(getattr(x, f.name), dev) for f in dataclasses.fields(x)})


def _threshold_rows(cfgs: list[SamplingConfig], v: int):
    """The sequences' sampling columns as an engine packs them (top_k 0 -> V, top_p 1 -> 2), on DEV."""
    from common.kernels.sampling import SamplingRows

    cols = torch.stack([torch.from_numpy(SamplingRows.pack(cfg, 3 + i, v)) for i, cfg in enumerate(cfgs)])
    return _on(SamplingRows.unpack(cols, torch.zeros(len(cfgs), dtype=torch.int64)))


def _check_threshold(x: torch.Tensor, rows, per: int = 1):
    """The sort-free kernel against the reference's sort: theta exactly, logz to 1e-5 relative."""
    from common.kernels import sampling

    got = sampling_ops().target_threshold(x, rows, per)
    want = sampling.target_threshold(x, rows, per)
    assert torch.equal(got.theta, want.theta), (got.theta, want.theta)
    torch.testing.assert_close(got.logz, want.logz, rtol=1e-5, atol=1e-6)
    return got


@pytest.mark.parametrize("dtype", DTYPES)
def test_target_threshold_random_rows(dtype):
    """Random rows, two a sequence: top-p alone (once beyond the tail bound's reach), top-k alone, both, top-k
    1, filters off; temperatures 0.7 and 1.5 and a greedy row's 1; a flat row whose cut lies far below the
    max, under 0; -inf entries; V not a multiple of the block."""
    g = torch.Generator().manual_seed(31)
    v = 1500
    cfgs = [
        SamplingConfig(temperature=0.7, top_p=0.9),
        SamplingConfig(temperature=1.5, top_p=0.9995),
        SamplingConfig(temperature=1.5, top_k=40),
        SamplingConfig(temperature=0.7, top_k=300, top_p=0.8),
        SamplingConfig(temperature=1.0, top_k=1, top_p=0.5),
        SamplingConfig(temperature=0.0, top_k=7, top_p=0.6),
        SamplingConfig(temperature=1.5),
    ]
    x = torch.randn(2 * len(cfgs), v, generator=g) * 3
    x[1] *= 0.1
    x[3, :50] = -torch.inf
    x[12, 7] = -torch.inf  # filters off: theta -inf, the row's minimum
    _check_threshold(x.to(DEV, dtype), _threshold_rows(cfgs, v), per=2)


@pytest.mark.parametrize("dtype", DTYPES)
def test_target_threshold_hand_made_rows(dtype):
    """Rows whose cuts are known: ties at the top-p cut (sampling.target_threshold's example) and at the k-th
    value, all kept; -0.0 and 0.0 tied at the k-th; one token with almost all the mass, under a top_p beyond
    the tail bound's reach too; every value equal; filters off (theta the minimum, the unfiltered logz)."""
    from common.kernels import sampling

    g = torch.Generator().manual_seed(32)
    v = 300
    x = torch.full((7, v), -30.0)
    x[0, [5, 90, 17, 200]] = torch.tensor([2.0, 1.0, 1.0, 0.0])  # cumulative .48 .65 .83: the cut at a 1
    x[1, [3, 4, 50, 51, 52, 53, 54, 55]] = torch.tensor([5.0, 4.0, 3.0, 3.0, 3.0, 3.0, 3.0, 3.0])
    x[2, [9, 10, 11, 12, 13]] = torch.tensor([1.0, 0.0, -0.0, 0.0, -0.0])
    x[3:5] = torch.randn(2, v, generator=g)
    x[3:5, 123] = 30.0
    x[5] = 1.5
    x[6] = torch.randn(v, generator=g) * 3
    cfgs = [
        SamplingConfig(temperature=1.0, top_p=0.7),
        SamplingConfig(temperature=0.7, top_k=4),  # the 4th value is one of six 3.0s
        SamplingConfig(temperature=1.5, top_k=3),  # 1, then four zeros of both signs
        SamplingConfig(temperature=0.7, top_p=0.9),
        SamplingConfig(temperature=1.5, top_p=0.99999),
        SamplingConfig(temperature=0.7, top_k=2, top_p=0.5),
        SamplingConfig(temperature=1.5),
    ]
    x = x.to(DEV, dtype)
    got = _check_threshold(x, _threshold_rows(cfgs, v))
    assert got.theta[:6].tolist() == [1.0, 3.0, 0.0, 30.0, 30.0, 1.5]
    assert got.theta[6] == x[6].float().min()
    assert [int((x[i] >= got.theta[i]).sum()) for i in range(3)] == [3, 8, 5]  # every tie kept
    temp = torch.tensor([1.5], device=DEV)
    torch.testing.assert_close(got.logz[6:], sampling.row_logz(x[6:], temp), rtol=1e-5, atol=1e-6)


def _accepted_as_the_reference(ids, parent_rows, logits, sets, target, rows, t):
    """The fused acceptance of trees up to t - 1 children a row against the reference's on the host (the same
    inputs copied to the CPU): the same path rows, and each tree's tokens up to its bonus; on a GPU the reference
    run there (the PyTorch path the engine falls back on) as well. Returns the kernel's and the host's (result,
    src)."""
    from common.kernels import sampling

    def on_host(x):
        return _on(x, torch.device("cpu"))

    anc, depth = reference.tree_mask(parent_rows)
    args = (ids, parent_rows, anc, depth, logits, sets, target, rows, t - 1)
    got = sampling_ops().accept_sampled(*args)
    want = sampling.accept_sampled(*(x if isinstance(x, int) else on_host(x) for x in args))
    paths = {"the fused kernel": got}
    if CUDA:
        paths["the PyTorch path on the GPU"] = sampling.accept_sampled(*args)
    for name, (result, src) in paths.items():
        bad = [i for i in range(ids.shape[0]) if not torch.equal(src[i].cpu(), want[1][i])]
        assert not bad, f"{name}: trees {bad} take another path than the host's"
        for i in range(ids.shape[0]):
            c = int(want[0][i, 0])
            assert result[i, : c + 2].tolist() == want[0][i, : c + 2].tolist(), (name, i)
    return got, want


@pytest.mark.parametrize("filtered", [False, True])
def test_target_and_sampled_acceptance(filtered):
    """The target's threshold and normaliser (no sort), and the fused acceptance (the walk, the bonus's
    chunks, the bonus) against the reference's every-row decisions: both rules, trees of no
    nodes to t - 1, the same random numbers; tokens up to the bonus and the path's rows."""
    from common.kernels import sampling

    b, t, w, v = 6, 9, 8, 300
    packed, sets, logits, rows = _trees_on(*_sampled_trees(b, t, w, v, seed=24 + filtered))
    ids, parent_rows = packed[:, :t], packed[:, t : 2 * t]
    want_t = sampling.target_threshold(logits.view(b * t, v), rows, t) if filtered else None
    if filtered:
        got_t = sampling_ops().target_threshold(logits.view(b * t, v), rows, t)
        assert torch.equal(got_t.theta, want_t.theta)
        torch.testing.assert_close(got_t.logz, want_t.logz)
    else:
        want_t = sampling.Target(theta=None, logz=sampling.row_logz(logits.view(b * t, v), rows.temperature, t))
        torch.testing.assert_close(sampling_ops().row_logz(logits.view(b * t, v), rows.temperature, t), want_t.logz)
    _, want = _accepted_as_the_reference(ids, parent_rows, logits, sets, want_t, rows, t)
    assert int(want[0][:, 0].max()) >= 1  # some tree accepts: the walk goes below a root


def test_sampled_acceptance_bonus_chunks():
    """The bonus's draw off the set split over chunks of the vocabulary (V not a multiple of the chunk):
    trees whose best off-set key lies in a later chunk (a +inf logit in the last, partial one), tied across
    chunks (+inf in two: the smaller column wins, as in one pass), the rest random; against the reference."""
    from common.kernels import sampling

    chunk = sampling_ops().BONUS_CHUNK
    b, t, w, v = 6, 9, 8, 2 * chunk + 300
    packed, sets, logits, rows = _sampled_trees(b, t, w, v, seed=27)
    tied = {0: [chunk + 5, 2 * chunk + 7], 1: [v - 3], 2: [3, 2 * chunk + 1], 3: [2 * chunk - 1, chunk + 2]}
    for i, cols in tied.items():  # +inf in every row: no target mass at the sets, the bonus at the root
        assert not set(cols) & set(sets.ids[i, 0].tolist())
        logits[i, :, cols] = torch.inf
    packed, sets, logits, rows = _trees_on(packed, sets, logits, rows)
    ids, parent_rows = packed[:, :t], packed[:, t : 2 * t]
    target = sampling.Target(theta=None, logz=sampling.row_logz(logits.view(b * t, v), rows.temperature, t))
    got, want = _accepted_as_the_reference(ids, parent_rows, logits, sets, target, rows, t)
    assert [got[0][i, :2].tolist() for i in tied] == [[0, min(cols)] for cols in tied.values()]


def test_sampled_acceptance_needs_one_row_stride():
    """The walk reads ids, parent rows and set positions at one row stride (an input block's columns): positions
    copied out of the block are refused, not read at the block's stride (on a GPU that read other columns)."""
    import dataclasses

    from common.kernels import sampling

    b, t, w, v = 2, 5, 4, 64
    packed, sets, logits, rows = _trees_on(*_sampled_trees(b, t, w, v, seed=3))
    target = sampling.Target(theta=None, logz=sampling.row_logz(logits.view(b * t, v), rows.temperature, t))
    ids, parent_rows = packed[:, :t], packed[:, t : 2 * t]
    anc, depth = reference.tree_mask(parent_rows)
    copied = dataclasses.replace(sets, pos=sets.pos.contiguous())
    with pytest.raises(ValueError, match="one row stride"):
        sampling_ops().accept_sampled(ids, parent_rows, anc, depth, logits, copied, target, rows, t - 1)


@pytest.mark.parametrize("sampled", [False, True])
def test_chained_block(sampled):
    """A chained round's next block: the kernel equals reference.chained_block on random blocks (rows past B kept,
    rows past K without a tree, trees narrower and wider than the bucket, keep from 0 to all), and the reference
    follows the worked example of common.engine.verifier_parts.chained_block."""
    from common.kernels import reference as ref

    tb = 4
    prev = torch.tensor([[7, 1, 2, 3, 0, 0, 1, 2, 10, 5]])  # root 7, tokens 1 2 3, parent rows 0 0 1 2, n 10, more
    result = torch.tensor([[1, 8, 9, 0, 0]])  # one accepted (8), bonus 9
    block = ref.chained_block(prev, result, torch.tensor([[5, 6]]), torch.tensor([[-1, 0]]), torch.tensor([2]), tb, 8)
    assert block.tolist() == [[9, 5, 6, 0, 0, 0, 1, 3, 12, 5]] and prev[0, 0] == 7
    g = torch.Generator().manual_seed(3)
    for tb, n_nodes, bb, b, k in ((16, 10, 8, 6, 4), (8, 12, 5, 5, 5), (61, 60, 9, 7, 3), (4, 0, 3, 2, 2)):
        width = 3 * tb + 6 + 3 * tb * 8 if sampled else 2 * tb + 3
        n_col = 3 * tb if sampled else 2 * tb
        prev = torch.randint(0, 1000, (bb, width), generator=g)
        count = torch.randint(0, tb, (b,), generator=g)
        result = torch.randint(0, 1000, (b, tb + 1), generator=g)
        result[:, 0] = count
        tokens = torch.randint(0, 1000, (k, n_nodes), generator=g)
        parents = torch.empty((k, n_nodes), dtype=torch.int64)
        for j in range(n_nodes):  # a node's parent before it (-1: the root)
            parents[:, j] = torch.randint(-1, j, (k,), generator=g)
        keep = torch.randint(0, n_nodes + 1, (k,), generator=g)
        args = [x.to(DEV) for x in (prev, result, tokens, parents, keep)]
        want = ref.chained_block(*args, tb, n_col)
        got = ops().chained_block(*args, tb, n_col)
        assert torch.equal(got, want), (tb, n_nodes, bb, b, k)
        assert torch.equal(args[0], prev.to(DEV))
        # as the engine calls it: the trees float64 rows of the drafter's [K, 4, N] block, keep a column of its
        # accept block, the result written over prev (the graph's input buffer)
        tree = torch.zeros((k, 4, n_nodes), dtype=torch.float64)
        tree[:, 0], tree[:, 1] = tokens, parents
        column = torch.zeros((k, 3), dtype=torch.int64)
        column[:, 1] = keep
        inplace = prev.to(DEV).clone()
        views = (tree.to(DEV)[:, 0], tree.to(DEV)[:, 1], column.to(DEV)[:, 1])
        got = ops().chained_block(inplace, args[1], *views, tb, n_col, out=inplace)
        assert got is inplace and torch.equal(got, want), (tb, n_nodes, bb, b, k)
        assert torch.equal(ref.chained_block(prev.to(DEV), args[1], *views, tb, n_col), want)


def test_chained_block_refuses_what_its_kernel_cannot_read(monkeypatch):
    """On the Triton path a layout the kernel does not take is a ValueError, not the reference's launches in its
    place; the engine's layout (float64 trees, a keep column, the block written in place) is taken."""
    import common.kernels as kernels

    monkeypatch.setattr(kernels, "_MODE", "triton")  # on CPU: Triton's interpreter; on a GPU the tensors are CUDA's
    prev, result = (
        torch.zeros((2, 11), dtype=torch.int64, device=DEV),
        torch.zeros((2, 5), dtype=torch.int64, device=DEV),
    )
    tokens, parents = (torch.zeros((2, 3), dtype=torch.int64, device=DEV) for _ in range(2))
    keep = torch.ones(2, dtype=torch.int64, device=DEV)
    with torch.no_grad(), pytest.raises(ValueError, match="unit stride"):
        kernels.chained_block(prev, result, tokens.t().contiguous().t(), parents, keep, 4, 8)
    with torch.no_grad(), pytest.raises(ValueError, match="int64"):
        kernels.chained_block(prev, result.int(), tokens, parents, keep, 4, 8)
    with torch.no_grad(), pytest.raises(ValueError, match="int64"):
        kernels.chained_block(prev, result, tokens.half(), parents, keep, 4, 8)
    with torch.no_grad():  # the engine's layout: float64 trees, a keep column, the block written in place
        column = torch.stack([keep, keep], 1)[:, 1]  # stride 2
        assert kernels.chained_block(prev, result, tokens.double(), parents.double(), column, 4, 8, out=prev) is prev


@pytest.mark.parametrize("chained", [False, True])
def test_accept_inputs(chained):
    """A drafting's inputs behind a verify: the kernel writes what reference.accept_inputs writes (the accepted
    tokens and their count into the host's block, the lengths of a chained launch, the features padded and cast,
    rows past B and columns past n left to the host's block), and the reference follows its docstring's example."""
    from common.kernels import reference as ref

    packed = torch.zeros((1, 8), dtype=torch.int64)
    packed[0, 3] = 10  # L 3: the length column
    took, m, keep = ref.accept_inputs(
        packed, torch.zeros((1, 3, 2)), torch.tensor([[1, 8, 9, 0]]), torch.ones((1, 2, 2)), None, 3
    )
    assert packed[0, :5].tolist() == [8, 9, 0, 10, 2] and took.tolist() == [2] and m.tolist() == [10]
    g = torch.Generator().manual_seed(5)
    for bb, b, length, n, t, f in ((4, 3, 7, 4, 6, 24), (1, 1, 3, 1, 1, 8), (8, 5, 7, 7, 9, 40)):
        host = torch.randint(0, 100, (bb, length + 5), generator=g)
        result = torch.randint(0, 1000, (b, t + 1), generator=g)
        result[:, 0] = torch.randint(0, n, (b,), generator=g)
        kept = torch.randn((b, n, f), generator=g)
        after = (torch.randint(0, 50, (b,), generator=g), torch.randint(1, 5, (b,), generator=g)) if chained else None
        args = [x.to(DEV) for x in (result, kept)]
        after = None if after is None else tuple(x.to(DEV) for x in after)
        want_p, want_h = host.clone().to(DEV), torch.full((bb, length, f), 7.0, dtype=torch.float16, device=DEV)
        want = ref.accept_inputs(want_p, want_h, *args, after, length)
        got_p, got_h = host.clone().to(DEV), torch.full((bb, length, f), 7.0, dtype=torch.float16, device=DEV)
        got = ops().accept_inputs(got_p, got_h, *args, after, length)
        assert torch.equal(got_p, want_p) and torch.equal(got_h, want_h), (bb, b, length, n)
        assert all(torch.equal(x, y) for x, y in zip(got, want)), (bb, b, length, n)


def test_the_drafters_warm_up_of_accept_inputs_passes_the_kernels_checks(monkeypatch):
    """Eagle3Drafter._warm_accept_inputs (run at graph capture, so that the kernel's compile is start-up's) hands
    the Triton path tensors it takes, for both kinds of launch; on CPU through Triton's interpreter."""
    import types

    import common.kernels as kernels
    from common.engine.draft import Eagle3Drafter
    from common.engine.draft_parts import accept_block

    monkeypatch.setattr(kernels, "_MODE", "triton")
    calls = []
    real = kernels.accept_inputs
    monkeypatch.setattr(kernels, "accept_inputs", lambda *a: calls.append(a[4] is not None) or real(*a))
    fake = types.SimpleNamespace(
        max_new=4,
        device=DEV,
        _accept_block=lambda b, n: accept_block(b, n, 0),
        _hidden_block=lambda b, n: torch.zeros(b, n, 12, dtype=torch.float16),
    )
    with torch.no_grad():
        Eagle3Drafter._warm_accept_inputs(fake)
    assert calls == [False, True]
