"""The verifier service's host time per round, without the model: what the process spends around the
engine's forward on a Verify (trees in the request, or chained from the draft) and on a plain Decode.

    PYTHONPATH=. python -m bench.host_round [--items 1,16,64] [--rounds 200] [--out bench-results]
                                            [--hidden ipc|inline] [--hidden-size 576] [--profile KIND:ITEMS]

The servicer (services/verifier/server.py) and the engine (common/engine/verifier.Verifier) are the real
ones, built on the CPU with a small random Llama of SmolLM2-135M's width (3 x 576 features a row), with
batches and trees padded to their CUDA-graph buckets as on a GPU. Only the step functions that a GPU
replays as graphs (_verify_step, _decode_step) are replaced: they return outputs of the right shapes at
once (every tree accepts ACCEPTED nodes), so what is timed is the host's share of a round:

  parse the request bytes (gRPC's deserializer), the servicer's call (leases, the chain protocol, tree
  checks, packing, the engine's bookkeeping, the response, hidden rows into the export), serialize the
  response.

verify          a VerifyRequest of 60-node trees (10/6/60, the draft's default shape, top-k) in the request
verify-chained  the round protocol: every item `chained`, its tree taken from the draft's answer (the
                ProposeResponse parsed here, as services.clients.DraftClient does), and after the verify
                each item's outcome packed into a ProposeRequest for the next tree (serialized here)
decode          a DecodeRequest of `--steps` plain steps whose items want their features (a draft following
                plain rounds: DecodeItem.want_hidden)
colocated-kK    verify-chained with the draft in this process (`--draft-here`): the real DraftServicer
                (services.draft.here.LocalDraftClient) over the real Eagle3Drafter, its graph-replayed proposal
                answered at once with the bench tree; K rounds a Verify (`--colocated-rounds`), the figure
                per round (the call's wall / K): both services' host work, as one process does it on a GPU
colocated-msg-kK the same, the draft reached as before the hand-over (d4376c7): ProposeItems with IPC
                references through its own Propose, tree messages back (MessageDraft)
engines         with the colocated kinds: the same two engines called directly, a proposal then a verify a
                round (common/engine/loop.py's round): the host work under the colocated kinds, no service

--hidden ipc (default): hidden rows go into the exported buffer (common.ipc.HiddenExport, here on the CPU),
the colocated fast path; inline: as bytes in the response. Calls run inline on the event loop, as they do
on a GPU (services/engine_runner.py). Each round starts from the same sequence lengths.

Here the features' copies (the kept rows, a decode's steps, the writes into the buffer) are CPU memory
traffic, which on a GPU is device work: --hidden-size 64 makes them small and leaves the host's own work.
"torch ops" counts the torch operations that do work in one round (count_ops): each is a kernel launch or a
copy on a GPU, microseconds of host time apiece there. Writes DIR/host_round.json and DIR/host_round.md and
logs the table; --profile verify-chained:64 also writes DIR/host_round_verify-chained_64.txt, cProfile's top
functions over that case's rounds.
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import functools
import io
import json
import logging
import math
import os
import platform
import pstats
import statistics
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from common.config import DraftingConfig, LlamaConfig
from common.engine.base import ProposeInput, VerifyInput
from common.engine.cuda_graphs import GraphConfig
from common.engine.draft import DraftOut, Eagle3Drafter
from common.engine.verifier import DecodeStep, Verifier, VerifierConfig, VerifyStep
from common.ipc import HiddenExport
from common.model.eagle3 import Eagle3Config, Eagle3Head
from common.tensors import encode_inline
from common.weights import Checkpoint
from services.clients import Batched
from services.draft.server import DraftServicer
from services.packed import pack_ints
from services.tree_wire import draft_tree
from services.verifier.chain import DraftChain
from services.verifier.server import VerifierServicer
from specdec.v1 import internal_pb2 as pb

log = logging.getLogger("bench.host_round")
ACCEPTED = 3  # drafted nodes every stubbed verify accepts (a round commits 4 tokens, as EAGLE-3 roughly does)
LEVELS = (10, 16, 14, 10, 6, 4)  # nodes per depth of a bench tree: 60 nodes, 6 levels, top-10 wide
PROMPT = 32  # tokens each sequence is prefilled with
VOCAB = 4096  # a small vocabulary keeps the set-up quick (tree tokens are drawn from it)


def model_config(hidden_size: int) -> LlamaConfig:
    """A random Llama of this width (SmolLM2-135M's by default: 576, heads of 64), with the few layers that
    EAGLE-3's taps need (layer 2)."""
    if hidden_size % 64:
        raise ValueError(f"hidden size must be a multiple of 64, got {hidden_size}")
    heads = hidden_size // 64
    return LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=hidden_size,
        intermediate_size=256,
        num_layers=5,
        num_heads=heads,
        num_kv_heads=math.gcd(heads, 3),
        head_dim=64,
        max_position=1024,
    )


