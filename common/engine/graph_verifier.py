"""TorchVerifier with CUDA graphs: tree verification per (batch bucket, tree-rows bucket) and plain
decoding per batch bucket run as captured graphs; prefill stays eager.

What changes against TorchVerifier (results stay the same):
  * static shapes: every graph attends over the whole slot (K = cache capacity), masked, instead of the
    longest sequence in the batch; batches are padded to a bucket with rows that write to a spare
    "trash" slot, trees are padded with rows that see only the prefix and themselves;
  * the host sends one small int64 block per call ([B, 2T + 2]: tokens, parent rows, length, slot);
    ancestor mask, RoPE positions and the [B, 1, T, K] attention mask are built on the device;
  * greedy argmax runs on the device: only [B, T] token ids come back for acceptance (sampled sequences
    recompute their logits rows eagerly from the graph's final hidden states);
  * KV compaction of all sequences is one batched gather/scatter after the graph.
On CPU the same static-shape bodies run eagerly (no capture), which is what the CPU tests exercise.
"""

from __future__ import annotations

import logging

import numpy as np
import torch

from common.engine.base import PrefillInput, PrefillOutput, VerifyInput, VerifyOutput
from common.engine.cuda_graphs import CudaGraphManager, GraphConfig, batch_buckets_for, pick_bucket, staging
from common.engine.torch_verifier import TorchVerifier, VerifierConfig, torch_dtype
from common.model.llama import Batch, KVCache
from common.weights import Checkpoint

log = logging.getLogger(__name__)


def tree_ancestors(parent_rows: torch.Tensor) -> torch.Tensor:
    """parent_rows [B, T] (row 0 = root, row i+1 = node i; the root and padding rows name themselves)
    -> [B, T, T] bool, anc[b, i, j] = row j is row i or one of its ancestors (common.tree.ancestor_mask).

    Pointer doubling, ceil(log2(T - 1)) rounds with static shapes: after round r every row holds its
    ancestors up to distance 2^r, and jump[i] is its 2^r-th ancestor (the root points at itself).
    Worked example (tokens [a, b, c, d], parents [-1, -1, 0, 1], then one padding row p):
        row          r  a  b  c  d  p
        parent_rows  0  0  0  1  2  5
        start        anc = self + parent:  r {r}  a {a,r}  b {b,r}  c {c,a}  d {d,b}  p {p}
        round 1      anc[c] |= anc[jump[c] = a] -> {c,a,r};  jump[c] <- jump[a] = r   (d likewise)
        depth = |anc| - 1:  r 0  a 1  b 1  c 2  d 2  p 0
    """
    b, t = parent_rows.shape
    anc = torch.eye(t, dtype=torch.bool, device=parent_rows.device).expand(b, t, t).clone()  # [B, T, T]
    anc.scatter_(2, parent_rows[:, :, None], True)
    jump = parent_rows                                                                        # [B, T]
    for _ in range(max(t - 2, 0).bit_length()):  # ceil(log2(T - 1)) rounds cover depth T - 1
        anc = anc | anc.gather(1, jump[:, :, None].expand(b, t, t))
        jump = jump.gather(1, jump)
    return anc


def tree_attention_mask(anc: torch.Tensor, lengths: torch.Tensor, kv_len: int) -> torch.Tensor:
    """anc [B, T, T] tree ancestor mask, lengths [B] committed prefix lengths n -> [B, 1, T, kv_len] bool.

    Row i sees cache positions [0, n) (the prefix) and n + j for every ancestor-or-self row j; the tree
    rows sit at n, n + 1, ..., n + T - 1.
    Example: n = 3, T = 2 (root, one child), kv_len 6:
        rel = k - n = [-3 -2 -1 0 1 2]
        root  [1 1 1 1 0 0]
        child [1 1 1 1 1 0]
    """
    b, t, _ = anc.shape
    rel = torch.arange(kv_len, device=anc.device)[None, :] - lengths[:, None]         # [B, K]
    in_tree = (rel >= 0) & (rel < t)                                                   # [B, K]
    tree = anc.gather(2, rel.clamp(0, t - 1)[:, None, :].expand(b, t, kv_len))         # [B, T, K]
    return ((rel < 0)[:, None, :] | (tree & in_tree[:, None, :]))[:, None]             # [B, 1, T, K]


