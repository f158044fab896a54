"""The verifier engine: prefill, tree verification with greedy or sampled acceptance and KV compaction
on the device, and plain decoding, over the base model's slotted KV cache.

Verification and decoding are step functions of static-shape tensors (_verify_step, _verify_sampled_step,
_decode_step). On CPU they run eagerly at the exact batch and tree size; on a GPU the same functions are
captured as CUDA graphs per (batch bucket, tree-rows bucket, Sampler) and replayed, with batches padded
by rows that write to a spare "trash" slot and trees padded by rows that see only the prefix and
themselves. Attention reads each sequence's real length (common.kernels), so a graph costs what the
context costs.

One verify call moves: the host packs one int64 block (all greedy: [B, 2T + 3], tokens, parent rows,
length, slot, greedy flag; with a sampling row, SampledColumns: also each row's sampling, seed and the
token sets its acceptance follows); the step builds the tree mask and positions, runs the model, accepts
(greedy rows by the argmax; sampling rows by the one-hot rule, or the q rule when the tree carries the
draft's q: common.kernels.speculative), compacts the accepted path's K/V in every layer, and gathers the
kept EAGLE features; the host reads back one [B, T + 1] block (accepted count, tokens). Plain decoding draws
on the device too, several steps a call. Every draw is a function of the sequence's seed and the position
(common.kernels.sampling): a seed reproduces a sequence on one speculation path. Its parts: verifier_parts.py,
verifier_sampled.py (sampled verification)."""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable

import numpy as np
import torch

