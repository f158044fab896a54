"""The gateway's host time per round, without the services: what the gateway process itself spends on a
round (the scheduler's bookkeeping, the calls' messages, committing, detokenizing, metrics, streaming).

    PYTHONPATH=. python -m bench.gateway_host [--concurrency 1,16,64] [--rounds 200] [--kinds spec,spec-gateway,plain]
                                              [--hidden ipc|inline] [--hidden-size 576] [--stop STR]
                                              [--profile KIND:CONCURRENCY] [--out bench-results]

The public servicer (services/gateway/server.py), the scheduler, the verifier and draft clients
(services/clients.py), the metrics and the tokenizer (the embedded SmolLM2's) are the real ones. Only the
transport ends: the clients' stubs and streams are fakes that answer at once with messages of a real
round's size, so the time between two rounds' calls is the gateway's own. What is timed, and what is not:

  timed      building each request, serializing it (gRPC does it in the gateway's process), parsing the
             answer, everything the scheduler does between two calls, and the streamed responses (each
             GenerateResponse serialized, as gRPC would send it)
  not timed  the fakes answering: parsing a request and building and serializing its answer (the
             services' work), measured around each call and subtracted

spec          chained rounds, the deployed round protocol: each Verify names the sequences `chained` (their
              trees wait at the verifier) and returns 3 or 4 tokens a sequence (2 or 3 of a 60-node tree
              accepted, and the bonus token); no hidden states come back
spec-gateway  the gateway proposes every round (no draft address for the verifier): the draft's 60-node
              trees pass through the gateway into the Verify, and each result's hidden states (an IPC
              reference, or inline bytes with --hidden inline) go into the next ProposeItem
plain         plain decoding, requests without speculation: one Decode of `--steps` tokens a sequence

Each sequence's tokens are a real text's (English prose, code, accented, CJK and emoji text: multi-byte
characters split across tokens and across rounds), so the detokenizer does its real work. All sequences
join first; `--warmup` rounds after the first one that holds them all, `--rounds` are timed, one by one:
the table gives the median round, the mean, and the mean per committed token. `--stop STR` gives every
request a stop string (one that never occurs: the held-text check runs on every round). Writes
DIR/gateway_host.json and DIR/gateway_host.md and logs the table; `--profile spec:64` also writes
DIR/gateway_host_spec_64.txt, cProfile's top functions over that case's timed rounds.
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import io
import json
import logging
import os
import platform
import pstats
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path

from common.model_path import default_model_path
from common.policy import FixedPolicy, Shape
from common.tokenizer import Tokenizer
from services.clients import DraftClient, VerifierClient
from services.gateway.scheduler import Scheduler, SchedulerConfig
from services.gateway.server import GenerationServicer
from services.tree_wire import draft_tree
from specdec.v1 import generation_pb2 as gpb
from specdec.v1 import internal_pb2 as pb

log = logging.getLogger("bench.gateway_host")
KINDS = ("spec", "spec-gateway", "plain")
TREE = Shape(6, 60)  # the draft's default tree (depth x nodes), every round (the policy pinned, as bench.run does)
WIDTHS = (10, 16, 14, 10, 6, 4)  # nodes per level of the bench tree: 60 nodes in 6 levels
DRAFT_ADDRESS = "bench-draft:1"  # the draft as the (fake) verifier reaches it: chained rounds
PROMPT = "Tell me a story about a traveller who collects words in many languages, and show some code."
TEXT = (
    "The traveller kept a notebook of words. In Lyon she wrote café, crème brûlée and naïve; in Athens, "
    "Ελληνικά and φιλοξενία; in Moscow, русский язык. In Tokyo the page filled with 日本語のテキスト and "
    "in Seoul with 한국어, and a friend drew 👋🏽 🇫🇷 ❤️ 🧑🏿‍💻 in the margin.\n\n"
    "```python\ndef reverse(s: str) -> str:\n    return s[::-1]  # héllo -> olléh\n```\n\n"
    "Every evening she counted them: 1, 2, 3... then she read them aloud, slowly, until the lamp went out. "
    "Some words had no translation at all, only a story, and those she liked best.\n"
)


def bench_tree() -> pb.DraftTree:
    """A 60-node draft tree of the default shape: each level's nodes hang under the level above's, in turn."""
    parents: list[int] = []
    above = [-1]
    for width in WIDTHS:
        start = len(parents)
        parents += [above[i % len(above)] for i in range(width)]
        above = list(range(start, start + width))
    parents.sort()  # a parent always before its children, siblings together
    n = len(parents)
    return draft_tree(list(range(1000, 1000 + n)), parents, [1.0 / (1 + i) for i in range(n)])


@dataclass
class Clock:
    """Round boundaries and the fakes' own time. Each round's call (Verify, or Decode when plain) marks a
    boundary when it starts; the host time of round i is the wall time between boundaries i and i + 1
    less the fakes' time in between (every call of the round, proposes too)."""

    items: int  # sequences a timed round holds (the concurrency)
    warmup: int
    rounds: int
    profiler: cProfile.Profile | None = None
    fake_s: float = 0.0  # the fakes' time so far
    marks: list[tuple[float, float, int]] = field(default_factory=list)  # [calls] (start, fake_s, tokens)
    done: asyncio.Event = field(default_factory=asyncio.Event)

    def round_call(self, items: int) -> bool:
        """A round's call starts; whether it is in the timed window (its tokens then count)."""
        if self.done.is_set() or (not self.marks and items < self.items):
            return False  # sequences still joining: not a full round yet
        self.marks.append((time.perf_counter(), self.fake_s, 0))
        n = len(self.marks)
        if self.profiler is not None and n == self.warmup + 1:
            self.profiler.enable()
        if n == self.warmup + self.rounds + 1:
            if self.profiler is not None:
                self.profiler.disable()
            self.done.set()
            return False
        return n > self.warmup

    def tokens(self, n: int) -> None:
        start, fake, tokens = self.marks[-1]
        self.marks[-1] = (start, fake, tokens + n)

    def host_s(self) -> list[float]:
        """[rounds] the gateway's seconds of each timed round."""
        m = self.marks[self.warmup :]
        return [(b[0] - a[0]) - (b[1] - a[1]) for a, b in zip(m, m[1:])]

    def committed(self) -> int:
        return sum(t for _, _, t in self.marks[self.warmup : -1])


