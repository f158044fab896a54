"""The prompt sets: held-out eval sets, and training prompts from every source, filtered and deduplicated.

Output files in the work dir, one JSON object per line: {"id", "source", "text", "prompt_ids"} where prompt_ids
is the chat-templated token sequence of the single user turn. The eval sets are chosen as they always were
(ShareGPT's first `heldout` usable conversations, HumanEval, WritingBench's English queries) and enter the
deduplicator first, with the benchmarks' held-out prompts (bench.load.HELDOUT), so no training
prompt equal or near-equal to an eval or held-out prompt survives. Training prompts
then pass the quality filters (training/filters.py), the token bound and deduplication, source by source in
priority order; the manifest counts each source's prompts left after each step (STEPS).
"""

from __future__ import annotations

import json
import logging
import random
from collections.abc import Iterable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path

from bench.load import CATEGORIES, HELDOUT
from bench.load import read_prompts as read_heldout  # the benchmarks' reader of their one format
from training.dedup import DedupConfig, Deduplicator
from training.filters import FILTERS, FilterConfig, is_english
from training.sources import HUMANEVAL, SHAREGPT, TRAIN_SOURCES, WRITINGBENCH, Item, package_versions

log = logging.getLogger(__name__)

TRAIN_FILE = "train_prompts.jsonl"
EVAL_FILES = {
    "sharegpt": "sharegpt_heldout.jsonl",
    "humaneval": "humaneval.jsonl",
    "writingbench": "writingbench.jsonl",
}
# the benchmarks' held-out prompts (bench.load.HELDOUT: 24 a category, never trained on) as
# evaluation sets, one a category; "heldout" names all six
HELDOUT_SETS = {"heldout": [f"heldout-{c}" for c in CATEGORIES]}
MANIFEST = "prompts_manifest.json"
EVAL_LABEL = "eval"
# prompts left after each step: read, FILTERS, the token bound, no overlap with an eval set, no earlier duplicate
STEPS = ("raw", *FILTERS, "tokens", "eval_overlap", "dedup")


@dataclass(frozen=True)
class PromptConfig:
    max_prompt_tokens: int = 512
    heldout: int = 100  # ShareGPT conversations never trained on (taken first, in file order)
    max_train: int | None = None  # cap on training prompts, taken after shuffling (None = all usable)
    min_chars: int = 8  # eval sets only: their selection stays what it was
    filters: FilterConfig = field(default_factory=FilterConfig)
    dedup: DedupConfig = field(default_factory=DedupConfig)
    seed: int = 0  # of the training prompts' shuffle

    def __post_init__(self) -> None:
        if self.max_prompt_tokens < 16:
            raise ValueError(f"max_prompt_tokens must be >= 16, got {self.max_prompt_tokens}")
        if self.heldout < 0:
            raise ValueError(f"heldout must be >= 0, got {self.heldout}")
        if self.max_train is not None and self.max_train < 0:
            raise ValueError(f"max_train must be >= 0, got {self.max_train}")


def _write(path: Path, rows: list[dict]) -> None:
    tmp = path.with_suffix(".tmp")
    with tmp.open("w", encoding="utf-8") as f:
        for r in rows:
            f.write(json.dumps(r, ensure_ascii=False) + "\n")
    tmp.replace(path)


