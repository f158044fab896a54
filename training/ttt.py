"""EAGLE-3 training-time test (TTT): unroll the head for several steps on full sequences.

Indexing (row r = sequence position r, RoPE position r at every step):
  step 0:  row r takes (fc(a_r), embed(x_{r+1})) and predicts x_{r+2}
  step j:  row r takes (h^{j-1}_{r-1}, embed(x_{r+1})) and predicts x_{r+2}
so inputs tokens and targets are the same at every step; only the fed-back hidden shifts one row per
step. This is what the drafter does at inference: a depth-j node over a committed prefix of m pairs sits
at position m + j - 1 and sees the committed entries [0, m) plus its ancestors.
Attention for row r at step j sees: step-0 entries at rows <= r - j, and the step-s entry at row
r - j + s for s = 1..j (the diagonal).

Training runs that attention as FusedAttention (common.kernels.ttt: a causal flash kernel plus the
diagonal, no mask, each step's K/V kept in a list, no cache); DenseMaskAttention, the mask ttt_mask through
the PyTorch attention over a KV cache whose columns [s*T, (s+1)*T) hold step s, is the oracle the tests and
training.ttt_step compare it with. On CUDA each step (ttt_step) may run through torch.compile.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.fx.experimental._config as fx_config

from common.kernels import TTTPlan
from common.model.eagle3 import Eagle3Head
from common.model.llama import Batch, KVCache


@dataclass
class TTTTargets:
    # the base distribution over the draft vocab, p = exp(target_logits - target_lse), kept as the base's
    # logits in their own dtype (bf16 on a GPU: half the bytes of p in float32, which the loss reads twice
    # a TTT step) and their float32 log-sum-exp: the same information, nothing rounded that was not before
    target_logits: torch.Tensor  # [B, T, Vd] the base's logits at the draft vocab's ids
    target_lse: torch.Tensor  # [B, T] float32 logsumexp of target_logits (in float32)
    base_top: torch.Tensor  # [B, T] base argmax over the full vocab (the greedy next token)
    in_draft: torch.Tensor  # [B, T] bool: base_top is in the draft vocab
    valid: torch.Tensor  # [B, T] bool: row predicts a response token of a real position

    @classmethod
    def of(cls, target_logits: torch.Tensor, base_top: torch.Tensor, in_draft: torch.Tensor, valid: torch.Tensor):
        """From the base's logits at the draft vocabulary's ids [B, T, Vd] (their log-sum-exp computed here)."""
        lse = target_logits.float().logsumexp(-1)  # [B, T]
        return cls(target_logits, lse, base_top, in_draft, valid)


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

    def batch(self, pos: torch.Tensor, slots: torch.Tensor, step: int, kv: list[torch.Tensor]) -> Batch:
        """pos [B, T] positions 0..T-1 of every row; slots [B]; kv: the steps' K/V so far (TTTPlan.kv), for
        an attention that keeps them out of the cache."""
        ...

    def cache_len(self, t: int, steps: int) -> int:
        """KV cache positions a sequence needs for `steps` steps of T rows."""
        ...


@dataclass(frozen=True)
class FusedAttention:
    """The training path: common.kernels.ttt (causal flash kernel + the diagonal, merged by log-sum-exp),
    O(T) memory per step; the steps' K/V in TTTPlan.kv, no cache."""

    def batch(self, pos: torch.Tensor, slots: torch.Tensor, step: int, kv: list[torch.Tensor]) -> Batch:
        b, t = pos.shape
        return Batch(
            input_ids=pos,
            positions=pos,
            slots=slots,
            write_pos=pos,  # unused, as are prefix_len and window: the plan decides
            prefix_len=torch.zeros(b, dtype=torch.long, device=pos.device),
            window=torch.zeros(b, t, 0, dtype=torch.bool, device=pos.device),
            plan=TTTPlan(step=step, kv=kv),
        )

    def cache_len(self, t: int, steps: int) -> int:
        return 0


@dataclass(frozen=True)
class DenseMaskAttention:
    """The oracle: ttt_mask as a dense [T, (j+1)T] mask through the PyTorch attention (math kernel,
    O(j T^2) memory per step). Kept for tests and for training.ttt_step's comparison."""

    def batch(self, pos: torch.Tensor, slots: torch.Tensor, step: int, kv: list[torch.Tensor]) -> Batch:
        b, t = pos.shape
        mask = ttt_mask(t, step, pos.device)[None, None].expand(b, 1, t, (step + 1) * t)
        return Batch.masked(input_ids=pos, positions=pos, slots=slots, write_pos=pos + step * t, mask=mask)

    def cache_len(self, t: int, steps: int) -> int:
        return steps * t


def make_targets(
    base_logits_fn, hidden_next: torch.Tensor, draft_to_base: torch.Tensor, t2d: torch.Tensor, valid: torch.Tensor
) -> TTTTargets:
    """hidden_next [B, T, H]: base final hidden at position r+1 for row r."""
    with torch.no_grad():
        logits = base_logits_fn(hidden_next)  # [B, T, V]
        base_top = logits.argmax(-1)  # [B, T]
        return TTTTargets.of(logits[..., draft_to_base], base_top, t2d[base_top], valid)


@dataclass
class StepOutput:
    hidden: torch.Tensor  # [B, T, H] the layer's output, fed back (shifted one row) to the next step
    loss: torch.Tensor  # scalar: mean soft cross-entropy over the rows of pmask
    draft_top: torch.Tensor  # [B, T] the draft's argmax (draft vocabulary ids)


