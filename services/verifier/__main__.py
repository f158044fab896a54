"""python -m services.verifier: the base model, its KV cache, prefill, tree verification, plain decoding."""

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
    servicer = VerifierServicer(
        engine,
        hidden_width=3 * ckpt.config.hidden_size,
        max_sequences=args.max_sequences,
        lease_ttl=args.lease_ttl,
        draft_timeout=args.draft_timeout,
    )
    await serve(
        args.addr,
        internal_pb2_grpc.add_VerifierServicer_to_server,
        servicer,
        "specdec.v1.Verifier",
        args.port_file,
        args.drain_grace,
    )


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
    a = parse_and_log(p)
    asyncio.run(main(a))


if __name__ == "__main__":
    cli()
