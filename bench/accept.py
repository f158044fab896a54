"""Mean acceptance length per held-out category, through the public API: what a draft head buys users.

    python -m bench.accept --out DIR                              # starts `python -m services.stack --device cuda`
    python -m bench.accept --out DIR --head W/head                # the stack with another EAGLE-3 head
    python -m bench.accept --gateway 127.0.0.1:50051 --out DIR    # a gateway that is already serving

Each prompt of bench/prompts/heldout-mixed.jsonl and heldout-more.jsonl (24 each of chat, code, math, QA,
summarization and writing, never trained on: the deduplicator of training/prompts.py drops training prompts equal or
near-equal to them) is sent one request at a time, with the tree pinned (--tree, default 6x60: the drafter's top-k
10, depth 6, 60 nodes), max_tokens 256, stopped by EOS, at each --temperatures entry: once greedy at 0, otherwise
with top-p --top-p --seeds times (the i-th of n prompts with seeds i, i + n, i + 2n, ...). A request's answer says
its verification rounds and mean acceptance length (committed tokens per round, the bonus token included); a
category's figure pools its requests' rounds: the sum of acceptance x rounds over the sum of rounds, i.e. committed
tokens per round. "all" pools every category.
Writes DIR/accept.json (every request's tokens, rounds and acceptance, the table, GetModelInfo) and DIR/accept.md
(also printed). `--compare BASE/accept.json NEW/accept.json` prints, without a run, the mean and standard error of
NEW's acceptance minus BASE's, prompt by prompt (a prompt's seeds averaged), per category and temperature.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import math
import shlex
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from bench.load import CATEGORIES, HELDOUT, Client, Prompt, open_gateway, read_prompts, stack_options
from common.policy import Shape

log = logging.getLogger("bench.accept")
ALL = "all"


@dataclass(frozen=True)
class Answer:
    """One request's outcome: its prompt's category, the temperature, and what the API answered."""

    category: str
    temperature: float
    tokens: int
    finish: str
    rounds: int
    acceptance: float  # committed tokens per round (0 when rounds is 0)
    prompt: int = -1  # the prompt's index in the run's list
    seed: int | None = None  # a sampled request's seed


def parse_tree(text: str) -> Shape:
    """--tree's value: a tree shape, Shape.parse's DEPTHxNODES ('6x60' -> Shape(6, 60)); plain refused."""
    try:
        shape = Shape.parse(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"--tree takes DEPTHxNODES with nodes >= depth >= 1: {e}") from None
    if shape.plain:
        raise argparse.ArgumentTypeError(f"--tree takes DEPTHxNODES with nodes >= depth >= 1, got {text!r}")
    return shape


def message(prompt: Prompt, seed: int, tree: Shape, temperature: float, top_p: float, max_tokens: int) -> dict:
    """The request for one prompt (field names as in generation.proto): greedy at temperature 0, else sampled with
    top-p and the seed."""
    m = {"messages": [{"role": "user", "content": prompt.text}], "max_tokens": max_tokens}
    m["tree"] = {"depth": tree.depth, "nodes": tree.nodes}
    if temperature > 0:
        m |= {"temperature": temperature, "top_p": top_p, "seed": seed}
    return m


def pooled(answers: list[Answer]) -> float | None:
    """Committed tokens per round over the answers' rounds together (None without a round):
    acceptance 4.0 over 10 rounds and 2.0 over 30 -> (40 + 60) / 40 = 2.5."""
    rounds = sum(a.rounds for a in answers)
    return sum(a.acceptance * a.rounds for a in answers) / rounds if rounds else None


def table(answers: list[Answer]) -> dict[float, dict[str, float | None]]:
    """{temperature: {category: pooled acceptance, ..., "all": over every category}}, in CATEGORIES' order."""
    out: dict[float, dict[str, float | None]] = {}
    for t in dict.fromkeys(a.temperature for a in answers):
        at = [a for a in answers if a.temperature == t]
        out[t] = {c: pooled([a for a in at if a.category == c]) for c in CATEGORIES} | {ALL: pooled(at)}
    return out


def paired(base: list[Answer], new: list[Answer]) -> dict[float, dict[str, tuple[float, float]]]:
    """{temperature: {category: (mean, standard error) of new's acceptance minus base's, prompt by prompt}} of two runs
    that sent the same requests (ValueError otherwise). A prompt sent with several seeds counts once, its difference
    the mean over its seeds. Differences 0.2, 0.4, 0.3 -> (0.3, 0.1 / sqrt(3))."""
    if [(a.category, a.temperature, a.prompt, a.seed) for a in base] != [
        (a.category, a.temperature, a.prompt, a.seed) for a in new
    ]:
        raise ValueError("the two runs did not send the same prompts at the same temperatures and seeds")
    out: dict[float, dict[str, tuple[float, float]]] = {}
    for t in dict.fromkeys(a.temperature for a in base):
        out[t] = {}
        for c in CATEGORIES:
            by_prompt: dict[int, list[float]] = {}
            for x, y in zip(base, new):
                if x.temperature == t and x.category == c:
                    by_prompt.setdefault(x.prompt, []).append(y.acceptance - x.acceptance)
            d = [statistics.fmean(v) for v in by_prompt.values()]
            if len(d) > 1:
                out[t][c] = (statistics.fmean(d), statistics.stdev(d) / math.sqrt(len(d)))
    return out


def load_answers(path: Path) -> list[Answer]:
    """An accept.json's answers; an answer that names no prompt gets its position within its temperature (such files
    hold one pass a temperature, in the prompts' order)."""
    position: dict[float, int] = {}
    answers = []
    for x in json.loads(path.read_text())["answers"]:
        if "prompt" not in x:
            x = x | {"prompt": position.get(x["temperature"], 0)}
            position[x["temperature"]] = x["prompt"] + 1
        answers.append(Answer(**x))
    return answers


