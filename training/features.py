"""Base-model features for training: aux [T, 3H] (the head's input) and the final hidden [T, H]
(whose logits are the training target). Computed per batch on the fly, or stored as shards."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file, save_file

from common.model.llama import Batch, KVCache, LlamaModel
from training.generate import Sequences

log = logging.getLogger(__name__)


@dataclass
class PaddedBatch:
    ids: torch.Tensor  # [B, T] right-padded token ids (pad = 0)
    lengths: torch.Tensor  # [B] real lengths
    prompt_len: torch.Tensor  # [B]


def pad_batch(
    seqs: list[tuple[np.ndarray, int]], max_len: int, device: torch.device, rows_multiple: int = 1
) -> PaddedBatch:
    """(tokens, prompt_len) rows cut at max_len and right-padded with 0 to the longest, then further until T - 1 (the
    rows training-time test predicts from) is a multiple of rows_multiple: lengths 10 and 13, multiple 8 -> T = 17."""
    t = min(max_len, max(len(s) for s, _ in seqs))
    longest = t
    t = 1 + -(-(t - 1) // rows_multiple) * rows_multiple
    ids = np.zeros((len(seqs), t), dtype=np.int64)
    lens = np.zeros(len(seqs), dtype=np.int64)
    for i, (s, _) in enumerate(seqs):
        n = min(len(s), longest)
        ids[i, :n] = s[:n]
        lens[i] = n
    return PaddedBatch(
        ids=torch.from_numpy(ids).to(device),
        lengths=torch.from_numpy(lens).to(device),
        prompt_len=torch.tensor([p for _, p in seqs], device=device),
    )


@dataclass
class BaseFeatures:
    aux: torch.Tensor  # [B, T, 3H] inputs of the three EAGLE layers
    hidden: torch.Tensor  # [B, T, H] final-normed hidden (logits = base.lm_head(hidden))


@torch.no_grad()
def base_features(model: LlamaModel, ids: torch.Tensor) -> BaseFeatures:
    """One causal forward over right-padded rows (padding only ever follows real tokens)."""
    cfg = model.cfg
    b, t = ids.shape
    device = ids.device
    dtype = next(model.parameters()).dtype
    cache = KVCache.allocate(cfg.num_layers, b, t, cfg.num_kv_heads, cfg.head_dim, dtype, device)
    pos = torch.arange(t, device=device)[None, :].expand(b, t)
    mask = torch.ones(t, t, dtype=torch.bool, device=device).tril()[None, None].expand(b, 1, t, t)
    out = model(
        Batch.masked(input_ids=ids, positions=pos, slots=torch.arange(b, device=device), write_pos=pos, mask=mask),
        cache,
    )
    return BaseFeatures(aux=out.aux, hidden=out.hidden)


def features_stage(
    model: LlamaModel,
    seqs: Sequences,
    outdir: Path,
    device: torch.device,
    batch_size: int = 16,
    shard_size: int = 256,
    max_len: int = 1024,
    limit: int | None = None,
    deadline: float | None = None,
) -> bool:
    """Store features per sequence as bf16 safetensors shards feat-KKKKK.safetensors with keys
    aux.{i} [T, 3H] and hidden.{i} [T, H] (i = global sequence index). Resumable by shard."""
    outdir.mkdir(parents=True, exist_ok=True)
    n = len(seqs) if limit is None else min(limit, len(seqs))
    for k, s0 in enumerate(range(0, n, shard_size)):
        path = outdir / f"feat-{k:05d}.safetensors"
        if path.exists():
            continue
        if deadline is not None and time.time() > deadline:
            return False
        tensors: dict[str, torch.Tensor] = {}
        for b0 in range(s0, min(s0 + shard_size, n), batch_size):
            idx = list(range(b0, min(b0 + batch_size, s0 + shard_size, n)))
            pb = pad_batch([seqs.get(i) for i in idx], max_len, device)
            f = base_features(model, pb.ids)
            for j, i in enumerate(idx):
                L = int(pb.lengths[j])
                tensors[f"aux.{i}"] = f.aux[j, :L].to(torch.bfloat16).cpu().contiguous()
                tensors[f"hidden.{i}"] = f.hidden[j, :L].to(torch.bfloat16).cpu().contiguous()
        tmp = path.with_name(path.stem + ".tmp")
        save_file(tensors, str(tmp))
        tmp.replace(path)
        log.info("features: shard %d (%d sequences)", k, len(tensors) // 2)
    return True


class StoredFeatures:
    """Reads features written by features_stage (keeps one shard in memory)."""

    def __init__(self, folder: Path) -> None:
        self.files = sorted(folder.glob("feat-*.safetensors"))
        if not self.files:
            raise FileNotFoundError(f"no feature shards in {folder}")
        self.where: dict[int, Path] = {}
        from safetensors import safe_open

        for f in self.files:
            with safe_open(str(f), framework="pt") as h:
                for key in h.keys():  # noqa: SIM118 (safe_open handle, not a dict)
                    if key.startswith("aux."):
                        self.where[int(key[4:])] = f
        self._loaded: tuple[Path, dict[str, torch.Tensor]] | None = None

    def __contains__(self, i: int) -> bool:
        return i in self.where

    def get(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        f = self.where[i]
        if self._loaded is None or self._loaded[0] != f:
            self._loaded = (f, load_file(str(f)))
        d = self._loaded[1]
        return d[f"aux.{i}"], d[f"hidden.{i}"]

    def batch(self, idx: list[int], t: int, device: torch.device) -> BaseFeatures:
        rows = [self.get(i) for i in idx]
        h3 = rows[0][0].shape[-1]
        h = rows[0][1].shape[-1]
        aux = torch.zeros(len(idx), t, h3, dtype=torch.bfloat16)
        hid = torch.zeros(len(idx), t, h, dtype=torch.bfloat16)
        for j, (a, hh) in enumerate(rows):
            n = min(t, a.shape[0])
            aux[j, :n], hid[j, :n] = a[:n], hh[:n]
        return BaseFeatures(aux=aux.to(device), hidden=hid.to(device))
