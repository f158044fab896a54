"""A small client: python -m services.client [--addr HOST:PORT] [--raw] [--plain] "your question"

Streams the completion as it is generated, then prints usage and speculation stats. `demo` (python -m
services.stack --demo, make run) also times the same request with the draft's tree pinned and with plain decoding,
and says what the speculation policy chose and why (its estimates for one sequence)."""

from __future__ import annotations

import argparse
import os
import sys
import time
from typing import TextIO

import grpc

from specdec.v1 import generation_pb2 as gpb
from specdec.v1 import generation_pb2_grpc as gpb_grpc


def stream(
    addr: str,
    text: str,
    *,
    max_tokens: int = 128,
    chat: bool = True,
    speculative: bool = True,
    temperature: float = 0.0,
    out: TextIO = sys.stdout,
) -> gpb.GenerateResponse:
    req = gpb.GenerateRequest(max_tokens=max_tokens, temperature=temperature, speculative=speculative)
    if chat:
        req.messages.add(role="user", content=text)
    else:
        req.prompt = text
    last = None
    with grpc.insecure_channel(addr) as ch:
        for msg in gpb_grpc.GenerationStub(ch).Generate(req):
            out.write(msg.text)
            out.flush()
            last = msg
    s, u = last.speculation, last.usage
    out.write(
        f"\n\n[{gpb.FinishReason.Name(last.finish_reason)}] prompt {u.prompt_tokens} tokens, "
        f"completion {u.completion_tokens} tokens; speculation: {s.rounds} rounds, "
        f"{s.drafted_tokens} drafted, {s.accepted_tokens} accepted, "
        f"mean acceptance length {s.mean_acceptance_length:.2f}\n"
    )
    return last


def demo(addr: str, text: str = "Why is the sky blue?", max_tokens: int = 96, out: TextIO = sys.stdout) -> None:
    """Stream `text` under the policy, then time it pinned to the draft's tree and plainly, and explain."""
    stream(addr, text, max_tokens=max_tokens, out=out)
    with grpc.insecure_channel(addr) as ch:
        stub = gpb_grpc.GenerationStub(ch)
        info = stub.GetModelInfo(gpb.ModelInfoRequest(), timeout=30)
        if not info.drafting_steps:
            out.write("No draft: every request is decoded plainly.\n")
            return
        rates = {}
        own = (info.drafting_steps, info.verify_tree_size)
        for name, tree, spec in (("pinned tree", own, True), ("plain", None, False)):
            req = gpb.GenerateRequest(max_tokens=max_tokens, speculative=spec)
            req.messages.add(role="user", content=text)
            if tree:
                req.tree.depth, req.tree.nodes = tree
            t0 = time.perf_counter()
            r = stub.Complete(req, timeout=600)
            rates[name] = (len(r.token_ids) / (time.perf_counter() - t0), r.speculation.mean_acceptance_length)
        info = stub.GetModelInfo(gpb.ModelInfoRequest(), timeout=30)
    (tree_rate, acceptance), (plain_rate, _) = rates["pinned tree"], rates["plain"]
    out.write(
        f"Same request, {info.drafting_steps}x{info.verify_tree_size} tree pinned: {tree_rate:.1f} tokens/s "
        f"(mean acceptance length {acceptance:.2f}); plain decoding: {plain_rate:.1f} tokens/s "
        f"({tree_rate / plain_rate:.2f}x).\n"
    )
    one = [e for e in info.policy_estimates if e.batch == 1 and e.band == "greedy" and e.HasField("tokens_per_s")]
    if one:
        best = max(one, key=lambda e: e.tokens_per_s)
        plain = next((e.tokens_per_s for e in one if e.tree.depth == 0), 0.0)
        what = "plain decoding" if best.tree.depth == 0 else f"the {best.tree.depth}x{best.tree.nodes} tree"
        out.write(
            f"The speculation policy picks {what} for one sequence on this {info.device}: it estimates "
            f"{best.tokens_per_s:.1f} tokens/s for it against {plain:.1f} for plain decoding "
            "(GetModelInfo.policy_estimates; a round costs what the device makes of a tree's rows).\n"
        )


def main() -> None:
    p = argparse.ArgumentParser(prog="python -m services.client", description=__doc__)
    p.add_argument("text")
    p.add_argument("--addr", default=os.environ.get("GATEWAY_ADDR", "127.0.0.1:50051"))
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--raw", action="store_true", help="send a raw prompt, no chat template")
    p.add_argument("--plain", action="store_true", help="plain decoding on the verifier (no speculation)")
    a = p.parse_args()
    try:
        stream(
            a.addr, a.text, max_tokens=a.max_tokens, chat=not a.raw, speculative=not a.plain, temperature=a.temperature
        )
    except grpc.RpcError as e:
        sys.stderr.write(f"error: {e.code().name}: {e.details()}\n")
        sys.exit(1)


if __name__ == "__main__":
    main()
