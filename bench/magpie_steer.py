"""What the Magpie steers make the base model write: a few user messages per steer, sampled on the CPU in
float32 the way the prompts stage samples them (training/magpie.py: the template up to the user turn, the
steer's opener, then temperature 1.0 and top-p 0.95 until <|im_end|>), printed and written to DIR/steers.jsonl
for reading by eye (are the writing steers' messages writing requests?).

    PYTHONPATH=. python -m bench.magpie_steer [--per-steer 3] [--max-new-tokens 48] [--seed 5] [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import logging
from pathlib import Path

import torch

from common.model.llama import LlamaModel
from common.tokenizer import Tokenizer
from common.weights import load_checkpoint
from training.generate import Sampling, generate_batch
from training.magpie import STEERS, steer_prefixes

log = logging.getLogger("bench.magpie_steer")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--per-steer", type=int, default=3)
    ap.add_argument("--max-new-tokens", type=int, default=48)
    ap.add_argument("--seed", type=int, default=5)
    ap.add_argument("--out", default="bench-results")
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    ckpt = load_checkpoint()
    tok = Tokenizer(ckpt.path)
    model = LlamaModel(ckpt.config)
    model.load_state_dict(ckpt.state_dict, strict=False)
    model.eval().requires_grad_(False)
    prefixes = steer_prefixes(tok.encode_turn_prefix("user"), tok.encode_prompt, list(STEERS))
    rows = []
    for steer in STEERS:
        n, prefix = args.per_steer, prefixes[steer.id]
        sampling = Sampling(1.0, 0.95, args.seed)
        for out in generate_batch(
            model, [prefix] * n, args.max_new_tokens, tok.eos_token_id, torch.device("cpu"), sampling
        ):
            ids = out[:-1] if out[-1:] == [tok.eos_token_id] else out
            rows.append({"steer": steer.id, "text": steer.opener + tok.decode(ids)})
            log.info("%-16s %s", steer.id, rows[-1]["text"].replace("\n", " ")[:150])
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "steers.jsonl").write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows))


if __name__ == "__main__":
    main()
