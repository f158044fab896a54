"""Magpie: prompts the base model writes itself (Xu et al. 2024, "Magpie: Alignment Data Synthesis from Scratch").

The model is given its chat template up to and including the start of a user turn (for SmolLM2: the default
system prompt, then "<|im_start|>user\\n") and samples what follows; the message ends where the model ends the
turn (its end-of-turn token, <|im_end|>). A message that reaches max_new_tokens without ending is kept in the
shard but marked unfinished and never used. Shards of `shard_size` messages are written as they finish and
skipped when present, so a run stopped by its time budget continues where it left off; each batch draws from
its own seed (derived from the config's seed, the shard and the batch), so a shard's content does not depend
on which run wrote it.

Steered shards (for the held-out categories the head accepts least, whose kind of prompt the other sources rarely
hold): a `steered_share` of the shards, spread evenly and chosen from the config alone (MagpieConfig.steer), starts
every user message with the opening words of a request of one of `steer_families` (STEER_FAMILIES: writing "Write a
short story about", "Draft an email", ...; qa "Why do", "How does", ...; summary "Summarize this article:", ...;
chat "Can you suggest", "Any tips for", ...; code "Write a Python function that", "Explain what this code does:",
...; math "Solve for x:", "Solve this word problem step by step:", ...) and samples the rest, so the model writes the
passage to summarize, the question, the piece of writing, the code or the problem it asks for. Such a shard's
file and rows name its steer's id; at steered_share 0 (the default) every shard is a plain Magpie shard.
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
from training.parallel import Part
from training.sources import Item, read_jsonl

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Steer:
    """How a shard's user messages start: the template's own turn prefix, then `opener` (the first words of the
    message, part of its text), after which the model samples the rest."""

    id: str  # names the steer in shard files and rows
    opener: str  # "" for the plain Magpie prefix


DEFAULT_STEER = Steer("default", "")
WRITING_STEERS = (
    Steer("writing-story", "Write a short story about"),
    Steer("writing-poem", "Write a poem about"),
    Steer("writing-essay", "Write an essay"),
    Steer("writing-email", "Draft an email"),
    Steer("writing-blog", "Write a blog post"),
    Steer("writing-letter", "Write a letter"),
    Steer("writing-report", "Write a report"),
    Steer("writing-product", "Write a product description"),
    Steer("writing-rewrite", "Please rewrite"),
)
QA_STEERS = (
    Steer("qa-why-do", "Why do"),
    Steer("qa-how-does", "How does"),
    Steer("qa-what-causes", "What causes"),
    Steer("qa-why-is", "Why is"),
    Steer("qa-how-do", "How do"),
    Steer("qa-difference", "What is the difference between"),
    Steer("qa-explain", "Explain how"),
    Steer("qa-what-happens", "What happens when"),
)
SUMMARY_STEERS = (
    Steer("summary-article", "Summarize this article:"),
    Steer("summary-passage", "Summarize the following passage in a few sentences:"),
    Steer("summary-short", "Give me a short summary of this text:"),
    Steer("summary-email", "Summarize the following email:"),
    Steer("summary-paragraph", "Summarize this paragraph:"),
    Steer("summary-review", "Summarize this review:"),
)
CHAT_STEERS = (
    Steer("chat-suggest", "Can you suggest"),
    Steer("chat-tips", "Any tips for"),
    Steer("chat-how-can-i", "How can I"),
    Steer("chat-i-want", "I want to"),
    Steer("chat-my", "My"),
    Steer("chat-advice", "I need some advice"),
)
# the code a user pastes or asks for: the other sources' code is mostly ShareGPT's (7% of issue 36's prompts)
CODE_STEERS = (
    Steer("code-python-function", "Write a Python function that"),
    Steer("code-explain", "Explain what this code does:"),
    Steer("code-javascript", "Write a JavaScript function that"),
    Steer("code-fix", "Fix the bug in this code:"),
    Steer("code-sql", "Write a SQL query that"),
    Steer("code-python-class", "Write a Python class"),
    Steer("code-bash", "Write a bash script that"),
    Steer("code-how-do-i", "How do I use Python to"),
)
# word problems and exercises: the other sources' math is GSM8K's (1% of issue 36's prompts) and ShareGPT's
MATH_STEERS = (
    Steer("math-solve", "Solve for x:"),
    Steer("math-word-problem", "Solve this word problem step by step:"),
    Steer("math-probability", "What is the probability that"),
    Steer("math-area", "Find the area of"),
    Steer("math-calculate", "Calculate"),
    Steer("math-if-it-takes", "If it takes"),
    Steer("math-simplify", "Simplify the expression"),
    Steer("math-how-many", "How many"),
)
STEER_FAMILIES = {
    "writing": WRITING_STEERS,
    "qa": QA_STEERS,
    "summary": SUMMARY_STEERS,
    "chat": CHAT_STEERS,
    "code": CODE_STEERS,
    "math": MATH_STEERS,
}
STEERS = (DEFAULT_STEER, *(st for family in STEER_FAMILIES.values() for st in family))  # ids unique (test_prompts)


@dataclass(frozen=True)
class MagpieConfig:
    count: int  # user messages to sample (raw, before filtering)
    batch_size: int = 64
    shard_size: int = 1024  # messages per shard (the unit of resumption)
    max_new_tokens: int = 128
    temperature: float = 1.0
    top_p: float = 0.95
    seed: int = 0
    steered_share: float = 0.0  # share of the shards whose messages start with a steer's opener, in [0, 1]
    steer_families: tuple[str, ...] = ("writing",)  # STEER_FAMILIES the steered shards take in turn

    def __post_init__(self) -> None:
        for name in ("count", "batch_size", "shard_size", "max_new_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        Sampling(self.temperature, self.top_p)  # raises ValueError on bad values
        if not 0.0 <= self.steered_share <= 1.0:  # NaN fails too
            raise ValueError(f"steered_share must be in [0, 1], got {self.steered_share}")
        unknown = [f for f in self.steer_families if f not in STEER_FAMILIES]
        if unknown or not self.steer_families or len(set(self.steer_families)) < len(self.steer_families):
            raise ValueError(
                f"steer_families must name distinct families of {', '.join(STEER_FAMILIES)}, got {self.steer_families}"
            )

    def n_shards(self) -> int:
        return (self.count + self.shard_size - 1) // self.shard_size

    def sampling(self, shard: int, batch: int) -> Sampling:
        seed = int(np.random.SeedSequence([self.seed, shard, batch]).generate_state(1)[0])
        return Sampling(self.temperature, self.top_p, seed)

    def steer(self, k: int) -> Steer:
        """Shard k's steer, from the share, the families and k alone (not the count, so more shards leave the first
        ones as they are). n(k) = floor(k * share) steered shards come before shard k; shard k is one when
        n(k + 1) > n(k). The i-th of them (from 0) takes family f = families[i % F] (F families) and that family's
        steer (i // F) % len(f); the other shards are plain Magpie. Example, share 0.25, families (writing,):
        n(k + 1) = floor((k + 1) / 4) steps up at k = 3, 7, 11, so shards 3, 7, 11 get WRITING_STEERS 0, 1, 2
        (story, poem, essay) and shards 0-2, 4-6, 8-10 the default; families (qa, summary) at share 1: shards 0-3
        get qa 0, summary 0, qa 1, summary 1. The share is read as the decimal it prints as (0.3 -> 3/10, not the
        binary float just below it), so 10 shards at 0.3 hold exactly 3 steered shards."""
        share = Fraction(str(self.steered_share))
        before = math.floor(k * share)
        if math.floor((k + 1) * share) == before:
            return DEFAULT_STEER
        n_families = len(self.steer_families)
        family = STEER_FAMILIES[self.steer_families[before % n_families]]
        return family[(before // n_families) % len(family)]

    def steers(self) -> list[Steer]:
        """The distinct steers of this config's shards, in order of first use."""
        return list(dict.fromkeys(self.steer(k) for k in range(self.n_shards())))


def shard_path(outdir: Path, k: int, steer: Steer = DEFAULT_STEER) -> Path:
    """Shard k's file; a steered shard's name holds the steer's id, so a run with another steered share or
    families never takes the shard for its own: magpie-00003.jsonl, magpie-00007-writing-poem.jsonl."""
    if steer == DEFAULT_STEER:
        return outdir / f"magpie-{k:05d}.jsonl"
    return outdir / f"magpie-{k:05d}-{steer.id}.jsonl"


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
    prefix: the template up to the user turn, then cfg.steer(k)'s opener (steer_prefixes); a steered message's
    text starts with the opener ("tokens" counts the sampled ones) and its row carries {"steer": the id} (the
    default's rows are as before steered shards existed)."""
    n = min(cfg.shard_size, cfg.count - k * cfg.shard_size)
    steer = cfg.steer(k)
    tag = {} if steer == DEFAULT_STEER else {"steer": steer.id}
    rows = []
    for b, s in enumerate(range(0, n, cfg.batch_size)):
        m = min(cfg.batch_size, n - s)
        outs = generate_batch(model, [prefix] * m, cfg.max_new_tokens, eos_id, device, cfg.sampling(k, b))
        for j, out in enumerate(outs):
            finished = bool(out) and out[-1] == eos_id
            ids = out[:-1] if finished else out
            pid = f"magpie-{k:05d}-{s + j:05d}"
            text = steer.opener + decode(ids)
            rows.append({"id": pid, "text": text, "tokens": len(ids), "finished": finished} | tag)
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
    part: Part | None = None,
) -> bool:
    """Sample cfg.count user messages shard by shard, skipping finished shards. True when all are done.
    prefixes: steer id -> its prefix (steer_prefixes over cfg.steers()); part: this process samples only the
    shards the part owns."""
    outdir.mkdir(parents=True, exist_ok=True)
    n_shards = cfg.n_shards()
    paths = [shard_path(outdir, k, cfg.steer(k)) for k in range(n_shards)]
    for k, path in missing_shards(paths, deadline, "magpie", part=part):
        t0, steer = time.time(), cfg.steer(k)
        rows = sample_shard(model, prefixes[steer.id], decode, cfg, k, eos_id, device)
        tmp = path.with_suffix(".tmp")
        tmp.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows), encoding="utf-8")
        tmp.replace(path)
        dt = time.time() - t0
        done = sum(r["finished"] for r in rows)
        log.info(
            "magpie: shard %d/%d (%s), %d messages (%d finished) in %.1fs (%.0f per minute)",
            k + 1,
            n_shards,
            steer.id,
            len(rows),
            done,
            dt,
            60 * len(rows) / max(dt, 1e-9),
        )
    return all(p.exists() for p in paths)