def read_prompts(path: Path) -> list[dict]:
    with path.open(encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


@dataclass
class Funnel:
    """Training prompts of one source left after each of STEPS."""

    left: dict[str, int] = field(default_factory=lambda: dict.fromkeys(STEPS, 0))

    def count(self, failed: str | None) -> None:
        """A prompt that failed step `failed` (None: passed them all) counts for every step before it."""
        for step in STEPS[: STEPS.index(failed) if failed is not None else len(STEPS)]:
            self.left[step] += 1


def select_training(
    streams: Iterable[tuple[str, Iterable[Item]]], tokenizer, cfg: PromptConfig, dedup: Deduplicator
) -> tuple[list[dict], dict[str, dict[str, int]]]:
    """Filter and deduplicate (source, items) streams in order; returns the kept rows and each source's funnel."""
    rows: list[dict] = []
    funnels: dict[str, dict[str, int]] = {}
    for source, items in streams:
        funnel = Funnel()
        for pid, raw in items:
            text = raw.strip()
            failed = cfg.filters.reason(text)
            ids: list[int] = []
            if failed is None:
                ids = tokenizer.encode_chat([("user", text)])
                if len(ids) > cfg.max_prompt_tokens:
                    failed = "tokens"
            if failed is None:
                dup = dedup.add(text, source)
                if dup is not None:
                    failed = "eval_overlap" if dup.of == EVAL_LABEL else "dedup"
            funnel.count(failed)
            if failed is None:
                rows.append({"id": pid, "source": source, "text": text, "prompt_ids": ids})
        funnels[source] = funnel.left
        log.info("prompts: %s %s", source, funnel.left)
    return rows, funnels


def build_prompts(
    workdir: Path,
    tokenizer,
    cfg: PromptConfig,
    sources: Iterable[str] = tuple(TRAIN_SOURCES),
    extra: dict[str, Iterable[Item]] | None = None,
    meta: dict | None = None,
) -> dict:
    """Write the eval files, the training file and the manifest (with `meta` merged in); returns the manifest.
    `sources` names TRAIN_SOURCES to train on; `extra` adds more (e.g. Magpie's prompts), after them."""
    workdir.mkdir(parents=True, exist_ok=True)
    unknown = [s for s in sources if s not in TRAIN_SOURCES]
    if unknown:
        raise ValueError(f"unknown prompt source {unknown[0]!r}: choose from {', '.join(TRAIN_SOURCES)}")
    max_chars = cfg.max_prompt_tokens * 8  # cheap pre-filter before tokenizing

    def encode(source: str, items: Iterable[Item]) -> Iterator[dict]:
        for pid, text in items:
            if len(text) < cfg.min_chars or len(text) > max_chars:
                continue
            ids = tokenizer.encode_chat([("user", text)])
            if len(ids) <= cfg.max_prompt_tokens:
                yield {"id": pid, "source": source, "text": text, "prompt_ids": ids}

    sharegpt = iter(SHAREGPT.items())  # held-out first; training resumes after the last held-out conversation
    heldout: list[dict] = []
    if cfg.heldout:
        for row in encode("sharegpt", ((i, t) for i, t in sharegpt if is_english(t))):
            heldout.append(row)
            if len(heldout) == cfg.heldout:
                break
    humaneval = list(encode("humaneval", HUMANEVAL.items()))
    writing = list(encode("writingbench", WRITINGBENCH.items()))
    dedup = Deduplicator(cfg.dedup)
    benches = [p.text for f in HELDOUT for p in read_heldout(f)]  # the prompts the head's acceptance is measured on
    for text in [row["text"] for row in heldout + humaneval + writing] + benches:
        dedup.add(text, EVAL_LABEL)

    names = [s for s in TRAIN_SOURCES if s in set(sources)]
    streams = [(s, sharegpt if s == "sharegpt" else TRAIN_SOURCES[s].items()) for s in names]
    streams += list((extra or {}).items())
    train, funnels = select_training(streams, tokenizer, cfg, dedup)
    random.Random(cfg.seed).shuffle(train)  # any prefix (generate --limit) mixes the sources
    if cfg.max_train is not None:
        train = train[: cfg.max_train]

    _write(workdir / TRAIN_FILE, train)
    _write(workdir / EVAL_FILES["sharegpt"], heldout)
    _write(workdir / EVAL_FILES["humaneval"], humaneval)
    _write(workdir / EVAL_FILES["writingbench"], writing)
    by_source = {name: sum(r["source"] == name for r in train) for name, _ in streams}
    manifest = {
        "packages": package_versions(),
        "sources": {s: TRAIN_SOURCES[s].describe() for s in names},
        "config": asdict(cfg),
        "steps": list(STEPS),
        "funnel": funnels,
        "counts": {
            "train": len(train),
            "train_by_source": by_source,
            "sharegpt_heldout": len(heldout),
            "humaneval": len(humaneval),
            "writingbench": len(writing),
            "heldout_bench": len(benches),
        },
        **(meta or {}),
    }
    (workdir / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")
    log.info("prompts: %s", manifest["counts"])
    return manifest


def heldout_prompts(tokenizer) -> dict[str, list[list[int]]]:
    """bench.load.HELDOUT's prompts as evaluation sets: {"heldout-CATEGORY": [prompt ids]}, each one
    user message in the chat template (as the gateway sends it), in the file's order within a category."""
    sets: dict[str, list[list[int]]] = {f"heldout-{c}": [] for c in CATEGORIES}
    for p in (p for f in HELDOUT for p in read_heldout(f)):
        sets[f"heldout-{p.category}"].append(tokenizer.encode_chat([("user", p.text)]))
    return sets
