"""Mean acceptance length of the two sampling rules (DraftingConfig.sampling_rule), in process: the
verifier and the shipped EAGLE-3 head driven by common.engine.loop.speculative_loop, sampled requests
(temperature 0.7 and 1.0, top-p 0.9 by default; one seed per prompt), stopping at EOS or the token limit.
    python -m bench.sampling_accept --out DIR [--prompts 6] [--max-new-tokens 64] [--device cpu]
                                    [--prompts-file W/sharegpt_heldout.jsonl]
By default the prompts are the benchmark's chat questions (bench.engine_bench.QUESTIONS); --prompts-file takes
the first --prompts rows of a JSONL file with "prompt_ids" (the training pipeline's held-out sets, or
tests/data/heldout_sharegpt.jsonl).
"Acceptance length" is tokens committed per verification round (accepted drafted tokens plus the bonus).
Prints a markdown table and writes DIR/sampling_accept.json. Both rules are lossless
(tests/test_sampling_rule.py): the one that accepts more is the default.
"""

from __future__ import annotations

import argparse
import json
import logging
import platform
import sys
import time
from dataclasses import replace
from pathlib import Path

import numpy as np
import torch

from bench.engine_bench import encode_prompts, load_head
from common.config import SAMPLING_RULES, DraftingConfig, SamplingConfig
from common.engine.factory import make_drafter, make_verifier, pick_dtype
from common.engine.loop import Round, speculative_loop
from common.engine.verifier import Verifier, VerifierConfig
from common.model.eagle3 import Eagle3Head
from common.weights import load_checkpoint
from training.prompts import read_prompts as prompt_rows

log = logging.getLogger("bench.sampling_accept")
DEFAULT_HEAD = Path(__file__).resolve().parents[1] / "models" / "eagle3-smollm2"


def acceptance(
    verifier: Verifier,
    head: Eagle3Head,
    drafting: DraftingConfig,
    prompts: list[list[int]],
    sampling: SamplingConfig,
    max_new: int,
    device: str,
) -> dict:
    """One rule at one sampling setting: every prompt decoded together, prompt i with seed + i."""
    drafter = make_drafter(head, verifier.model.embed_tokens, drafting, len(prompts), 1024, device, graphs=False)
    eos = verifier.model.cfg.eos_token_id
    outs: dict[str, list[int]] = {f"s{i}": [] for i in range(len(prompts))}
    committed: list[int] = []

    def commit(sid: str, tokens: list[int]) -> bool:
        outs[sid] += tokens
        return len(outs[sid]) < max_new and eos not in outs[sid]

    def on_round(r: Round) -> None:
        committed.extend(r.committed)

    seeds = {sid: replace(sampling, seed=(sampling.seed or 0) + i) for i, sid in enumerate(outs)}
    t0 = time.perf_counter()
    speculative_loop(
        verifier,
        drafter,
        dict(zip(outs, prompts)),
        drafting.verify_tree_size,
        commit,
        on_round,
        sampling=seeds,
    )
    c = np.array(committed)
    return {
        "rounds": int(c.size),
        "tokens": int(c.sum()),
        "mean_accept_len": float(c.mean()) if c.size else 0.0,
        "wall_s": round(time.perf_counter() - t0, 2),
    }


def read_prompts(path: Path, n: int) -> list[list[int]]:
    """The first n rows' prompt_ids of a prompts file (training.prompts.read_prompts); ValueError when it has
    fewer rows or a row lacks them."""
    rows = prompt_rows(path)[:n]
    if len(rows) < n:
        raise ValueError(f"{path} has {len(rows)} prompts, fewer than --prompts {n}")
    for i, r in enumerate(rows, 1):
        ids = r.get("prompt_ids")
        if not ids or not all(isinstance(t, int) for t in ids):
            raise ValueError(f"{path}: row {i} has no list of integer prompt_ids")
    return [r["prompt_ids"] for r in rows]


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--prompts", type=int, default=6)
    ap.add_argument("--prompts-file", type=Path, default=None, help='JSONL rows with "prompt_ids" (chat-templated)')
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--temperatures", type=float, nargs="+", default=[0.7, 1.0])
    ap.add_argument("--top-p", type=float, default=0.9)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default=None, help="float32 | bfloat16 | float16 (default: by device)")
    ap.add_argument("--head", default=str(DEFAULT_HEAD))
    ap.add_argument("--rules", nargs="+", default=list(SAMPLING_RULES), choices=SAMPLING_RULES)
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    torch.set_grad_enabled(False)
    dtype = pick_dtype(args.device, args.dtype)
    ckpt = load_checkpoint()
    prompts = read_prompts(args.prompts_file, args.prompts) if args.prompts_file else encode_prompts(ckpt, args.prompts)
    verifier = make_verifier(
        ckpt,
        VerifierConfig(max_sequences=args.prompts, max_context=1024, dtype=dtype, device=args.device),
        graphs=False,
    )
    head = load_head(args.head, ckpt.config, torch.device(args.device), dtype)
    results = []
    for temperature in args.temperatures:
        sampling = SamplingConfig(temperature=temperature, top_p=args.top_p, seed=args.seed)
        for rule in args.rules:
            r = acceptance(
                verifier, head, DraftingConfig(sampling_rule=rule), prompts, sampling, args.max_new_tokens, args.device
            )
            results.append({"rule": rule, "temperature": temperature, "top_p": args.top_p, **r})
            log.info("%s at temperature %.2f: mean acceptance length %.3f", rule, temperature, r["mean_accept_len"])
    meta = {
        "device": args.device,
        "dtype": dtype,
        "machine": platform.machine(),
        "prompts": len(prompts),
        "prompts_file": str(args.prompts_file) if args.prompts_file else None,
        "max_new_tokens": args.max_new_tokens,
        "tree": {"top_k": 10, "steps": 6, "verify_tree_size": 60, "q_width": DraftingConfig().q_width},
        "command": "python -m bench.sampling_accept " + " ".join(sys.argv[1:] if argv is None else argv),
    }
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "sampling_accept.json").write_text(json.dumps({"meta": meta, "results": results}, indent=1))
    lines = [
        f"# Sampling rules: mean acceptance length ({args.device}, {dtype}, {len(prompts)} prompts"
        f"{' of ' + args.prompts_file.name if args.prompts_file else ''} x "
        f"{args.max_new_tokens} tokens, top-p {args.top_p})",
        "",
        "| temperature | rule | rounds | tokens | mean acceptance length |",
        "|---|---|---|---|---|",
    ]
    lines += [
        f"| {r['temperature']} | {r['rule']} | {r['rounds']} | {r['tokens']} | {r['mean_accept_len']:.3f} |"
        for r in results
    ]
    (out / "sampling_accept.md").write_text("\n".join(lines) + "\n")
    sys.stdout.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
