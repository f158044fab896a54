"""Eagle3Drafter with CUDA graphs: the accept-token pass per (batch bucket, new-token bucket 1..steps+1)
and the whole EAGLE-2 tree proposal (every drafting step, top-k, scoring and the final top-N selection)
per batch bucket run as captured graphs. Start (prompt) calls stay eager.

Data flow of one propose call (no start items):
    host  --[B, L + 3] int64 + [B, L, 3H] hidden-->  accept graph (L, B)
          accept graph writes root hidden [B, H] and root log-probs [B, Vd] into the expand graph's inputs
    host  --[B, 3] int64 (length, slot, keep)-->     expand graph (B)
    host  <--[B, 3, N] float64 (tokens, parents, probs)--
The host receives only the final trees; ties in the selection go to the earlier-created node (a parent
before its children), as common.tree.select_top_nodes does. On CPU the same bodies run eagerly.
"""

from __future__ import annotations

import logging

import numpy as np
import torch

from common.config import DraftingConfig
from common.engine.base import ProposeInput
from common.engine.cuda_graphs import CudaGraphManager, GraphConfig, batch_buckets_for, pick_bucket, staging
from common.engine.torch_draft import DraftSeq, Eagle3Drafter
from common.model.eagle3 import Eagle3Head
from common.model.llama import Batch, KVCache
from common.slots import check_unique
from common.tree import Tree

log = logging.getLogger(__name__)


def select_top_nodes_device(scores: torch.Tensor, parents: torch.Tensor, keep: torch.Tensor,
                            n: int) -> tuple[torch.Tensor, torch.Tensor]:
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
    order = torch.sort(scores, dim=1, descending=True, stable=True).indices[:, :n]   # [B, n] best first
    rank = torch.arange(n, device=scores.device)
    key = torch.where(rank[None, :] < keep[:, None], order, order + c)             # kept ones sort first
    kept = torch.sort(key, dim=1).values % c                                        # [B, n] creation order
    position = torch.full((b, c), -1, dtype=torch.long, device=scores.device)       # [B, C]
    position.scatter_(1, kept, rank[None, :].expand(b, n).contiguous())
    par = parents.gather(1, kept)                                                   # [B, n]
    new_parents = torch.where(par < 0, -1, position.gather(1, par.clamp(min=0)))
    return kept, new_parents


