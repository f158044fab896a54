"""The EAGLE-3 drafter in PyTorch: accept-token pass over newly committed tokens, then EAGLE-2
dynamic tree expansion, batched over sequences.

Draft KV layout per slot: positions [0, m) hold committed pairs (m equals the base sequence length);
tree expansion writes scratch entries after m, which the next accept pass overwrites.
A depth-d node sits at RoPE position m + d - 1 and is written to scratch slot m + (d-1)*K + j.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import numpy as np
import torch

from common.config import DraftingConfig
from common.engine.base import ProposeInput
from common.errors import CapacityExhausted, InvalidRequest
from common.model.eagle3 import Eagle3Head
from common.model.llama import Batch, KVCache
from common.slots import SlotTable, check_unique
from common.tree import Tree, select_top_nodes

log = logging.getLogger(__name__)


@dataclass
class DraftSeq:
    length: int  # committed pairs in the draft KV cache


@dataclass
class RootState:
    hidden: torch.Tensor  # [B, H] head output at each sequence's last committed pair
    logp: torch.Tensor    # [B, Vd] draft log-probabilities of the root's children


class Eagle3Drafter:
    name = "eagle3"

    def __init__(self, head: Eagle3Head, embed: torch.nn.Embedding, drafting: DraftingConfig,
                 max_sequences: int, max_context: int, device: torch.device) -> None:
        self.head, self.embed, self.drafting, self.device = head, embed, drafting, device
        head.fuse()  # fused q|k|v and gate|up weights, built before any CUDA graph capture
        c = head.cfg
        scratch = (drafting.steps - 1) * drafting.top_k
        dtype = next(head.parameters()).dtype
        self.cache = KVCache.allocate(1, max_sequences, max_context + scratch + 1, c.num_kv_heads, c.head_dim,
                                      dtype, device)
        self.seqs: SlotTable[DraftSeq] = SlotTable(max_sequences)
        self.max_context = max_context

    def release(self, seq_ids: list[str]) -> int:
        return sum(self.seqs.release(s) for s in seq_ids)

    @torch.inference_mode()
    def propose(self, items: list[ProposeInput]) -> list[Tree]:
        check_unique([it.seq_id for it in items])
        for it in items:
            if it.start:
                self.seqs.acquire(it.seq_id, DraftSeq(length=0))
        try:
            root = self._accept(items)
        except BaseException:
            for it in items:
                if it.start:
                    self.seqs.release(it.seq_id)
            raise
        return self._expand(items, root)

    # ---- accept-token pass ----
    def _accept_states(self, items: list[ProposeInput]) -> list[tuple[int, DraftSeq]]:
        """Checks every accept path makes; returns (slot, state) per item."""
        states = [self.seqs.get(it.seq_id) for it in items]
        for it, (_, st) in zip(items, states):
            k = len(it.token_ids)
            if k == 0 or it.hidden.shape[0] != k:
                raise InvalidRequest(f"sequence {it.seq_id!r}: {k} new tokens but {it.hidden.shape[0]} hidden rows")
            if st.length + k > self.max_context:
                raise CapacityExhausted(f"sequence {it.seq_id!r} is at the end of the draft context")
        return states

    def _accept(self, items: list[ProposeInput]) -> RootState:
        """Append each sequence's new (hidden, token) pairs and return the head's output at the last."""
        states = self._accept_states(items)
        t = max(len(it.token_ids) for it in items)
        kv_len = max(st.length for _, st in states) + t
        b = len(items)
        ids = np.zeros((b, t), dtype=np.int64)
        pos = np.zeros((b, t), dtype=np.int64)
        mask = np.zeros((b, 1, t, kv_len), dtype=bool)
        hidden = torch.zeros(b, t, items[0].hidden.shape[-1], device=self.device, dtype=self.cache.k.dtype)
        last = np.zeros(b, dtype=np.int64)
        for i, (it, (_, st)) in enumerate(zip(items, states)):
            k, m = len(it.token_ids), st.length
            ids[i, :k] = it.token_ids
            pos[i] = m + np.arange(t)  # rows past k are padding: causal over the prefix, never read
            mask[i, 0] = np.arange(kv_len)[None, :] <= (m + np.arange(t))[:, None]
            hidden[i, :k] = it.hidden.to(device=self.device, dtype=hidden.dtype)
            last[i] = k - 1
        p = self._t(pos)
        batch = Batch(input_ids=self._t(ids), positions=p, slots=self._slots(states), write_pos=p,
                      mask=torch.from_numpy(mask).to(self.device))
        out = self.head(self.embed(batch.input_ids), hidden, batch, self.cache)
        for it, (_, st) in zip(items, states):
            st.length += len(it.token_ids)
        rows = torch.arange(b, device=self.device)
        li = self._t(last)
        return RootState(hidden=out.hidden[rows, li], logp=out.logp[rows, li])

    # ---- dynamic tree ----
    def _expand(self, items: list[ProposeInput], root: RootState) -> list[Tree]:
        """EAGLE-2: keep top-K children per expanded node, expand the K best of each level by
        cumulative log-probability, and finally keep the best `verify_tree_size` nodes."""
        k, steps = self.drafting.top_k, self.drafting.steps
        states = [self.seqs.get(it.seq_id) for it in items]
        b = len(items)
        m = self._t(np.array([st.length for _, st in states]))  # [B]
        slots = self._slots(states)
        scratch = (steps - 1) * k

        logp, tok = root.logp.topk(k, dim=-1)  # [B, K] depth-1 candidates
        cand_tok, cand_score, cand_parent = [tok], [logp], [torch.full((b, k), -1, device=self.device)]
        front_tok, front_score = tok, logp               # [B, K] nodes expanded next
        front_id = torch.arange(k, device=self.device).expand(b, k)  # creation index of each
        front_hidden = root.hidden[:, None, :].expand(b, k, -1)      # [B, K, H] hidden fed with them
        front_anc = torch.zeros(b, k, scratch, dtype=torch.bool, device=self.device)  # scratch ancestors
        created = k
        kv_len = int(m.max()) + scratch
        prefix = torch.arange(kv_len, device=self.device)[None, None, :] < m[:, None, None]  # [B, 1, K']
        for depth in range(1, steps):
            own = (depth - 1) * k + torch.arange(k, device=self.device)  # [K] scratch slot of each
            anc = front_anc.clone()
            anc[:, torch.arange(k), own] = True
            write = m[:, None] + own[None, :]                     # [B, K]
            scratch_mask = torch.zeros(b, k, kv_len, dtype=torch.bool, device=self.device)
            idx = m[:, None, None] + torch.arange(scratch, device=self.device)[None, None, :]  # [B, 1, S]
            scratch_mask.scatter_(2, idx.expand(b, k, scratch), anc)
            mask = (prefix | scratch_mask)[:, None]               # [B, 1, K, kv_len]
            pos = (m + depth - 1)[:, None].expand(b, k)
            batch = Batch(input_ids=self.head.to_base_ids(front_tok), positions=pos, slots=slots,
                          write_pos=write, mask=mask)
            out = self.head(self.embed(batch.input_ids), front_hidden, batch, self.cache)
            child_logp, child_tok = out.logp.topk(k, dim=-1)      # [B, K, K]
            scores = (front_score[:, :, None] + child_logp).reshape(b, k * k)
            parents = front_id[:, :, None].expand(b, k, k).reshape(b, k * k)
            cand_tok.append(child_tok.reshape(b, k * k))
            cand_score.append(scores)
            cand_parent.append(parents)
            if depth == steps - 1:
                break
            best = scores.topk(k, dim=-1).indices                # [B, K] next level to expand
            src = best // k                                       # which frontier node they hang from
            front_tok = child_tok.reshape(b, k * k).gather(1, best)
            front_score = scores.gather(1, best)
            front_id = created + best
            front_hidden = out.hidden.gather(1, src[:, :, None].expand(b, k, out.hidden.shape[-1]))
            front_anc = anc.gather(1, src[:, :, None].expand(b, k, scratch))
            created += k * k
        toks = self.head.to_base_ids(torch.cat(cand_tok, 1)).cpu().numpy()  # [B, C]
        scores = torch.cat(cand_score, 1).float().cpu().numpy()              # [B, C]
        parents = torch.cat(cand_parent, 1).cpu().numpy()                    # [B, C]
        trees = []
        for i, it in enumerate(items):
            keep = min(it.max_nodes or self.drafting.verify_tree_size, self.drafting.verify_tree_size)
            kept, new_parents = select_top_nodes(scores[i], parents[i], keep)
            parent_score = np.where(parents[i][kept] < 0, 0.0, scores[i][np.maximum(parents[i][kept], 0)])
            probs = np.exp(scores[i][kept] - parent_score).astype(np.float32)
            trees.append(Tree(tokens=toks[i][kept], parents=new_parents, probs=probs))
        return trees

    def _slots(self, states) -> torch.Tensor:
        return torch.tensor([slot for slot, _ in states], device=self.device)

    def _t(self, a: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(np.ascontiguousarray(a, dtype=np.int64)).to(self.device)
