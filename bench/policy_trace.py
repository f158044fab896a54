"""What the speculation policy does for one prompt sent one request at a time through Complete, as ghz sends it
(session 21: through ghz, speculative requests at concurrency 1 ran no faster than plain).

    python -m bench.policy_trace --out DIR [--device cuda] [--requests 8] [--max-sequences N] [--colocate off]

On a stack with the defaults (--max-sequences N: engines and gateway pinned to N sequences, as
bench.services_bench pins them), batches of `--requests` requests one after the other: the prompt speculative,
plain, speculative again, with the draft's tree pinned (6x60), then a second prompt speculative and plain. For
each request: its wall ms, its rounds, accepted tokens and mean acceptance length (Complete's SpeculationStats);
for each batch the rounds per shape the policy chose meanwhile (GetModelInfo's policy_choices). Printed and
written to DIR/policy_trace.json. Session 21's run 8 (docs/benchmarks.md) ran this as a script
(docs/results/h200-2026-11-26-s21/8-why/why.py.txt), two stacks: the defaults, then 64 sequences.
"""

from __future__ import annotations

import argparse
import json
import logging
import time
from pathlib import Path

import grpc

from bench.ghz_load import PROMPT
from bench.services_bench import request_for
from services.stack import Stack, colocate_argument, colocated
from specdec.v1 import generation_pb2 as gpb
from specdec.v1 import generation_pb2_grpc as gpb_grpc

log = logging.getLogger("bench.policy_trace")
SECOND = "What is the capital of France, and why is it famous?"
# (label, prompt, bench.services_bench's request mode)
BATCHES = [
    ("spec", PROMPT, "spec"),
    ("plain", PROMPT, "plain"),
    ("spec again", PROMPT, "spec"),
    ("6x60", PROMPT, "tree:6x60"),
    ("second spec", SECOND, "spec"),
    ("second plain", SECOND, "plain"),
]


def choices(stub) -> dict[str, int]:
    """Rounds per shape the policy chose since the stack started ("DxN"; "0x0": plain)."""
    info = stub.GetModelInfo(gpb.ModelInfoRequest(), timeout=10)
    return {f"{c.tree.depth}x{c.tree.nodes}": c.rounds for c in info.policy_choices}


def batch(stub, text: str, mode: str, n: int, max_tokens: int) -> list[dict]:
    out = []
    for _ in range(n):
        t0 = time.perf_counter()
        s = stub.Complete(request_for(text, max_tokens, mode), timeout=300).speculation
        ms = 1e3 * (time.perf_counter() - t0)
        out.append({"ms": round(ms, 1), "rounds": s.rounds, "accepted": s.accepted_tokens,
                    "acceptance": round(s.mean_acceptance_length, 2)})  # fmt: skip
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--requests", type=int, default=8, help="requests a batch, one at a time")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--max-sequences", type=int, default=0, help="engines' --max-sequences and gateway's --max-active")
    colocate_argument(ap)
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    common = ["--device", args.device, "--max-context", "1024"]
    gateway = []
    if args.max_sequences:
        common += ["--max-sequences", str(args.max_sequences)]
        gateway = ["--max-active", str(args.max_sequences)]
    rows = []
    stack = Stack(common_args=common, gateway_args=gateway, colocate=colocated(args.colocate, args.device))
    with stack, grpc.insecure_channel(stack.gateway) as ch:
        stub = gpb_grpc.GenerationStub(ch)
        for label, text, mode in BATCHES:
            before = choices(stub)
            requests = batch(stub, text, mode, args.requests, args.max_tokens)
            chosen = {k: v - before.get(k, 0) for k, v in choices(stub).items() if v != before.get(k, 0)}
            rows.append({"batch": label, "requests": requests, "policy_rounds": chosen})
            log.info("%s: ms %s; policy rounds %s", label, [r["ms"] for r in requests], chosen)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "policy_trace.json").write_text(json.dumps({"args": vars(args), "batches": rows}, indent=1))


if __name__ == "__main__":
    main()
