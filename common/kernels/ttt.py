"""Training-time-test (TTT) attention without a dense mask: a causal flash-attention kernel for the step-0
keys plus `step` per-row "diagonal" keys, merged by log-sum-exp, with an exact backward.

Step j of training-time test (training/ttt.py) unrolls the draft head j times; the K/V of step s are
kv[s] [B, T, 2, KVH, D] (TTTPlan.kv, no cache). Row r of step j sees

    step 0:           keys k <= r - j      (a causal mask shifted by j)
    step s = 1..j:    key r - j + s only   (one "diagonal" key per earlier step, when r - j + s >= 0)

Example, T = 5, j = 2, row r = 4 (x: seen), the dense mask training.ttt.ttt_mask builds (its columns:
the steps' keys side by side):

    step 0      step 1      step 2
    x x x . .   . . . x .   . . . . x        step 0: k <= 2; step 1: k = 3; step 2: k = 4

The dense mask costs (j + 1) T^2 scores per head and the PyTorch math kernel. Here step 0 is plain
causal attention of queries j..T-1 over keys 0..T-1-j (query r is row r - j of that square, so
"k <= r - j" is "column <= row"), which PyTorch's flash kernels (CPU and CUDA) compute in O(T) memory and
return with its log-sum-exp; the diagonal keys are j dot products per row. The two are merged by
log-sum-exp into exactly the softmax over the union of keys.

Backward: the flash backward is called on the merged output and the merged log-sum-exp, as ring
attention does for one block of keys: with them it recomputes block 0's probabilities as fractions of the
whole row's mass (P = exp(S - lse)) and delta = rowsum(dO * O) over the whole output, which is the exact
gradient of the merged attention with respect to block 0's q, k and v. The diagonal's gradient is written
out by hand (same formula, j entries per row).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from common.kernels import TTTPlan, reference

Tensor = torch.Tensor


def _causal_forward(q: Tensor, k: Tensor, v: Tensor, scale: float) -> tuple[Tensor, Tensor, tuple]:
    """q, k, v [B, H, L, D] -> (out [B, H, L, D], lse [B, H, L] float32, what the backward needs)."""
    if q.is_cuda:
        if q.dtype not in (torch.float16, torch.bfloat16):
            raise TypeError(f"TTT attention on CUDA needs float16 or bfloat16 (autocast), got {q.dtype}")
        out, lse, cq, ck, mq, mk, seed, offset, _ = torch.ops.aten._scaled_dot_product_flash_attention(
            q, k, v, 0.0, True, False, scale=scale
        )
        return out, lse, (cq, ck, mq, mk, seed, offset)
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, True, scale=scale)
    return out, lse, ()


def _causal_backward(
    grad: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, extra: tuple, scale: float
) -> tuple[Tensor, Tensor, Tensor]:
    """The flash backward with the caller's out and lse (see the module docstring)."""
    if q.is_cuda:
        cq, ck, mq, mk, seed, offset = extra
        return torch.ops.aten._scaled_dot_product_flash_attention_backward(
            grad, q, k, v, out, lse, cq, ck, mq, mk, 0.0, True, seed, offset, scale=scale
        )
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
        grad, q, k, v, out, lse, 0.0, True, scale=scale
    )


