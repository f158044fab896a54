"""CPU benchmark: plain and speculative decoding through the three services, and the verifier engine's
plain decoding in this process, against Hugging Face eager `generate`, same prompts, same run, float32,
one request at a time (prefill included).

    python -m bench.cpu_bench --out DIR [--prompts 4] [--max-new-tokens 64]

Each figure is wall time per generated token of a whole request (the client's view, prefill included),
averaged over the prompts. Writes DIR/cpu_bench.json and DIR/cpu_bench.md and prints the markdown. Run it
on an otherwise idle machine: the services and Hugging Face share its cores.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import platform
import time
from pathlib import Path

import grpc

from bench.engine_bench import QUESTIONS
from services.stack import Stack
from specdec.v1 import generation_pb2 as gpb
from specdec.v1 import generation_pb2_grpc as gpb_grpc

log = logging.getLogger("bench.cpu_bench")


def through_services(addr: str, prompts: list[str], max_new: int, speculative: bool, tree: str = "") -> dict:
    """One request at a time; tree: a pinned DEPTHxNODES (the policy off), "" for the gateway's policy."""
    per_token, accept = [], []
    with grpc.insecure_channel(addr) as ch:
        stub = gpb_grpc.GenerationStub(ch)
        for text in prompts:
            req = gpb.GenerateRequest(
                messages=[gpb.ChatMessage(role="user", content=text)],
                max_tokens=max_new,
                ignore_eos=True,
                speculative=speculative,
            )
            if tree:
                depth, nodes = (int(x) for x in tree.split("x"))
                req.tree.depth, req.tree.nodes = depth, nodes
            t0 = time.perf_counter()
            resp = stub.Complete(req, timeout=600)
            per_token.append((time.perf_counter() - t0) / len(resp.token_ids))
            if speculative:  # the policy may not have drafted at all: no rounds
                accept.append((resp.speculation.accepted_tokens, resp.speculation.rounds))
    rounds = sum(r for _, r in accept)
    return {
        "ms_per_token": 1e3 * sum(per_token) / len(per_token),
        "acceptance_length": (sum(a for a, _ in accept) + rounds) / rounds if rounds else None,
    }


def engine_plain(prompts: list[str], max_new: int) -> dict:
    """The verifier engine in this process: prefill, then one decode call per token (no gRPC)."""
    from common.config import SamplingConfig
    from common.engine.base import PrefillInput
    from common.engine.verifier import Verifier, VerifierConfig
    from common.model_path import default_model_path
    from common.tokenizer import Tokenizer
    from common.weights import load_checkpoint

    tok = Tokenizer(default_model_path())
    verifier = Verifier(load_checkpoint(), VerifierConfig(max_sequences=1, max_context=1024))
    per_token = []
    for text in prompts:
        ids = tok.encode_chat([("user", text)])
        t0 = time.perf_counter()
        verifier.prefill(PrefillInput("p", ids, SamplingConfig()))
        for _ in range(max_new - 1):
            verifier.decode(["p"])
        per_token.append((time.perf_counter() - t0) / max_new)
        verifier.release(["p"])
    return {"ms_per_token": 1e3 * sum(per_token) / len(per_token), "acceptance_length": None}


def hugging_face(prompts: list[str], max_new: int) -> dict:
    import torch
    from transformers import AutoModelForCausalLM

    from common.tokenizer import Tokenizer
    from common.weights import default_model_path

    path = default_model_path()
    tok = Tokenizer(path)
    model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32).eval()
    per_token = []
    with torch.inference_mode():
        for text in prompts:
            ids = torch.tensor([tok.encode_chat([("user", text)])])
            t0 = time.perf_counter()
            out = model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=max_new,
                min_new_tokens=max_new,
                do_sample=False,
            )
            per_token.append((time.perf_counter() - t0) / (out.shape[1] - ids.shape[1]))
    return {"ms_per_token": 1e3 * sum(per_token) / len(per_token), "acceptance_length": None}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument(
        "--trees", default="6x60,2x4,1x1", help="fixed trees measured beside the policy (comma-separated, '' for none)"
    )
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    prompts = [QUESTIONS[i % len(QUESTIONS)] for i in range(args.prompts)]
    results = {}
    stack = Stack(
        common_args=["--device", "cpu", "--dtype", "float32", "--max-context", "1024", "--max-sequences", "4"]
    ).start()
    try:
        through_services(stack.gateway, prompts[:1], 4, False)  # warm-up
        results["services-plain"] = through_services(stack.gateway, prompts, args.max_new_tokens, False)
        results["services-speculative"] = through_services(stack.gateway, prompts, args.max_new_tokens, True)
        with grpc.insecure_channel(stack.gateway) as ch:
            info = gpb_grpc.GenerationStub(ch).GetModelInfo(gpb.ModelInfoRequest(), timeout=10)
        results["services-speculative"]["policy_choices"] = {
            f"{c.tree.depth}x{c.tree.nodes}" if c.tree.depth else "plain": c.rounds for c in info.policy_choices
        }
        for tree in filter(None, args.trees.split(",")):
            results[f"services-tree-{tree}"] = through_services(stack.gateway, prompts, args.max_new_tokens, True, tree)
    finally:
        stack.stop()
    results["engine-plain"] = engine_plain(prompts, args.max_new_tokens)
    results["hf-generate"] = hugging_face(prompts, args.max_new_tokens)
    hf = results["hf-generate"]["ms_per_token"]
    for r in results.values():
        r["speed_vs_hf"] = hf / r["ms_per_token"]
    meta = {
        "machine": f"{platform.machine()}, {os.cpu_count()} cores",
        "prompts": args.prompts,
        "max_new_tokens": args.max_new_tokens,
        "command": f"python -m bench.cpu_bench --out DIR --prompts {args.prompts} "
        f"--max-new-tokens {args.max_new_tokens} --trees {args.trees}",
    }
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "cpu_bench.json").write_text(json.dumps({"meta": meta, "results": results}, indent=1))
    lines = [
        f"# CPU benchmark ({meta['machine']}, float32, {args.prompts} chat prompts x {args.max_new_tokens} "
        "tokens, prefill included)",
        "",
        f"Command: `{meta['command']}`",
        "",
        "| method | ms/token | speed vs HF generate | acceptance length |",
        "|---|---:|---:|---:|",
    ]
    plain = results["services-plain"]["ms_per_token"]
    lines[-2:] = [
        "| method | ms/token | speed vs HF generate | vs services-plain | acceptance length |",
        "|---|---:|---:|---:|---:|",
    ]
    for name, r in results.items():
        acc = "-" if r["acceptance_length"] is None else f"{r['acceptance_length']:.2f}"
        lines.append(
            f"| {name} | {r['ms_per_token']:.1f} | {r['speed_vs_hf']:.2f}x | {plain / r['ms_per_token']:.2f}x | {acc} |"
        )
    lines += ["", f"Policy choices (group rounds): {results['services-speculative']['policy_choices']}"]
    text = "\n".join(lines)
    (out / "cpu_bench.md").write_text(text + "\n")
    log.info("\n%s", text)


if __name__ == "__main__":
    main()
