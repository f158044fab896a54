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
of new tokens, 1..steps + 1, and depth bucket) and replayed. A round with a new sequence runs its prompt's accept pass
eagerly (prompt lengths vary), then the captured expansion.

Data flow of one propose call without new sequences:
    host --[B, L + 5] int64 + [B, L, 3H] features--> propose graph --[B, 3, N] float64--> host
(tokens, parents, draft probabilities of the N best nodes per sequence; ties in the selection go to the
earlier-created node, a parent before its children, as common.tree.select_top_nodes does).
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from common import validate
from common.config import DraftingConfig
from common.engine.base import ProposeInput, StepTime
from common.engine.cuda_graphs import CudaGraphManager, GraphConfig, batch_buckets_for
from common.errors import CapacityExhausted, InvalidRequest
from common.model.eagle3 import Eagle3Head
from common.model.llama import Batch, KVCache
from common.slots import SlotTable, check_unique
from common.tree import Tree

log = logging.getLogger(__name__)


@dataclass
class DraftSeq:
    length: int  # committed pairs in the draft KV cache


@dataclass(frozen=True)
class Root:
    """The head's output at each sequence's last committed pair: where the tree grows from."""

    hidden: torch.Tensor  # [B, H] fed back with the depth-1 nodes
    logp: torch.Tensor  # [B, K] the K best draft log-probabilities, descending
    ids: torch.Tensor  # [B, K] their draft-vocabulary ids