class Faked:
    """Times a fake's answer: the gateway's side of a call (its request's bytes, the answer parsed) is
    timed, what the service would do in between is not."""

    def __init__(self, clock: Clock) -> None:
        self.clock = clock
        self._t0 = 0.0

    def __enter__(self) -> Faked:
        self._t0 = time.perf_counter()
        return self

    def __exit__(self, *exc: object) -> None:
        self.clock.fake_s += time.perf_counter() - self._t0


class Streams:
    """Each sequence's tokens: TEXT's tokens from an offset of its own, round and round."""

    def __init__(self, ids: list[int]) -> None:
        self.ids = ids
        self.at: dict[str, int] = {}

    def take(self, seq_id: str, n: int) -> list[int]:
        at = self.at.setdefault(seq_id, 37 * len(self.at) % len(self.ids))
        self.at[seq_id] = at + n
        return [self.ids[(at + i) % len(self.ids)] for i in range(n)]


class Hidden:
    """Hidden states as the verifier sends them: an IPC reference into its exported buffer (the colocated
    path), or inline bfloat16 bytes."""

    def __init__(self, mode: str, hidden_size: int) -> None:
        self.mode, self.row = mode, 3 * hidden_size
        self.slots: dict[str, int] = {}

    def rows(self, seq_id: str, n: int, msg: pb.TensorRef) -> None:
        msg.shape[:] = [n, self.row]
        msg.dtype = "bfloat16"
        if self.mode == "inline":
            msg.inline_data = bytes(2 * n * self.row)
        else:
            slot = self.slots.setdefault(seq_id, len(self.slots))
            msg.ipc.buffer_id, msg.ipc.offset_bytes, msg.ipc.round = "bench", slot << 24, 1


