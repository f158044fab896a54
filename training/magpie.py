"""Magpie: prompts the base model writes itself (Xu et al. 2024, "Magpie: Alignment Data Synthesis from Scratch").

The model is given its chat template up to and including the start of a user turn (for SmolLM2: the default
system prompt, then "<|im_start|>user\\n") and samples what follows; the message ends where the model ends the
turn (its end-of-turn token, <|im_end|>). A message that reaches max_new_tokens without ending is kept in the
shard but marked unfinished and never used. Shards of `shard_size` messages are written as they finish and
skipped when present, so a run stopped by its time budget continues where it left off; each batch draws from
its own seed (derived from the config's seed, the shard and the batch), so a shard's content does not depend
on which run wrote it.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from common.model.llama import LlamaModel
from training.generate import Sampling, generate_batch, missing_shards
from training.sources import Item, read_jsonl

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class MagpieConfig:
    count: int  # user messages to sample (raw, before filtering)
    batch_size: int = 64
    shard_size: int = 1024  # messages per shard (the unit of resumption)
    max_new_tokens: int = 128
    temperature: float = 1.0
    top_p: float = 0.95
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("count", "batch_size", "shard_size", "max_new_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        Sampling(self.temperature, self.top_p)  # raises ValueError on bad values

    def n_shards(self) -> int:
        return (self.count + self.shard_size - 1) // self.shard_size

    def sampling(self, shard: int, batch: int) -> Sampling:
        seed = int(np.random.SeedSequence([self.seed, shard, batch]).generate_state(1)[0])
        return Sampling(self.temperature, self.top_p, seed)


def shard_path(outdir: Path, k: int) -> Path:
    return outdir / f"magpie-{k:05d}.jsonl"


def sample_shard(
    model: LlamaModel,
    prefix: list[int],
    decode: Callable[[list[int]], str],
    cfg: MagpieConfig,
    k: int,
    eos_id: int,
    device: torch.device,
) -> list[dict]:
    """Shard k's rows {"id", "text", "tokens", "finished"}: message k * shard_size + i for i in the shard."""
    n = min(cfg.shard_size, cfg.count - k * cfg.shard_size)
    rows = []
    for b, s in enumerate(range(0, n, cfg.batch_size)):
        m = min(cfg.batch_size, n - s)
        outs = generate_batch(model, [prefix] * m, cfg.max_new_tokens, eos_id, device, cfg.sampling(k, b))
        for j, out in enumerate(outs):
            finished = bool(out) and out[-1] == eos_id
            ids = out[:-1] if finished else out
            pid = f"magpie-{k:05d}-{s + j:05d}"
            rows.append({"id": pid, "text": decode(ids), "tokens": len(ids), "finished": finished})
    return rows


def magpie_stage(
    model: LlamaModel,
    prefix: list[int],
    decode: Callable[[list[int]], str],
    outdir: Path,
    cfg: MagpieConfig,
    eos_id: int,
    device: torch.device,
    deadline: float | None = None,
) -> bool:
    """Sample cfg.count user messages shard by shard, skipping finished shards. True when all are done."""
    outdir.mkdir(parents=True, exist_ok=True)
    n_shards = cfg.n_shards()
    paths = [shard_path(outdir, k) for k in range(n_shards)]
    for k, path in missing_shards(paths, deadline, "magpie"):
        t0 = time.time()
        rows = sample_shard(model, prefix, decode, cfg, k, eos_id, device)
        tmp = path.with_suffix(".tmp")
        tmp.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows), encoding="utf-8")
        tmp.replace(path)
        dt = time.time() - t0
        done = sum(r["finished"] for r in rows)
        log.info(
            "magpie: shard %d/%d, %d messages (%d finished) in %.1fs (%.0f per minute)",
            k + 1,
            n_shards,
            len(rows),
            done,
            dt,
            60 * len(rows) / max(dt, 1e-9),
        )
    return all(p.exists() for p in paths)


def read_shards(outdir: Path, cfg: MagpieConfig) -> list[dict]:
    """All rows of the first cfg.n_shards() shards, in order."""
    return [row for k in range(cfg.n_shards()) for row in read_jsonl(shard_path(outdir, k))]


def finished_items(rows: list[dict]) -> list[Item]:
    """(id, text) of the messages the model ended itself."""
    return [(r["id"], r["text"]) for r in rows if r["finished"]]