def select_top_nodes_device(
    scores: torch.Tensor, parents: torch.Tensor, keep: torch.Tensor, n: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Batched, static-shape common.tree.select_top_nodes.

    scores  [B, C] cumulative log-probabilities in creation order
    parents [B, C] creation index of each candidate's parent, -1 for the root
    keep    [B]    nodes to keep per row (<= n)
    Returns kept [B, n] creation indices and new_parents [B, n] (re-indexed into kept); the first keep[b]
    entries of row b are its tree in creation order, the rest is filler the caller drops.

    Worked example: scores [-0.1, -2.0, -0.5, -0.5], parents [-1, -1, 0, 0], keep 3, n 4
        stable descending sort      order [0, 2, 3, 1]   (ties 2, 3 keep creation order)
        first keep of it are kept   {0, 2, 3};  key = order where rank < keep else order + C
                                    key [0, 2, 3, 5] -> sorted [0, 2, 3, 5] -> kept [0, 2, 3, 1]
        position of each kept node  0 -> 0, 2 -> 1, 3 -> 2
        new_parents                 [-1, 0, 0, ...]
    """
    b, c = scores.shape
    order = torch.sort(scores, dim=1, descending=True, stable=True).indices[:, :n]  # [B, n] best first
    rank = torch.arange(n, device=scores.device)
    key = torch.where(rank[None, :] < keep[:, None], order, order + c)  # kept ones sort first
    kept = torch.sort(key, dim=1).values % c  # [B, n] creation order
    position = torch.full((b, c), -1, dtype=torch.long, device=scores.device)  # [B, C]
    position.scatter_(1, kept, rank[None, :].expand(b, n).contiguous())
    par = parents.gather(1, kept)  # [B, n]
    new_parents = torch.where(par < 0, -1, position.gather(1, par.clamp(min=0)))
    return kept, new_parents


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
        # own[d][j, s] = node j of depth d + 1 sits in scratch entry s  ([steps - 1, K, S]; built here, not
        # in the step, so that capture never meets one_hot's host-side range checks)
        self._own = torch.zeros(max(steps - 1, 1), k, max(self.scratch, 1), dtype=torch.bool, device=self.device)
        self._own.view(-1, max(self.scratch, 1))[torch.arange(self.scratch), torch.arange(self.scratch)] = True
        with torch.inference_mode():  # base-model embeddings of the draft vocabulary [Vd, H]
            self._draft_embed = self.embed(head.to_base_ids(torch.arange(c.draft_vocab_size, device=self.device)))
        gc = graph_cfg or GraphConfig()
        self.graphs = CudaGraphManager.for_engine(self.device, "drafter", graphs, gc)
        self.batch_buckets = batch_buckets_for(max_sequences, gc.batch_buckets)
        self.depth_buckets = tuple(sorted({d for d in gc.depth_buckets if d <= steps} | {steps}))
        if self.graphs.enabled:
            self._capture()

    def _capture(self) -> None:
        with torch.inference_mode(), self.graphs.on_stream():
            for bb in sorted(self.batch_buckets, reverse=True):
                for depth in sorted(self.depth_buckets, reverse=True):
                    propose = functools.partial(self._propose_step, depth=depth)
                    for length in range(self.max_new, 0, -1):
                        packed, hidden = self._accept_block(bb, length), self._hidden_block(bb, length)
                        self.graphs.capture(
                            ("propose", bb, length, depth), propose, {"packed": packed, "hidden": hidden}
                        )
                    root = self._accept_step(
                        self._accept_block(bb, 1).to(self.device), self._hidden_block(bb, 1).to(self.device)
                    )
                    self.graphs.capture(
                        ("expand", bb, depth),
                        functools.partial(self._expand_step, depth=depth),
                        {
                            "packed": self._expand_block(bb),
                            "root_hidden": root.hidden,
                            "root_logp": root.logp,
                            "root_ids": root.ids,
                        },
                    )
        self.graphs.log_report()

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
                t = self.graphs.seconds(("propose", bb, 2, depth), step, inputs)
                out.append(StepTime("propose", bb, depth, t))
        return out

    # ---- step functions (eager on CPU, captured on a GPU) ----
    def _accept_step(self, packed: torch.Tensor, hidden: torch.Tensor) -> Root:
        """Append each sequence's new (feature, token) pairs and return the head's output at the last.
        packed [B, L + 5]: columns [0, L) new token ids, L the length m before, L + 1 the count k of new
        tokens, L + 2 the slot, L + 3 nodes to keep and L + 4 the tree's depth (both read by _expand_step);
        hidden [B, L, 3H].
        Rows past k are padding: they write scratch positions (clamped into the slot) and are not read."""
        length = packed.shape[1] - 5
        ids = packed[:, :length]  # [B, L]
        m, new, slots = packed[:, length], packed[:, length + 1], packed[:, length + 2]  # [B] each
        pos = m[:, None] + torch.arange(length, device=packed.device)[None, :]  # [B, L]
        causal = torch.ones(length, length, dtype=torch.bool, device=packed.device).tril()
        batch = Batch(
            input_ids=ids,
            positions=pos.clamp(max=self.rope_len - 1),
            slots=slots,
            write_pos=pos.clamp(max=self.cache.capacity - 1),
            prefix_len=m,
            window=causal[None].expand(packed.shape[0], length, length),
        )
        out = self.head.top_k(self.embed(ids), hidden, batch, self.cache, self.drafting.top_k)
        rows = torch.arange(packed.shape[0], device=packed.device)
        last = (new - 1).clamp(min=0)
        return Root(hidden=out.hidden[rows, last], logp=out.logp[rows, last], ids=out.ids[rows, last])

    def _expand_step(
        self,
        packed: torch.Tensor,
        root_hidden: torch.Tensor,
        root_logp: torch.Tensor,
        root_ids: torch.Tensor,
        depth: int | None = None,
    ) -> torch.Tensor:
        """EAGLE-2: keep top-K children per expanded node, expand the K best of each level by cumulative
        log-probability for `depth` levels (None: the drafter's steps), and keep the best `keep` nodes
        of at most the row's depth. packed [B, 4]: committed length m, slot, keep, the row's depth;
        root_* as Root. Returns [B, 3, N] float64: base token ids, parents (re-indexed, -1 = root) and
        draft probabilities given the parent of the N best nodes (one D2H copy; int64 ids are exact)."""
        k, scratch = self.drafting.top_k, self.scratch
        steps = depth or self.drafting.steps
        bb, dev = packed.shape[0], packed.device
        m, slots, keep, row_depth = packed[:, 0], packed[:, 1], packed[:, 2], packed[:, 3]  # [B] each
        front_tok, front_score = root_ids, root_logp  # [B, K]
        cand_tok, cand_score = [front_tok], [front_score]
        cand_parent = [torch.full((bb, k), -1, device=dev)]
        cand_depth = [torch.full((k,), 1, device=dev)]
        front_id = torch.arange(k, device=dev).expand(bb, k)  # [B, K] creation index
        front_hidden = root_hidden[:, None, :].expand(bb, k, root_hidden.shape[-1])  # [B, K, H]
        front_anc = torch.zeros(bb, k, max(scratch, 1), dtype=torch.bool, device=dev)  # [B, K, S]
        created = k
        for depth in range(1, steps):
            own = (depth - 1) * k + torch.arange(k, device=dev)  # [K] scratch entries
            anc = front_anc | self._own[depth - 1][None]  # [B, K, S]
            batch = Batch(
                input_ids=front_tok,  # draft ids; the head reads only the embeddings below
                positions=(m + depth - 1)[:, None].expand(bb, k).clamp(max=self.rope_len - 1),
                slots=slots,
                write_pos=m[:, None] + own[None, :],
                prefix_len=m,
                window=anc,
            )
            embeds = F.embedding(front_tok, self._draft_embed)  # one gather: no d2t mapping per level
            out = self.head.top_k(embeds, front_hidden, batch, self.cache, k)
            scores = (front_score[:, :, None] + out.logp).reshape(bb, k * k)  # [B, K*K]
            child_tok = out.ids.reshape(bb, k * k)
            cand_tok.append(child_tok)
            cand_score.append(scores)
            cand_parent.append(front_id[:, :, None].expand(bb, k, k).reshape(bb, k * k))
            cand_depth.append(torch.full((k * k,), depth + 1, device=dev))
            if depth == steps - 1:
                break
            best = scores.topk(k, dim=-1).indices  # [B, K]
            src = best // k  # frontier parent
            front_tok = child_tok.gather(1, best)
            front_score = scores.gather(1, best)
            front_id = created + best
            front_hidden = out.hidden.gather(1, src[:, :, None].expand(bb, k, out.hidden.shape[-1]))
            front_anc = anc.gather(1, src[:, :, None].expand(bb, k, anc.shape[-1]))
            created += k * k
        toks = self.head.to_base_ids(torch.cat(cand_tok, 1))  # [B, C]
        scores = torch.cat(cand_score, 1).float()  # [B, C]
        parents = torch.cat(cand_parent, 1)  # [B, C]
        too_deep = torch.cat(cand_depth)[None, :] > row_depth[:, None]  # [B, C]
        select = scores.masked_fill(too_deep, float("-inf"))  # deeper than the row's tree: never kept
        n = min(self.tree_size, scores.shape[1])
        kept, new_parents = select_top_nodes_device(select, parents, keep, n)  # [B, n]
        par = parents.gather(1, kept)
        parent_score = torch.where(par < 0, 0.0, scores.gather(1, par.clamp(min=0)))
        probs = torch.exp(scores.gather(1, kept) - parent_score)  # [B, N]
        return torch.stack((toks.gather(1, kept).double(), new_parents.double(), probs.double()), 1)

    def _propose_step(self, packed: torch.Tensor, hidden: torch.Tensor, depth: int | None = None) -> torch.Tensor:
        """A whole round's drafting: the accept pass, then the expansion from its root. packed and hidden
        as _accept_step; returns _expand_step's [B, 3, N]."""
        length = packed.shape[1] - 5
        root = self._accept_step(packed, hidden)
        m_after = packed[:, length] + packed[:, length + 1]
        expand = torch.stack((m_after, packed[:, length + 2], packed[:, length + 3], packed[:, length + 4]), dim=1)
        return self._expand_step(expand, root.hidden, root.logp, root.ids, depth)

    # ---- host side ----
    def _accept_block(self, b: int, length: int) -> torch.Tensor:
        """An all-padding accept block [b, L + 5]: length 0, one new token, the trash slot, keep 1, depth 1."""
        a = np.zeros((b, length + 5), dtype=np.int64)
        a[:, length + 1] = 1
        a[:, length + 2] = self.trash_slot
        a[:, length + 3] = 1
        a[:, length + 4] = 1
        return torch.from_numpy(a)

    def _hidden_block(self, b: int, length: int) -> torch.Tensor:
        return torch.zeros(b, length, self.feature_dim, dtype=self.cache.kv.dtype)

    def _expand_block(self, b: int) -> torch.Tensor:
        """An all-padding expand block [b, 4]: length 0, the trash slot, keep 1, depth 1."""
        a = np.zeros((b, 4), dtype=np.int64)
        a[:, 1] = self.trash_slot
        a[:, 2] = 1
        a[:, 3] = 1
        return torch.from_numpy(a)

    def _depth(self, it: ProposeInput) -> int:
        """Levels a sequence's tree has: its max_depth (0: the drafter's steps)."""
        return it.max_depth or self.drafting.steps

    def _keep(self, it: ProposeInput) -> int:
        """Nodes a sequence's tree keeps: its max_nodes (0: the drafter's verify_tree_size), at most that
        and at most what its depth drafts (top_k per level: 10 at depth 1, 110 at depth 2 for K = 10)."""
        k, d = self.drafting.top_k, self._depth(it)
        return min(it.max_nodes or self.tree_size, self.tree_size, k + (d - 1) * k * k)

    def _pack(self, items: list[ProposeInput], bb: int, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The accept inputs of items padded to bb rows and L new tokens: packed [bb, L + 4] (host) and
        hidden [bb, L, 3H] (on the device, one gather of the items' rows).
        Example: items with 2 and 1 new tokens, L = 3 -> hidden rows [[h0, h1, 0], [h2, 0, 0], ...]."""
        block = self._accept_block(bb, length)
        a = block.numpy()
        for i, it in enumerate(items):
            slot, st = self.seqs.get(it.seq_id)
            k = len(it.token_ids)
            a[i, :k] = it.token_ids
            a[i, length:] = (st.length, k, slot, self._keep(it), self._depth(it))
        rows = torch.cat([it.hidden.to(device=self.device, dtype=self.cache.kv.dtype) for it in items])
        rows = torch.cat((rows, rows.new_zeros(1, rows.shape[1])))  # [sum k + 1, 3H]
        src = np.full((bb, length), rows.shape[0] - 1, dtype=np.int64)  # padding: the zero row
        offset = 0
        for i, it in enumerate(items):
            k = len(it.token_ids)
            src[i, :k] = offset + np.arange(k)
            offset += k
        hidden = rows.index_select(0, torch.from_numpy(src).to(self.device).view(-1)).view(bb, length, -1)
        return block, hidden

    def _check(self, items: list[ProposeInput]) -> None:
        for it in items:
            _, st = self.seqs.get(it.seq_id)
            k = len(it.token_ids)
            validate.hidden_rows(it.hidden, self.feature_dim, k, f"sequence {it.seq_id!r}")
            if not 0 <= it.max_depth <= self.drafting.steps:
                raise InvalidRequest(f"max_depth must be in [0, {self.drafting.steps}], got {it.max_depth}")
            if st.length + k > self.max_context:
                raise CapacityExhausted(f"sequence {it.seq_id!r} is at the end of the draft context")

    @torch.inference_mode()
    def propose(self, items: list[ProposeInput]) -> list[Tree]:
        check_unique([it.seq_id for it in items])
        started = [it.seq_id for it in items if it.start]
        for s in started:
            self.seqs.acquire(s, DraftSeq(length=0))
        try:
            self._check(items)
            with self.graphs.on_stream():
                trees = self._run(items)
        except BaseException:
            for s in started:
                self.seqs.release(s)
            raise
        for it in items:
            self.seqs.get(it.seq_id)[1].length += len(it.token_ids)
        return trees

    def _run(self, items: list[ProposeInput]) -> torch.Tensor:
        b = len(items)
        bb = self.graphs.bucket(b, self.batch_buckets)
        length = max(len(it.token_ids) for it in items)
        depth = self.graphs.bucket(max(self._depth(it) for it in items), self.depth_buckets)
        if not any(it.start for it in items) and length <= self.max_new:
            packed, hidden = self._pack(items, bb, length)
            step = functools.partial(self._propose_step, depth=depth)
            res = self.graphs.run(("propose", bb, length, depth), step, {"packed": packed, "hidden": hidden})
        else:
            res = self._run_with_prompts(items, bb, depth)
        return self._trees(res[:b].cpu().numpy(), [self._keep(it) for it in items])

    def _run_with_prompts(self, items: list[ProposeInput], bb: int, depth: int) -> torch.Tensor:
        """A round where sequences start: accept passes in two eager groups (new sequences over their
        prompts; the others over their few new tokens), so that no padded row runs past its slot, then
        the expansion for everyone."""
        roots: dict[int, Root] = {}
        for group in ([i for i, it in enumerate(items) if it.start], [i for i, it in enumerate(items) if not it.start]):
            if group:
                sub = [items[i] for i in group]
                packed, hidden = self._pack(sub, len(sub), max(len(it.token_ids) for it in sub))
                root = self._accept_step(packed.to(self.device), hidden)
                for j, i in enumerate(group):
                    roots[i] = Root(hidden=root.hidden[j], logp=root.logp[j], ids=root.ids[j])
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
            ("expand", bb, depth),
            functools.partial(self._expand_step, depth=depth),
            {
                "packed": expand,
                "root_hidden": stacked("hidden"),
                "root_logp": stacked("logp"),
                "root_ids": stacked("ids"),
            },
        )

    def _trees(self, res: np.ndarray, keeps: list[int]) -> list[Tree]:
        """res [B, 3, N] from _expand_step -> one Tree per sequence with its first keep nodes."""
        trees = []
        for i, keep in enumerate(keeps):
            parents = res[i, 1, :keep].astype(np.int64)
            if (parents >= np.arange(keep)).any():
                raise ValueError("tree selection dropped a parent while keeping its child")
            trees.append(
                Tree(
                    tokens=res[i, 0, :keep].astype(np.int64), parents=parents, probs=res[i, 2, :keep].astype(np.float32)
                )
            )
        return trees
