"""How much of the responses a draft vocabulary holds: a token outside it cannot be drafted, so it ends the round.

    python -m training.vocab --gen W/gen [--head models/eagle3-smollm2] [--sizes 8192,16384,32768] [--held-out 0.25]
        [--source-weights sharegpt=3]

The vocabularies of --sizes are chosen as `train` chooses them (training.train.top_tokens: the most frequent response
tokens) over the sequences before the last --held-out share, and their coverage (the share of response tokens they
hold) is measured on that last share, as on responses they were not chosen from; --head's vocabulary is measured on
the same share. --source-weights counts each sequence as `train --source-weights` does, in both shares. Prints a
markdown table.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

from training.generate import load_sequences
from training.sources import parse_source_weights
from training.train import response_counts, sequence_copies, top_tokens


def coverage(held: np.ndarray, vocab: np.ndarray) -> float:
    """Share of the held-out response tokens (counts [vocab_size]) that vocab (base ids) holds:
    counts [1, 3, 0, 6], vocab [1, 3] -> 9 / 10."""
    return float(held[vocab].sum() / max(held.sum(), 1))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m training.vocab", description=__doc__.split("\n\n")[0])
    p.add_argument("--gen", type=Path, required=True, help="a workdir's gen/ (the generate stage's shards)")
    p.add_argument("--head", type=Path, default=None, help="an EAGLE-3 head folder whose vocabulary to measure too")
    p.add_argument("--sizes", default="8192,12288,16384,24576,32768")
    p.add_argument("--held-out", type=float, default=0.25, help="the last share of the sequences, measured on")
    p.add_argument("--vocab-size", type=int, default=49152, help="the base vocabulary (SmolLM2's)")
    p.add_argument("--source-weights", default="", help="SOURCE=COPIES,... as train's")
    a = p.parse_args(argv)
    if not 0 < a.held_out < 1:
        p.error("--held-out takes a share in (0, 1)")
    try:
        weights = parse_source_weights(a.source_weights)
    except ValueError as e:
        p.error(f"--source-weights: {e}")
    seqs = load_sequences(a.gen)
    copies = sequence_copies(seqs, weights)  # [N]
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