def ttt_step(
    head: Eagle3Head,
    embeds: torch.Tensor,
    hidden: torch.Tensor,
    batch: Batch,
    cache: KVCache,
    target_logits: torch.Tensor,
    target_lse: torch.Tensor,
    pmask: torch.Tensor,
) -> StepOutput:
    """One TTT step: the head forward and its loss (soft_cross_entropy). target_logits [B, T, Vd],
    target_lse [B, T] (TTTTargets); pmask [B, T] float32, 1 on the rows that count."""
    h, normed = head.hidden_and_normed(embeds, hidden, batch, cache)
    logits = head.lm_head(normed)  # [B, T, Vd] in the compute dtype
    loss = soft_cross_entropy(logits, target_logits, target_lse, pmask)
    return StepOutput(hidden=h, loss=loss, draft_top=logits.detach().argmax(-1))


def soft_cross_entropy(
    logits: torch.Tensor, target_logits: torch.Tensor, target_lse: torch.Tensor, pmask: torch.Tensor
) -> torch.Tensor:
    """Mean over the rows of pmask of -sum_v p_v log q_v, q = softmax(logits), p = exp(target_logits -
    target_lse), in float32. logits, target_logits [B, T, Vd]; target_lse, pmask [B, T]. Written as
    sum(p) logsumexp(x) - sum(p x) (log q = x - logsumexp(x)): every sum of a row comes from one pass over
    x and p, which Inductor fuses with the argmax, where log_softmax first needs the log-sum-exp before the
    products can be summed (session 14: with this and p read from bf16 logits, the loss's kernels went from 21 to 17 ms
    of a 6-step TTT step at batch 64 x 1024 on an H100)."""
    x = logits.float()
    p = torch.exp(target_logits.float() - target_lse[..., None])  # [B, T, Vd]
    ce = p.sum(-1) * x.logsumexp(-1) - (p * x).sum(-1)  # [B, T]
    return (ce * pmask).sum() / pmask.sum().clamp(min=1.0)


def compile_step(backend="inductor"):
    """ttt_step through torch.compile with dynamic shapes: one graph per TTT step j whatever the batch and length
    (not one per padded length; static shapes gave wrong gradients, see common.kernels.ttt.rope_attention).
    Traced with duck sizing off: by default dynamo assumes that dimensions of equal size at tracing are equal
    symbols and guards on it, so a batch whose size matched an unrelated dimension (on CPU 2 rows and the K/V pair's
    2) compiled all the steps again when the next batch differed. On a GPU, Inductor also guards on the rows'
    divisibility by 8, which the Trainer keeps fixed by padding (TrainConfig.rows_multiple)."""
    step = torch.compile(ttt_step, dynamic=True, backend=backend)

    @functools.wraps(ttt_step)
    def run(*args):
        with fx_config.patch(use_duck_shape=False):  # read when a call traces: compiled graphs are unaffected
            return step(*args)

    return run


@functools.cache
def compiled_step():
    """compile_step() by TorchInductor, for CUDA: the norms, RoPE, SwiGLU, casts, the TTT attention's diagonal
    and merge (common.kernels.ttt) and the vocabulary-wide loss become a few fused kernels. Built on first use
    (importing the compiler costs a CPU process time); compiling costs a few minutes once per process (134 s for
    6 steps on an H100, 175 s on an H200: training.ttt_step's warm-up at batch 64 x 1024)."""
    return compile_step()


def ttt_forward(
    head: Eagle3Head,
    embeds: torch.Tensor,
    aux: torch.Tensor,
    targets: TTTTargets,
    steps: int,
    step_weight: float = 0.8,
    attention: StepAttention = FusedAttention(),
    compile: bool = False,
) -> TTTResult:
    """embeds [B, T, H] = embed(x_{r+1}); aux [B, T, 3H_target] = a_r. Returns the weighted loss.
    compile: each step through compiled_step() (the same function compiled; the caller decides, on CUDA)."""
    b, t, _ = embeds.shape
    device = embeds.device
    c = head.cfg
    step_fn = compiled_step() if compile else ttt_step
    cache_dtype = torch.float32 if device.type == "cpu" else torch.bfloat16
    cache = KVCache.allocate(1, b, attention.cache_len(t, steps), c.num_kv_heads, c.head_dim, cache_dtype, device)
    kv: list[torch.Tensor] = []  # FusedAttention: each step's K/V [B, T, 2, KVH, D], appended by its forward
    rows = torch.arange(t, device=device)
    pos = rows[None, :].expand(b, t)
    slots = torch.arange(b, device=device)
    hidden = aux
    total = embeds.new_zeros((), dtype=torch.float32)
    stats = []  # per step: [loss, rows counted, rows where the draft argmax is the base argmax]
    for j in range(steps):
        rows_ok = targets.valid & (rows >= j)[None, :]  # [B, T]
        pmask = (rows_ok & targets.in_draft).float()  # [B, T] reference: only in-vocab targets
        batch = attention.batch(pos, slots, j, kv)
        out = step_fn(head, embeds, hidden, batch, cache, targets.target_logits, targets.target_lse, pmask)
        total = total + (step_weight**j) * out.loss
        with torch.no_grad():
            hit = (head.to_base_ids(out.draft_top) == targets.base_top) & rows_ok  # [B, T]
            stats.append(torch.stack((out.loss.detach().float(), rows_ok.sum().float(), hit.sum().float())))
        # next step: row r gets this step's output at row r-1 (row 0 gets zeros; it is masked)
        hidden = torch.cat((out.hidden.new_zeros(b, 1, out.hidden.shape[-1]), out.hidden[:, :-1]), dim=1)
    per_step = torch.stack(stats).tolist()  # one device sync for the whole unroll
    return TTTResult(
        loss=total,
        step_loss=[s[0] for s in per_step],
        step_acc=[s[2] / max(s[1], 1.0) for s in per_step],
        step_rows=[int(s[1]) for s in per_step],
    )