class HostOnlyVerifier(Verifier):
    """The real engine with its graph-replayed steps answered at once: outputs of the step's shapes,
    made once per shape (a replayed graph's are static buffers too)."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._verify_out: dict[tuple[int, int], VerifyStep] = {}
        self._decode_out: dict[int, DecodeStep] = {}

    def _verify_step(self, packed: torch.Tensor, max_depth: int | None = None) -> VerifyStep:
        b, t = packed.shape[0], (packed.shape[1] - 3) // 2
        out = self._verify_out.get((b, t))
        if out is None:
            h = self.model.embed_tokens.weight.shape[1]
            result = torch.zeros(b, t + 1, dtype=torch.long)  # [B, T + 1] count, then tokens
            result[:, 0] = min(ACCEPTED, t - 1)
            result[:, 1:] = torch.arange(5, 5 + t)
            out = self._verify_out[(b, t)] = VerifyStep(
                result=result, kept=torch.randn(b, t, 3 * h), hidden=torch.randn(b, t, h), aux=torch.randn(b, t, 3 * h)
            )
        return out

    def _decode_step(self, packed: torch.Tensor) -> DecodeStep:
        b = packed.shape[0]
        out = self._decode_out.get(b)
        if out is None:
            h = self.model.embed_tokens.weight.shape[1]
            out = self._decode_out[b] = DecodeStep(
                hidden=torch.randn(b, h), greedy=torch.full((b,), 7, dtype=torch.long), aux=torch.randn(b, 3 * h)
            )
        return out


class Aborted(Exception):
    """A call the servicer refused (the bench's requests are all valid: a bug)."""


class Context:
    """The servicer's view of a call (grpc.aio.ServicerContext): only a failure reads it."""

    async def abort(self, code: object, details: str) -> None:
        raise Aborted(f"{code}: {details}")


def bench_arrays(rng: np.random.Generator, vocab: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(tokens, parents, probs) [60] of a tree of the draft's default shape: LEVELS nodes per depth, each
    node's parent one of the level above, tokens distinct under each parent (as a top-k pick makes them)."""
    parents: list[int] = []
    level = [-1]
    for width in LEVELS:
        start = len(parents)
        parents += sorted(rng.choice(level, size=width).tolist())
        level = list(range(start, start + width))
    n = len(parents)
    return rng.choice(vocab, size=n, replace=False), np.array(parents), rng.random(n).astype(np.float32)


def bench_tree(rng: np.random.Generator, vocab: int) -> pb.DraftTree:
    """bench_arrays' tree on the wire."""
    tokens, parents, probs = bench_arrays(rng, vocab)
    return draft_tree(tokens.tolist(), parents.tolist(), probs.tolist())


class HostOnlyDrafter(Eagle3Drafter):
    """The real drafter with its graph-replayed proposal answered at once: every row drafts the bench tree
    (an output of the step's shapes, made once per batch, as a replayed graph's static buffers)."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        tokens, parents, probs = bench_arrays(np.random.default_rng(0), VOCAB)
        self._row = torch.from_numpy(np.stack((tokens, parents, probs, -np.ones_like(probs))).astype(np.float64))
        self._out: dict[int, DraftOut] = {}

    def _propose_step(self, packed, hidden, temp=None, gumbel=None, depth=None) -> DraftOut:
        b = packed.shape[0]
        out = self._out.get(b)
        if out is None:
            w = self.width
            out = self._out[b] = DraftOut(
                tree=self._row.expand(b, -1, -1).clone(),  # [B, 4, 60]
                q_ids=torch.zeros(b, 1, w, dtype=torch.long),  # [B, 1, W]: read for sampled rows only
                q_probs=torch.zeros(b, 1, w),
            )
        return out


class FakeDraft:
    """The draft at the other end of the round protocol: answers every propose at once with the bench tree,
    through the bytes a real DraftClient serializes and parses in this process."""

    def __init__(self, tree: pb.DraftTree) -> None:
        self.tree = tree
        self.answers: dict[int, bytes] = {}

    async def propose(self, items: list[pb.ProposeItem], owner: str = "") -> Batched:
        pb.ProposeRequest(items=items, owner=owner).SerializeToString()  # the call's request, sent from here
        raw = self.answers.get(len(items))
        if raw is None:
            resp = pb.ProposeResponse(results=[pb.ProposeResult(seq_id=it.seq_id, tree=self.tree) for it in items])
            raw = self.answers[len(items)] = resp.SerializeToString()
        resp = pb.ProposeResponse.FromString(raw)
        return Batched([r.tree for r in resp.results], resp.compute_us / 1e6)


def build(max_items: int, hidden: str, hidden_size: int = 576) -> tuple[VerifierServicer, FakeDraft]:
    """The servicer over a HostOnlyVerifier with room for max_items sequences (and the spare)."""
    torch.manual_seed(0)
    cfg = VerifierConfig(max_sequences=max_items + 1, max_context=512, max_tree_nodes=64)
    mcfg = model_config(hidden_size)
    engine = HostOnlyVerifier(Checkpoint("bench", mcfg, {}, Path(".")), cfg, graphs=True)  # pads as a GPU
    servicer = VerifierServicer(engine, 3 * hidden_size, max_items, lease_ttl=3600.0)
    servicer.runner.inline = True  # on the event loop, as on a GPU (no engine-thread hop)
    if hidden == "ipc":
        i = engine.info
        servicer.export = HiddenExport(i.max_sequences, i.max_context, 3 * hidden_size, torch.float32, "cpu")
    draft = FakeDraft(bench_tree(np.random.default_rng(0), VOCAB))
    servicer.chain = DraftChain(lambda address: draft)
    return servicer, draft


class MessageDraft:
    """The draft in this process reached as before the hand-over (d4376c7): each outcome a ProposeItem with
    an IPC reference into the verifier's exported buffer, through the DraftServicer's own Propose (its
    checks, the reference's decode, tree messages that the verifier parses). `colocated-msg` kinds."""

    def __init__(self, draft: DraftServicer) -> None:
        self.draft = draft

    async def propose(self, items: list[pb.ProposeItem], owner: str = "") -> Batched:
        resp = await self.draft.Propose(pb.ProposeRequest(items=items, owner=owner), Context())
        return Batched([r.tree for r in resp.results], resp.compute_us / 1e6)


def colocate(servicer: VerifierServicer, max_items: int, hidden_size: int, messages: bool) -> DraftServicer:
    """The draft in the verifier's process, as `--draft-here` builds it: a DraftServicer over a
    HostOnlyDrafter (a random head of the model's width) that reads the verifier's exported buffer in place,
    called by the chain (VerifierServicer.colocate), inline on the event loop as on a GPU."""
    heads = hidden_size // 64
    head = Eagle3Head(
        Eagle3Config(
            hidden_size=hidden_size,
            intermediate_size=256,
            num_heads=heads,
            num_kv_heads=math.gcd(heads, 3),
            head_dim=64,
            vocab_size=VOCAB,
            draft_vocab_size=VOCAB // 4,
            target_hidden_size=hidden_size,
            max_position=1024,
        )
    ).eval()
    head.set_vocab_map(torch.arange(VOCAB // 4))
    drafting = DraftingConfig()
    engine: Verifier = servicer.engine  # type: ignore[assignment]
    drafter = HostOnlyDrafter(
        head,
        engine.model.embed_tokens,
        drafting,
        max_items + 1,
        512,
        "cpu",
        graphs=True,  # pads as a GPU
        graph_cfg=GraphConfig(capture=False),
    )
    draft = DraftServicer(drafter, drafting, 3 * hidden_size, VOCAB, torch.device("cpu"), lease_ttl=3600.0)
    draft.runner.inline = True
    if servicer.export is not None:
        draft.mapped.add_local(servicer.export.exported.buffer_id, servicer.export.buffer)
    if messages:
        servicer.chain = DraftChain(lambda address: MessageDraft(draft))
    else:
        servicer.colocate(draft)
    return draft


def requests(ids: list[str], tree: pb.DraftTree, steps: int, colocated: list[int]) -> dict[str, bytes]:
    """Each kind's request bytes, as they arrive (colocated-kK: a chained Verify of K rounds, each item with
    the budget and stop ids the gateway sends with K > 1, neither of which the bench's tokens reach)."""
    nodes, depth = len(tree.token_ids) // 4, len(LEVELS)
    verify = pb.VerifyRequest(items=[pb.VerifyItem(seq_id=s, tree=tree) for s in ids])
    chained = pb.VerifyRequest(
        draft="draft:0", items=[pb.VerifyItem(seq_id=s, chained=True, next_nodes=nodes, next_depth=depth) for s in ids]
    )
    decode = pb.DecodeRequest(steps=steps, items=[pb.DecodeItem(seq_id=s, want_hidden=True, hidden_row=4) for s in ids])
    out = {k: m.SerializeToString() for k, m in (("verify", verify), ("verify-chained", chained), ("decode", decode))}
    for k in colocated:
        req = pb.VerifyRequest(draft="here", rounds=k)
        for s in ids:
            req.items.add(
                seq_id=s, chained=True, next_nodes=nodes, next_depth=depth, max_new=4096, stop_ids=pack_ints([2])
            )
        out[f"colocated-k{k}"] = req.SerializeToString()
        out[f"colocated-msg-k{k}"] = out[f"colocated-k{k}"]
    return out


def _first_chained(raw: bytes, tree: pb.DraftTree) -> pb.VerifyRequest:
    """The round before the chained ones: the same items with their trees in the request, so that each
    has a proposal pending when the measured rounds start."""
    req = pb.VerifyRequest.FromString(raw)
    for it in req.items:
        it.chained = False
        it.tree.CopyFrom(tree)
    return req


@dataclass(frozen=True)
class Measured:
    walls: list[float]  # [rounds] seconds of each round
    engine: list[float]  # [rounds] seconds of the engine call, as the service reports them (compute_us)
    ops: int  # torch operations that do work in one more round (count_ops)


def keeper(engine: Verifier, drafter: Eagle3Drafter | None, ids: list[str]) -> Callable[[], None]:
    """A function that puts the sequences back at their lengths of now, in the verifier (and its pending
    token) and in the drafter when there is one: every measured round starts from the same place."""
    start = {s: (engine.seqs.get(s)[1].length, engine.seqs.get(s)[1].pending) for s in ids}
    drafted = {s: drafter.seqs.get(s)[1].length for s in ids} if drafter is not None else {}

    def reset() -> None:
        for s, (length, pending) in start.items():
            st = engine.seqs.get(s)[1]
            st.length, st.pending = length, pending
        for s, length in drafted.items():
            drafter.seqs.get(s)[1].length = length

    return reset


async def measure(
    servicer: VerifierServicer,
    kind: str,
    ids: list[str],
    raw: bytes,
    tree: pb.DraftTree,
    rounds: int,
    warmup: int,
    drafter: Eagle3Drafter | None = None,
) -> Measured:
    """`rounds` calls of one kind after `warmup`, every call from the same sequence lengths (the drafter's
    too, when it is in this process); a call of several rounds counts as its wall over its rounds."""
    reset = keeper(servicer.engine, drafter, ids)
    if kind == "decode":
        parse: Callable[[bytes], object] = pb.DecodeRequest.FromString
        call: Callable[[object, object], Awaitable] = servicer.Decode
    else:
        parse, call = pb.VerifyRequest.FromString, servicer.Verify
    chained = kind == "verify-chained" or kind.startswith("colocated")
    if chained:
        await servicer.Verify(_first_chained(raw, tree), Context())

    async def one_round():
        reset()
        t0 = time.perf_counter()
        resp = await call(parse(raw), Context())
        resp.SerializeToString()
        n = max(getattr(resp, "rounds_run", 1), 1)
        return (time.perf_counter() - t0) / n, (resp.compute_us + getattr(resp, "draft_compute_us", 0)) / 1e6 / n

    walls, engine_s = [], []
    for r in range(warmup + rounds):
        wall, compute = await one_round()
        if r >= warmup:
            walls.append(wall)
            engine_s.append(compute)
    ops = await count_ops(one_round)
    if chained:
        await servicer.chain.settle(ids)  # the proposals the last round asked for
    return Measured(walls, engine_s, ops)


async def measure_engines(
    servicer: VerifierServicer, drafter: Eagle3Drafter, ids: list[str], rounds: int, warmup: int
) -> Measured:
    """The colocated kinds' two engines with no service around them: Eagle3Drafter.propose, then
    Verifier.verify, the next proposal's inputs from the verify's outputs (common/engine/loop.py's round),
    from the same lengths every round: the floor under the colocated kinds' host time."""
    engine: Verifier = servicer.engine  # type: ignore[assignment]
    reset = keeper(engine, drafter, ids)
    width = drafter.feature_dim
    items = [ProposeInput(s, [5, 6, 7, 8], torch.zeros(4, width), False, [], 0) for s in ids]

    async def one_round():
        nonlocal items
        reset()
        t0 = time.perf_counter()
        trees = drafter.propose(items)
        outs = engine.verify([VerifyInput(s, t) for s, t in zip(ids, trees)])
        items = [ProposeInput.after_verify(s, o, 0) for s, o in zip(ids, outs)]
        wall = time.perf_counter() - t0
        return wall, wall

    walls = [(await one_round())[0] for _ in range(warmup + rounds)][warmup:]
    return Measured(walls, walls, await count_ops(one_round))


@functools.cache
def does_work(name: str) -> bool:
    """Whether a torch operation (a profiler event name) does work: a kernel or a copy on a GPU. Not one whose
    result is a view of its input (its schema says the result aliases it and nothing is written: select,
    slice, view, detach, to when nothing changes, ...), nor a bare allocation (empty, new_empty)."""
    op = name.removeprefix("aten::")
    if op.startswith(("empty", "new_empty")):
        return False
    packet = getattr(torch.ops.aten, op, None)
    if packet is None:
        return True
    for overload in packet.overloads():
        returns = getattr(packet, overload)._schema.returns
        if returns and all(r.alias_info is not None and not r.alias_info.is_write for r in returns):
            return False
    return True


async def count_ops(round_: Callable[[], Awaitable]) -> int:
    """Top-level torch operations that do work in one round: on a GPU each is a kernel launch or a copy
    (microseconds of host time apiece there, less on a CPU), so the count says what the CPU time
    understates."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        await round_()
    n = 0
    for e in prof.events():  # counted once: at the outermost operation that does work
        if not e.name.startswith("aten::") or not does_work(e.name):
            continue
        parent = e.cpu_parent
        while parent is not None and parent.name.startswith("aten::") and not does_work(parent.name):
            parent = parent.cpu_parent
        n += parent is None or not parent.name.startswith("aten::")
    return n


async def prefilled(args: argparse.Namespace, max_items: int, ids: list[str], here: str = ""):
    """A servicer (build) holding ids, each prefilled with PROMPT random tokens; here "handover" or
    "messages": with the draft in its process (colocate) reached that way, which holds them too (started on
    random features, as after a prefill)."""
    servicer, draft = build(max_items, args.hidden, args.hidden_size)
    rng = np.random.default_rng(1)
    prompts = {s: rng.integers(3, VOCAB, PROMPT).tolist() for s in ids}
    prefill = pb.PrefillRequest(
        items=[pb.PrefillItem(seq_id=s, token_ids=p, want_hidden=False) for s, p in prompts.items()]
    )
    firsts = await servicer.Prefill(prefill, Context())
    if not here:
        return servicer, draft, None
    local = colocate(servicer, max_items, args.hidden_size, messages=here == "messages")
    start = pb.ProposeRequest()
    for (s, p), r in zip(prompts.items(), firsts.results):
        it = start.items.add(seq_id=s, token_ids=p[1:] + [r.next_token], context_prefix=p[:1], start=True)
        encode_inline(torch.randn(PROMPT, 3 * args.hidden_size), it.hidden)
    await local.Propose(start, Context())
    return servicer, draft, local.drafter


async def run(args: argparse.Namespace, out: Path) -> list[dict]:
    items = [int(n) for n in args.items.split(",")]
    ids = [f"gw.0-{i}" for i in range(max(items))]
    colocated = [int(k) for k in args.colocated_rounds.split(",") if k]
    servicer, draft, _ = await prefilled(args, max(items), ids)
    colocated_here = {how: await prefilled(args, max(items), ids, how) for how in ("handover", "messages") if colocated}
    profile = tuple(args.profile.split(":")) if args.profile else None
    rows = []
    for n in items:
        raws = requests(ids[:n], draft.tree, args.steps, colocated)
        for kind in list(raws) + (["engines"] if colocated else []):
            prof = cProfile.Profile() if profile == (kind, str(n)) else None
            if prof is not None:
                prof.enable()
            if kind == "engines":  # no request: the hand-over servicer's two engines called directly
                here, _, drafter = colocated_here["handover"]
                m = await measure_engines(here, drafter, ids[:n], args.rounds, args.warmup)
            elif kind.startswith("colocated"):
                here, _, drafter = colocated_here["messages" if kind.startswith("colocated-msg") else "handover"]
                m = await measure(here, kind, ids[:n], raws[kind], draft.tree, args.rounds, args.warmup, drafter)
            else:
                m = await measure(servicer, kind, ids[:n], raws[kind], draft.tree, args.rounds, args.warmup)
            if prof is not None:
                prof.disable()
                text = io.StringIO()
                pstats.Stats(prof, stream=text).sort_stats("cumulative").print_stats(60)
                (out / f"host_round_{kind}_{n}.txt").write_text(text.getvalue())
            ms = 1e3 * statistics.median(m.walls)
            rows.append(
                {
                    "kind": kind,
                    "items": n,
                    "round_ms": ms,
                    "round_ms_mean": 1e3 * statistics.fmean(m.walls),
                    "engine_call_ms": 1e3 * statistics.median(m.engine),
                    "us_per_item": 1e3 * ms / n,
                    "torch_ops": m.ops,
                    "rounds": len(m.walls),
                }
            )
            log.info("%s x %d: %.3f ms a round", kind, n, ms)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--items", default="1,16,64", help="sequences per round, comma-separated")
    ap.add_argument("--rounds", type=int, default=200, help="timed rounds per case (the median is reported)")
    ap.add_argument("--warmup", type=int, default=20)
    ap.add_argument("--steps", type=int, default=8, help="plain steps per Decode (the gateway's --plain-steps)")
    ap.add_argument("--hidden", choices=("ipc", "inline"), default="ipc")
    ap.add_argument(
        "--hidden-size", type=int, default=576, help="the model's width (3x a feature row); 64 leaves out the copies"
    )
    ap.add_argument(
        "--colocated-rounds",
        default="1,4",
        help="rounds a Verify of the colocated kinds (comma-separated; '' for none)",
    )
    ap.add_argument("--profile", default="", help="KIND:ITEMS to profile, e.g. verify-chained:64 or colocated-k4:64")
    ap.add_argument("--out", default="bench-results")
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    torch.set_num_threads(1)  # host bookkeeping is single-threaded; keep the copies from spreading
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rows = asyncio.run(run(args, out))
    command = (
        f"PYTHONPATH=. python -m bench.host_round --items {args.items} --rounds {args.rounds} "
        f"--steps {args.steps} --hidden {args.hidden} --hidden-size {args.hidden_size} "
        f"--colocated-rounds {args.colocated_rounds}"
    )
    meta = {
        "machine": f"{platform.machine()}, {os.cpu_count()} cores",
        "python": platform.python_version(),
        "torch": torch.__version__,
        "command": command,
        "accepted": ACCEPTED,
        "tree_nodes": sum(LEVELS),
    }
    (out / "host_round.json").write_text(json.dumps({"meta": meta, "results": rows}, indent=1))
    lines = [
        f"# Verifier host time per round (CPU, model forward stubbed; {meta['machine']})",
        "",
        f"Command: `{command}`",
        "",
        "| round | items | host ms (median) | mean | engine call ms | us per item | torch ops |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r['kind']} | {r['items']} | {r['round_ms']:.3f} | {r['round_ms_mean']:.3f} "
            f"| {r['engine_call_ms']:.3f} | {r['us_per_item']:.1f} | {r['torch_ops']} |"
        )
    text = "\n".join(lines)
    (out / "host_round.md").write_text(text + "\n")
    log.info("\n%s", text)


if __name__ == "__main__":
    main()
