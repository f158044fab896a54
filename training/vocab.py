"""How much of the responses a draft vocabulary holds: a token outside it cannot be drafted, so it ends the round.

    python -m training.vocab --gen W/gen [--head models/eagle3-smollm2] [--sizes 8192,16384,32768] [--held-out 0.25]
        [--source-weights sharegpt=3]

The vocabularies of --sizes are chosen as `train` chooses them (training.train.top_tokens: the most frequent response
tokens) over the sequences before the last --held-out share, and their coverage (the share of response tokens they
hold) is measured on that last share, as on responses they were not chosen from; --head's vocabulary is measured on
the same share. --source-weights counts each sequence as `train --source-weights` does, in both shares. Prints a
markdown table.

    python -m training.vocab --gen W/gen --head models/eagle3-smollm2 --against F [F ...] --responses FILE
        [--swap-ratios 1,2,3,4] [--against-limit N] [--max-prompt-tokens 400] [--chunk 24]

measures instead on the base model's greedy responses (CPU, float32, 256 tokens, --chunk prompts a batch, each
file's prompts in turn) to the prompts of the files F: the benchmarks' ({"category", "prompt"} a line,
bench/prompts/*.jsonl, grouped by category) or the prompts stage's ({"source", "prompt_ids"}, e.g.
W/humaneval.jsonl, grouped by source), the first --against-limit of each file, those of at most --max-prompt-tokens,
and pooled as "all". The responses are written to FILE and read back from it on the next call. The rows: --head's
vocabulary, and the vocabulary `train --init-head` would give it at each --swap-ratios over the responses of --gen
(training.train.kept_vocab).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

from training.generate import load_sequences
from training.sources import parse_source_weights
from training.train import kept_vocab, response_counts, sequence_copies, top_tokens


def coverage(held: np.ndarray, vocab: np.ndarray) -> float:
    """Share of the held-out response tokens (counts [vocab_size]) that vocab (base ids) holds:
    counts [1, 3, 0, 6], vocab [1, 3] -> 9 / 10."""
    return float(held[vocab].sum() / max(held.sum(), 1))


def read_against(files: list[Path], limit: int | None, max_tokens: int) -> list[list[tuple[str, list[int]]]]:
    """Each file's (group, prompt ids): a benchmark prompt's category and its chat-templated ids, or a prompts-stage
    row's source and its prompt_ids; the first `limit` rows, those of at most max_tokens ids."""
    import json

    from bench.load import read_prompts
    from common.model_path import default_model_path
    from common.tokenizer import Tokenizer

    tok = None
    out = []
    for f in files:
        rows = [json.loads(line) for line in f.read_text(encoding="utf-8").splitlines() if line.strip()]
        if rows and "category" in rows[0]:  # a benchmark's file, in bench.load.read_prompts' order (by category)
            tok = tok or Tokenizer(default_model_path())
            pairs = [(p.category, tok.encode_chat([("user", p.text)])) for p in read_prompts(f)[:limit]]
        else:
            pairs = [(r["source"], r["prompt_ids"]) for r in rows[:limit]]
        out.append([(g, ids) for g, ids in pairs if len(ids) <= max_tokens])
    return out


def base_responses(files: list[list[tuple[str, list[int]]]], path: Path, chunk: int) -> list[tuple[str, list[int]]]:
    """(group, response ids, without the eos) of the base model's greedy responses (CPU, float32, 256 tokens, stopped
    at eos: the chat template's end of turn) to each file's prompts, `chunk` a batch; written to `path` (JSON) and read
    back from it when it exists."""
    import json

    if path.exists():
        return [(r["group"], r["response"]) for r in json.loads(path.read_text())]
    import torch

    from common.model.llama import LlamaModel
    from common.model_path import default_model_path
    from common.tokenizer import Tokenizer
    from common.weights import load_checkpoint
    from training.generate import generate_batch

    eos = Tokenizer(default_model_path()).eos_token_id
    ck = load_checkpoint()
    model = LlamaModel.loaded(ck.config, ck.state_dict, torch.device("cpu"), torch.float32)
    out = []
    for pairs in files:
        for i in range(0, len(pairs), chunk):
            part = pairs[i : i + chunk]
            with torch.no_grad():
                res = generate_batch(model, [ids for _, ids in part], 256, eos, torch.device("cpu"))
            out += [(g, [int(t) for t in r if t != eos]) for (g, _), r in zip(part, res)]
    path.write_text(json.dumps([{"group": g, "response": r} for g, r in out]))
    return out


