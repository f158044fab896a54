"""Magpie: prompts the base model writes itself (Xu et al. 2024, "Magpie: Alignment Data Synthesis from Scratch").

The model is given its chat template up to and including the start of a user turn (for SmolLM2: the default
system prompt, then "<|im_start|>user\\n") and samples what follows; the message ends where the model ends the
turn (its end-of-turn token, <|im_end|>). A message that reaches max_new_tokens without ending is kept in the
shard but marked unfinished and never used. Shards of `shard_size` messages are written as they finish and
skipped when present, so a run stopped by its time budget continues where it left off; each batch draws from
its own seed (derived from the config's seed, the shard and the batch), so a shard's content does not depend
on which run wrote it.

Writing shards (issue 11: WritingBench trails the other held-out sets, and few training prompts ask for writing):
a `writing_share` of the shards, spread evenly and chosen from the config alone (MagpieConfig.system_prompt), is
sampled under a writing assistant's system prompt instead of the template's own, the WRITING_PROMPTS in turn,
so the model writes requests for stories, essays, emails, articles, poems, reports and edits. Such a shard's
file and rows name its prompt's id; with writing_share 0 (the default) every shard, prefix and seed is as before.
"""

from __future__ import annotations

import json
import logging
import math
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from fractions import Fraction
from pathlib import Path

import numpy as np
import torch

from common.model.llama import LlamaModel
from training.generate import Sampling, generate_batch, missing_shards
from training.sources import Item, read_jsonl

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class SystemPrompt:
    """A system prompt Magpie samples user messages under."""

    id: str  # names the prompt in shard files and rows (the text is in this module, not in the data)
    text: str | None  # None: the chat template's own default system prompt


DEFAULT_SYSTEM = SystemPrompt("default", None)

_WRITER = "You are a helpful AI writing assistant named SmolLM, trained by Hugging Face."
WRITING_PROMPTS = (
    SystemPrompt(
        "writing-stories",
        f"{_WRITER} Users ask you to write short stories, fables and scenes, and describe the characters, the "
        "setting and the tone they want.",
    ),
    SystemPrompt(
        "writing-essays",
        f"{_WRITER} Users ask you to write essays, opinion pieces and persuasive arguments on a topic they give, "
        "often with a length or a structure in mind.",
    ),
    SystemPrompt(
        "writing-emails",
        f"{_WRITER} Users ask you to draft emails, letters, cover letters and messages to colleagues, customers "
        "or friends, and explain the situation and what the message has to say.",
    ),
    SystemPrompt(
        "writing-articles",
        f"{_WRITER} Users ask you to write blog posts, news articles, product descriptions and social media posts "
        "for an audience they describe.",
    ),
    SystemPrompt(
        "writing-poems",
        f"{_WRITER} Users ask you to write poems, song lyrics and haiku on a theme, in a form or a mood they choose.",
    ),
    SystemPrompt(
        "writing-reports",
        f"{_WRITER} Users ask you to write reports, summaries, proposals and plans from the facts and figures "
        "they give you.",
    ),
    SystemPrompt(
        "writing-editing",
        f"{_WRITER} Users paste a text of their own and ask you to rewrite, edit, shorten or proofread it, or to "
        "change its tone.",
    ),
)
SYSTEM_PROMPTS = (DEFAULT_SYSTEM, *WRITING_PROMPTS)  # ids unique (tests/test_prompts.py)


