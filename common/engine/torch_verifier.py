"""The base model in PyTorch: prefill, one-forward tree verification with KV compaction, plain decoding."""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from common.acceptance import Acceptance, accept_greedy, accept_sampled, compaction_plan
from common.config import LlamaConfig, SamplingConfig
from common.engine.base import EngineInfo, PrefillInput, PrefillOutput, VerifyInput, VerifyOutput
from common.errors import CapacityExhausted, InvalidRequest
from common.model.llama import Batch, KVCache, LlamaModel
from common.sampling import target_distribution
from common.slots import SlotTable, check_unique
from common.tree import ancestor_mask, depths
from common.weights import Checkpoint

log = logging.getLogger(__name__)


@dataclass
class VerifierSeq:
    length: int    # tokens whose K/V are in the cache
    pending: int   # last chosen token, not yet in the cache (the next tree's root)
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


class TorchVerifier:
    def __init__(self, ckpt: Checkpoint, cfg: VerifierConfig) -> None:
        self.cfg = cfg
        self.device = torch.device(cfg.device)
        mcfg: LlamaConfig = ckpt.config
        if cfg.max_context + cfg.max_tree_nodes + 1 > mcfg.max_position:
            mcfg = LlamaConfig(**{**mcfg.__dict__, "max_position": cfg.max_context + cfg.max_tree_nodes + 1})
        self.model = LlamaModel(mcfg)
        self.model.load_state_dict(ckpt.state_dict, strict=False)
        self.model.to(device=self.device, dtype=torch_dtype(cfg.dtype)).eval()
        self.model.fuse()  # fused q|k|v and gate|up weights, built before any CUDA graph capture
        # capacity leaves room for one tree beyond the longest allowed sequence
        self.cache = KVCache.allocate(mcfg.num_layers, cfg.max_sequences, cfg.max_context + cfg.max_tree_nodes + 1,
                                      mcfg.num_kv_heads, mcfg.head_dim, torch_dtype(cfg.dtype), self.device)
        self.capacity = self.cache.capacity  # positions a sequence may use: its tokens plus one tree
        self.seqs: SlotTable[VerifierSeq] = SlotTable(cfg.max_sequences)
        self.info = EngineInfo(model=ckpt.name, vocab_size=mcfg.vocab_size, max_context=cfg.max_context,
                               max_sequences=cfg.max_sequences, max_tree_nodes=cfg.max_tree_nodes,
                               dtype=cfg.dtype, device=str(self.device))

    # ---- prefill ----
    @torch.inference_mode()
    def prefill(self, item: PrefillInput) -> PrefillOutput:
        n = len(item.token_ids)
        if n == 0:
            raise InvalidRequest("prompt is empty")
        if n >= self.cfg.max_context:
            raise InvalidRequest(f"prompt has {n} tokens; the context holds {self.cfg.max_context}")
        self._check_tokens(item.token_ids)
        rng = np.random.default_rng(item.sampling.seed)
        slot = self.seqs.acquire(item.seq_id, VerifierSeq(length=0, pending=-1, sampling=item.sampling, rng=rng))
        try:
            pos = torch.arange(n, device=self.device)[None]
            mask = torch.ones(n, n, dtype=torch.bool, device=self.device).tril()[None, None]
            batch = Batch(input_ids=torch.tensor([item.token_ids], device=self.device), positions=pos,
                          slots=torch.tensor([slot], device=self.device), write_pos=pos, mask=mask)
            out = self.model(batch, self.cache)
            logits = self.model.logits(out.hidden[0, -1])  # [V]
            _, state = self.seqs.get(item.seq_id)
            state.length = n
            state.pending = self._choose(logits, state)
            return PrefillOutput(next_token=state.pending, hidden=out.aux[0])
        except BaseException:
            self.seqs.release(item.seq_id)
            raise

    # ---- verification ----
    @torch.inference_mode()
    def verify(self, items: list[VerifyInput]) -> list[VerifyOutput]:
        states, t = self._verify_states(items)
        kv_len = max(st.length for _, st in states) + t
        b = len(items)
        ids = np.zeros((b, t), dtype=np.int64)
        pos = np.zeros((b, t), dtype=np.int64)
        write = np.zeros((b, t), dtype=np.int64)
        mask = np.zeros((b, 1, t, kv_len), dtype=bool)
        for i, (it, (_, st)) in enumerate(zip(items, states)):
            n, size = st.length, it.tree.size
            ids[i, 0], ids[i, 1:size + 1] = st.pending, it.tree.tokens
            pos[i, :size + 1] = n + np.concatenate(([0], depths(it.tree.parents)))
            pos[i, size + 1:] = n  # padding rows: see only the prefix and themselves
            write[i] = n + np.arange(t)
            mask[i, 0, :, :n] = True
            mask[i, 0, :size + 1, n:n + size + 1] = ancestor_mask(it.tree.parents)
            mask[i, 0, np.arange(size + 1, t), n + np.arange(size + 1, t)] = True
        batch = Batch(input_ids=self._t(ids), positions=self._t(pos),
                      slots=torch.tensor([slot for slot, _ in states], device=self.device),
                      write_pos=self._t(write), mask=torch.from_numpy(mask).to(self.device))
        out = self.model(batch, self.cache)
        logits = self.model.logits(out.hidden)  # [B, T, V]
        accs = self._accept(items, states, logits.argmax(-1).cpu().numpy(), lambda i: logits[i])
        return self._finish_verify(states, accs, out.aux)

    def _verify_states(self, items: list[VerifyInput]) -> tuple[list[tuple[int, VerifierSeq]], int]:
        """Checks every verify path makes; returns (slot, state) per item and the rows per tree (root +
        nodes, padded to the largest tree)."""
        check_unique([it.seq_id for it in items])
        states = [self.seqs.get(it.seq_id) for it in items]
        t = 1 + max(it.tree.size for it in items)
        for it, (_, st) in zip(items, states):
            if st.length + t > self.capacity:
                raise CapacityExhausted(f"sequence {it.seq_id!r} has no room for a {t}-row tree "
                                        f"at length {st.length}")
        return states, t

    def _accept(self, items: list[VerifyInput], states, greedy_rows: np.ndarray,
                logits_of: Callable[[int], torch.Tensor]) -> list[Acceptance]:
        """greedy_rows [B, T]: base argmax per tree row. logits_of(i) gives item i's rows of logits [T, V],
        asked for only by sequences that sample."""
        accs = []
        for i, (it, (_, st)) in enumerate(zip(items, states)):
            if st.sampling.greedy:
                accs.append(accept_greedy(it.tree.tokens, it.tree.parents, greedy_rows[i]))
                continue
            rows = logits_of(i)
            accs.append(accept_sampled(it.tree.tokens, it.tree.parents,
                                       lambda r, rows=rows, st=st: target_distribution(rows[r].cpu().numpy(),
                                                                                       st.sampling),
                                       st.rng))
        return accs

    def _finish_verify(self, states, accs: list[Acceptance], aux: torch.Tensor) -> list[VerifyOutput]:
        """One H2D copy of all indices, then one batched KV compaction and one gather of the kept rows.
        aux [B, T, 3H]: the forward's EAGLE features.

        Index layout (worked example: two sequences, slot 3 at length 10 accepting path [1, 3], slot 0 at
        length 5 accepting path [0]):
            keep rows   batch [0 0 0 1 1]  row [0 2 4 0 1]     (root, then node p at row p + 1)
            KV moves    slot [3 3]  src [12 14]  dst [11 12]   (sequence 2's path is already compact)
        """
        batch_idx, row_idx, counts = [], [], []
        move_slot, move_src, move_dst = [], [], []
        for i, ((slot, st), acc) in enumerate(zip(states, accs)):
            rows = [0] + [p + 1 for p in acc.path]
            batch_idx += [i] * len(rows)
            row_idx += rows
            counts.append(len(rows))
            move = compaction_plan(acc.path, st.length)
            move_slot += [slot] * len(move.src)
            move_src += move.src
            move_dst += move.dst
        nk, nm = len(row_idx), len(move_src)
        idx = self._t(np.array(batch_idx + row_idx + move_slot + move_src + move_dst, dtype=np.int64))
        if nm:
            sl, src, dst = idx[2 * nk:2 * nk + nm], idx[2 * nk + nm:2 * nk + 2 * nm], idx[2 * nk + 2 * nm:]
            # gather everything first, then scatter: later sources lie beyond earlier destinations
            # (common.acceptance.compaction_plan), so this equals copying one by one
            self.cache.k[:, sl, dst] = self.cache.k[:, sl, src].clone()
            self.cache.v[:, sl, dst] = self.cache.v[:, sl, src].clone()
        kept = aux[idx[:nk], idx[nk:2 * nk]]  # [sum(num_accepted + 1), 3H], a fresh tensor
        results = []
        for (_, st), acc, hidden in zip(states, accs, torch.split(kept, counts)):
            st.length += 1 + acc.num_accepted
            st.pending = acc.tokens[-1]
            results.append(VerifyOutput(tokens=acc.tokens, hidden=hidden))
        return results

    # ---- plain decoding ----
    @torch.inference_mode()
    def decode(self, seq_ids: list[str]) -> list[int]:
        states = self._decode_states(seq_ids)
        kv_len = max(st.length for _, st in states) + 1
        lengths = np.array([st.length for _, st in states])
        mask = np.arange(kv_len)[None, :] <= lengths[:, None]  # [B, K]
        batch = Batch(input_ids=self._t(np.array([[st.pending] for _, st in states])),
                      positions=self._t(lengths[:, None]), write_pos=self._t(lengths[:, None]),
                      slots=torch.tensor([slot for slot, _ in states], device=self.device),
                      mask=torch.from_numpy(mask[:, None, None, :]).to(self.device))
        out = self.model(batch, self.cache)
        logits = self.model.logits(out.hidden[:, 0])  # [B, V]
        return self._commit_decode(states, logits.argmax(-1).cpu().numpy(), lambda i: logits[i])

    def _decode_states(self, seq_ids: list[str]) -> list[tuple[int, VerifierSeq]]:
        check_unique(seq_ids)
        states = [self.seqs.get(s) for s in seq_ids]
        for s, (_, st) in zip(seq_ids, states):
            if st.length + 1 > self.capacity:
                raise CapacityExhausted(f"sequence {s!r} is at the end of its context")
        return states

    def _commit_decode(self, states, greedy: np.ndarray, logits_of: Callable[[int], torch.Tensor]) -> list[int]:
        """greedy [B]: base argmax per sequence; logits_of(i) [V] only for sequences that sample."""
        tokens = []
        for i, (_, st) in enumerate(states):
            st.length += 1
            st.pending = int(greedy[i]) if st.sampling.greedy else self._choose(logits_of(i), st)
            tokens.append(st.pending)
        return tokens

    def release(self, seq_ids: list[str]) -> int:
        return sum(self.seqs.release(s) for s in seq_ids)

    # ---- helpers ----
    def _choose(self, logits: torch.Tensor, st: VerifierSeq) -> int:
        if st.sampling.greedy:
            return int(logits.argmax())
        p = target_distribution(logits.cpu().numpy(), st.sampling)
        return int(st.rng.choice(p.shape[0], p=p))

    def _check_tokens(self, ids: list[int]) -> None:
        v = self.info.vocab_size
        bad = [i for i in ids if not 0 <= i < v]
        if bad:
            raise InvalidRequest(f"token id {bad[0]} is outside the vocabulary [0, {v})")

    def _t(self, a: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(np.ascontiguousarray(a, dtype=np.int64)).to(self.device)