class Stub:
    """The unary methods of both services' stubs, answered at once (see Faked)."""

    def __init__(self, clock: Clock, streams: Streams, hidden: Hidden, tree: pb.DraftTree) -> None:
        self.clock, self.streams, self.hidden = clock, streams, hidden
        self.tree_bytes = tree.SerializeToString()
        self.rounds = 0

    async def Prefill(self, request: pb.PrefillRequest, timeout: float) -> pb.PrefillResponse:
        raw = request.SerializeToString()
        with Faked(self.clock):
            req = pb.PrefillRequest.FromString(raw)
            resp = pb.PrefillResponse()
            for it in req.items:
                r = resp.results.add(seq_id=it.seq_id)
                if not it.more:
                    r.next_token = self.streams.take(it.seq_id, 1)[0]
                    if it.want_hidden:
                        self.hidden.rows(it.seq_id, len(it.token_ids), r.hidden)
            raw = resp.SerializeToString()
        return pb.PrefillResponse.FromString(raw)

    async def Verify(self, request: pb.VerifyRequest) -> pb.VerifyResponse:
        raw = request.SerializeToString()
        timed = self.clock.round_call(len(request.items))
        with Faked(self.clock):
            req = pb.VerifyRequest.FromString(raw)
            resp = pb.VerifyResponse(compute_us=9500)
            chained = sum(it.chained for it in req.items)  # trees the draft's chained call made
            for i, it in enumerate(req.items):
                accepted = 2 + (self.rounds + i) % 2  # 3 or 4 tokens a round
                tokens = self.streams.take(it.seq_id, accepted + 1)
                r = resp.results.add(seq_id=it.seq_id, accepted_tokens=tokens, tree_nodes=TREE.nodes)
                if req.draft and it.next_depth:
                    r.chained = True
                else:
                    self.hidden.rows(it.seq_id, len(tokens), r.hidden)
                if timed:
                    self.clock.tokens(len(tokens))
            if chained:
                resp.draft_compute_us, resp.draft_batch = 3000, chained
            self.rounds += 1
            raw = resp.SerializeToString()
        return pb.VerifyResponse.FromString(raw)

    async def Decode(self, request: pb.DecodeRequest, timeout: float) -> pb.DecodeResponse:
        raw = request.SerializeToString()
        timed = self.clock.round_call(len(request.items))
        with Faked(self.clock):
            req = pb.DecodeRequest.FromString(raw)
            resp = pb.DecodeResponse(compute_us=8000)
            for it in req.items:
                tokens = self.streams.take(it.seq_id, req.steps)
                r = resp.results.add(seq_id=it.seq_id, next_token=tokens[0], tokens=tokens)
                if it.want_hidden:
                    self.hidden.rows(it.seq_id, len(tokens), r.hidden)
                if timed:
                    self.clock.tokens(len(tokens))
            raw = resp.SerializeToString()
        return pb.DecodeResponse.FromString(raw)

    async def Propose(self, request: pb.ProposeRequest) -> pb.ProposeResponse:
        raw = request.SerializeToString()
        with Faked(self.clock):
            req = pb.ProposeRequest.FromString(raw)
            resp = pb.ProposeResponse(compute_us=3000)
            for it in req.items:
                resp.results.add(seq_id=it.seq_id).tree.MergeFromString(self.tree_bytes)
            raw = resp.SerializeToString()
        return pb.ProposeResponse.FromString(raw)

    async def Release(self, request: pb.ReleaseRequest, timeout: float) -> pb.ReleaseResponse:
        return pb.ReleaseResponse(released=len(request.seq_ids))


class BenchVerifier(VerifierClient):
    """The gateway's real verifier client, its stub and stream the fake's (no channel)."""

    def __init__(self, stub: Stub) -> None:
        self.timeout, self.stub, self.streamed = 60.0, stub, stub.Verify


class BenchDraft(DraftClient):
    """The gateway's real draft client, its stub and stream the fake's (no channel)."""

    def __init__(self, stub: Stub) -> None:
        self.timeout, self.stub, self.streamed = 60.0, stub, stub.Propose

    def reachable(self) -> bool:
        return True


class Context:
    """The servicer's view of a call (grpc.aio.ServicerContext): only a failure reads it."""

    async def abort(self, code: object, details: str) -> None:
        raise RuntimeError(f"{code}: {details}")


@dataclass(frozen=True)
class Case:
    kind: str
    concurrency: int


async def measure(
    case: Case, args: argparse.Namespace, tok: Tokenizer, ids: list[int], profiler: cProfile.Profile | None = None
) -> dict:
    """One case: `concurrency` requests through the servicer until the timed rounds are done; `profiler`
    runs over the timed rounds (and slows them)."""
    clock = Clock(case.concurrency, args.warmup, args.rounds, profiler)
    stub = Stub(clock, Streams(ids), Hidden(args.hidden, args.hidden_size), bench_tree())
    draft = None if case.kind == "plain" else BenchDraft(stub)
    cfg = SchedulerConfig(
        max_active=case.concurrency,
        max_waiting=case.concurrency,
        plain_steps=args.steps,
        draft_address=DRAFT_ADDRESS if case.kind == "spec" else "",
    )
    scheduler = Scheduler(BenchVerifier(stub), draft, cfg, FixedPolicy(TREE))
    vinfo = pb.InfoResponse(model="bench", vocab_size=tok.vocab_size, max_context=1 << 20)
    servicer = GenerationServicer(scheduler, tok, vinfo, None)
    # nobody finishes before the timed rounds end (the first to join run rounds while the others tokenize)
    max_tokens = (args.steps if case.kind == "plain" else 4) * 10 * (args.warmup + args.rounds)
    request = gpb.GenerateRequest(
        prompt=PROMPT, max_tokens=max_tokens, ignore_eos=True, speculative=case.kind != "plain", stop=args.stop
    )

    async def consume() -> None:
        async for msg in servicer.Generate(request, Context()):
            msg.SerializeToString()  # what gRPC sends

    scheduler.start()
    streams = [asyncio.create_task(consume()) for _ in range(case.concurrency)]
    waiting = asyncio.create_task(clock.done.wait())
    await asyncio.wait([waiting, *streams], return_when=asyncio.FIRST_COMPLETED)
    if not clock.done.is_set():
        ended = next(s for s in streams if s.done())
        raise RuntimeError(f"a request ended before the timed rounds were done: {ended.exception()}")
    for s in streams:
        s.cancel()
    await asyncio.gather(*streams, return_exceptions=True)
    await scheduler.stop()
    servicer.close()
    host = clock.host_s()
    tokens = clock.committed()
    row = {
        "kind": case.kind,
        "concurrency": case.concurrency,
        "round_ms": 1e3 * statistics.median(host),
        "round_ms_mean": 1e3 * statistics.fmean(host),
        "token_us": 1e6 * sum(host) / tokens,
        "tokens_per_round": tokens / len(host),
        "rounds": len(host),
    }
    return row