def read_shards(outdir: Path, cfg: MagpieConfig) -> list[dict]:
    """All rows of the first cfg.n_shards() shards, in order, each with its shard's steer id as "steer" (filled in
    for the default, whose rows do not store it)."""
    rows = []
    for k in range(cfg.n_shards()):
        steer = cfg.steer(k)
        rows += [{"steer": steer.id} | row for row in read_jsonl(shard_path(outdir, k, steer))]
    return rows


def finished_items(rows: list[dict]) -> list[Item]:
    """(id, text) of the messages the model ended itself."""
    return [(r["id"], r["text"]) for r in rows if r["finished"]]


def steer_prefixes(
    turn_prefix: list[int], encode: Callable[[str], list[int]], steers: list[Steer]
) -> dict[str, list[int]]:
    """Each steer's prefix: the template up to the user turn (Tokenizer.encode_turn_prefix("user")), then its
    opener's tokens (encode: plain text to ids, Tokenizer.encode_prompt); the default's is the turn prefix."""
    return {st.id: turn_prefix + (encode(st.opener) if st.opener else []) for st in steers}


def steer_counts(rows: list[dict]) -> dict[str, dict[str, int]]:
    """Messages generated and finished under each steer (rows of read_shards), for the manifest:
    rows [default finished, writing-poem unfinished, writing-poem finished] ->
    {"default": {"generated": 1, "finished": 1}, "writing-poem": {"generated": 2, "finished": 1}}."""
    counts: dict[str, dict[str, int]] = {}
    for r in rows:
        c = counts.setdefault(r["steer"], {"generated": 0, "finished": 0})
        c["generated"] += 1
        c["finished"] += int(r["finished"])
    return counts
