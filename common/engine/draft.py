"""The EAGLE-3 drafter: an accept-token pass over newly committed tokens, then EAGLE-2 dynamic tree
expansion and the final top-N selection, batched over sequences, all on the device.

Depth: a call expands D levels, D the deepest item's depth rounded up to a captured depth bucket; each
item's tree keeps only nodes of its own depth (its candidates of deeper levels are masked out of the
selection), which is exactly the tree a call of its depth would draft: level d's candidates depend only
on the levels above it.

Draft KV layout per slot: positions [0, m) hold committed pairs (m equals the base sequence length);
tree expansion writes scratch entries after m, which the next accept pass overwrites (the roll-back is
free). A depth-d node sits at RoPE position m + d - 1 and in scratch entry (d - 1) * K + j, at m + that.

Step functions of static-shape tensors (_accept_step, _expand_step, and _propose_step = both) run
eagerly on CPU at exact sizes; on a GPU the same functions are captured per batch bucket (and per count
of new tokens, 1..steps + 1, and depth bucket) and replayed. A round with a new sequence (or more new
tokens than steps + 1) runs its accept passes per rows x tokens bucket (captured up to ACCEPT_TOKENS; more
tokens than a captured pass takes go in several passes, _accept_span), then the captured expansion.

One propose call without new sequences: the host packs one int64 block [B, L + 5] (new tokens, length,
count, slot, keep, depth) and gathers the new tokens' features into [B, L, 3H] on the device; one replay; the
host reads the [B, 4, N] tree block. After a verify, launch_after instead builds those two inputs on the
device from the verify's acceptance (common.engine.base.Accepted), padded to L = steps + 1 new tokens, and
queues the replay behind the verification: the host reads the trees once (read_after), not the tokens first.
A batch with a sampling row (the q rule) also sends each row's temperature and seed: its children's draws
are hashed on the device from the seed and the committed length (common.kernels.sampling), in the variant
captured for it.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import time
from collections.abc import Iterator

import numpy as np
import torch

from common import kernels, validate
from common.config import DraftingConfig, SamplingConfig
from common.engine.base import Accepted, Chained, ProposeAfter, ProposeInput, Steps, StepTime, finish
from common.engine.cuda_graphs import CudaGraphManager, GraphConfig, batch_buckets_for
from common.engine.draft_parts import (  # noqa: F401 - callers import these from here too
    ACCEPT_TOKENS,
    AfterVerify,
    Children,
    DraftOut,
    DraftSeq,
    Frontier,
    Root,
    _children,
    accept_block,
    accept_span,
    expand_block,
    gather_index,
    noise_block,
    trees_of,
)
from common.errors import CapacityExhausted, InvalidRequest, UnknownSequence
from common.kernels import reference
from common.model.eagle3 import Eagle3Head
from common.model.llama import Batch, KVCache
from common.sampling import DRAFT_SALT, sequence_seed
from common.slots import SlotTable, check_unique
from common.tree import Tree

log = logging.getLogger(__name__)


class Eagle3Drafter:
    name = "eagle3"

    def __init__(
        self,
        head: Eagle3Head,
        embed: torch.nn.Embedding,
        drafting: DraftingConfig,
        max_sequences: int,
        max_context: int,
        device: torch.device | str,
        graphs: bool = False,
        graph_cfg: GraphConfig | None = None,
    ) -> None:
        self.head, self.embed, self.drafting = head, embed, drafting
        self.device = torch.device(device)
        head.fuse()  # fused q|k|v and gate|up weights, built before any CUDA graph capture
        c = head.cfg
        k, steps = drafting.top_k, drafting.steps
        self.width = drafting.width  # W
        if self.width > c.draft_vocab_size:
            raise ValueError(f"the draft reads {self.width} tokens per node; its vocabulary has {c.draft_vocab_size}")
        self.scratch = (steps - 1) * k
        self.max_new = steps + 1  # committed tokens per round: at most the tree's depth plus the bonus
        self.tree_size = drafting.verify_tree_size
        self.max_context = max_context
        # a spare slot for batch padding rows; headroom so padded accept rows and scratch stay in the slot
        self.trash_slot = max_sequences
        dtype = next(head.parameters()).dtype
        self.cache = KVCache.allocate(
            1,
            max_sequences + 1,
            max_context + self.scratch + 1 + self.max_new,
            c.num_kv_heads,
            c.head_dim,
            dtype,
            self.device,
        )
        self.rope_len = head.rope_cos.shape[0]
        self.feature_dim = 3 * c.target_hidden_size
        self.seqs: SlotTable[DraftSeq] = SlotTable(max_sequences)
        # 0, 1, ... [capacity]: the steps slice it (a view) where they would launch an arange
        self._arange = torch.arange(max(self.cache.capacity, max_sequences + 1), device=self.device)
        with torch.inference_mode():  # base-model embeddings of the draft vocabulary [Vd, H]
            self._draft_embed = self.embed(head.to_base_ids(torch.arange(c.draft_vocab_size, device=self.device)))
        self._d2t = head.d2t.cpu().numpy()  # [Vd] draft id -> base id offsets, for q on the host
        gc = graph_cfg or GraphConfig()
        self.graphs = CudaGraphManager.for_engine(self.device, "drafter", graphs, gc)
        self.batch_buckets = batch_buckets_for(max_sequences, gc.batch_buckets)
        self.depth_buckets = tuple(sorted({d for d in gc.depth_buckets if d <= steps} | {steps}))
        # a round's accept pass over prompts or many tokens (joiners, catch-ups, a tree after plain rounds):
        # tokens buckets as the verifier's prefill, at most ACCEPT_TOKENS rows x tokens a graph
        self.accept_buckets = tuple(sorted(t for t in gc.prefill_buckets if t < max_context))
        if self.graphs.enabled:
            self._capture()

    def _capture(self) -> None:
        with torch.inference_mode(), self.graphs.on_stream():
            for bb in sorted(self.batch_buckets, reverse=True):
                for depth, sampled in self._variants():
                    propose = functools.partial(self._propose_step, depth=depth)
                    noise = noise_block(bb) if sampled else {}
                    for length in range(self.max_new, 0, -1):
                        packed, hidden = self._accept_block(bb, length), self._hidden_block(bb, length)
                        self.graphs.capture(
                            ("propose", bb, length, depth, sampled),
                            propose,
                            {"packed": packed, "hidden": hidden, **noise},
                        )
                    root = self._accept_step(
                        self._accept_block(bb, 1).to(self.device),
                        self._hidden_block(bb, 1).to(self.device),
                        self._width(sampled),
                    )
                    self.graphs.capture(
                        ("expand", bb, depth, sampled),
                        functools.partial(self._expand_step, depth=depth),
                        {
                            "packed": self._expand_block(bb),
                            "root_hidden": root.hidden,
                            "root_logp": root.logp,
                            "root_ids": root.ids,
                            **noise,
                        },
                    )
            for lb in sorted(self.accept_buckets, reverse=True):  # top-k rows only (the common case)
                for bb in [b for b in sorted(self.batch_buckets, reverse=True) if b * lb <= ACCEPT_TOKENS]:
                    step = functools.partial(self._accept_step, width=self._width(False))
                    block = {"packed": self._accept_block(bb, lb), "hidden": self._hidden_block(bb, lb)}
                    self.graphs.capture(("accept", bb, lb, self._width(False)), step, block)
            self._warm_accept_inputs()
        self.graphs.log_report()

    def _warm_accept_inputs(self) -> None:
        """One accept_inputs of each kind (a first launch behind a verify, a chained one) on a one-row block:
        launch_after runs it between replays, and its kernel's compile (or its load from Triton's cache) belongs to
        start-up, not to the first chained round (and the policy's cost sample of it)."""
        length = self.max_new
        packed = self._accept_block(1, length).to(self.device)  # [1, L + 5]
        hidden = self._hidden_block(1, length).to(self.device)  # [1, L, 3H]
        result = torch.zeros((1, length + 1), dtype=torch.int64, device=self.device)  # [1, T + 1] nothing accepted
        kept = hidden[:, :1].clone()  # [1, 1, 3H] the root's features
        took, m, _ = kernels.accept_inputs(packed, hidden, result, kept, None, length)
        kernels.accept_inputs(packed, hidden, result, kept, (m, took), length)

    def _variants(self) -> list[tuple[int, bool]]:
        """(depth bucket, sampled) of the captured steps, deepest first: top-k trees at every depth bucket;
        under the q rule, batches with a sampling row at the drafter's depth alone (rows of shallower trees
        mask their deeper candidates), which halves what sampling adds to capture."""
        greedy = [(d, False) for d in sorted(self.depth_buckets, reverse=True)]
        return ([(self.drafting.steps, True)] if self.drafting.sampling_rule == "q" else []) + greedy

    def release(self, seq_ids: list[str]) -> int:
        return sum(self.seqs.release(s) for s in seq_ids)

    @torch.inference_mode()
    def step_costs(self) -> list[StepTime]:
        """Seconds of a propose (the accept pass over 2 new tokens, then the expansion) per batch bucket
        and depth bucket, on all-padding blocks in the trash slot: graph replays on a GPU, eager steps
        of batch 1 on a CPU (see Verifier.step_costs)."""
        cpu = self.device.type == "cpu"
        out = []
        for bb in self.batch_buckets[:1] if cpu else self.batch_buckets:
            for depth in self.depth_buckets:
                inputs = {"packed": self._accept_block(bb, 2), "hidden": self._hidden_block(bb, 2)}
                step = functools.partial(self._propose_step, depth=depth)
                t = self.graphs.seconds(("propose", bb, 2, depth, False), step, inputs)
                out.append(StepTime("propose", bb, depth, t))
        return out

    # ---- step functions (eager on CPU, captured on a GPU) ----
    def _width(self, sampled: bool) -> int:
        """Draft tokens read per node: W for a batch with sampling rows (q), top_k for top-k trees alone (the
        top-k kernel's cost grows with it: 32 rounds of argmax instead of 10 at the defaults)."""
        return self.width if sampled else self.drafting.top_k

    def _accept_step(self, packed: torch.Tensor, hidden: torch.Tensor, width: int) -> Root:
        """Append each sequence's new (feature, token) pairs and return the head's output at the last.
        packed [B, L + 5]: columns [0, L) new token ids, L the length m before, L + 1 the count k of new
        tokens, L + 2 the slot, L + 3 nodes to keep and L + 4 the tree's depth (both read by _expand_step);
        hidden [B, L, 3H].
        Rows past k are padding: they write scratch positions (clamped into the slot) and are not read.
        width: the root's tokens read (_width)."""
        length = packed.shape[1] - 5
        ids = packed[:, :length]  # [B, L]
        m, new, slots = packed[:, length], packed[:, length + 1], packed[:, length + 2]  # [B] each
        offs = self._arange[:length]  # [L]
        pos = m[:, None] + offs[None, :]  # [B, L]
        causal = offs[None, :] <= offs[:, None]  # [L, L]
        batch = Batch(
            input_ids=ids,
            positions=pos.clamp(max=self.rope_len - 1),
            slots=slots,
            write_pos=pos.clamp(max=self.cache.capacity - 1),
            prefix_len=m,
            window=causal[None].expand(packed.shape[0], length, length),
        )
        out = self.head.top_k(self.embed(ids), hidden, batch, self.cache, width)
        rows = self._arange[: packed.shape[0]]
        last = (new - 1).clamp(min=0)
        return Root(hidden=out.hidden[rows, last], logp=out.logp[rows, last], ids=out.ids[rows, last])

    def _expand_step(
        self,
        packed: torch.Tensor,
        root_hidden: torch.Tensor,
        root_logp: torch.Tensor,
        root_ids: torch.Tensor,
        temp: torch.Tensor | None = None,
        seed: torch.Tensor | None = None,
        depth: int | None = None,
    ) -> DraftOut:
        """EAGLE-2: K children per expanded node (_children: the top-K, or K drawn from q), expand the K
        best of each level by cumulative score for `depth` levels (None: the drafter's steps), and keep
        the best `keep` nodes of at most the row's depth. packed [B, 4]: committed length m (the draws'
        counter), slot, keep, the row's depth; root_* as Root; temp, seed [B] as _children. Returns
        DraftOut: [B, 4, N] float64 base token ids, parents (re-indexed, -1 = root), draft probabilities
        given the parent and q rows of the N best nodes (one D2H copy; int64 ids are exact), and q of the
        root and every expanded node. temp and seed None (a batch where no row samples): top-k children
        only, no q (q_ids and q_probs [B, 0, W], q rows -1), no draws."""
        k, scratch = self.drafting.top_k, self.scratch
        sampled = temp is not None
        steps = depth or self.drafting.steps
        bb, dev = packed.shape[0], packed.device
        m, slots, keep, row_depth = packed[:, 0], packed[:, 1], packed[:, 2], packed[:, 3]  # [B] each
        c = k + (steps - 1) * k * k  # candidates: K at depth 1, K * K a level below
        # ids, cumulative scores, log q of the draw, parents' creation indices (-1: the root), each [B, C]
        cand = (
            torch.empty(bb, c, dtype=torch.long, device=dev),
            torch.empty(bb, c, device=dev),
            torch.empty(bb, c, device=dev),
            torch.empty(bb, c, dtype=torch.long, device=dev),
        )
        # RoPE positions [B, steps] (depth d at m + d - 1) and cache positions [B, S] of the scratch entries
        # (node j of depth d in entry (d - 1) K + j), sliced per level
        positions = (m[:, None] + self._arange[None, :steps]).clamp(max=self.rope_len - 1)
        write_pos = m[:, None] + self._arange[None, :scratch]
        kids = _children(root_logp[:, None], root_ids[:, None], temp, seed, m, 0, k)
        q_ids, q_probs = [root_ids[:, None]], [kids.q]  # [B, 1 + levels * K, W] once concatenated
        fronts = []  # creation indices of each level's expanded nodes, [B, K] each
        root = kernels.draft_level(
            kids.ids,
            kids.score,
            kids.logq,
            None,
            None,
            root_hidden[:, None, :],
            None,
            self._draft_embed,
            cand,
            offset=0,
            created=0,
            own_base=0 if steps > 1 else None,
            scratch=scratch,
        )
        front = Frontier(*root) if root is not None else None
        for depth in range(1, steps):
            batch = Batch(
                input_ids=front.tok,  # draft ids; the head reads only the embeddings
                positions=positions[:, depth - 1 : depth].expand(bb, k),
                slots=slots,
                write_pos=write_pos[:, (depth - 1) * k : depth * k],
                prefix_len=m,
                window=front.anc,
            )
            out = self.head.top_k(front.embeds, front.hidden, batch, self.cache, self._width(sampled))
            kids = _children(out.logp, out.ids, temp, seed, m, depth, k)
            fronts.append(front.id)
            q_ids.append(out.ids)
            q_probs.append(kids.q)
            offset = k + (depth - 1) * k * k
            nxt = kernels.draft_level(
                kids.ids,
                kids.score,
                kids.logq,
                front.score,
                front.id,
                out.hidden,
                front.anc,
                self._draft_embed,
                cand,
                offset=offset,
                created=offset,
                own_base=depth * k if depth < steps - 1 else None,
                scratch=scratch,
            )
            front = Frontier(*nxt) if nxt is not None else front
        n = min(self.tree_size, c)
        drawn = None
        if sampled:  # sampling rows' probabilities are their draws', and the kept nodes name their q rows
            fronts = torch.stack(fronts, 1).view(bb, -1) if fronts else cand[3][:, :0]  # [B, (steps - 1) K]
            drawn = reference.Drawn(logq=cand[2], temperature=temp, fronts=fronts)
        tree, _ = kernels.select_tree(cand[0], cand[1], cand[3], self.head.d2t, keep, row_depth, k, n, drawn)
        if not sampled:
            none = torch.empty(bb, 0, self.width, device=dev)
            return DraftOut(tree=tree, q_ids=none.long(), q_probs=none)
        return DraftOut(tree=tree, q_ids=torch.cat(q_ids, 1), q_probs=torch.cat(q_probs, 1))

    def _propose_step(
        self,
        packed: torch.Tensor,
        hidden: torch.Tensor,
        temp: torch.Tensor | None = None,
        seed: torch.Tensor | None = None,
        depth: int | None = None,
    ) -> DraftOut:
        """A whole round's drafting: the accept pass, then the expansion from its root. packed and hidden
        as _accept_step, temp, seed and depth as _expand_step; returns _expand_step's DraftOut."""
        length = packed.shape[1] - 5
        root = self._accept_step(packed, hidden, self._width(temp is not None))
        m_after = packed[:, length] + packed[:, length + 1]
        expand = torch.stack((m_after, packed[:, length + 2], packed[:, length + 3], packed[:, length + 4]), dim=1)
        return self._expand_step(expand, root.hidden, root.logp, root.ids, temp, seed, depth)

    # ---- host side ----
    def _accept_block(self, b: int, length: int) -> torch.Tensor:
        return accept_block(b, length, self.trash_slot)

    def _hidden_block(self, b: int, length: int) -> torch.Tensor:
        return torch.zeros(b, length, self.feature_dim, dtype=self.cache.kv.dtype)

    def _new_seq(self, it: ProposeInput) -> DraftSeq:
        """A sequence's draft state: under the q rule its sampling and a seed apart from the verifier's
        (common.sampling.sequence_seed); else greedy (the top-k tree)."""
        s: SamplingConfig = it.sampling if self.drafting.sampling_rule == "q" else SamplingConfig()
        return DraftSeq(length=0, sampling=s, seed=0 if s.greedy else sequence_seed(s.seed, DRAFT_SALT))

    def _expand_block(self, b: int) -> torch.Tensor:
        return expand_block(b, self.trash_slot)

    def _depth(self, it: ProposeInput) -> int:
        """Levels a sequence's tree has: its max_depth (0: the drafter's steps)."""
        return it.max_depth or self.drafting.steps

    def _keep(self, it: ProposeInput) -> int:
        """Nodes a sequence's tree keeps: its max_nodes (0: the drafter's verify_tree_size), at most that
        and at most what its depth drafts (top_k per level: 10 at depth 1, 110 at depth 2 for K = 10)."""
        k, d = self.drafting.top_k, self._depth(it)
        return min(it.max_nodes or self.tree_size, self.tree_size, k + (d - 1) * k * k)

    def _pack(
        self, items: list[ProposeInput], bb: int, length: int, start: int = 0
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The accept inputs of items padded to bb rows and L new tokens: packed [bb, L + 5] (host) and
        hidden [bb, L, 3H] (on the device, one gather of the items' rows). start: the pass takes each item's
        new tokens from there on (an accept pass in several, _run_with_prompts), after the start it wrote
        before; an item with none left there is all padding.
        Example: items with 2 and 1 new tokens, L = 3 -> hidden rows [[h0, h1, 0], [h2, 0, 0], ...]."""
        block = self._accept_block(bb, length)
        a = block.numpy()
        counts = []  # new tokens of each item in this pass
        for i, it in enumerate(items):
            slot, st = self.seqs.get(it.seq_id)
            k = max(0, min(length, len(it.token_ids) - start))
            a[i, :k] = it.token_ids[start : start + k]
            a[i, length:] = (st.length + start, k, slot, self._keep(it), self._depth(it))
            counts.append(k)
        dtype = self.cache.kv.dtype
        parts = [it.hidden[start : start + k].to(device=self.device, dtype=dtype) for it, k in zip(items, counts)]
        rows = torch.cat(parts)
        rows = torch.cat((rows, rows.new_zeros(1, rows.shape[1])))  # [sum k + 1, 3H]
        src = self.graphs.to_device(torch.from_numpy(gather_index(counts, bb, length)))  # [bb, L]
        hidden = rows.index_select(0, src.view(-1)).view(bb, length, -1)
        return block, hidden

    def _accept_span(self, rows: int, longest: int) -> int:
        return accept_span(rows, longest, self.accept_buckets, self.graphs.pad)

    def _check(self, items: list[ProposeInput]) -> None:
        for it in items:
            _, st = self.seqs.get(it.seq_id)
            k = len(it.token_ids)
            validate.hidden_rows(it.hidden, self.feature_dim, k, f"sequence {it.seq_id!r}")
            if not 0 <= it.max_depth <= self.drafting.steps:
                raise InvalidRequest(f"max_depth must be in [0, {self.drafting.steps}], got {it.max_depth}")
            if st.length + k > self.max_context:
                raise CapacityExhausted(f"sequence {it.seq_id!r} is at the end of the draft context")

    def propose(self, items: list[ProposeInput]) -> list[Tree]:
        return finish(self.propose_steps(items))

    @torch.inference_mode()
    def launch_after(
        self, items: list[ProposeAfter], accepted: Accepted, after: AfterVerify | None = None
    ) -> AfterVerify | None:
        """The items' next trees queued on the device behind the verify whose acceptance this is (row i of
        accepted: items[i]), the host reading none of it: its tokens and features become the accept pass's inputs
        there (padded to steps + 1 new tokens), then the propose step's replay (common.engine.base.Drafter);
        rows that sample draw their children on the device (the sampled variant, at the drafter's depth). None,
        with nothing queued, when a sequence is unknown or too near the end of the draft context: the caller
        proposes from the verify's outputs. On a GPU, called on the caller's stream: the drafting waits for the
        work queued there, the caller does not wait for it. after: the launch whose trees this verify verified
        (a chained round): the lengths follow from it on the device; it is settled (settle_after) before this
        one is read."""
        b, length = len(items), self.max_new
        if accepted.kept.shape[1] > length:  # trees deeper than this drafter drafts (not its own): more new tokens
            return None
        ahead = 0 if after is None else after.ahead + self.max_new  # tokens the host has not counted yet, at most
        # a chained launch over the rows of the launch before it: its key, host columns and noise stand (the graph's
        # input buffers hold them; accept_inputs rewrites the rest in place), no row lookup and no copy
        reuse = after is not None and after.items is items
        if reuse:
            key, noise, lengths, sampled = after.key, after.noise, after.lengths, after.sampled
            depth, keep_max = after.chained.depth, after.chained.keep_max
        else:
            states = []
            for it in items:
                try:
                    states.append(self.seqs.get(it.seq_id))
                except UnknownSequence:
                    return None
                if not 0 <= it.max_depth <= self.drafting.steps:
                    raise InvalidRequest(f"max_depth must be in [0, {self.drafting.steps}], got {it.max_depth}")
            lengths = np.fromiter((st.length for _, st in states), dtype=np.int64, count=b)  # [B]
            bb = self.graphs.bucket(b, self.batch_buckets)
            noise = noise_block(bb, [st for _, st in states])
            depth = self.graphs.bucket(max(self._depth(it) for it in items), self.depth_buckets)
            depth = self.drafting.steps if noise else depth  # sampled variants: the drafter's depth only
            key = ("propose", bb, length, depth, bool(noise))
            keeps = [self._keep(it) for it in items]
            keep_max = max(keeps)
            sampled = [i for i, (_, st) in enumerate(states) if noise and not st.sampling.greedy]
        if (lengths + ahead + self.max_new > self.max_context).any():
            return None
        t0 = time.perf_counter()
        with self.graphs.after_caller() as stream:
            for t in (accepted.result, accepted.kept):  # made on the verifier's stream, read on this one
                if stream is not None:
                    t.record_stream(stream)
            start = self.graphs.event()
            packed, hidden = after.inputs if reuse else self._after_inputs(key, bb, states, lengths, keeps, items)
            lengths_ahead = None if after is None else (after.m, after.took)  # what the host has not counted yet
            took, m, keep = kernels.accept_inputs(packed, hidden, accepted.result, accepted.kept, lengths_ahead, length)
            step = functools.partial(self._propose_step, depth=depth)
            out = self.graphs.run(key, step, {"packed": packed, "hidden": hidden, **noise})
            tree = out.tree[:b].clone()  # outlives the next replay
            q = self._q_rows(out, sampled)
            tokens, parents = tree[:, 0], tree[:, 1]  # [b, N] each, for a chained verify (views: no launch)
            done = self.graphs.event()
        kids = min(self.drafting.top_k, keep_max)  # a node's children: at most top_k, and the tree's nodes
        chained = Chained(tokens, parents, keep, keep_max, depth, done, kids)  # depth: a bound
        wall = time.perf_counter() - t0
        inputs = (packed, hidden)
        return AfterVerify(
            items, tree, took, m, ahead, chained, sampled, q, start, done, wall, key, inputs, noise, lengths
        )

    def _after_inputs(
        self, key: tuple, bb: int, states: list, lengths: np.ndarray, keeps: list[int], items: list[ProposeAfter]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """A first launch's accept inputs (packed [BB, L + 5], hidden [BB, L, 3H]) where its graph reads them, or
        with no graph in new tensors, the host's columns written (length, slot, keep, depth; through pinned memory:
        CudaGraphManager.to_device); accept_inputs writes the verify's tokens and features."""
        length, b = self.max_new, len(items)
        block = self._accept_block(bb, length)
        a = block.numpy()  # [bb, L + 5]: the host's columns; the tokens and their count come from the device
        a[:b, length] = lengths
        a[:b, length + 2] = [slot for slot, _ in states]
        a[:b, length + 3] = keeps
        a[:b, length + 4] = [self._depth(it) for it in items]
        static = self.graphs.inputs(key)
        if static is None:
            hidden = torch.empty((bb, length, self.feature_dim), dtype=self.cache.kv.dtype, device=self.device)
            return self.graphs.to_device(block), hidden
        return self.graphs.to_device(block, out=static["packed"]), static["hidden"]

    def settle_after(self, launched: AfterVerify) -> None:
        """A launch whose trees a chained round verified (the host never read them): its sequences count the
        tokens it took (read_after does so for the launch the host reads)."""
        for it, took in zip(launched.items, launched.took.tolist()):
            self.seqs.get(it.seq_id)[1].length += took

    def read_after(self, launched: AfterVerify, rows: list[int]) -> list[Tree]:
        return finish(self.read_after_steps(launched, rows))

    def read_after_steps(self, launched: AfterVerify, rows: list[int]) -> Steps[list[Tree]]:
        """The trees of `rows` of a launch_after (in that order) once the device is done: those rows' sequences
        now hold the verify's tokens (a row not read is as if never proposed: its sequence stopped). Each
        launch is read once."""
        if launched.done is not None:
            yield launched.done
        tree, took = launched.tree.cpu().numpy(), launched.took.tolist()
        states = [self.seqs.get(launched.items[r].seq_id)[1] for r in rows]
        q = None if launched.q is None else tuple(t.cpu().numpy() for t in launched.q)
        sampled = [j for j, r in enumerate(rows) if r in launched.sampled]  # among the rows read
        if q is not None:  # q's rows: those of launched.sampled -> those of `sampled`
            at = [launched.sampled.index(rows[j]) for j in sampled]
            q = (q[0][at], q[1][at])
        trees = trees_of(tree[rows], [self._keep(launched.items[r]) for r in rows], sampled, q, self._d2t)
        for r, st in zip(rows, states):
            st.length += took[r]
        return trees

    @contextlib.contextmanager
    def _taking(self, items: list[ProposeInput]) -> Iterator[None]:
        """A call over the items' new tokens: start items acquire their slots (released again when the call
        fails), the items are checked, and each sequence counts its new tokens once the call is through."""
        check_unique([it.seq_id for it in items])
        started = [it.seq_id for it in items if it.start]
        for it in items:
            if it.start:
                self.seqs.acquire(it.seq_id, self._new_seq(it))
        try:
            self._check(items)
            yield
        except BaseException:
            for s in started:
                self.seqs.release(s)
            raise
        for it in items:
            self.seqs.get(it.seq_id)[1].length += len(it.token_ids)

    @torch.inference_mode()  # a generator: torch enters the mode at each resume
    def propose_steps(self, items: list[ProposeInput]) -> Steps[list[Tree]]:
        """propose as steps: the drafting is launched, then (on a GPU) the call yields until it is done,
        then reads the trees."""
        with self._taking(items):
            with self.graphs.on_stream():
                res, noise = self._launch(items)
            yield from self.graphs.launched()
            with self.graphs.on_stream():
                trees = self._read(items, res, noise)
        return trees

    @torch.inference_mode()
    def take(self, items: list[ProposeInput]) -> bool:
        """Sequences taken in without a tree (common.engine.base.Drafter.take): their accept passes queued on the
        device behind the caller's work (the prefill that made their features), the host waiting for none of it;
        each one's first tree is drafted behind its first verify (launch_after)."""
        with self._taking(items), self.graphs.after_caller() as stream:
            if stream is not None:  # made on the caller's stream, read on this one after the caller drops them
                for it in items:
                    it.hidden.record_stream(stream)
            self._accept_passes(items, self._width(False), roots=False)
        return True

    def _launch(self, items: list[ProposeInput]) -> tuple[DraftOut, dict[str, torch.Tensor]]:
        """The round's drafting queued on the device -> (its outputs, the sampling noise block: empty when
        every sequence is greedy)."""
        bb = self.graphs.bucket(len(items), self.batch_buckets)
        length = max(len(it.token_ids) for it in items)
        noise = noise_block(bb, [self.seqs.get(it.seq_id)[1] for it in items])
        depth = self.graphs.bucket(max(self._depth(it) for it in items), self.depth_buckets)
        depth = self.drafting.steps if noise else depth  # sampled variants: the drafter's depth only
        if not any(it.start for it in items) and length <= self.max_new:
            packed, hidden = self._pack(items, bb, length)
            step = functools.partial(self._propose_step, depth=depth)
            key = ("propose", bb, length, depth, bool(noise))
            return self.graphs.run(key, step, {"packed": packed, "hidden": hidden, **noise}), noise
        return self._run_with_prompts(items, bb, depth, noise), noise

    def _read(self, items: list[ProposeInput], res: DraftOut, noise: dict[str, torch.Tensor]) -> list[Tree]:
        """The trees of a launched round (its outputs on the host)."""
        b = len(items)
        sampled = [i for i in range(b) if noise and noise["temp"][i] > 0]
        q = self._q_rows(res, sampled)
        q = None if q is None else (q[0].cpu().numpy(), q[1].cpu().numpy())
        return trees_of(res.tree[:b].cpu().numpy(), [self._keep(it) for it in items], sampled, q, self._d2t)

    def _q_rows(self, res: DraftOut, sampled: list[int]) -> tuple[torch.Tensor, torch.Tensor] | None:
        """q_ids and q_probs [len(sampled), Q, W] of the sampled rows, copied on the device (None: none)."""
        if not sampled:
            return None
        rows = torch.tensor(sampled, device=res.q_ids.device)
        return res.q_ids.index_select(0, rows), res.q_probs.index_select(0, rows)

    def _run_with_prompts(
        self, items: list[ProposeInput], bb: int, depth: int, noise: dict[str, torch.Tensor]
    ) -> DraftOut:
        """A round where sequences start or bring more new tokens than a propose graph takes: their accept
        passes (_accept_passes), then the expansion for everyone."""
        roots = self._accept_passes(items, self._width(bool(noise)), roots=True)
        pad = bb - len(items)
        expand = self._expand_block(bb)
        a = expand.numpy()
        for i, it in enumerate(items):
            slot, st = self.seqs.get(it.seq_id)
            a[i] = (st.length + len(it.token_ids), slot, self._keep(it), self._depth(it))

        def stacked(field: str) -> torch.Tensor:
            rows = torch.stack([getattr(roots[i], field) for i in range(len(items))])
            return torch.cat((rows, rows[:1].expand(pad, *rows.shape[1:]))) if pad else rows

        return self.graphs.run(
            ("expand", bb, depth, bool(noise)),
            functools.partial(self._expand_step, depth=depth),
            {
                "packed": expand,
                "root_hidden": stacked("hidden"),
                "root_logp": stacked("logp"),
                "root_ids": stacked("ids"),
                **noise,
            },
        )

    def _accept_passes(self, items: list[ProposeInput], width: int, roots: bool) -> dict[int, Root]:
        """The items' new tokens through the head in two groups (new sequences over their prompts; the others
        over their new tokens), each padded to a rows and tokens bucket and replayed where captured, in several
        passes of _accept_span tokens when one captured pass cannot take them all (a catch-up of 16 sequences'
        whole contexts). Padded positions are written past a row's tokens (clamped inside the slot) and never
        read before they are rewritten. Returns each item's root (by index) when `roots`, else nothing (take:
        the roots are the verify's to make). The blocks go through CudaGraphManager.to_device: passes of one key
        are queued back to back, nothing waiting between them (take)."""
        out_roots: dict[int, Root] = {}
        step = functools.partial(self._accept_step, width=width)
        for group in ([i for i, it in enumerate(items) if it.start], [i for i, it in enumerate(items) if not it.start]):
            if not group:
                continue
            sub = [items[i] for i in group]
            gb = self.graphs.bucket(len(sub), self.batch_buckets)
            longest = max(len(it.token_ids) for it in sub)
            span = self._accept_span(gb, longest)
            for start in range(0, longest, span):  # each pass attends to the ones before it in the cache
                lb = self.graphs.bucket(min(span, longest - start), self.accept_buckets)
                packed, hidden = self._pack(sub, gb, lb, start)
                packed = self.graphs.to_device(packed)
                out = self.graphs.run(("accept", gb, lb, width), step, {"packed": packed, "hidden": hidden})
                ends = [j for j, it in enumerate(sub) if start < len(it.token_ids) <= start + span]
                if not roots or not ends:
                    continue
                # the rows whose last token was here, copied to outlive the next replay: a slice when they are
                # all of them (one pass, the common case: no indices to send to the device), else a gather
                rows = slice(None, len(sub)) if len(ends) == len(sub) else torch.tensor(ends, device=self.device)
                root = Root(*(t[rows].clone() for t in (out.hidden, out.logp, out.ids)))
                for r, j in enumerate(ends):
                    out_roots[group[j]] = Root(hidden=root.hidden[r], logp=root.logp[r], ids=root.ids[r])
        return out_roots