class _ShiftedCausalWithDiagonal(torch.autograd.Function):
    """out = softmax over [block-0 keys k <= r - shift | the row's diagonal keys] of the values.

    q [B, KVH, G, T, D] (the G query heads sharing a KV head); k0, v0 [B, KVH, T, D] block 0;
    diag_s [B, KVH, G, T, J] float32 scaled diagonal scores (-inf where the key does not exist);
    diag_v [B, KVH, T, J, D] their values. Returns [B, KVH, G, T, D] in q's dtype.
    """

    @staticmethod
    def forward(ctx, q, k0, v0, diag_s, diag_v, shift: int, scale: float):
        b, kvh, g, t, d = q.shape
        h, n = kvh * g, t - shift  # n: query rows that see block 0 (r >= shift)
        lse = diag_s.logsumexp(-1)  # [B, KVH, G, T] the diagonal's mass (-inf when J = 0)
        merged = torch.zeros(b, kvh, g, t, d, dtype=torch.float32, device=q.device)
        extra, qs, ks, vs = (), None, None, None
        if n > 0:
            # block 0 as H flash heads: query rows shift..T-1 over keys 0..n-1, causal
            qs = q[:, :, :, shift:].reshape(b, h, n, d)
            ks = k0[:, :, None, :n].expand(b, kvh, g, n, d).reshape(b, h, n, d)
            vs = v0[:, :, None, :n].expand(b, kvh, g, n, d).reshape(b, h, n, d)
            out0, lse0, extra = _causal_forward(qs, ks, vs, scale)
            out0, lse0 = out0.view(b, kvh, g, n, d), lse0.view(b, kvh, g, n)
            both = torch.logaddexp(lse0, lse[..., shift:])
            merged[..., shift:, :] = torch.exp(lse0 - both)[..., None] * out0.float()
            lse = torch.cat((lse[..., :shift], both), dim=-1)  # [B, KVH, G, T]
        p = torch.exp(diag_s - lse[..., None])  # [B, KVH, G, T, J] diagonal probabilities
        merged += (p[..., None] * diag_v.float()[:, :, None]).sum(-2)  # [B, KVH, G, T, D]
        out = merged.to(q.dtype)
        ctx.save_for_backward(q, k0, v0, diag_v, out, lse, p, *(x for x in (qs, ks, vs) if x is not None))
        ctx.shift, ctx.scale, ctx.extra = shift, scale, extra
        return out

    @staticmethod
    def backward(ctx, grad):
        q, k0, v0, diag_v, out, lse, p, *flash_in = ctx.saved_tensors
        b, kvh, g, t, d = q.shape
        h, shift, n = kvh * g, ctx.shift, t - ctx.shift
        grad = grad.contiguous()
        gq, gk0, gv0 = torch.zeros_like(q), torch.zeros_like(k0), torch.zeros_like(v0)
        if n > 0:
            qs, ks, vs = flash_in
            gqs, gks, gvs = _causal_backward(
                grad[:, :, :, shift:].reshape(b, h, n, d),
                qs,
                ks,
                vs,
                out[:, :, :, shift:].reshape(b, h, n, d),
                lse[..., shift:].reshape(b, h, n).contiguous(),
                ctx.extra,
                ctx.scale,
            )
            gq[:, :, :, shift:] = gqs.view(b, kvh, g, n, d)
            gk0[:, :, :n] = gks.view(b, kvh, g, n, d).sum(2)
            gv0[:, :, :n] = gvs.view(b, kvh, g, n, d).sum(2)
        # diagonal: d out / d score_j = p_j * (v_j - out), so d loss / d score_j = p_j * (grad . v_j - delta)
        gf = grad.float()
        delta = (gf * out.float()).sum(-1, keepdim=True)  # [B, KVH, G, T, 1]
        g_diag_s = p * ((gf[..., None, :] * diag_v.float()[:, :, None]).sum(-1) - delta)  # [B, KVH, G, T, J]
        g_diag_v = (p[..., None] * gf[..., None, :]).sum(2).to(diag_v.dtype)  # [B, KVH, T, J, D]
        return gq, gk0, gv0, g_diag_s, g_diag_v, None, None