def compare(base_file: Path, new_file: Path) -> str:
    """`--compare BASE NEW`'s markdown: paired() of two accept.json files."""
    runs = [load_answers(f) for f in (base_file, new_file)]
    lines = [
        f"# {new_file} against {base_file}: acceptance, prompt by prompt (mean +- standard error)",
        "",
        "| temperature | " + " | ".join(CATEGORIES) + " |",
        "|---:|" + "---:|" * len(CATEGORIES),
    ]
    for t, row in paired(*runs).items():
        cells = [f"{row[c][0]:+.2f} +- {row[c][1]:.2f}" if c in row else "-" for c in CATEGORIES]
        lines.append(f"| {t:g} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def markdown(figures: dict[float, dict[str, float | None]], answers: list[Answer], meta: dict) -> str:
    cols = [*CATEGORIES, ALL]
    lines = [
        f"# Acceptance per category: {meta['title']}",
        "",
        f"`{meta['command']}`; {meta['stack']}. Mean acceptance length (committed tokens per verification round, the",
        "bonus token included), each category's requests' rounds pooled.",
        "",
        "| temperature | " + " | ".join(cols) + " | rounds | tokens |",
        "|---:|" + "---:|" * (len(cols) + 2),
    ]
    for t, row in figures.items():
        at = [a for a in answers if a.temperature == t]
        cells = ["-" if row[c] is None else f"{row[c]:.2f}" for c in cols]
        lines.append(
            f"| {t:g} | " + " | ".join(cells) + f" | {sum(a.rounds for a in at)} | {sum(a.tokens for a in at)} |"
        )
    return "\n".join(lines) + "\n"


def ask(client: Client, prompts: list[Prompt], args: argparse.Namespace) -> list[Answer]:
    answers = []
    for t in args.temperatures:
        start = time.monotonic()
        seeds = [i + k * len(prompts) for k in range(args.seeds if t > 0 else 1) for i in range(len(prompts))]
        for n, seed in enumerate(seeds):
            i = n % len(prompts)
            r = client.complete(
                message(prompts[i], seed, args.tree, t, args.top_p, args.max_tokens), args.request_timeout
            )
            sampled_seed = seed if t > 0 else None
            answers.append(
                Answer(prompts[i].category, t, r["tokens"], r["finish"], r["rounds"], r["acceptance"], i, sampled_seed)
            )
        log.info("temperature %g: %d requests in %.1f s", t, len(seeds), time.monotonic() - start)
    return answers


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m bench.accept", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--out", default="bench-results/accept")
    stack_options(p)
    p.add_argument("--head", default="", help="the draft's EAGLE-3 head folder (default: the shipped one)")
    p.add_argument("--tree", type=parse_tree, default=parse_tree("6x60"), help="the pinned tree, DEPTHxNODES")
    p.add_argument("--temperatures", default="0,0.7", help="comma-separated; 0 is greedy")
    p.add_argument("--top-p", type=float, default=0.9, help="top-p of the sampled requests")
    p.add_argument("--seeds", type=int, default=1, help="each prompt's sampled requests, one a seed (greedy: one)")
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--prompts-file", type=Path, nargs="+", default=list(HELDOUT), help="prompt files, read in turn")
    p.add_argument("--prompts", type=int, default=None, help="the first N prompts only (interleaved by category)")
    p.add_argument("--request-timeout", type=float, default=300.0, help="seconds a request")
    p.add_argument(
        "--compare",
        type=Path,
        nargs=2,
        metavar=("BASE", "NEW"),
        help="no run: two accept.json files over the same prompts, their paired differences per category",
    )
    a = p.parse_args(argv)
    try:
        a.temperatures = [float(t) for t in a.temperatures.split(",") if t.strip()]
    except ValueError:
        p.error(f"--temperatures takes comma-separated numbers, got {a.temperatures!r}")
    if not a.temperatures or min(a.temperatures) < 0 or a.max_tokens < 1 or a.seeds < 1:
        p.error("--temperatures takes numbers >= 0 (at least one), --max-tokens and --seeds positive integers")
    return a


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    if a.compare:
        sys.stdout.write(compare(*a.compare))
        return 0
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    prompts = [p for f in a.prompts_file for p in read_prompts(f)][: a.prompts]
    with contextlib.ExitStack() as stack:
        gateway, stack_line = open_gateway(a, out, stack, (f"--draft-arg=--head={a.head}",) if a.head else ())
        client = Client(gateway)
        stack.callback(client.close)
        info = client.model_info()
        answers = ask(client, prompts, a)
    figures = table(answers)
    meta = {
        "title": f"{info.get('device', '?')}, {info.get('dtype', '?')}, {len(prompts)} held-out prompts, "
        f"tree {a.tree} pinned, max_tokens {a.max_tokens}, EOS stops, one at a time"
        + (f", {a.seeds} seeds a sampled prompt" if a.seeds > 1 else ""),
        "command": "python -m bench.accept " + shlex.join(argv if argv is not None else sys.argv[1:]),
        "stack": stack_line,
        "head": a.head or "the shipped head (models/eagle3-smollm2)",
        "model_info": info,
    }
    md = markdown(figures, answers, meta)
    (out / "accept.md").write_text(md)
    result = {
        "meta": meta,
        "figures": {f"{t:g}": row for t, row in figures.items()},
        "answers": [asdict(x) for x in answers],
    }
    (out / "accept.json").write_text(json.dumps(result, indent=1) + "\n")
    sys.stdout.write(md)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
