"""The model's fused operations, one entry point each: Triton kernels on a CUDA device when no gradient is
needed (serving, CUDA graph capture), the PyTorch reference otherwise (CPU, training with autograd).

The model calls these and never asks which path runs; both compute the same function (tests compare
them, on CPU through Triton's interpreter). SPECDEC_KERNELS=reference forces the PyTorch path everywhere
(for A/B measurements and debugging). The sampling operations (draws, targets, the draft's children, the
sampled acceptance) follow the same rule: common.kernels.sampling is their reference, triton_sampling their
kernels, and common.kernels.speculative composes them into the verifier's steps.
"""

from __future__ import annotations

import importlib.util
import os
from dataclasses import dataclass

import torch

from common.kernels import reference, sampling

_MODE = os.environ.get("SPECDEC_KERNELS", "auto")
if _MODE not in ("auto", "reference", "triton"):
    raise ValueError(f"SPECDEC_KERNELS must be auto, reference or triton, got {_MODE!r}")
HAVE_TRITON = importlib.util.find_spec("triton") is not None


def _ops():
    """The Triton kernels, imported on first use (a CPU process never loads triton)."""
    from common.kernels import triton_ops

    return triton_ops


def _sampling_ops():
    """The Triton kernels of the sampling operations (common.kernels.sampling), imported on first use."""
    from common.kernels import triton_sampling

    return triton_sampling


def use_triton(x: torch.Tensor) -> bool:
    """Triton on CUDA tensors when no gradient is recorded (the kernels have no backward: under autograd,
    a weight that needs a gradient would silently get none); SPECDEC_KERNELS=triton also on CPU (Triton's
    interpreter, TRITON_INTERPRET=1, for tests)."""
    if not HAVE_TRITON or _MODE == "reference" or torch.is_grad_enabled():
        return False
    return x.is_cuda or _MODE == "triton"


def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(x + residual) * weight, x + residual); x, residual [..., H]."""
    if use_triton(x):
        return _ops().add_rms_norm(x, residual, weight, eps)
    return reference.add_rms_norm(x, residual, weight, eps)


def rope_kv_write(
    qkv: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    positions: torch.Tensor,
    slots: torch.Tensor,
    write_pos: torch.Tensor,
    kv: torch.Tensor,
    num_heads: int,
    num_kv_heads: int,
) -> None:
    """Rotate q (in place in qkv) and k, write k and v into the cache; see reference.rope_kv_write."""
    if use_triton(qkv) and qkv.is_contiguous() and kv.stride(-1) == 1:
        _ops().rope_kv_write(qkv, cos, sin, positions, slots, write_pos, kv, num_heads, num_kv_heads)
    else:
        reference.rope_kv_write(qkv, cos, sin, positions, slots, write_pos, kv, num_heads, num_kv_heads)


def swiglu(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up; gate_up [..., 2I]."""
    if use_triton(gate_up):
        return _ops().swiglu(gate_up)
    return reference.swiglu(gate_up)


@dataclass(frozen=True)
class AttentionPlan:
    """What the PyTorch attention shares across the layers of one forward (the Triton kernel needs none)."""

    kv_len: int  # cache positions read: the longest prefix plus W
    bias: torch.Tensor  # [B, 1, G * T, kv_len] additive mask in the compute dtype (see reference.attention)


@dataclass(frozen=True, eq=False)
class TTTPlan:
    """Training-time-test attention (common.kernels.ttt): step `step` of T query rows over the K/V of
    steps 0..step. They are not in a KV cache but in `kv` (kv[s]: step s's [B, T, 2, KVH, D]), where
    this step appends its own: gradients reach each step's K/V directly (a cache written in place under
    autograd costs whole-cache zero fills and index adds in the backward). Chosen by the caller, not by
    the model; eq=False: compared and hashed by identity (kv is a list)."""

    step: int  # TTT step j >= 0
    kv: list  # [step] tensors [B, T, 2, KVH, D] before this step's forward, [step + 1] after it

    def __post_init__(self) -> None:
        if self.step < 0:
            raise ValueError(f"TTTPlan needs step >= 0, got {self.step}")
        if len(self.kv) != self.step:
            raise ValueError(f"TTTPlan of step {self.step} needs the K/V of {self.step} steps, got {len(self.kv)}")


def attention_plan(
    witness: torch.Tensor, prefix_len: torch.Tensor, window: torch.Tensor, groups: int
) -> AttentionPlan | None:
    """Built once per forward by the model; None when the Triton kernel will run. witness: a tensor of
    the forward's device and compute dtype."""
    return None if use_triton(witness) else _reference_plan(prefix_len, window, groups, witness.dtype)