@dataclass(frozen=True)
class MagpieConfig:
    count: int  # user messages to sample (raw, before filtering)
    batch_size: int = 64
    shard_size: int = 1024  # messages per shard (the unit of resumption)
    max_new_tokens: int = 128
    temperature: float = 1.0
    top_p: float = 0.95
    seed: int = 0
    writing_share: float = 0.0  # share of the shards sampled under a WRITING_PROMPTS system prompt, in [0, 1]

    def __post_init__(self) -> None:
        for name in ("count", "batch_size", "shard_size", "max_new_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        Sampling(self.temperature, self.top_p)  # raises ValueError on bad values
        if not 0.0 <= self.writing_share <= 1.0:  # NaN fails too
            raise ValueError(f"writing_share must be in [0, 1], got {self.writing_share}")

    def n_shards(self) -> int:
        return (self.count + self.shard_size - 1) // self.shard_size

    def sampling(self, shard: int, batch: int) -> Sampling:
        seed = int(np.random.SeedSequence([self.seed, shard, batch]).generate_state(1)[0])
        return Sampling(self.temperature, self.top_p, seed)

    def system_prompt(self, k: int) -> SystemPrompt:
        """Shard k's system prompt, from the share and k alone (not the count, so more shards leave the first
        ones as they are). n(k) = floor(k * share) writing shards come before shard k; shard k is one when
        n(k + 1) > n(k), and the i-th of them (from 0) takes WRITING_PROMPTS[i % 7] (7 prompts); the others keep
        the template's own prompt. Example, share 0.25: n(k + 1) = floor((k + 1) / 4) steps up at k = 3, 7, 11, so
        shards 3, 7, 11 get writing prompts 0, 1, 2 (stories, essays, emails) and shards 0-2, 4-6, 8-10 the
        default; share 1: shard k gets prompt k % 7. The share is read as the decimal it prints as (0.3 -> 3/10,
        not the binary float just below it), so 10 shards at 0.3 hold exactly 3 writing shards."""
        share = Fraction(str(self.writing_share))
        before = math.floor(k * share)
        if math.floor((k + 1) * share) == before:
            return DEFAULT_SYSTEM
        return WRITING_PROMPTS[before % len(WRITING_PROMPTS)]

    def system_prompts(self) -> list[SystemPrompt]:
        """The distinct system prompts of this config's shards, in order of first use."""
        return list(dict.fromkeys(self.system_prompt(k) for k in range(self.n_shards())))


def shard_path(outdir: Path, k: int, system: SystemPrompt = DEFAULT_SYSTEM) -> Path:
    """Shard k's file; under another prompt than the template's own the prompt's id is part of the name, so a run
    with another writing_share never takes the shard for its own: magpie-00003.jsonl, magpie-00007-writing-poems.jsonl.
    """
    if system == DEFAULT_SYSTEM:
        return outdir / f"magpie-{k:05d}.jsonl"
    return outdir / f"magpie-{k:05d}-{system.id}.jsonl"


def sample_shard(
    model: LlamaModel,
    prefix: list[int],
    decode: Callable[[list[int]], str],
    cfg: MagpieConfig,
    k: int,
    eos_id: int,
    device: torch.device,
) -> list[dict]:
    """Shard k's rows {"id", "text", "tokens", "finished"}: message k * shard_size + i for i in the shard.
    prefix: the template up to the user turn under cfg.system_prompt(k); rows sampled under another prompt than
    the template's own also carry {"system": its id} (the default's rows are as before writing prompts existed).
    """
    n = min(cfg.shard_size, cfg.count - k * cfg.shard_size)
    system = cfg.system_prompt(k)
    tag = {} if system == DEFAULT_SYSTEM else {"system": system.id}
    rows = []
    for b, s in enumerate(range(0, n, cfg.batch_size)):
        m = min(cfg.batch_size, n - s)
        outs = generate_batch(model, [prefix] * m, cfg.max_new_tokens, eos_id, device, cfg.sampling(k, b))
        for j, out in enumerate(outs):
            finished = bool(out) and out[-1] == eos_id
            ids = out[:-1] if finished else out
            pid = f"magpie-{k:05d}-{s + j:05d}"
            rows.append({"id": pid, "text": decode(ids), "tokens": len(ids), "finished": finished} | tag)
    return rows


def magpie_stage(
    model: LlamaModel,
    prefixes: Mapping[str, list[int]],
    decode: Callable[[list[int]], str],
    outdir: Path,
    cfg: MagpieConfig,
    eos_id: int,
    device: torch.device,
    deadline: float | None = None,
) -> bool:
    """Sample cfg.count user messages shard by shard, skipping finished shards. True when all are done.
    prefixes: system prompt id -> the template up to the user turn under that prompt (every cfg.system_prompts())."""
    outdir.mkdir(parents=True, exist_ok=True)
    n_shards = cfg.n_shards()
    paths = [shard_path(outdir, k, cfg.system_prompt(k)) for k in range(n_shards)]
    for k, path in missing_shards(paths, deadline, "magpie"):
        t0 = time.time()
        rows = sample_shard(model, prefixes[cfg.system_prompt(k).id], decode, cfg, k, eos_id, device)
        tmp = path.with_suffix(".tmp")
        tmp.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows), encoding="utf-8")
        tmp.replace(path)
        dt = time.time() - t0
        done = sum(r["finished"] for r in rows)
        log.info(
            "magpie: shard %d/%d (%s), %d messages (%d finished) in %.1fs (%.0f per minute)",
            k + 1,
            n_shards,
            cfg.system_prompt(k).id,
            len(rows),
            done,
            dt,
            60 * len(rows) / max(dt, 1e-9),
        )
    return all(p.exists() for p in paths)


def read_shards(outdir: Path, cfg: MagpieConfig) -> list[dict]:
    """All rows of the first cfg.n_shards() shards, in order, each with its shard's system prompt id as "system"
    (filled in for the template's own prompt, whose rows do not store it)."""
    rows = []
    for k in range(cfg.n_shards()):
        system = cfg.system_prompt(k)
        rows += [{"system": system.id} | row for row in read_jsonl(shard_path(outdir, k, system))]
    return rows


def finished_items(rows: list[dict]) -> list[Item]:
    """(id, text) of the messages the model ended itself."""
    return [(r["id"], r["text"]) for r in rows if r["finished"]]


def system_counts(rows: list[dict]) -> dict[str, dict[str, int]]:
    """Messages generated and finished under each system prompt (rows of read_shards), for the manifest:
    rows [default finished, writing-poems unfinished, writing-poems finished] ->
    {"default": {"generated": 1, "finished": 1}, "writing-poems": {"generated": 2, "finished": 1}}."""
    counts: dict[str, dict[str, int]] = {}
    for r in rows:
        c = counts.setdefault(r["system"], {"generated": 0, "finished": 0})
        c["generated"] += 1
        c["finished"] += int(r["finished"])
    return counts