from common import kernels, validate
from common.config import LlamaConfig, SamplingConfig
from common.engine.base import (
    Accepted,
    Chained,
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
from common.engine.verifier_parts import (  # noqa: F401 - callers import these from here too
    CPU_CALIBRATION_ROWS,
    PREFILLING,
    SHALLOW_DEPTH,
    SIBLINGS,
    DecodeStep,
    PrefillLaunch,
    PrefillStep,
    SampledColumns,
    Sampler,
    VerifierConfig,
    VerifierSeq,
    VerifyGraph,
    VerifyStep,
    chained_block,
    pack_sampled,
    pack_trees,
    prefill_groups,
    torch_dtype,
    tree_depth,
)
from common.engine.verifier_sampled import SampledVerify
from common.errors import CapacityExhausted, InvalidRequest, UnknownSequence
from common.kernels import speculative
from common.kernels.sampling import SamplingRows
from common.model.llama import Batch, ForwardOutput, KVCache, LlamaModel
from common.sampling import VERIFIER_SALT, sequence_seed
from common.slots import SlotTable, check_unique
from common.weights import Checkpoint

log = logging.getLogger(__name__)


class Verifier(SampledVerify):
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
        self.model = LlamaModel.loaded(mcfg, ckpt.state_dict, self.device, torch_dtype(cfg.dtype))
        self.model.fuse()  # fused q|k|v and gate|up weights, built before any CUDA graph capture
        # Capacity (what requests may use) leaves room for one tree beyond the longest allowed sequence;
        # the cache gets one spare slot for batch padding rows and max_rows of headroom, so that a tree
        # padded to its bucket never runs off its slot.
        self.capacity = cfg.max_context + self.max_rows
        slots = cfg.max_sequences + cfg.prefill_ahead
        # two slots past the sequences': the rounds' padding rows write one, the prefills' (beside the rounds on a
        # stream of their own) the other
        self.trash_slot, self.prefill_trash = slots, slots + 1
        rows, dtype = self.capacity + self.max_rows, torch_dtype(cfg.dtype)
        self.cache = KVCache.allocate(
            mcfg.num_layers, slots + 2, rows, mcfg.num_kv_heads, mcfg.head_dim, dtype, self.device
        )
        self.seqs: SlotTable[VerifierSeq] = SlotTable(slots)
        self.set_width = cfg.q_width + cfg.q_width % 2  # W of the captured sampled verify (even: q's float32 pairs)
        self._greedy_draw = SamplingRows.pack(SamplingConfig(), 0, mcfg.vocab_size)  # [3] a padding row's
        c, name = cfg, ckpt.name
        self.info = EngineInfo(
            name, mcfg.vocab_size, c.max_context, c.max_sequences, c.max_tree_nodes, c.dtype, str(self.device)
        )
        gc = graph_cfg or GraphConfig()
        self.graphs = CudaGraphManager.for_engine(self.device, "verifier", graphs, gc)
        # prefills: their own stream and graph pool, so that a prefill runs beside the rounds (prefill_launch)
        self.prefill_graphs = CudaGraphManager.for_engine(self.device, "prefill", graphs, gc)
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
                    self._warm_chained(block, tb, None)
                    for sampler in (Sampler.TEMPERATURE, Sampler.FILTERED):  # sampled trees: shallow ones only
                        w, s = self.set_width, self._siblings(tb)
                        key, step = self._sampled_variant(bb, tb, sampler, True, w, s)
                        sampled = self._sampled_block(bb, tb, w)
                        self.graphs.capture(key, step, {"packed": sampled})
                        self._warm_chained(sampled, tb, SampledColumns(tb, w))
                for sampler in Sampler:
                    key, step = self._decode_variant(bb, sampler)
                    self.graphs.capture(key, step, {"packed": self._decode_block(bb, sampler)})
        with torch.inference_mode(), self.prefill_graphs.on_stream():
            for bb in sorted(self.prefill_batch_buckets, reverse=True):
                for tb in sorted(self.prefill_buckets, reverse=True):
                    block = {"packed": self._prefill_block(bb, tb)}
                    self.prefill_graphs.capture(("prefill", bb, tb), self._prefill_step, block)
        self.graphs.log_report()
        self.prefill_graphs.log_report()

    def _warm_chained(self, block: torch.Tensor, tb: int, cols: SampledColumns | None) -> None:
        """Builds one chained block of `block`'s layout [BB, C] (a round of no nodes): chained_block runs between
        replays, and its kernel's compile (or its load from Triton's cache) belongs to start-up, not to the first
        call that chains at this width (tens of milliseconds to seconds inside a round, and in the policy's cost
        sample of it)."""
        prev = block.to(self.device)
        result = torch.zeros((1, tb + 1), dtype=torch.int64, device=self.device)  # [1, T + 1] nothing accepted
        none = torch.zeros((1, 1), dtype=torch.float64, device=self.device)  # [K 1, N 1] the drafter's tree dtype
        keep = torch.zeros((1, 2), dtype=torch.int64, device=self.device)[:, 1]  # [K] a column, as the drafter's
        trees = Chained(tokens=none, parents=none - 1, keep=keep, keep_max=0, depth=0, ready=None, kids=0)
        chained_block(prev, result, trees, tb, cols, out=prev)

    # ---- prefill (graphs per rows and tokens bucket; longer prompts and larger calls eager) ----
    def prefill(self, item: PrefillInput) -> PrefillOutput:
        return self.prefill_batch([item])[0]

    @torch.inference_mode()
    def prefill_batch(self, items: list[PrefillInput]) -> list[PrefillOutput]:
        """Prompts, or their next chunks (see PrefillInput), of several sequences: prefill_launch, then
        prefill_read."""
        return self.prefill_read(self.prefill_launch(items))

    @torch.inference_mode()  # also when called alone (the core's prefill beside a call)
    def prefill_launch(self, items: list[PrefillInput]) -> PrefillLaunch:
        """The items' prefill queued on the device: one forward per group of similar lengths (prefill_groups), each
        row written after its sequence's cache and attending to it as a prefix, the same attention as one call over
        a whole prompt. It runs on the prefill stream beside whatever the rounds have queued, neither waiting for
        them nor they for it (it writes its own sequences' slots and its own trash slot): the caller reads it
        (prefill_read) before any other call names these sequences. All or nothing: when the call fails, every
        sequence it created or continued is freed."""
        check_unique([it.seq_id for it in items])
        if any(not it.token_ids for it in items):
            raise InvalidRequest("prompt is empty")
        mine: list[str] = []  # created or continued here: freed if the call fails
        try:
            for it in items:
                if self._prefilling(it.seq_id) is None:  # a new sequence
                    seed = 0 if it.sampling.greedy else sequence_seed(it.sampling.seed, VERIFIER_SALT)
                    draw = SamplingRows.pack(it.sampling, seed, self.info.vocab_size)
                    self.seqs.acquire(
                        it.seq_id, VerifierSeq(length=0, pending=PREFILLING, sampling=it.sampling, draw=draw)
                    )
                mine.append(it.seq_id)
                validate.token_ids(it.token_ids, self.info.vocab_size, "prompt")
                total = self.seqs.get(it.seq_id)[1].length + len(it.token_ids)
                if total >= self.cfg.max_context:
                    raise InvalidRequest(f"prompt has {total} tokens; the context holds {self.cfg.max_context}")
            groups = prefill_groups([len(it.token_ids) for it in items], max_rows=self._prefill_rows_max)
            with self.prefill_graphs.beside():  # every group's forward queued, then one copy of their tokens
                launched = [self._prefill_rows([items[i] for i in group]) for group in groups]
                tokens = self.prefill_graphs.to_host(torch.cat([chosen for _, chosen in launched]))
            for it in items:  # their rows are in the cache once the launch has run
                self.seqs.get(it.seq_id)[1].length += len(it.token_ids)
            rows = [(i, row) for group, (aux, _) in zip(groups, launched) for i, row in zip(group, aux)]
            return PrefillLaunch(items, rows, tokens)
        except BaseException:
            self.release(mine)
            raise

    def prefill_read(self, launch: PrefillLaunch) -> list[PrefillOutput]:
        """A launched prefill's outputs, in the items' order, once the device has run it (the host waits for it
        here; on CPU it ran at the launch). When the read fails, the sequences it created or continued are freed."""
        host, ready = launch.tokens
        try:
            if ready is not None:
                ready.synchronize()
            tokens = host.tolist()
        except BaseException:
            self.release([it.seq_id for it in launch.items])
            raise
        outs: list[PrefillOutput | None] = [None] * len(launch.items)
        for (i, row), token in zip(launch.rows, tokens):  # tokens: in the groups' order, as rows
            it = launch.items[i]
            n = len(it.token_ids)
            next_token = None
            if not it.more:
                self.seqs.get(it.seq_id)[1].pending = next_token = token
            outs[i] = PrefillOutput(next_token=next_token, hidden=row[:n])
        return outs

    def _prefill_block(self, b: int, t: int) -> torch.Tensor:
        """An all-padding prefill block [b, t + 3]: tokens 0, start 0, the trash slot, one real token."""
        a = np.zeros((b, t + 3), dtype=np.int64)
        a[:, t + 1] = self.prefill_trash
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

    def _prefill_rows(self, items: list[PrefillInput]) -> tuple[torch.Tensor, torch.Tensor]:
        """One step over the items' rows, padded to the longest (and on a GPU to their buckets), queued: (aux
        [B, T, 3H] each row's features, chosen [B] its next token on the device), copies that outlive the next
        replay. The caller reads every group's tokens at once."""
        b, t = len(items), max(len(it.token_ids) for it in items)
        bb, tb = (
            self.prefill_graphs.bucket(b, self.prefill_batch_buckets),
            self.prefill_graphs.bucket(t, self.prefill_buckets),
        )
        slots, states = zip(*(self.seqs.get(it.seq_id) for it in items))
        block = self._prefill_block(bb, tb)
        a = block.numpy()  # [bb, tb + 3]
        for i, (it, slot, st) in enumerate(zip(items, slots, states)):
            a[i, : len(it.token_ids)] = it.token_ids
            a[i, tb], a[i, tb + 1], a[i, tb + 2] = st.length, slot, len(it.token_ids)
        key = ("prefill", bb, tb)
        packed = self.prefill_graphs.to_device(block)  # groups of one key are queued back to back: no staging buffer
        out = self.prefill_graphs.run(key, self._prefill_step, {"packed": packed})
        captured = self.prefill_graphs.is_captured(key)
        aux = out.aux[:b, :t].clone() if captured else out.aux
        chosen = out.greedy[:b].clone() if captured else out.greedy[:b]
        hot = [i for i, (it, st) in enumerate(zip(items, states)) if not it.more and not st.sampling.greedy]
        if hot:  # drawn on the device at the last prompt position (the counter), eagerly
            cols = np.empty((len(hot), SamplingRows.COLUMNS + 2), dtype=np.int64)  # [H, draw columns, counter, row]
            cols[:, :-2] = np.stack([states[i].draw for i in hot])
            cols[:, -2] = [states[i].length + len(items[i].token_ids) - 1 for i in hot]
            cols[:, -1] = hot
            on = self.prefill_graphs.to_device(torch.from_numpy(cols))  # behind the queued replay, the host not waiting
            rows = SamplingRows.unpack(on[:, :-2], on[:, -2])
            at = on[:, -1]
            filtered = Sampler.of([states[i].sampling for i in hot]) is Sampler.FILTERED
            chosen = chosen.index_copy(0, at, speculative.sample_next(out.logits[at], chosen[at], rows, filtered))
        return aux, chosen

    def _prefilling(self, seq_id: str) -> VerifierSeq | None:
        """The state of a sequence whose prompt is partly prefilled (pending PREFILLING), None for a new id; an id
        whose prompt is complete is refused."""
        try:
            _, state = self.seqs.get(seq_id)
        except UnknownSequence:
            return None
        if state.pending != PREFILLING:
            raise InvalidRequest(f"sequence {seq_id!r} already exists")
        return state

    def _ready(self, seq_id: str) -> tuple[int, VerifierSeq]:
        """(slot, state) of a sequence whose prompt is prefilled (InvalidRequest while chunks are due)."""
        slot, state = self.seqs.get(seq_id)
        if state.pending == PREFILLING:
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
        t = (packed.shape[1] - 3) // 2
        ids, parent_rows = packed[:, :t], packed[:, t : 2 * t]  # [B, T] each
        n, slots, greedy = packed[:, 2 * t], packed[:, 2 * t + 1], packed[:, 2 * t + 2]  # [B] each (greedy: 0/1)
        anc, depth, out = self._tree_forward(ids, parent_rows, n, slots, max_depth)
        result, src = kernels.accept_tree(ids, parent_rows, anc, depth, self.model.greedy(out.hidden), greedy)
        return self._compact(out.aux, result, src, slots, n)

    def _tree_forward(
        self,
        ids: torch.Tensor,
        parent_rows: torch.Tensor,
        n: torch.Tensor,
        slots: torch.Tensor,
        max_depth: int | None,
    ) -> tuple[torch.Tensor, torch.Tensor, ForwardOutput]:
        """The trees' mask (anc [B, T, T], depth [B, T]) and the model's forward over them."""
        anc, depth = kernels.tree_mask(parent_rows, max_depth)  # [B, T, T], [B, T]
        rows = torch.arange(ids.shape[1], device=ids.device)
        batch = Batch(
            input_ids=ids,
            positions=n[:, None] + depth,
            slots=slots,
            write_pos=n[:, None] + rows[None, :],
            prefix_len=n,
            window=anc,
        )
        return anc, depth, self.model(batch, self.cache)

    def _compact(
        self, aux: torch.Tensor, result: torch.Tensor, src: torch.Tensor, slots: torch.Tensor, n: torch.Tensor
    ) -> VerifyStep:
        """The accepted paths' K/V moved next to their roots in every layer, and their features [B, T, 3H]."""
        kernels.move_rows(self.cache.kv, slots, n, src)
        kept = aux.gather(1, src[:, :, None].expand(*src.shape, aux.shape[-1]))  # [B, T, 3H]
        return VerifyStep(result=result, kept=kept)

    def verify(self, items: list[VerifyInput]) -> list[VerifyOutput]:
        return finish(self.verify_steps(items))

    def verify_steps(
        self, items: list[VerifyInput], then: Callable[[Accepted], Chained | None] | None = None
    ) -> Steps[list[VerifyOutput]]:
        """One round of verify_rounds_steps."""
        outs = yield from self.verify_rounds_steps(items, 1, then)
        return outs[0]

    @torch.inference_mode()  # a generator: torch enters the mode at each resume
    def verify_rounds_steps(
        self,
        items: list[VerifyInput],
        rounds: int = 1,
        then: Callable[[Accepted], Chained | None] | None = None,
        each: Callable[[int, int, list[VerifyOutput]], bool] | None = None,
    ) -> Steps[list[list[VerifyOutput]]]:
        """Up to `rounds` verifications of the items' rows launched back to back, as steps: (on a GPU) the call
        yields until a round's result has reached the host, reads it and commits it, round after round, while
        the later rounds run on the device. then(accepted): called after each launch with copies of its
        acceptance on the device (its rows those of items); it returns the next trees of the first rows drafted
        on the device (Chained), which the next round verifies without the host (chained_block), or None: the
        call ends after this round, as it does when a round that might not fit, or one whose rows' sets the
        device cannot build (a q rule row's), would follow. each(r, launched, outputs): called with each round's
        outputs as soon as they are read (the caller's bookkeeping of round r overlaps the device's later
        rounds; launched: the call's rounds so far); when it returns True, one more round is launched behind
        the last, the chain permitting, so that a caller that keeps asking keeps the device fed across what
        would be calls. A tree of no nodes gets one token, as a decode step would. Returns each round's
        outputs, in order."""
        ids = [it.seq_id for it in items]
        check_unique(ids)
        states = [self._ready(s) for s in ids]
        b = len(items)
        lengths = np.fromiter((st.length for _, st in states), dtype=np.int64, count=b)  # [B]
        block, deepest, g = self._verify_plan(items, states, lengths)
        accepted: list[Accepted] = []
        reads: list[tuple[torch.Tensor, torch.cuda.Event | None]] = []  # each round's [B, T + 1] on the host
        grown = lengths + deepest + 1  # [B] each sequence's length after the launched rounds, at most

        def launch(block: torch.Tensor | None, after: tuple | None = None) -> tuple | None:
            """One round: `block`, or the one built on the device from `after` (the last round's block, its
            acceptance and the trees drafted behind it) -> the next round's `after`, or None: the chain ends."""
            nonlocal grown
            with self.graphs.on_stream():
                if block is None:  # built in the last round's block (the graph's input buffer): no copy to feed
                    block = self._chained_block(*after, g)
                fed = self.graphs.feed(g.key, {"packed": block})
                out = self.graphs.replay(g.key, g.step, fed)
                # copies: the next replay rewrites the graph's buffers. A path holds at most deepest + 1 rows
                depth = deepest if after is None else after[2].depth
                accepted.append(Accepted(result=out.result[:b].clone(), kept=out.kept[:b, : depth + 1].clone()))
                reads.append(self.graphs.to_host(accepted[-1].result))
                chained = then(accepted[-1]) if then is not None else None
            if chained is None or not self._chains(chained, g, grown):
                return None  # one-hot sets the device cannot build, another graph, or no room: the host goes on
            grown += chained.depth + 1
            return fed["packed"], accepted[-1].result, chained

        nxt = launch(block)
        while nxt is not None and len(accepted) < rounds:
            nxt = launch(None, nxt)
        outputs: list[list[VerifyOutput]] = []
        for r, ((host, ready), acc) in enumerate(zip(reads, accepted)):  # reads grows while the caller asks
            if ready is not None:
                yield ready  # round r's result is on the host; the later rounds run on
            rows = host.tolist()  # [B][T + 1]: each row's count c, then its c tokens (one conversion for the batch)
            outputs.append([VerifyOutput(row[1 : row[0] + 2], acc.kept, i) for i, row in enumerate(rows)])
            for (_, st), out in zip(states, outputs[-1]):
                st.length, st.pending = st.length + len(out.tokens), out.tokens[-1]
            if each is not None and each(r, len(accepted), outputs[-1]) and nxt is not None:
                nxt = launch(None, nxt)
        return outputs

    def _verify_plan(
        self, items: list[VerifyInput], states: list[tuple[int, VerifierSeq]], lengths: np.ndarray
    ) -> tuple[torch.Tensor, int, VerifyGraph]:
        """The first round's verify block [BB, C] packed from the items' trees, their depth, and its graph."""
        b = len(items)
        sizes = np.fromiter((it.tree.size for it in items), dtype=np.int64, count=b)  # [B]
        t = 1 + int(sizes.max())
        if (full := np.flatnonzero(lengths + t > self.capacity)).size:
            sid, n = items[int(full[0])].seq_id, lengths[int(full[0])]
            raise CapacityExhausted(f"sequence {sid!r} has no room for a {t}-row tree at length {n}")
        bb, tb = self.graphs.bucket(b, self.batch_buckets), self.graphs.bucket(t, self.tree_buckets)
        sampler = Sampler.of([st.sampling for _, st in states])
        sampled, kids = None, 0
        if sampler is Sampler.GREEDY:
            block, cols = self._verify_block(bb, tb), (2 * tb, 2 * tb + 1)  # n, slot
        else:
            sets_width, siblings = self._sets_shape(items, states, tb)
            sampled = SampledColumns(tb, sets_width)
            block, cols = self._sampled_block(bb, tb, sets_width), (sampled.n, sampled.n + 1)
            # chained rounds' one-hot sets are built on the device; a q rule row's q comes from the host
            kids = 0 if any(it.tree.q is not None for it in items) else min(siblings, sets_width)
        a = block.numpy()
        pack_trees(a, [it.tree for it in items], sizes, tb)
        a[:b, 0] = [st.pending for _, st in states]
        a[:b, cols[0]] = lengths
        a[:b, cols[1]] = [slot for slot, _ in states]
        deepest = tree_depth(a[:b, tb : 2 * tb])
        shallow = deepest <= SHALLOW_DEPTH
        if sampler is Sampler.GREEDY:
            key, step = ("verify", bb, tb, shallow), self._verify_step
            if shallow:
                step = functools.partial(self._verify_step, max_depth=SHALLOW_DEPTH)
        else:
            pack_sampled(a, [it.tree for it in items], [st for _, st in states], sampled)
            key, step = self._sampled_variant(bb, tb, sampler, shallow, sets_width, siblings)
        return block, deepest, VerifyGraph(key, step, tb, sampled, kids)

    def _chains(self, chained: Chained, g: VerifyGraph, lengths: np.ndarray) -> bool:
        """Whether trees drafted on the device go on in graph g: one-hot sets it can build, trees its bucket and
        shallow depth take, room for them past lengths [B] (each sequence's length, at most)."""
        if (g.cols is not None and chained.kids > g.kids) or chained.depth > SHALLOW_DEPTH:
            return False
        rows = self.graphs.bucket(1 + chained.keep_max, self.tree_buckets)
        return rows == g.tb and not (lengths + g.tb > self.capacity).any()

    def _chained_block(
        self, prev: torch.Tensor, result: torch.Tensor, chained: Chained, g: VerifyGraph
    ) -> torch.Tensor:
        """The next round's block, built on the device once the trees drafted there are done (chained_block), in
        prev's place (the last round's block, read by nothing after its replay)."""
        if chained.ready is not None:
            torch.cuda.current_stream(self.device).wait_event(chained.ready)
        return chained_block(prev, result, chained, g.tb, g.cols, out=prev)

    # ---- plain decoding ----
    def _decode_block(self, b: int, sampler: Sampler = Sampler.GREEDY) -> torch.Tensor:
        """An all-padding decode block: [b, 3] (token 0, length 0, the trash slot), then for a sampling
        variant a greedy row's four sampling columns ([b, 7])."""
        greedy = sampler is Sampler.GREEDY
        a = np.zeros((b, 3 if greedy else 3 + SamplingRows.COLUMNS), dtype=np.int64)
        a[:, 2] = self.trash_slot
        if not greedy:
            a[:, 3:] = self._greedy_draw
        return torch.from_numpy(a)

    def _decode_step(self, packed: torch.Tensor, sampler: Sampler = Sampler.GREEDY) -> DecodeStep:
        """packed [B, 3]: pending token, committed length n, slot; for a sampling variant [B, 7], then the
        row's sampling (SamplingRows; its counter: n). Greedy rows take the argmax the greedy step takes."""
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
        if sampler is Sampler.GREEDY:
            token = self.model.greedy(hidden)
        else:
            logits = self.model.lm_head(hidden)  # [B, V]
            rows = SamplingRows.unpack(packed[:, 3:], n)
            token = speculative.sample_next(logits, logits.argmax(-1), rows, sampler is Sampler.FILTERED)
        return DecodeStep(token=token, aux=out.aux[:, 0])

    def _decode_variant(self, bb: int, sampler: Sampler) -> tuple[tuple, Callable[..., DecodeStep]]:
        """The graph key and step of a decode (the greedy one's key is ("decode", bb), as before sampling)."""
        if sampler is Sampler.GREEDY:
            return ("decode", bb), self._decode_step
        return ("decode", bb, sampler), functools.partial(self._decode_step, sampler=sampler)

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
        again (a sampling row draws on the device, its counter the length). The caller applies stop rules
        to the tokens (steps past a stop are wasted, not wrong). Sequences near the end of their context
        take fewer steps; every sequence gets the same number of tokens. with_hidden: also the EAGLE
        features of every step (hidden[i, j] produced tokens[i][j]), for a draft that follows along."""
        if steps < 1:
            raise InvalidRequest(f"decode steps must be >= 1, got {steps}")
        check_unique(seq_ids)
        states = [self._ready(s) for s in seq_ids]
        for s, (_, st) in zip(seq_ids, states):
            if st.length + 1 > self.capacity:
                raise CapacityExhausted(f"sequence {s!r} is at the end of its context")
        steps = min(steps, min(self.capacity - st.length for _, st in states))
        b = len(seq_ids)
        bb = self.graphs.bucket(b, self.batch_buckets)
        sampler = Sampler.of([st.sampling for _, st in states])
        block = self._decode_block(bb, sampler)
        a = block.numpy()  # [bb, 3] or [bb, 7]
        a[:b, :3] = [(st.pending, st.length, slot) for slot, st in states]
        if sampler is not Sampler.GREEDY:
            a[:b, 3:] = np.stack([st.draw for _, st in states])
        key, step_fn = self._decode_variant(bb, sampler)
        with self.graphs.on_stream():
            fed = self.graphs.feed(key, {"packed": block})
            tokens = torch.empty(bb, steps, dtype=torch.long, device=self.device)  # [B, steps]
            features = None
            for j in range(steps):
                step: DecodeStep = self.graphs.replay(key, step_fn, fed)
                tokens[:, j] = step.token
                if with_hidden:
                    if features is None:  # [B, steps, 3H]
                        features = step.aux.new_empty(bb, steps, step.aux.shape[-1])
                    features[:, j] = step.aux
                if j + 1 < steps:  # the next step's input: this token at the next position
                    fed["packed"][:, 0] = step.token
                    fed["packed"][:, 1] += 1
        yield from self.graphs.launched()  # as steps: the replays are queued, the host reads them once done
        with self.graphs.on_stream():
            result = tokens[:b].cpu().tolist()  # [B][steps]
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