class GraphVerifier(TorchVerifier):
    def __init__(self, ckpt: Checkpoint, cfg: VerifierConfig, graph_cfg: GraphConfig | None = None) -> None:
        super().__init__(ckpt, cfg)
        gc = graph_cfg or GraphConfig()
        self.graph_cfg = gc
        mcfg = self.model.cfg
        self.max_rows = cfg.max_tree_nodes + 1
        self.batch_buckets = batch_buckets_for(cfg.max_sequences, gc.batch_buckets)
        self.tree_buckets = tuple(sorted({t for t in gc.tree_buckets if t <= self.max_rows} | {self.max_rows}))
        # Logical capacity (what requests may use) stays TorchVerifier's; the cache gets one spare slot
        # for batch padding rows and max_rows of headroom so that a padded tree never runs off its slot.
        self.capacity = self.cache.capacity
        self.trash_slot = cfg.max_sequences
        self.cache = KVCache.allocate(mcfg.num_layers, cfg.max_sequences + 1, self.capacity + self.max_rows,
                                      mcfg.num_kv_heads, mcfg.head_dim, torch_dtype(cfg.dtype), self.device)
        self.kv_len = self.cache.capacity  # every graph attends over the whole slot, masked
        self.graphs = CudaGraphManager(self.device, name="verifier", enabled=gc.capture,
                                       warmup_iters=gc.warmup_iters)
        self._stage: dict[tuple, torch.Tensor] = {}
        with torch.inference_mode():
            for bb in self.batch_buckets:
                self._register_decode(bb)
                for tb in self.tree_buckets:
                    self._register_verify(bb, tb)
            self.graphs.capture_all()

    # ---- graph bodies ----
    def _register_verify(self, bb: int, tb: int) -> None:
        packed = torch.zeros(bb, 2 * tb + 2, dtype=torch.long, device=self.device)  # [B, 2T + 2]
        stage = staging((bb, 2 * tb + 2), torch.long, self.device)
        self._pad_verify(stage.numpy(), 0, tb)
        packed.copy_(stage)
        self._stage[("verify", bb, tb)] = stage

        def body() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
            ids = packed[:, :tb]                  # [B, T] root token, then the tree's tokens
            parent_rows = packed[:, tb:2 * tb]    # [B, T] parent row of each row (self for root/padding)
            n = packed[:, 2 * tb]                 # [B] committed length: the root's cache position
            slots = packed[:, 2 * tb + 1]         # [B]
            anc = tree_ancestors(parent_rows)     # [B, T, T]
            depth = anc.sum(-1) - 1               # [B, T]
            rows = torch.arange(tb, device=packed.device)
            batch = Batch(input_ids=ids, positions=n[:, None] + depth, slots=slots,
                          write_pos=n[:, None] + rows[None, :],
                          mask=tree_attention_mask(anc, n, self.kv_len))
            out = self.model(batch, self.cache)
            logits = self.model.logits(out.hidden)  # [B, T, V] float32, a graph intermediate only
            return out.hidden, out.aux, logits.argmax(-1)

        self.graphs.register(("verify", bb, tb), body, {"packed": packed}, size=bb * tb)

    def _register_decode(self, bb: int) -> None:
        packed = torch.zeros(bb, 3, dtype=torch.long, device=self.device)  # [B, 3] pending, length, slot
        stage = staging((bb, 3), torch.long, self.device)
        self._pad_decode(stage.numpy(), 0)
        packed.copy_(stage)
        self._stage[("decode", bb)] = stage

        def body() -> tuple[torch.Tensor, torch.Tensor]:
            n = packed[:, 1:2]                                                             # [B, 1]
            mask = torch.arange(self.kv_len, device=packed.device)[None, :] <= n           # [B, K]
            batch = Batch(input_ids=packed[:, 0:1], positions=n, slots=packed[:, 2], write_pos=n,
                          mask=mask[:, None, None, :])
            hidden = self.model(batch, self.cache).hidden[:, 0]                            # [B, H]
            return hidden, self.model.logits(hidden).argmax(-1)                            # [B, H], [B]

        self.graphs.register(("decode", bb), body, {"packed": packed}, size=bb)

    def _pad_verify(self, a: np.ndarray, start: int, tb: int) -> None:
        """Rows start.. of a verify block become padding: token 0, every row its own parent, length 0,
        the trash slot (they see only themselves there)."""
        a[start:] = 0
        a[start:, tb:2 * tb] = np.arange(tb)
        a[start:, 2 * tb + 1] = self.trash_slot

    def _pad_decode(self, a: np.ndarray, start: int) -> None:
        a[start:] = 0
        a[start:, 2] = self.trash_slot

    # ---- verification ----
    @torch.inference_mode()
    def verify(self, items: list[VerifyInput]) -> list[VerifyOutput]:
        states, t = self._verify_states(items)
        b = len(items)
        bb, tb = pick_bucket(b, self.batch_buckets), pick_bucket(t, self.tree_buckets)
        if bb is None or tb is None:
            log.warning("verify batch %d x %d rows has no graph bucket: running it eagerly", b, t)
            return super().verify(items)
        with self.graphs.on_stream():
            stage = self._stage[("verify", bb, tb)]
            a = stage.numpy()  # [bb, 2 tb + 2]
            for i, (it, (slot, st)) in enumerate(zip(items, states)):
                size = it.tree.size
                a[i, :tb] = 0
                a[i, 0], a[i, 1:size + 1] = st.pending, it.tree.tokens
                a[i, tb:2 * tb] = np.arange(tb)            # padding rows: their own parent
                a[i, tb] = 0                               # root
                a[i, tb + 1:tb + 1 + size] = np.asarray(it.tree.parents) + 1
                a[i, 2 * tb], a[i, 2 * tb + 1] = st.length, slot
            self._pad_verify(a, b, tb)
            hidden, aux, argmax = self.graphs.run(("verify", bb, tb), {"packed": stage})
            greedy_rows = argmax[:b].cpu().numpy()  # [B, T] the only thing the host needs for greedy
            # sampling sequences recompute their rows' logits eagerly from the graph's hidden states
            accs = self._accept(items, states, greedy_rows,
                                lambda i: self.model.logits(hidden[i, :items[i].tree.size + 1]))
            return self._finish_verify(states, accs, aux)

    # ---- plain decoding ----
    @torch.inference_mode()
    def decode(self, seq_ids: list[str]) -> list[int]:
        states = self._decode_states(seq_ids)
        b = len(seq_ids)
        bb = pick_bucket(b, self.batch_buckets)
        if bb is None:
            log.warning("decode batch %d has no graph bucket: running it eagerly", b)
            return super().decode(seq_ids)
        with self.graphs.on_stream():
            stage = self._stage[("decode", bb)]
            a = stage.numpy()  # [bb, 3]
            for i, (slot, st) in enumerate(states):
                a[i] = (st.pending, st.length, slot)
            self._pad_decode(a, b)
            hidden, argmax = self.graphs.run(("decode", bb), {"packed": stage})
            return self._commit_decode(states, argmax[:b].cpu().numpy(), lambda i: self.model.logits(hidden[i]))

    def prefill(self, item: PrefillInput) -> PrefillOutput:
        """Eager (prompt lengths vary too much to bucket), on the engine's stream."""
        with self.graphs.on_stream():
            return super().prefill(item)
