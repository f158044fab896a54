"""The verifier engine: prefill, tree verification with greedy acceptance and KV compaction on the
device, and plain decoding, over the base model's slotted KV cache.

Verification and decoding are step functions of static-shape tensors (_verify_step, _decode_step). On
CPU they run eagerly at the exact batch and tree size; on a GPU the same functions are captured as CUDA
graphs per (batch bucket, tree-rows bucket) and replayed, with batches padded by rows that write to a
spare "trash" slot and trees padded by rows that see only the prefix and themselves. Attention reads
each sequence's real length (common.kernels), so a graph costs what the context costs.

One verify call moves: the host packs one int64 block [B, 2T + 3] (tokens, parent rows, length, slot,
greedy flag); the step builds the tree mask and positions, runs the model, accepts greedily, compacts
the accepted path's K/V in every layer, and gathers the kept EAGLE features; the host reads back one
[B, T + 1] block (accepted count, tokens). Sequences that sample accept on the host from their logits
rows and compact afterwards: with the q rule when the tree carries the draft's q
(common.acceptance.accept_sampled_q), else with the one-hot rule (accept_sampled).
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from common import kernels, validate
from common.acceptance import Acceptance, accept_sampled, accept_sampled_q, compaction_plan
from common.config import LlamaConfig, SamplingConfig
from common.engine.base import (
    Accepted,
    Decoded,
    EngineInfo,
    PrefillInput,
    PrefillOutput,
    Steps,
    StepTime,
    VerifyInput,
    VerifyOutput,
    finish,
)
from common.engine.cuda_graphs import CudaGraphManager, GraphConfig, batch_buckets_for
from common.errors import CapacityExhausted, InvalidRequest, UnknownSequence
from common.model.llama import Batch, KVCache, LlamaModel
from common.sampling import target_distribution
from common.slots import SlotTable, check_unique
from common.tree import node_positions
from common.weights import Checkpoint

log = logging.getLogger(__name__)


def prefill_groups(lengths: list[int], waste: float = 1.5, max_rows: int | None = None) -> list[list[int]]:
    """Indices of prompts (or chunks) to prefill in one forward each: longest first, a group growing while
    its padded size (members x its longest) stays within `waste` x its real tokens and it has fewer than
    max_rows members (the most rows a captured prefill graph takes: a larger group would run eagerly).
    Example: lengths [30, 500, 28, 4, 3] -> [[1], [0, 2, 3], [4]]: 500 alone (2 x 500 > 1.5 x 530); 30, 28
    and 4 pad to 3 x 30 = 90 for 62 tokens (<= 93); 3 more would make 120 for 65 (> 97.5). With max_rows 2:
    [[1], [0, 2], [3, 4]]."""
    if waste < 1:
        raise ValueError(f"waste must be >= 1, got {waste}")
    groups: list[list[int]] = []
    real = 0
    for i in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
        g = groups[-1] if groups else None
        room = g is not None and (max_rows is None or len(g) < max_rows)
        if room and (len(g) + 1) * lengths[g[0]] <= waste * (real + lengths[i]):
            g.append(i)
            real += lengths[i]
        else:
            groups.append([i])
            real = lengths[i]
    return groups


@dataclass
class VerifierSeq:
    length: int  # tokens whose K/V are in the cache
    pending: int  # last chosen token, not yet in the cache (the next tree's root)
    sampling: SamplingConfig
    rng: np.random.Generator


@dataclass(frozen=True)
class VerifierConfig:
    max_sequences: int = 8
    max_context: int = 2048
    max_tree_nodes: int = 64
    dtype: str = "float32"
    device: str = "cpu"

    def __post_init__(self) -> None:
        if self.max_sequences < 1:
            raise ValueError(f"max_sequences must be >= 1, got {self.max_sequences}")
        if self.max_context < 16:
            raise ValueError(f"max_context must be >= 16, got {self.max_context}")
        if self.max_tree_nodes < 1:
            raise ValueError(f"max_tree_nodes must be >= 1, got {self.max_tree_nodes}")
        if self.dtype not in ("float32", "bfloat16", "float16"):
            raise ValueError(f"dtype must be float32, bfloat16 or float16, got {self.dtype!r}")


def torch_dtype(name: str) -> torch.dtype:
    return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[name]


SHALLOW_DEPTH = 8  # trees at most this deep (every dynamic tree of up to 8 steps) take 3 doubling rounds


def tree_depth(parent_rows: np.ndarray) -> int:
    """The deepest row of a batch of trees in the verifier's row layout ([B, T], a root or padding row
    names itself): rows climb to their parents together, one step a level, over the batch flattened
    (row r of tree b is b * T + r), dropping those that reach a row naming itself.
    [[0, 0, 0, 1, 2, 5]] -> rows 1..4 climb to [0, 0, 1, 2]; rows 3, 4 (now at 1, 2) to [0, 0] -> 2"""
    b, t = parent_rows.shape
    up = (parent_rows + (t * np.arange(b))[:, None]).ravel()  # [B * T] each row's parent, flattened
    at = np.flatnonzero(up != np.arange(b * t))  # rows that have a parent (not roots or padding)
    depth = 0
    while at.shape[0]:
        depth += 1
        at = up[at]  # one level up
        at = at[up[at] != at]  # those not at a root yet
    return depth


@dataclass(frozen=True)
class VerifyStep:
    """Outputs of _verify_step (static buffers under a graph)."""

    result: torch.Tensor  # [B, T + 1] int64: accepted count, then the accepted tokens and the bonus
    kept: torch.Tensor  # [B, T, 3H] EAGLE features of the root and the accepted nodes, in path order
    hidden: torch.Tensor  # [B, T, H] final hidden states (sampling sequences compute logits from them)
    aux: torch.Tensor  # [B, T, 3H] EAGLE features of every row


@dataclass(frozen=True)
class PrefillStep:
    """Outputs of _prefill_step (static buffers under a graph)."""

    logits: torch.Tensor  # [B, V] at each row's last real token
    greedy: torch.Tensor  # [B] their argmax (greedy rows read it: one host copy for the call)
    aux: torch.Tensor  # [B, T, 3H] EAGLE features of every position


@dataclass(frozen=True)
class DecodeStep:
    """Outputs of _decode_step (static buffers under a graph)."""

    hidden: torch.Tensor  # [B, H] final hidden state
    greedy: torch.Tensor  # [B] the greedy next token
    aux: torch.Tensor  # [B, 3H] EAGLE features of the step's row


CPU_CALIBRATION_ROWS = 16  # tree rows measured at start-up on a CPU (see Verifier.step_costs)


class Verifier:
    """The base model's engine. On CUDA with graphs on, verify and decode replay captured graphs."""

    def __init__(
        self, ckpt: Checkpoint, cfg: VerifierConfig, graphs: bool = False, graph_cfg: GraphConfig | None = None
    ) -> None:
        self.cfg = cfg
        self.device = torch.device(cfg.device)
        mcfg: LlamaConfig = ckpt.config
        self.max_rows = cfg.max_tree_nodes + 1
        if cfg.max_context + 2 * self.max_rows > mcfg.max_position:
            mcfg = LlamaConfig(**{**mcfg.__dict__, "max_position": cfg.max_context + 2 * self.max_rows})
        self.model = LlamaModel(mcfg)
        self.model.load_state_dict(ckpt.state_dict, strict=False)
        self.model.to(device=self.device, dtype=torch_dtype(cfg.dtype)).eval()
        self.model.fuse()  # fused q|k|v and gate|up weights, built before any CUDA graph capture
        # Capacity (what requests may use) leaves room for one tree beyond the longest allowed sequence;
        # the cache gets one spare slot for batch padding rows and max_rows of headroom, so that a tree
        # padded to its bucket never runs off its slot.
        self.capacity = cfg.max_context + self.max_rows
        self.trash_slot = cfg.max_sequences
        self.cache = KVCache.allocate(
            mcfg.num_layers,
            cfg.max_sequences + 1,
            self.capacity + self.max_rows,
            mcfg.num_kv_heads,
            mcfg.head_dim,
            torch_dtype(cfg.dtype),
            self.device,
        )
        self.seqs: SlotTable[VerifierSeq] = SlotTable(cfg.max_sequences)
        self.info = EngineInfo(
            model=ckpt.name,
            vocab_size=mcfg.vocab_size,
            max_context=cfg.max_context,
            max_sequences=cfg.max_sequences,
            max_tree_nodes=cfg.max_tree_nodes,
            dtype=cfg.dtype,
            device=str(self.device),
        )
        gc = graph_cfg or GraphConfig()
        self.graphs = CudaGraphManager.for_engine(self.device, "verifier", graphs, gc)
        self.batch_buckets = batch_buckets_for(cfg.max_sequences, gc.batch_buckets)
        self.tree_buckets = tuple(sorted({t for t in gc.tree_buckets if t <= self.max_rows} | {self.max_rows}))
        self.prefill_buckets = tuple(sorted(t for t in gc.prefill_buckets if t < cfg.max_context))
        self.prefill_batch_buckets = tuple(sorted(b for b in gc.prefill_batch_buckets if b <= cfg.max_sequences))
        # more rows than the largest prefill graph takes go in several replays, not one eager forward (on a
        # GPU an eager forward of the model costs several times a replay: its hundreds of kernel launches)
        self._prefill_rows_max = (
            max(self.prefill_batch_buckets) if self.graphs.pad and self.prefill_batch_buckets else None
        )
        if self.graphs.enabled:
            self._capture()

    def _capture(self) -> None:
        with torch.inference_mode(), self.graphs.on_stream():
            for bb in sorted(self.batch_buckets, reverse=True):
                for tb in sorted(self.tree_buckets, reverse=True):
                    block = self._verify_block(bb, tb)
                    self.graphs.capture(("verify", bb, tb, False), self._verify_step, {"packed": block})
                    shallow = functools.partial(self._verify_step, max_depth=SHALLOW_DEPTH)
                    self.graphs.capture(("verify", bb, tb, True), shallow, {"packed": block})
                self.graphs.capture(("decode", bb), self._decode_step, {"packed": self._decode_block(bb)})
            for bb in sorted(self.prefill_batch_buckets, reverse=True):
                for tb in sorted(self.prefill_buckets, reverse=True):
                    block = {"packed": self._prefill_block(bb, tb)}
                    self.graphs.capture(("prefill", bb, tb), self._prefill_step, block)
        self.graphs.log_report()

    # ---- prefill (graphs per rows and tokens bucket; longer prompts and larger calls eager) ----
    def prefill(self, item: PrefillInput) -> PrefillOutput:
        return self.prefill_batch([item])[0]

    @torch.inference_mode()
    def prefill_batch(self, items: list[PrefillInput]) -> list[PrefillOutput]:
        """Prompts, or their next chunks (see PrefillInput), of several sequences: one forward per group of
        similar lengths (prefill_groups), each row written after its sequence's cache and attending to it as
        a prefix, the same attention as one call over a whole prompt. All or nothing: when the call fails,
        every sequence it created or continued is freed."""
        check_unique([it.seq_id for it in items])
        if any(not it.token_ids for it in items):
            raise InvalidRequest("prompt is empty")
        mine: list[str] = []  # created or continued here: freed if the call fails
        try:
            for it in items:
                if self._prefilling(it.seq_id) is None:  # a new sequence
                    rng = np.random.default_rng(it.sampling.seed)
                    self.seqs.acquire(it.seq_id, VerifierSeq(length=0, pending=-1, sampling=it.sampling, rng=rng))
                mine.append(it.seq_id)
                validate.token_ids(it.token_ids, self.info.vocab_size, "prompt")
                total = self.seqs.get(it.seq_id)[1].length + len(it.token_ids)
                if total >= self.cfg.max_context:
                    raise InvalidRequest(f"prompt has {total} tokens; the context holds {self.cfg.max_context}")
            outs: dict[str, PrefillOutput] = {}
            with self.graphs.on_stream():
                for group in prefill_groups([len(it.token_ids) for it in items], max_rows=self._prefill_rows_max):
                    outs.update(self._prefill_rows([items[i] for i in group]))
            return [outs[it.seq_id] for it in items]
        except BaseException:
            self.release(mine)
            raise

    def _prefill_block(self, b: int, t: int) -> torch.Tensor:
        """An all-padding prefill block [b, t + 3]: tokens 0, start 0, the trash slot, one real token."""
        a = np.zeros((b, t + 3), dtype=np.int64)
        a[:, t + 1] = self.trash_slot
        a[:, t + 2] = 1
        return torch.from_numpy(a)

    def _prefill_step(self, packed: torch.Tensor) -> PrefillStep:
        """packed [B, T + 3]: columns [0, T) the row's tokens (padded), T the length before them (they
        attend to the cache before it as a prefix), T + 1 the slot, T + 2 the row's real token count n.
        A padding token is written past its sequence's length (clamped inside the slot: never read before
        it is rewritten), and no real token sees it (the window is causal)."""
        b, t = packed.shape[0], packed.shape[1] - 3
        ids, start, slots, n = packed[:, :t], packed[:, t], packed[:, t + 1], packed[:, t + 2]  # [B, T], [B] x3
        pos = (start[:, None] + torch.arange(t, device=packed.device)[None, :]).clamp(max=self.capacity - 1)
        batch = Batch(
            input_ids=ids,
            positions=pos,
            slots=slots,
            write_pos=pos,
            prefix_len=start,
            window=torch.ones(t, t, dtype=torch.bool, device=packed.device).tril()[None].expand(b, t, t),
        )
        out = self.model(batch, self.cache)
        last = out.hidden[torch.arange(b, device=packed.device), (n - 1).clamp(min=0)]  # [B, H]
        logits = self.model.logits(last)  # [B, V]
        return PrefillStep(logits=logits, greedy=logits.argmax(-1), aux=out.aux)

    def _prefill_rows(self, items: list[PrefillInput]) -> dict[str, PrefillOutput]:
        """One step over the items' rows, padded to the longest (and on a GPU to their buckets)."""
        b, t = len(items), max(len(it.token_ids) for it in items)
        bb, tb = self.graphs.bucket(b, self.prefill_batch_buckets), self.graphs.bucket(t, self.prefill_buckets)
        slots, states = zip(*(self.seqs.get(it.seq_id) for it in items))
        block = self._prefill_block(bb, tb)
        a = block.numpy()  # [bb, tb + 3]
        for i, (it, slot, st) in enumerate(zip(items, slots, states)):
            a[i, : len(it.token_ids)] = it.token_ids
            a[i, tb], a[i, tb + 1], a[i, tb + 2] = st.length, slot, len(it.token_ids)
        key = ("prefill", bb, tb)
        out = self.graphs.run(key, self._prefill_step, {"packed": block})
        aux = out.aux[:b, :t].clone() if self.graphs.is_captured(key) else out.aux  # outlives the next replay
        greedy = out.greedy[:b].tolist()  # the call's one host synchronisation (sampling rows add theirs)
        done = {}
        for i, (it, st) in enumerate(zip(items, states)):
            n = len(it.token_ids)
            st.length += n
            next_token = None
            if not it.more:
                st.pending = next_token = greedy[i] if st.sampling.greedy else self._choose(out.logits[i], st)
            done[it.seq_id] = PrefillOutput(next_token=next_token, hidden=aux[i, :n])
        return done

    def _prefilling(self, seq_id: str) -> VerifierSeq | None:
        """The state of a sequence whose prompt is partly prefilled (pending -1), None for a new id; an id
        whose prompt is complete is refused."""
        try:
            _, state = self.seqs.get(seq_id)
        except UnknownSequence:
            return None
        if state.pending != -1:
            raise InvalidRequest(f"sequence {seq_id!r} already exists")
        return state

    def _ready(self, seq_id: str) -> tuple[int, VerifierSeq]:
        """(slot, state) of a sequence whose prompt is prefilled (InvalidRequest while chunks are due)."""
        slot, state = self.seqs.get(seq_id)
        if state.pending == -1:
            raise InvalidRequest(f"sequence {seq_id!r} is still being prefilled (its last chunk has not come)")
        return slot, state

    def room(self, seq_ids: list[str]) -> list[int]:
        """KV rows each sequence has left: a verify of a t-row tree (the root and its nodes) fits when t <= room."""
        return [self.capacity - self._ready(s)[1].length for s in seq_ids]

    # ---- verification ----
    def _verify_block(self, b: int, t: int) -> torch.Tensor:
        """An all-padding verify block [b, 2t + 3]: token 0, every row its own parent, length 0, the
        trash slot, greedy."""
        a = np.zeros((b, 2 * t + 3), dtype=np.int64)
        a[:, t : 2 * t] = np.arange(t)
        a[:, 2 * t + 1] = self.trash_slot
        a[:, 2 * t + 2] = 1
        return torch.from_numpy(a)

    def _verify_step(self, packed: torch.Tensor, max_depth: int | None = None) -> VerifyStep:
        """packed [B, 2T + 3]: columns [0, T) the root token then the tree's tokens, [T, 2T) each row's
        parent row (the root and padding rows their own), 2T the committed length n (the root's cache
        position), 2T + 1 the slot, 2T + 2 whether the sequence is greedy. max_depth: a bound on the
        trees' depth (fewer rounds for their ancestors), None for any."""
        b, t = packed.shape[0], (packed.shape[1] - 3) // 2
        ids, parent_rows = packed[:, :t], packed[:, t : 2 * t]  # [B, T] each
        n, slots, greedy = packed[:, 2 * t], packed[:, 2 * t + 1], packed[:, 2 * t + 2]  # [B] each (greedy: 0/1)
        anc, depth = kernels.tree_mask(parent_rows, max_depth)  # [B, T, T], [B, T]
        rows = torch.arange(t, device=packed.device)
        batch = Batch(
            input_ids=ids,
            positions=n[:, None] + depth,
            slots=slots,
            write_pos=n[:, None] + rows[None, :],
            prefix_len=n,
            window=anc,
        )
        out = self.model(batch, self.cache)
        result, src = kernels.accept_tree(ids, parent_rows, anc, depth, self.model.greedy(out.hidden), greedy)
        # greedy sequences: K/V of the accepted path move next to the root in every layer; sampling
        # sequences keep their rows (src[b, k] = k: the host compacts them after acceptance)
        kernels.move_rows(self.cache.kv, slots, n, src)
        kept = out.aux.gather(1, src[:, :, None].expand(b, t, out.aux.shape[-1]))  # [B, T, 3H]
        return VerifyStep(result=result, kept=kept, hidden=out.hidden, aux=out.aux)

    def verify(self, items: list[VerifyInput]) -> list[VerifyOutput]:
        return finish(self.verify_steps(items))

    @torch.inference_mode()  # a generator: torch enters the mode at each resume
    def verify_steps(
        self, items: list[VerifyInput], then: Callable[[Accepted], None] | None = None
    ) -> Steps[list[VerifyOutput]]:
        """verify as steps: the forward and acceptance are launched, then (on a GPU) the call yields until
        they are done, then reads its results and commits. then(accepted): called after the launch when
        every sequence is greedy, with copies of the acceptance on the device (its rows those of items)."""
        check_unique([it.seq_id for it in items])
        states = [self._ready(it.seq_id) for it in items]
        b = len(items)
        sizes = np.fromiter((it.tree.size for it in items), dtype=np.int64, count=b)  # [B]
        lengths = np.fromiter((st.length for _, st in states), dtype=np.int64, count=b)  # [B]
        t = 1 + int(sizes.max())
        full = np.flatnonzero(lengths + t > self.capacity)
        if full.size:
            i = int(full[0])
            raise CapacityExhausted(
                f"sequence {items[i].seq_id!r} has no room for a {t}-row tree at length {lengths[i]}"
            )
        bb, tb = self.graphs.bucket(b, self.batch_buckets), self.graphs.bucket(t, self.tree_buckets)
        block = self._verify_block(bb, tb)
        a = block.numpy()  # [bb, 2 tb + 3]
        self._pack_trees(a, items, sizes)
        a[:b, 0] = [st.pending for _, st in states]
        a[:b, 2 * tb] = lengths
        a[:b, 2 * tb + 1] = [slot for slot, _ in states]
        greedy = np.fromiter((st.sampling.greedy for _, st in states), dtype=bool, count=b)  # [B]
        a[:b, 2 * tb + 2] = greedy
        accepted = None
        with self.graphs.on_stream():
            deepest = tree_depth(a[:b, tb : 2 * tb])
            shallow = deepest <= SHALLOW_DEPTH
            key, step = ("verify", bb, tb, shallow), self._verify_step
            if shallow:
                step = functools.partial(self._verify_step, max_depth=SHALLOW_DEPTH)
            out = self.graphs.run(key, step, {"packed": block})
            if then is not None and greedy.all():
                # copies on this stream: the next call's replay may rewrite the graph's buffers before the
                # drafter has read them. A path holds at most the deepest tree's depth + 1 rows
                accepted = Accepted(result=out.result[:b].clone(), kept=out.kept[:b, : deepest + 1].clone())
        if accepted is not None:
            then(accepted)
        yield from self.graphs.launched()
        with self.graphs.on_stream():
            # [B, T + 1] the one host synchronisation of the call (from the copy made for `then`, when made)
            result = (accepted.result if accepted is not None else out.result[:b]).cpu().numpy()
            counts = np.where(greedy, result[:, 0] + 1, 0).tolist()  # [B] tokens of each greedy sequence
            kept = None  # [B, >= max(counts), 3H] outliving the next replay (the copy made for `then` does)
            if max(counts):
                kept = accepted.kept if accepted is not None else out.kept[:b, : max(counts)].clone()
            chosen = result[:, 1 : max(counts) + 1].tolist()  # [B][max(counts)] accepted tokens, the bonus
            outputs = []
            for i, (it, (slot, st)) in enumerate(zip(items, states)):
                if st.sampling.greedy:
                    tokens, hidden = chosen[i][: counts[i]], kept[i, : counts[i]]
                else:
                    tokens, hidden = self._verify_sampled(it, slot, st, out.hidden[i], out.aux[i])
                st.length += len(tokens)
                st.pending = tokens[-1]
                outputs.append(VerifyOutput(tokens=tokens, hidden=hidden))
            return outputs

    @staticmethod
    def _pack_trees(a: np.ndarray, items: list[VerifyInput], sizes: np.ndarray) -> None:
        """The trees' tokens and parent rows into a verify block a [bb, 2 tb + 3], all at once: node j of item
        i is row j + 1 (columns j + 1 and tb + j + 1), its parent row parents[j] + 1 (-1, the root: row 0).
        Example: trees [a, b] (parents [-1, 0]) and [c] ([-1]) -> items [0, 0, 1], rows [1, 2, 1]:
                 a[0, 1:3] = [a, b], a[0, tb + 1 : tb + 3] = [0, 1], a[1, 1] = c, a[1, tb + 1] = 0"""
        tb = (a.shape[1] - 3) // 2
        item, node = node_positions(sizes)  # [N] each
        a[item, node + 1] = np.concatenate([it.tree.tokens for it in items])
        a[item, tb + node + 1] = np.concatenate([it.tree.parents for it in items]) + 1

    def _verify_sampled(
        self, it: VerifyInput, slot: int, st: VerifierSeq, hidden: torch.Tensor, aux: torch.Tensor
    ) -> tuple[list[int], torch.Tensor]:
        """Host-side lossless acceptance for a sampling sequence, then its KV compaction.
        hidden [T, H], aux [T, 3H]: the step's rows for this sequence."""
        logits = self.model.logits(hidden[: it.tree.size + 1])  # [size + 1, V]

        def target(row: int) -> np.ndarray:
            return target_distribution(logits[row].cpu().numpy(), st.sampling)

        tree = it.tree
        if tree.q is not None:
            acc: Acceptance = accept_sampled_q(tree.tokens, tree.parents, tree.q, target, st.rng)
        else:
            acc = accept_sampled(tree.tokens, tree.parents, target, st.rng)
        move = compaction_plan(acc.path, st.length)
        if move.src:
            src, dst = self._t(np.array(move.src)), self._t(np.array(move.dst))
            self.cache.kv[:, slot, dst] = self.cache.kv[:, slot, src]  # gathered before written
        rows = self._t(np.array([0] + [p + 1 for p in acc.path]))
        return acc.tokens, aux[rows]

    # ---- plain decoding ----
    def _decode_block(self, b: int) -> torch.Tensor:
        """An all-padding decode block [b, 3]: token 0, length 0, the trash slot."""
        a = np.zeros((b, 3), dtype=np.int64)
        a[:, 2] = self.trash_slot
        return torch.from_numpy(a)

    def _decode_step(self, packed: torch.Tensor) -> DecodeStep:
        """packed [B, 3]: pending token, committed length n, slot."""
        n = packed[:, 1]
        batch = Batch(
            input_ids=packed[:, 0:1],
            positions=n[:, None],
            slots=packed[:, 2],
            write_pos=n[:, None],
            prefix_len=n,
            window=torch.ones_like(packed[:, :1, None], dtype=torch.bool),
        )
        out = self.model(batch, self.cache)
        hidden = out.hidden[:, 0]
        return DecodeStep(hidden=hidden, greedy=self.model.greedy(hidden), aux=out.aux[:, 0])

    @torch.inference_mode()
    def decode(self, seq_ids: list[str]) -> list[int]:
        """One plain decoding step for each sequence: its next token."""
        return [t[0] for t in self.decode_many(seq_ids, 1).tokens]

    def decode_many(self, seq_ids: list[str], steps: int, with_hidden: bool = False) -> Decoded:
        return finish(self.decode_many_steps(seq_ids, steps, with_hidden))

    @torch.inference_mode()  # a generator: torch enters the mode at each resume
    def decode_many_steps(self, seq_ids: list[str], steps: int, with_hidden: bool = False) -> Steps[Decoded]:
        """Up to `steps` plain decoding steps for each sequence with one host synchronisation: the step
        writes its token and length back into its input block on the device, and the graph is replayed
        again. The caller applies stop rules to the tokens (steps past a stop are wasted, not wrong).
        Batches with a sampling sequence (host-side sampling) and sequences near the end of their context
        take fewer steps; every sequence gets the same number of tokens. with_hidden: also the EAGLE
        features of every step (hidden[i, j] produced tokens[i][j]), for a draft that follows along."""
        if steps < 1:
            raise InvalidRequest(f"decode steps must be >= 1, got {steps}")
        check_unique(seq_ids)
        states = [self._ready(s) for s in seq_ids]
        for s, (_, st) in zip(seq_ids, states):
            if st.length + 1 > self.capacity:
                raise CapacityExhausted(f"sequence {s!r} is at the end of its context")
        if not all(st.sampling.greedy for _, st in states):
            steps = 1
        steps = min(steps, min(self.capacity - st.length for _, st in states))
        b = len(seq_ids)
        bb = self.graphs.bucket(b, self.batch_buckets)
        block = self._decode_block(bb)
        a = block.numpy()  # [bb, 3]
        a[:b] = [(st.pending, st.length, slot) for slot, st in states]
        key = ("decode", bb)
        with self.graphs.on_stream():
            fed = self.graphs.feed(key, {"packed": block})
            tokens = torch.empty(bb, steps, dtype=torch.long, device=self.device)  # [B, steps]
            features = None
            for j in range(steps):
                step: DecodeStep = self.graphs.replay(key, self._decode_step, fed)
                tokens[:, j] = step.greedy
                if with_hidden:
                    if features is None:  # [B, steps, 3H]
                        features = step.aux.new_empty(bb, steps, step.aux.shape[-1])
                    features[:, j] = step.aux
                if j + 1 < steps:  # the next step's input: this token at the next position
                    fed["packed"][:, 0] = step.greedy
                    fed["packed"][:, 1] += 1
        yield from self.graphs.launched()  # as steps: the replays are queued, the host reads them once done
        with self.graphs.on_stream():
            out = tokens[:b].cpu().numpy()
            for i, (_, st) in enumerate(states):
                if not st.sampling.greedy:  # steps == 1 here
                    out[i, 0] = self._choose(self.model.logits(step.hidden[i]), st)
            result = out.tolist()  # [B][steps]
            for (_, st), row in zip(states, result):
                st.length += steps
                st.pending = row[-1]
            return Decoded(tokens=result, hidden=features[:b] if features is not None else None)

    def release(self, seq_ids: list[str]) -> int:
        return sum(self.seqs.release(s) for s in seq_ids)

    @torch.inference_mode()
    def step_costs(self) -> list[StepTime]:
        """Seconds of a decode step per batch bucket and of a (shallow) verify step per batch and tree
        bucket, on all-padding blocks in the trash slot (no sequence is touched): graph replays on a GPU.
        On a CPU, eager steps of batch 1 and trees up to CPU_CALIBRATION_ROWS rows only (they are slow;
        the policy scales larger ones linearly and refines every size from the calls it sees)."""
        cpu = self.device.type == "cpu"
        out = []
        shallow = functools.partial(self._verify_step, max_depth=SHALLOW_DEPTH)
        for bb in self.batch_buckets[:1] if cpu else self.batch_buckets:
            block = {"packed": self._decode_block(bb)}
            t = self.graphs.seconds(("decode", bb), self._decode_step, block)
            out.append(StepTime("decode", bb, 1, t))
            for tb in self.tree_buckets:
                if cpu and tb > CPU_CALIBRATION_ROWS:
                    break
                block = {"packed": self._verify_block(bb, tb)}
                out.append(StepTime("verify", bb, tb, self.graphs.seconds(("verify", bb, tb, True), shallow, block)))
        return out

    # ---- helpers ----
    def _choose(self, logits: torch.Tensor, st: VerifierSeq) -> int:
        if st.sampling.greedy:
            return int(logits.argmax())
        p = target_distribution(logits.cpu().numpy(), st.sampling)
        return int(st.rng.choice(p.shape[0], p=p))

    def _t(self, a: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(np.ascontiguousarray(a, dtype=np.int64)).to(self.device)
