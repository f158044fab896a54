"""The Triton kernels (common/kernels/triton_ops.py) against the PyTorch reference they replace.

On CPU they run in Triton's interpreter (TRITON_INTERPRET=1, float32 and float16: the interpreter's
bfloat16 matmul is not faithful); on a GPU the same tests run the compiled kernels, bfloat16 included.
Shapes are SmolLM2's per-head shapes (9 query heads, 3 KV heads, head_dim 64) at small lengths.
"""

from __future__ import annotations

import os

import pytest
import torch

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
