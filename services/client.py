"""A small client: python -m services.client [--addr HOST:PORT] [--raw] [--plain] "your question"

Streams the completion as it is generated, then prints usage and speculation stats."""

from __future__ import annotations

import argparse
import os
import sys
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