def against_table(a: argparse.Namespace, copies: np.ndarray, seqs) -> list[str]:
    """The --against mode's markdown table (see the module's docstring)."""
    from common.model.eagle3_io import load_eagle3

    pairs = base_responses(read_against(a.against, a.against_limit, a.max_prompt_tokens), a.responses, a.chunk)
    groups: dict[str, np.ndarray] = {}
    for g, r in pairs:
        groups[g] = groups.get(g, np.zeros(a.vocab_size, dtype=np.int64)) + np.bincount(r, minlength=a.vocab_size)
    groups["all"] = sum(groups.values())
    head, _ = load_eagle3(a.head)
    saved = head.base_ids().numpy()  # [draft vocab]
    counts = response_counts(seqs, a.vocab_size, copies=copies)
    rows = [(str(a.head), saved)]
    for r in (float(x) for x in a.swap_ratios.split(",") if x.strip()):
        vocab = kept_vocab(counts, saved, r)
        rows.append((f"--vocab-swap-ratio {r:g} ({np.setdiff1d(vocab, saved).size} new)", vocab))
    lines = [
        f"Coverage of the base's greedy responses to {', '.join(map(str, a.against))} ({len(pairs)} prompts)",
        "",
        "| vocabulary | " + " | ".join(groups) + " |",
        "|---|" + "---:|" * len(groups),
    ]
    for name, vocab in rows:
        lines.append(f"| {name} | " + " | ".join(f"{100 * coverage(h, vocab):.1f}" for h in groups.values()) + " |")
    return lines


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m training.vocab", description=__doc__.split("\n\n")[0])
    p.add_argument("--gen", type=Path, required=True, help="a workdir's gen/ (the generate stage's shards)")
    p.add_argument("--head", type=Path, default=None, help="an EAGLE-3 head folder whose vocabulary to measure too")
    p.add_argument("--sizes", default="8192,12288,16384,24576,32768")
    p.add_argument("--held-out", type=float, default=0.25, help="the last share of the sequences, measured on")
    p.add_argument("--vocab-size", type=int, default=49152, help="the base vocabulary (SmolLM2's)")
    p.add_argument("--source-weights", default="", help="SOURCE=COPIES,... as train's")
    p.add_argument("--against", type=Path, nargs="+", default=None, help="prompt files: measure on their responses")
    p.add_argument("--responses", type=Path, default=None, help="--against: the responses' file (written once)")
    p.add_argument("--swap-ratios", default="1,2,3,4,8", help="--against: the --vocab-swap-ratio values to show")
    p.add_argument("--against-limit", type=int, default=None, help="--against: the first N prompts of each file")
    p.add_argument("--max-prompt-tokens", type=int, default=400, help="--against: longer prompts are left out")
    p.add_argument("--chunk", type=int, default=24, help="--against: prompts a generation batch")
    a = p.parse_args(argv)
    if not 0 < a.held_out < 1:
        p.error("--held-out takes a share in (0, 1)")
    if a.against is not None and (a.responses is None or a.head is None):
        p.error("--against needs --responses FILE and --head DIR")
    try:
        weights = parse_source_weights(a.source_weights)
    except ValueError as e:
        p.error(f"--source-weights: {e}")
    seqs = load_sequences(a.gen)
    copies = sequence_copies(seqs, weights)  # [N]
    if a.against is not None:
        sys.stdout.write("\n".join(against_table(a, copies, seqs)) + "\n")
        return 0
    cut = int(len(seqs) * (1 - a.held_out))
    chosen_on = response_counts(seqs, a.vocab_size, range(cut), copies)
    held = response_counts(seqs, a.vocab_size, range(cut, len(seqs)), copies)
    lines = [
        f"Coverage of the response tokens of sequences {cut}..{len(seqs) - 1} of {a.gen} ({int(held.sum()):,} tokens)",
        "",
        "| vocabulary | tokens | coverage |",
        "|---|---:|---:|",
    ]
    if a.head is not None:
        from common.model.eagle3_io import load_eagle3

        head, cfg = load_eagle3(a.head)
        vocab = head.base_ids().numpy()  # [draft vocab]
        lines.append(f"| {a.head} | {cfg.draft_vocab_size} | {100 * coverage(held, vocab):.1f}% |")
    for size in (int(s) for s in a.sizes.split(",")):
        covered = coverage(held, top_tokens(chosen_on, size))
        lines.append(f"| the most frequent before the held-out share | {size} | {100 * covered:.1f}% |")
    sys.stdout.write("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
