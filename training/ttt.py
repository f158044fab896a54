"""EAGLE-3 training-time test (TTT): unroll the head for several steps on full sequences.

Indexing (row r = sequence position r, RoPE position r at every step):
  step 0:  row r takes (fc(a_r), embed(x_{r+1})) and predicts x_{r+2}
  step j:  row r takes (h^{j-1}_{r-1}, embed(x_{r+1})) and predicts x_{r+2}
so inputs tokens and targets are the same at every step; only the fed-back hidden shifts one row per
step. This is what the drafter does at inference: a depth-j node over a committed prefix of m pairs sits
at position m + j - 1 and sees the committed entries [0, m) plus its ancestors.
Attention for row r at step j sees: step-0 entries at rows <= r - j, and the step-s entry at row
r - j + s for s = 1..j (the diagonal). K/V of step s live in cache columns [s*T, (s+1)*T).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from common.kernels import TTTPlan
from common.model.eagle3 import Eagle3Head
from common.model.llama import Batch, KVCache


@dataclass
class TTTTargets:
    target_p: torch.Tensor  # [B, T, Vd] float32 base distribution over the draft vocab (softmax of its logits)
    base_top: torch.Tensor  # [B, T] base argmax over the full vocab (the greedy next token)
    in_draft: torch.Tensor  # [B, T] bool: base_top is in the draft vocab
    valid: torch.Tensor  # [B, T] bool: row predicts a response token of a real position


@dataclass
class TTTResult:
    loss: torch.Tensor  # scalar, weighted sum over steps
    step_loss: list[float]  # [steps]
    step_acc: list[float]  # [steps] draft argmax == base argmax over valid rows (r >= step)
    step_rows: list[int]  # [steps] rows counted


def ttt_mask(t: int, step: int, device: torch.device) -> torch.Tensor:
    """[T, (step+1)*T] bool: what row r of step `step` may attend to."""
    r = torch.arange(t, device=device)[:, None]
    k = torch.arange(t, device=device)[None, :]
    parts = [k <= r - step]
    for s in range(1, step + 1):
        parts.append(k == r - step + s)
    return torch.cat(parts, dim=1)


class StepAttention(Protocol):
    """How step j's attention is told who sees whom: both implementations compute the same function."""

    def batch(self, pos: torch.Tensor, slots: torch.Tensor, step: int) -> Batch:
        """pos [B, T] positions 0..T-1 of every row; slots [B]; K/V of this step land at pos + step * T."""
        ...


@dataclass(frozen=True)
class FusedAttention:
    """The training path: common.kernels.ttt (causal flash kernel + the diagonal, merged by log-sum-exp),
    O(T) memory per step."""

    def batch(self, pos: torch.Tensor, slots: torch.Tensor, step: int) -> Batch:
        b, t = pos.shape
        return Batch(
            input_ids=pos,
            positions=pos,
            slots=slots,
            write_pos=pos + step * t,
            prefix_len=torch.zeros(b, dtype=torch.long, device=pos.device),
            window=torch.zeros(b, t, 0, dtype=torch.bool, device=pos.device),  # unused: the plan decides
            plan=TTTPlan(step=step, length=t),
        )


@dataclass(frozen=True)
class DenseMaskAttention:
    """The oracle: ttt_mask as a dense [T, (j+1)T] mask through the PyTorch attention (math kernel,
    O(j T^2) memory per step). Kept for tests and for bench.ttt_step's comparison."""

    def batch(self, pos: torch.Tensor, slots: torch.Tensor, step: int) -> Batch:
        b, t = pos.shape
        mask = ttt_mask(t, step, pos.device)[None, None].expand(b, 1, t, (step + 1) * t)
        return Batch.masked(input_ids=pos, positions=pos, slots=slots, write_pos=pos + step * t, mask=mask)


def make_targets(
    base_logits_fn, hidden_next: torch.Tensor, draft_to_base: torch.Tensor, t2d: torch.Tensor, valid: torch.Tensor
) -> TTTTargets:
    """hidden_next [B, T, H]: base final hidden at position r+1 for row r."""
    with torch.no_grad():
        logits = base_logits_fn(hidden_next)  # [B, T, V]
        base_top = logits.argmax(-1)  # [B, T]
        target_p = torch.softmax(logits[..., draft_to_base].float(), dim=-1)  # [B, T, Vd]
    return TTTTargets(target_p=target_p, base_top=base_top, in_draft=t2d[base_top], valid=valid)


def ttt_forward(
    head: Eagle3Head,
    embeds: torch.Tensor,
    aux: torch.Tensor,
    targets: TTTTargets,
    steps: int,
    step_weight: float = 0.8,
    attention: StepAttention = FusedAttention(),
) -> TTTResult:
    """embeds [B, T, H] = embed(x_{r+1}); aux [B, T, 3H_target] = a_r. Returns the weighted loss."""
    b, t, _ = embeds.shape
    device = embeds.device
    c = head.cfg
    cache_dtype = torch.float32 if device.type == "cpu" else torch.bfloat16
    cache = KVCache.allocate(1, b, steps * t, c.num_kv_heads, c.head_dim, cache_dtype, device)
    rows = torch.arange(t, device=device)
    pos = rows[None, :].expand(b, t)
    slots = torch.arange(b, device=device)
    hidden = aux
    total = embeds.new_zeros((), dtype=torch.float32)
    step_loss, step_acc, step_rows = [], [], []
    for j in range(steps):
        out = head(embeds, hidden, attention.batch(pos, slots, j), cache)
        rows_ok = targets.valid & (rows >= j)[None, :]  # [B, T]
        pmask = (rows_ok & targets.in_draft).float()  # [B, T] reference: only in-vocab targets
        ce = -(targets.target_p * out.logp).sum(-1)  # [B, T]
        loss = (ce * pmask).sum() / pmask.sum().clamp(min=1.0)
        total = total + (step_weight**j) * loss
        with torch.no_grad():
            pred = head.to_base_ids(out.logp.argmax(-1))  # [B, T]
            n = int(rows_ok.sum())
            acc = float(((pred == targets.base_top) & rows_ok).sum()) / max(n, 1)
        step_loss.append(float(loss.detach()))
        step_acc.append(acc)
        step_rows.append(n)
        # next step: row r gets this step's output at row r-1 (row 0 gets zeros; it is masked)
        hidden = torch.cat((out.hidden.new_zeros(b, 1, out.hidden.shape[-1]), out.hidden[:, :-1]), dim=1)
    return TTTResult(loss=total, step_loss=step_loss, step_acc=step_acc, step_rows=step_rows)
