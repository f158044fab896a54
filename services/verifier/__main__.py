"""python -m services.verifier: the base model, its KV cache, prefill, tree verification, plain decoding.

With --draft-here the draft engine runs in this process too and its service (specdec.v1.Draft) is served
on the same port: the gateway is given this address as --draft. The chained proposals then skip the
verifier -> draft RPC and the IPC export's mapping, and both engines share one CUDA context (processes on
one GPU take turns at it, bench/gpu_share.py; streams of one process need not)."""

from __future__ import annotations

import argparse
import asyncio

from services.launch import common_arguments, engine_arguments, parse_and_log, serve


async def main(args: argparse.Namespace) -> None:
    from common.engine.capacity import KVShape, auto_sequences
    from common.engine.factory import make_verifier, pick_dtype
    from common.engine.verifier import VerifierConfig
    from common.weights import load_checkpoint
    from services.verifier.server import VerifierServicer
    from specdec.v1 import internal_pb2_grpc

    dtype = pick_dtype(args.device, args.dtype)
    ckpt = load_checkpoint(args.model)
    mc = ckpt.config
    kv = KVShape(
        layers=mc.num_layers,
        positions=args.max_context + 2 * (args.max_tree_nodes + 1),
        kv_heads=mc.num_kv_heads,
        head_dim=mc.head_dim,
        itemsize=2 if dtype != "float32" else 4,
    )
    args.max_sequences = auto_sequences(args.max_sequences, args.device, kv, args.gpu_memory_fraction)
    # one engine slot beyond --max-sequences: the spare that recomputes features for a draft catching up
    cfg = VerifierConfig(
        max_sequences=args.max_sequences + 1,
        max_context=args.max_context,
        max_tree_nodes=args.max_tree_nodes,
        dtype=dtype,
        device=args.device,
    )
    engine = make_verifier(ckpt, cfg, graphs=args.graphs)  # CUDA graphs on a GPU, eager on CPU
    services, draft_here = [], None
    if args.draft_here:  # the draft with as many sequences as the verifier, reading its buffer in place
        from services.draft.__main__ import draft_service

        def exported(buffer_id: str):
            export = servicer.export
            return export.buffer if export is not None and export.exported.buffer_id == buffer_id else None

        services.append(draft_service(args, local_buffers=exported))
        draft_here = services[0][1]
    servicer = VerifierServicer(
        engine,
        hidden_width=3 * ckpt.config.hidden_size,
        max_sequences=args.max_sequences,
        lease_ttl=args.lease_ttl,
        draft_timeout=args.draft_timeout,
        draft_here=draft_here,
        poll=not args.block_on_device,
        prefill_between=args.prefill_between,
    )
    services.insert(0, (internal_pb2_grpc.add_VerifierServicer_to_server, servicer, "specdec.v1.Verifier"))
    await serve(args.addr, services, args.port_file, args.drain_grace)


def cli() -> None:
    p = argparse.ArgumentParser(prog="python -m services.verifier", description=__doc__)
    common_arguments(p, "VERIFIER_ADDR", "127.0.0.1:50053")
    engine_arguments(p)
    p.add_argument("--max-tree-nodes", type=int, default=64, help="largest draft tree accepted")
    p.add_argument(
        "--draft-timeout",
        type=float,
        default=10.0,
        help="seconds a chained propose may take before its sequences fall back to plain decoding",
    )
    p.add_argument(
        "--draft-here",
        action="store_true",
        help="run the draft engine in this process too and serve specdec.v1.Draft on this port (the "
        "drafter's flags below apply)",
    )
    p.add_argument(
        "--prefill-between",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="on a GPU, run each Prefill on the event loop between the per-round calls (holding the loop while "
        "it runs) instead of on the engine thread beside them (--no-prefill-between). Session 18, H100, eight "
        "alternated stacks: +13%% / +9%% / +7%% tokens/s per request at c=1 / 16 / 64 and a shorter TTFT "
        "(docs/benchmarks.md; A/B: bench.services_bench --prefill-between off,on)",
    )
    from services.draft.__main__ import draft_arguments

    draft_arguments(p.add_argument_group("draft (with --draft-here)"))
    a = parse_and_log(p)
    asyncio.run(main(a))


if __name__ == "__main__":
    cli()