def rope_attention(
    qkv: Tensor, cos: Tensor, sin: Tensor, positions: Tensor, plan: TTTPlan, num_heads: int, num_kv_heads: int
) -> Tensor:
    """Step plan.step's attention from its fused projections: q and k rotated (reference.rope, the RoPE of
    every other path), this step's K/V [B, T, 2, KVH, D] appended to plan.kv, then `attention`.

    qkv [B, T, (H + 2 KVH) * D]; cos, sin [max_position, D]; positions [B, T]. Returns [B, T, H * D].
    Under torch.compile (training's TTT step, training.ttt.compiled_step, dynamic shapes) it is traced with
    the rest of the step, one graph per TTT step (the plan's step is a constant of the graph), so the
    diagonal, the merge and the layout changes around the flash kernels fuse with the projections around
    them. With static shapes the same tracing gave a right forward and wrong gradients on an H100 (torch
    2.11: the q and k projections' 1.3x their norm off, a training run NaN within 20 steps;
    docs/ttt_training_step.md): tests/gpu/test_gpu_ttt.py compares the compiled step's
    gradients with the eager dense step's."""
    b, t, _ = qkv.shape
    h, kvh = num_heads, num_kv_heads
    view = qkv.view(b, t, h + 2 * kvh, -1)
    rotated = reference.rope(view[:, :, : h + kvh], cos, sin, positions)  # [B, T, H + KVH, D]
    plan.kv.append(torch.stack((rotated[:, :, h:], view[:, :, h + kvh :]), dim=2))  # [B, T, 2, KVH, D]
    return attention(rotated[:, :, :h], plan.kv)


def attention(q: Tensor, kv: list[Tensor]) -> Tensor:
    """Attention of TTT step j = len(kv) - 1 (see the module docstring).

    q [B, T, H, D] this step's rotated queries; kv[s] [B, T, 2, KVH, D] the K/V of step s = 0..j.
    Returns [B, T, H * D] in q's dtype, the same function as reference.attention under training.ttt.ttt_mask.
    """
    # q's dtype decides (bf16 under the trainer's autocast): autocast would round the float32 diagonal
    # scores and the merge to bf16
    with torch.autocast(q.device.type, enabled=False):
        return _attention(q, [x.to(q.dtype) for x in kv])


def _attention(q: Tensor, kv: list[Tensor]) -> Tensor:
    b, t, h, d = q.shape
    kvh = kv[0].shape[3]
    g, j = h // kvh, len(kv) - 1
    qg = q.view(b, t, kvh, g, d).permute(0, 2, 3, 1, 4)  # [B, KVH, G, T, D]
    # the diagonal: row r sees key row r - (j - s) of step s = 1..j, i.e. step s's K/V moved down j - s
    # rows (the rows above them are zeros, masked: that key does not exist). T = 4, j = 2:
    #   step 1 moved down 1 -> key rows [-, 0, 1, 2]; step 2 moved down 0 -> [0, 1, 2, 3]
    diag = torch.stack([_down(kv[s], j - s) for s in range(1, j + 1)], dim=2) if j else kv[0][:, :, None][:, :, :0]
    diag_k = diag[:, :, :, 0].permute(0, 3, 1, 2, 4)  # [B, KVH, T, j, D]
    diag_v = diag[:, :, :, 1].permute(0, 3, 1, 2, 4)  # [B, KVH, T, j, D]
    r = torch.arange(t, device=q.device)
    s = torch.arange(1, j + 1, device=q.device)
    missing = (r[:, None] - j + s[None, :]) < 0  # [T, j] key row r - j + s does not exist
    scale = 1.0 / math.sqrt(d)
    # j dot products per row: broadcast multiply and sum (batched matmuls of size j run far slower)
    diag_s = (qg.float()[..., None, :] * diag_k.float()[:, :, None]).sum(-1) * scale  # [B, KVH, G, T, j]
    diag_s = diag_s.masked_fill(missing, float("-inf"))
    k0 = kv[0][:, :, 0].transpose(1, 2)  # [B, KVH, T, D]
    v0 = kv[0][:, :, 1].transpose(1, 2)  # [B, KVH, T, D]
    out = _ShiftedCausalWithDiagonal.apply(qg, k0, v0, diag_s, diag_v, j, scale)
    return out.permute(0, 3, 1, 2, 4).reshape(b, t, h * d)


def _down(x: Tensor, n: int) -> Tensor:
    """x [B, T, ...] moved down n rows along T: row r holds x's row r - n, zeros above. [B, T, ...]"""
    t = x.shape[1]
    n = min(n, t)
    pad = [0, 0] * (x.dim() - 2) + [n, 0]  # F.pad's pairs run from the last dimension to the first
    return F.pad(x[:, : t - n], pad)
