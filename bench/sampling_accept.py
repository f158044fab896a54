"""Mean acceptance length of the two sampling rules (DraftingConfig.sampling_rule), in process: the
verifier and the shipped EAGLE-3 head driven by the engine core (common.engine.core.EngineCore, the draft's
default tree pinned), sampled requests (temperature 0.7 and 1.0, top-p 0.9 by default; one seed per prompt),
stopping at EOS or the token limit.
    python -m bench.sampling_accept --out DIR [--prompts 6] [--max-new-tokens 64] [--device cpu]
                                    [--prompts-file W/sharegpt_heldout.jsonl]
By default the prompts are the first --prompts of the load benchmark's held-out mixed prompts
(bench/prompts/heldout-mixed.jsonl, interleaved by category) with the chat template; --prompts-file takes the
first --prompts rows of a JSONL file with "prompt_ids" (the training pipeline's held-out sets, or
tests/data/heldout_sharegpt.jsonl).
"Acceptance length" is (accepted drafted tokens + rounds) / rounds: tokens per verification round, the bonus
token included, as the API's mean_acceptance_length.
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

import torch

from common.config import SAMPLING_RULES, DraftingConfig, SamplingConfig
from common.engine.core import CoreConfig, EngineCore
from common.engine.factory import make_drafter, make_verifier, pick_dtype
from common.engine.verifier import Verifier, VerifierConfig, torch_dtype
from common.model.eagle3 import Eagle3Head
from common.model.eagle3_io import load_eagle3
from common.policy import FixedPolicy, Shape
from common.sequence import Finish, Request
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
    tree = Shape(drafting.steps, drafting.verify_tree_size)
    core = EngineCore(verifier, drafter, FixedPolicy(tree), CoreConfig(max_sequences=len(prompts)))
    eos = frozenset({verifier.model.cfg.eos_token_id})
    for i, ids in enumerate(prompts):
        core.add(Request(f"s{i}", ids, replace(sampling, seed=(sampling.seed or 0) + i), max_new, eos, tree=tree))
    rounds = accepted = tokens = 0
    left = len(prompts)
    t0 = time.perf_counter()
    while left:
        for out in core.step():
            if out.finish is Finish.ERROR:
                raise RuntimeError(f"sequence {out.seq_id} failed") from out.error
            rounds, accepted, tokens = rounds + out.rounds, accepted + out.accepted, tokens + len(out.tokens)
            left -= out.finish is not Finish.NONE
    return {
        "rounds": rounds,
        "tokens": tokens,
        "mean_accept_len": (accepted + rounds) / rounds if rounds else 0.0,
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


def mixed_prompts(ckpt, n: int) -> list[list[int]]:
    """The first n held-out mixed prompts (bench.load's workload), chat-templated."""
    from bench.load import read_prompts as mixed
    from common.tokenizer import Tokenizer

    tok = Tokenizer(ckpt.path)
    return [tok.encode_chat([("user", p.text)]) for p in mixed()[:n]]


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
    prompts = read_prompts(args.prompts_file, args.prompts) if args.prompts_file else mixed_prompts(ckpt, args.prompts)
    verifier = make_verifier(
        ckpt,
        VerifierConfig(max_sequences=args.prompts, max_context=1024, dtype=dtype, device=args.device),
        graphs=False,
    )
    head, _ = load_eagle3(args.head)
    head.to(device=torch.device(args.device), dtype=torch_dtype(dtype)).eval()
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