class GraphEagle3Drafter(Eagle3Drafter):
    def __init__(self, head: Eagle3Head, embed: torch.nn.Embedding, drafting: DraftingConfig,
                 max_sequences: int, max_context: int, device: torch.device,
                 graph_cfg: GraphConfig | None = None) -> None:
        super().__init__(head, embed, drafting, max_sequences, max_context, device)
        gc = graph_cfg or GraphConfig()
        self.graph_cfg = gc
        self.device = torch.device(device)
        c = head.cfg
        k, steps = drafting.top_k, drafting.steps
        self.scratch = (steps - 1) * k
        self.max_new = steps + 1  # committed tokens per round: at most the tree's depth plus the bonus
        self.num_candidates = drafting.max_candidates()
        self.tree_size = drafting.verify_tree_size
        self.batch_buckets = batch_buckets_for(max_sequences, gc.batch_buckets)
        # a spare slot for batch padding rows; headroom so padded accept rows stay inside their slot
        self.trash_slot = max_sequences
        dtype = self.cache.k.dtype
        self.cache = KVCache.allocate(1, max_sequences + 1, max_context + self.scratch + 1 + self.max_new,
                                      c.num_kv_heads, c.head_dim, dtype, self.device)
        self.kv_len = self.cache.capacity
        self.rope_len = head.rope_cos.shape[0]
        self.feature_dim = 3 * c.target_hidden_size
        self.graphs = CudaGraphManager(self.device, name="drafter", enabled=gc.capture,
                                       warmup_iters=gc.warmup_iters)
        self._stage: dict[tuple, torch.Tensor] = {}
        self._root_hidden: dict[int, torch.Tensor] = {}
        self._root_logp: dict[int, torch.Tensor] = {}
        with torch.inference_mode():
            for bb in self.batch_buckets:
                self._root_hidden[bb] = torch.zeros(bb, c.hidden_size, dtype=dtype, device=self.device)  # [B, H]
                self._root_logp[bb] = torch.zeros(bb, c.draft_vocab_size, device=self.device)  # [B, Vd] f32
                self._register_expand(bb)
                for length in range(1, self.max_new + 1):
                    self._register_accept(bb, length)
            self.graphs.capture_all()

    # ---- accept-token pass ----
    def _register_accept(self, bb: int, length: int) -> None:
        cols = 2 * length + 3
        packed = torch.zeros(bb, cols, dtype=torch.long, device=self.device)  # [B, 2L + 3], layout below
        hidden = torch.zeros(bb, length, self.feature_dim, dtype=self.cache.k.dtype, device=self.device)
        stage = staging((bb, cols), torch.long, self.device)
        self._pad_accept(stage.numpy(), 0, length)
        packed.copy_(stage)
        self._stage[("accept", bb, length)] = stage
        root_hidden, root_logp = self._root_hidden[bb], self._root_logp[bb]

        def body() -> None:
            # packed columns: [0, L) token ids | L: length m before | L + 1: new tokens k | L + 2: slot |
            # [L + 3, 2L + 3): source row of each hidden row (used outside the graph, see _fill_hidden)
            ids = packed[:, :length]                                                        # [B, L]
            m, new, slots = packed[:, length], packed[:, length + 1], packed[:, length + 2]  # [B] each
            pos = m[:, None] + torch.arange(length, device=packed.device)[None, :]          # [B, L]
            mask = torch.arange(self.kv_len, device=packed.device)[None, None, :] <= pos[:, :, None]
            batch = Batch(input_ids=ids, positions=pos.clamp(max=self.rope_len - 1), slots=slots,
                          write_pos=pos, mask=mask[:, None])                                 # mask [B, 1, L, K]
            out = self.head(self.embed(ids), hidden, batch, self.cache)
            rows = torch.arange(bb, device=packed.device)
            last = (new - 1).clamp(min=0)
            root_hidden.copy_(out.hidden[rows, last])
            root_logp.copy_(out.logp[rows, last])

        self.graphs.register(("accept", bb, length), body, {"packed": packed, "hidden": hidden}, size=bb * length)

    def _pad_accept(self, a: np.ndarray, start: int, length: int) -> None:
        """Rows start.. become padding: length 0, one new token, the trash slot, hidden from the zero row."""
        a[start:] = 0
        a[start:, length + 1] = 1
        a[start:, length + 2] = self.trash_slot
        a[start:, length + 3:] = -1

    def _graph_accept(self, items: list[ProposeInput], bb: int, length: int) -> None:
        """Checks as Eagle3Drafter._accept, then the accept graph; the root lands in the expand inputs."""
        states = self._accept_states(items)
        key = ("accept", bb, length)
        stage = self._stage[key]
        a = stage.numpy()  # [bb, 2L + 3]
        offset = 0
        for i, (it, (slot, st)) in enumerate(zip(items, states)):
            k = len(it.token_ids)
            a[i, :length] = 0
            a[i, :k] = it.token_ids
            a[i, length:length + 3] = (st.length, k, slot)
            a[i, length + 3:] = -1
            a[i, length + 3:length + 3 + k] = offset + np.arange(k)
            offset += k
        self._pad_accept(a, len(items), length)
        inputs = self.graphs.inputs(key)
        inputs["packed"].copy_(stage, non_blocking=True)
        self._fill_hidden(inputs["hidden"], inputs["packed"][:, length + 3:], [it.hidden for it in items])
        self.graphs.run(key)
        for it, (_, st) in zip(items, states):
            st.length += len(it.token_ids)

    def _fill_hidden(self, dst: torch.Tensor, src_rows: torch.Tensor, hiddens: list[torch.Tensor]) -> None:
        """dst [B, L, 3H] <- the items' hidden rows, one gather: src_rows [B, L] names the row of the
        concatenated items (-1 = padding, which reads an appended zero row).
        Example: items with 2 and 1 rows, L = 3 -> src_rows [[0, 1, -1], [2, -1, -1]], zero row 3."""
        devices = {h.device for h in hiddens}
        if len(devices) == 1:
            cat = torch.cat(hiddens).to(device=self.device, dtype=dst.dtype)
        else:
            cat = torch.cat([h.to(device=self.device, dtype=dst.dtype) for h in hiddens])
        cat = torch.cat([cat, cat.new_zeros(1, cat.shape[1])])                  # [sum k + 1, 3H]
        idx = torch.where(src_rows < 0, cat.shape[0] - 1, src_rows).reshape(-1)  # [B * L]
        dst.view(-1, dst.shape[-1]).copy_(cat.index_select(0, idx))

    # ---- tree expansion and selection ----
    def _register_expand(self, bb: int) -> None:
        packed = torch.zeros(bb, 3, dtype=torch.long, device=self.device)  # [B, 3] length m, slot, keep
        stage = staging((bb, 3), torch.long, self.device)
        self._pad_expand(stage.numpy(), 0)
        packed.copy_(stage)
        self._stage[("expand", bb)] = stage
        root_hidden, root_logp = self._root_hidden[bb], self._root_logp[bb]
        k, steps, scratch = self.drafting.top_k, self.drafting.steps, self.scratch
        # own[d][j, s] = node j of depth d + 1 sits in scratch entry s  ([steps - 1, K, S]; built here, not
        # in the body, so that capture never meets one_hot's host-side range checks)
        own_slots = torch.arange((steps - 1) * k, device=self.device).view(steps - 1, k)
        own_onehot = torch.zeros(steps - 1, k, max(scratch, 1), dtype=torch.bool, device=self.device)
        own_onehot.scatter_(2, own_slots[:, :, None], True)

        def body() -> torch.Tensor:
            dev = packed.device
            m, slots, keep = packed[:, 0], packed[:, 1], packed[:, 2]                # [B] each
            ar = torch.arange(k, device=dev)                                         # [K]
            logp, tok = root_logp.topk(k, dim=-1)                                    # [B, K] depth 1
            cand_tok, cand_score, cand_parent = [tok], [logp], [torch.full((bb, k), -1, device=dev)]
            front_tok, front_score = tok, logp                                       # [B, K]
            front_id = ar.expand(bb, k)                                              # [B, K] creation index
            front_hidden = root_hidden[:, None, :].expand(bb, k, root_hidden.shape[-1])  # [B, K, H]
            created = k
            if steps > 1:
                front_anc = torch.zeros(bb, k, scratch, dtype=torch.bool, device=dev)    # [B, K, S]
                rel = torch.arange(self.kv_len, device=dev)[None, :] - m[:, None]        # [B, Kv] vs. m
                prefix = (rel < 0)[:, None, :]                                           # [B, 1, Kv]
                in_scratch = ((rel >= 0) & (rel < scratch))[:, None, :]                  # [B, 1, Kv]
                rel_idx = rel.clamp(0, scratch - 1)[:, None, :].expand(bb, k, self.kv_len)  # [B, K, Kv]
            for depth in range(1, steps):
                own = own_slots[depth - 1]                                           # [K] scratch slots
                anc = front_anc | own_onehot[depth - 1][None]                        # [B, K, S]
                # scratch entry s of a sequence sits at cache position m + s:
                # mask[b, j, m + s] = anc[b, j, s]   (gathered over the whole slot, then clipped)
                mask = prefix | (anc.gather(2, rel_idx) & in_scratch)               # [B, K, Kv]
                pos = (m + depth - 1)[:, None].expand(bb, k).clamp(max=self.rope_len - 1)
                ids = self.head.to_base_ids(front_tok)
                batch = Batch(input_ids=ids, positions=pos, slots=slots, write_pos=m[:, None] + own[None, :],
                              mask=mask[:, None])
                out = self.head(self.embed(ids), front_hidden, batch, self.cache)
                child_logp, child_tok = out.logp.topk(k, dim=-1)                     # [B, K, K]
                scores = (front_score[:, :, None] + child_logp).reshape(bb, k * k)   # [B, K*K]
                cand_tok.append(child_tok.reshape(bb, k * k))
                cand_score.append(scores)
                cand_parent.append(front_id[:, :, None].expand(bb, k, k).reshape(bb, k * k))
                if depth == steps - 1:
                    break
                best = scores.topk(k, dim=-1).indices                                # [B, K]
                src = best // k                                                      # frontier parent
                front_tok = child_tok.reshape(bb, k * k).gather(1, best)
                front_score = scores.gather(1, best)
                front_id = created + best
                front_hidden = out.hidden.gather(1, src[:, :, None].expand(bb, k, out.hidden.shape[-1]))
                front_anc = anc.gather(1, src[:, :, None].expand(bb, k, scratch))
                created += k * k
            toks = self.head.to_base_ids(torch.cat(cand_tok, 1))                     # [B, C]
            scores = torch.cat(cand_score, 1).float()                                # [B, C]
            parents = torch.cat(cand_parent, 1)                                      # [B, C]
            kept, new_parents = select_top_nodes_device(scores, parents, keep, self.tree_size)  # [B, N]
            par = parents.gather(1, kept)
            parent_score = torch.where(par < 0, 0.0, scores.gather(1, par.clamp(min=0)))
            probs = torch.exp(scores.gather(1, kept) - parent_score)                 # [B, N]
            # one D2H copy: int64 ids and parents are exact in float64
            return torch.stack((toks.gather(1, kept).double(), new_parents.double(), probs.double()), 1)

        self.graphs.register(("expand", bb), body, {"packed": packed}, size=10_000 + bb)

    def _pad_expand(self, a: np.ndarray, start: int) -> None:
        a[start:] = 0
        a[start:, 1] = self.trash_slot
        a[start:, 2] = 1

    # ---- propose ----
    @torch.inference_mode()
    def propose(self, items: list[ProposeInput]) -> list[Tree]:
        check_unique([it.seq_id for it in items])
        b = len(items)
        bb = pick_bucket(b, self.batch_buckets)
        if bb is None:
            log.warning("propose batch %d has no graph bucket: running it eagerly", b)
            return super().propose(items)
        for it in items:
            if it.start:
                self.seqs.acquire(it.seq_id, DraftSeq(length=0))
        with self.graphs.on_stream():
            try:
                length = max(len(it.token_ids) for it in items)
                if any(it.start for it in items) or length > self.max_new:
                    root = self._accept(items)  # eager (prompts); then hand the root to the expand graph
                    self._root_hidden[bb][:b].copy_(root.hidden)
                    self._root_logp[bb][:b].copy_(root.logp)
                else:
                    self._graph_accept(items, bb, length)
            except BaseException:
                for it in items:
                    if it.start:
                        self.seqs.release(it.seq_id)
                raise
            return self._graph_expand(items, bb)

    def _graph_expand(self, items: list[ProposeInput], bb: int) -> list[Tree]:
        stage = self._stage[("expand", bb)]
        a = stage.numpy()  # [bb, 3]
        keeps = []
        for i, it in enumerate(items):
            slot, st = self.seqs.get(it.seq_id)
            keep = min(it.max_nodes or self.tree_size, self.tree_size)
            keeps.append(keep)
            a[i] = (st.length, slot, keep)
        self._pad_expand(a, len(items))
        out = self.graphs.run(("expand", bb), {"packed": stage})
        res = out[:len(items)].cpu().numpy()  # [B, 3, N]
        trees = []
        for i, keep in enumerate(keeps):
            parents = res[i, 1, :keep].astype(np.int64)
            if (parents >= np.arange(keep)).any():
                raise ValueError("tree selection dropped a parent while keeping its child")
            trees.append(Tree(tokens=res[i, 0, :keep].astype(np.int64), parents=parents,
                              probs=res[i, 2, :keep].astype(np.float32)))
        return trees