def _reference_plan(prefix_len: torch.Tensor, window: torch.Tensor, groups: int, dtype: torch.dtype) -> AttentionPlan:
    kv_len = int(prefix_len.max()) + window.shape[-1]
    return AttentionPlan(kv_len=kv_len, bias=reference.attention_bias(prefix_len, window, kv_len, groups, dtype))


def attention(
    q: torch.Tensor,
    kv: torch.Tensor,
    slots: torch.Tensor,
    prefix_len: torch.Tensor,
    window: torch.Tensor,
    plan: AttentionPlan | None = None,
) -> torch.Tensor:
    """q [B, T, H, D] over the cache kv [S, C, 2, KVH, D]; see reference.attention. [B, T, H * D]"""
    if use_triton(q) and q.dtype == kv.dtype and window.stride(-1) == 1:
        return _ops().attention(q, kv, slots, prefix_len, window)
    if plan is None:
        plan = _reference_plan(prefix_len, window, q.shape[2] // kv.shape[3], q.dtype)
    return reference.attention(q, kv, slots, plan.kv_len, plan.bias)


def rope_attention(
    qkv: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    positions: torch.Tensor,
    slots: torch.Tensor,
    write_pos: torch.Tensor,
    kv: torch.Tensor,
    prefix_len: torch.Tensor,
    window: torch.Tensor,
    num_heads: int,
    num_kv_heads: int,
    plan: AttentionPlan | TTTPlan | None = None,
) -> torch.Tensor:
    """rope_kv_write, then attention of the rotated queries: [B, T, H * D]. One Triton kernel (two with
    a split over keys) for up to 64 new tokens a sequence (decoding, trees, the draft's levels and
    proposals); else the two operations (prefill, the reference). With a TTTPlan the cache and the
    positions' bookkeeping (slots, write_pos, prefix_len, window) are not used: common.kernels.ttt."""
    if isinstance(plan, TTTPlan):
        return _ttt_rope_attention(qkv, cos, sin, positions, plan, num_heads, num_kv_heads)
    b, t, _ = qkv.shape
    fused = (
        use_triton(qkv)
        and plan is None
        and t <= 64
        and qkv.is_contiguous()
        and qkv.dtype == kv.dtype
        and kv.stride(-1) == 1
        and window.stride(-1) == 1
    )
    if fused:
        args = (qkv, cos, sin, positions, slots, write_pos, kv, prefix_len, window, num_heads, num_kv_heads)
        return _ops().rope_attention(*args)
    rope_kv_write(qkv, cos, sin, positions, slots, write_pos, kv, num_heads, num_kv_heads)
    q = qkv.view(b, t, num_heads + 2 * num_kv_heads, -1)[:, :, :num_heads]  # rotated in place
    return attention(q, kv, slots, prefix_len, window, plan)


def _ttt_rope_attention(
    qkv: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    positions: torch.Tensor,
    plan: TTTPlan,
    num_heads: int,
    num_kv_heads: int,
) -> torch.Tensor:
    """Training-time test only: common.kernels.ttt is imported here, on first use, because it loads
    torch.compile's machinery (torch._dynamo, Triton: over a second), which no service needs."""
    from common.kernels import ttt

    return ttt.rope_attention(qkv, cos, sin, positions, plan, num_heads, num_kv_heads)


def topk_logprobs(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The k best log-probabilities [..., k] (float32, descending) and their ids [..., k] of logits [..., V]."""
    if use_triton(logits) and logits.shape[-1] <= 65536:
        return _ops().topk_logprobs(logits, k)
    return reference.topk_logprobs(logits, k)


def rms_norm_cat(a: torch.Tensor, wa: torch.Tensor, b: torch.Tensor, wb: torch.Tensor, eps: float) -> torch.Tensor:
    """rms_norm(a) * wa | rms_norm(b) * wb; a, b [..., H] -> [..., 2H]."""
    if use_triton(a):
        return _ops().rms_norm_cat(a, wa, b, wb, eps)
    return reference.rms_norm_cat(a, wa, b, wb, eps)


def draft_level(
    kid_ids: torch.Tensor,
    kid_score: torch.Tensor,
    kid_logq: torch.Tensor,
    front_score: torch.Tensor | None,
    front_id: torch.Tensor | None,
    hidden: torch.Tensor,
    front_anc: torch.Tensor | None,
    embed: torch.Tensor,
    cand: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor],
    offset: int,
    created: int,
    own_base: int | None,
    scratch: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """One level of the draft's tree expansion: write the children as candidates, return the next frontier
    (None when own_base is None); see reference.draft_level."""
    args = (kid_ids, kid_score, kid_logq, front_score, front_id, hidden, front_anc, embed, cand)
    if use_triton(hidden) and kid_ids.shape[1] * kid_ids.shape[2] <= 1024 and hidden.stride(-1) == 1:
        return _ops().draft_level(*args, offset, created, own_base, scratch)
    return reference.draft_level(*args, offset, created, own_base, scratch)


def select_tree(
    tok: torch.Tensor,
    score: torch.Tensor,
    parent: torch.Tensor,
    d2t: torch.Tensor,
    keep: torch.Tensor,
    row_depth: torch.Tensor,
    k: int,
    n: int,
    drawn: reference.Drawn | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The draft tree [B, 4, N] float64 and its candidates' creation indices [B, N] of each row: the keep
    best candidates no deeper than the row's depth (drawn: a batch with sampling rows); see
    reference.select_tree."""
    if use_triton(score) and score.shape[1] <= 1024 and (drawn is None or drawn.fronts.shape[1] <= 1024):
        return _ops().select_tree(tok, score, parent, d2t, keep, row_depth, k, n, drawn)
    return reference.select_tree(tok, score, parent, d2t, keep, row_depth, k, n, drawn)


def tree_mask(parent_rows: torch.Tensor, max_depth: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """A batch of trees' ancestor masks [B, T, T] and row depths [B, T]; see reference.tree_mask."""
    if use_triton(parent_rows) and parent_rows.shape[1] <= 128 and parent_rows.stride(1) == 1:
        return _ops().tree_mask(parent_rows)
    return reference.tree_mask(parent_rows, max_depth)


def accept_tree(
    ids: torch.Tensor,
    parent_rows: torch.Tensor,
    anc: torch.Tensor,
    depth: torch.Tensor,
    target: torch.Tensor,
    greedy: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Greedy acceptance: (result [B, T + 1], src [B, T]); see reference.accept_tree."""
    flat = ids.stride(1) == 1 and parent_rows.stride(1) == 1
    if use_triton(ids) and ids.shape[1] <= 128 and flat and anc.is_contiguous() and target.is_contiguous():
        return _ops().accept_tree(ids, parent_rows, anc, depth.contiguous(), target, greedy)
    return reference.accept_tree(ids, parent_rows, anc, depth, target, greedy)


def chained_block(
    prev: torch.Tensor,
    result: torch.Tensor,
    tokens: torch.Tensor,
    parents: torch.Tensor,
    keep: torch.Tensor,
    tb: int,
    n_col: int,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """A chained round's next verify block, in `out` (which may be prev) or a new tensor; see
    reference.chained_block. On the Triton path a layout its kernel does not take is an error, not a quiet fall
    back to the reference's twenty launches."""
    if not use_triton(prev):
        return reference.chained_block(prev, result, tokens, parents, keep, tb, n_col, out)
    two_d = [x for x in (prev, result, tokens, parents, out) if x is not None]
    if any(x.stride(-1) != 1 for x in two_d) or keep.dim() != 1:
        raise ValueError("chained_block: 2-D tensors need unit stride along their last dimension, keep one dimension")
    wide = (prev, result, keep) + (() if out is None else (out,))
    ids = {torch.int32, torch.int64, torch.float64}
    if any(x.dtype != torch.int64 for x in wide) or {tokens.dtype, parents.dtype} - ids:
        raise ValueError("chained_block: prev, result, keep and out int64; tokens and parents int32, int64 or float64")
    return _ops().chained_block(prev, result, tokens, parents, keep, tb, n_col, out)


def accept_inputs(
    packed: torch.Tensor,
    hidden: torch.Tensor,
    result: torch.Tensor,
    kept: torch.Tensor,
    after: tuple[torch.Tensor, torch.Tensor] | None,
    length: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A drafting's inputs behind a verify, in place in packed [BB, L + 5] and hidden [BB, L, 3H]: (took, m, keep)
    [B] each; see reference.accept_inputs. On the Triton path a layout its kernel does not take is an error."""
    if not use_triton(packed):
        return reference.accept_inputs(packed, hidden, result, kept, after, length)
    rows = [packed, result] + ([] if after is None else list(after))
    if any(x.dtype != torch.int64 for x in rows) or packed.stride(-1) != 1 or result.stride(-1) != 1:
        raise ValueError("accept_inputs: packed, result and after int64, packed and result unit stride on columns")
    if (
        hidden.stride(-1) != 1
        or kept.stride(-1) != 1
        or (after is not None and not all(x.is_contiguous() for x in after))
    ):
        raise ValueError("accept_inputs: hidden and kept unit stride on features, after's tensors contiguous")
    return _ops().accept_inputs(packed, hidden, result, kept, after, length)


def onehot_sets(ids: torch.Tensor, parent_rows: torch.Tensor, w: int) -> tuple[torch.Tensor, ...]:
    """A batch of one-hot trees' sets: (pos [K, T], ids [K, T * W], q [K, T * W / 2]); see reference.onehot_sets."""
    if use_triton(ids) and ids.shape[1] <= 128 and ids.stride(1) == 1 and parent_rows.stride(1) == 1:
        return _ops().onehot_sets(ids, parent_rows, w)
    return reference.onehot_sets(ids, parent_rows, w)


def move_rows(kv: torch.Tensor, slots: torch.Tensor, n: torch.Tensor, src: torch.Tensor) -> None:
    """Move the accepted path's cache rows next to the root in every layer; see reference.move_rows."""
    if use_triton(kv) and kv.is_contiguous() and src.shape[1] <= 128:
        _ops().move_rows(kv, slots, n, src.contiguous())
    else:
        reference.move_rows(kv, slots, n, src)


# ---- Sampling (common.kernels.sampling: the reference and the random numbers) ------------------------------
def sample_tokens(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    theta: torch.Tensor | None,
    seed: torch.Tensor,
    counter: torch.Tensor,
    index: torch.Tensor | None = None,
    greedy: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """A Gumbel-max column of each row of logits [R, V] and its key; see sampling.sample_tokens."""
    if use_triton(logits) and logits.stride(-1) == 1 and (index is None or index.stride(-1) == 1):
        return _sampling_ops().sample_tokens(logits, temperature, theta, seed, counter, index, greedy)
    return sampling.sample_tokens(logits, temperature, theta, seed, counter, index, greedy)


def row_logz(logits: torch.Tensor, temperature: torch.Tensor, per: int = 1) -> torch.Tensor:
    """[R] logsumexp(logits [R, V] / T); see sampling.row_logz."""
    if use_triton(logits) and logits.stride(-1) == 1:
        return _sampling_ops().row_logz(logits, temperature, per)
    return sampling.row_logz(logits, temperature, per)


def target_threshold(logits: torch.Tensor, rows: sampling.SamplingRows, per: int = 1) -> sampling.Target:
    """Each row's threshold and normaliser after temperature, top-k and top-p; see sampling.target_threshold."""
    if use_triton(logits):
        return _sampling_ops().target_threshold(logits, rows, per)
    return sampling.target_threshold(logits, rows, per)


def draft_children(
    logp: torch.Tensor,
    ids: torch.Tensor,
    temperature: torch.Tensor,
    seed: torch.Tensor,
    counter: torch.Tensor,
    level: int,
    k: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The K children of each expanded node of a batch with sampling rows; see sampling.draft_children."""
    if use_triton(logp) and logp.shape[-1] <= 256:
        return _sampling_ops().draft_children(logp, ids, temperature, seed, counter, level, k)
    return sampling.draft_children(logp, ids, temperature, seed, counter, level, k)


def sampled_layout(ids: torch.Tensor, parent_rows: torch.Tensor, logits: torch.Tensor, sets: sampling.TreeSets) -> bool:
    """Whether accept_sampled's tensors are laid out as its fused kernel reads them: the tree's columns and the
    sets' positions one row stride (a verify block's), unit strides along the last dimensions."""
    flat = ids.stride(1) == 1 and parent_rows.stride(0) == ids.stride(0) == sets.pos.stride(0)
    return flat and logits.stride(-1) == 1 and sets.ids.stride(-1) == 1 and sets.q.stride(-1) == 1


def accept_sampled(
    ids: torch.Tensor,
    parent_rows: torch.Tensor,
    anc: torch.Tensor,
    depth: torch.Tensor,
    logits: torch.Tensor,
    sets: sampling.TreeSets,
    target: sampling.Target,
    rows: sampling.SamplingRows,
    siblings: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The sampled acceptance of a batch of trees: (result [B, T + 1], src [B, T]); see sampling.accept_sampled."""
    if (
        use_triton(logits)
        and ids.shape[1] <= 128
        and sets.ids.shape[-1] <= 256
        and sampled_layout(ids, parent_rows, logits, sets)
    ):
        return _sampling_ops().accept_sampled(ids, parent_rows, anc, depth, logits, sets, target, rows, siblings)
    return sampling.accept_sampled(ids, parent_rows, anc, depth, logits, sets, target, rows, siblings)