def profile(case: Case, args: argparse.Namespace, tok: Tokenizer, ids: list[int]) -> Path:
    """cProfile's top functions over a case's timed rounds, in a run of its own (the timed one is not slowed)."""
    profiler = cProfile.Profile()
    asyncio.run(measure(case, args, tok, ids, profiler))
    text = io.StringIO()
    pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(50)
    path = Path(args.out) / f"gateway_host_{case.kind}_{case.concurrency}.txt"
    path.write_text(text.getvalue())
    return path


def table(rows: list[dict], meta: dict) -> str:
    lines = [
        f"# Gateway host time per round (CPU, services faked; {meta['machine']})",
        "",
        f"Command: `{meta['command']}`",
        "",
        "| round | concurrency | host ms (median) | mean | us per token | tokens a round |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r['kind']} | {r['concurrency']} | {r['round_ms']:.3f} | {r['round_ms_mean']:.3f} "
            f"| {r['token_us']:.1f} | {r['tokens_per_round']:.1f} |"
        )
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--concurrency", default="1,16,64", help="sequences per round, comma-separated")
    ap.add_argument("--kinds", default=",".join(KINDS), help=f"comma-separated, of {', '.join(KINDS)}")
    ap.add_argument("--rounds", type=int, default=200, help="timed rounds per case")
    ap.add_argument("--warmup", type=int, default=20, help="rounds before the timed ones, once all have joined")
    ap.add_argument("--steps", type=int, default=8, help="plain steps per Decode (the gateway's --plain-steps)")
    ap.add_argument("--hidden", choices=("ipc", "inline"), default="ipc")
    ap.add_argument("--hidden-size", type=int, default=576, help="the model's width (3x a feature row)")
    ap.add_argument("--stop", action="append", default=[], help="a stop string every request carries")
    ap.add_argument("--profile", default="", help="KIND:CONCURRENCY to profile, e.g. spec:64")
    ap.add_argument("--out", default="bench-results")
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    kinds = args.kinds.split(",")
    if not set(kinds) <= set(KINDS):
        ap.error(f"--kinds takes {', '.join(KINDS)}")
    Path(args.out).mkdir(parents=True, exist_ok=True)
    tok = Tokenizer(default_model_path())
    ids = tok.encode_prompt(TEXT)
    rows = []
    for kind in kinds:
        for c in (int(c) for c in args.concurrency.split(",")):
            rows.append(asyncio.run(measure(Case(kind, c), args, tok, ids)))
            log.info("%s at %d: %.3f ms a round", kind, c, rows[-1]["round_ms"])
    if args.profile:
        kind, c = args.profile.split(":")
        log.info("cProfile of %s at %s: %s", kind, c, profile(Case(kind, int(c)), args, tok, ids))
    stops = "".join(f" --stop {s!r}" for s in args.stop)
    command = (
        f"PYTHONPATH=. python -m bench.gateway_host --concurrency {args.concurrency} --kinds {args.kinds} "
        f"--rounds {args.rounds} --warmup {args.warmup} --steps {args.steps} --hidden {args.hidden} "
        f"--hidden-size {args.hidden_size}{stops}"
    )
    meta = {
        "machine": f"{platform.machine()}, {os.cpu_count()} cores",
        "python": platform.python_version(),
        "command": command,
        "tree": str(TREE),
        "text_tokens": len(ids),
    }
    out = Path(args.out)
    (out / "gateway_host.json").write_text(json.dumps({"meta": meta, "results": rows}, indent=1))
    text = table(rows, meta)
    (out / "gateway_host.md").write_text(text + "\n")
    log.info("\n%s", text)


if __name__ == "__main__":
    main()
