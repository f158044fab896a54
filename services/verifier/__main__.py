"""python -m services.verifier: the base model, its KV cache, prefill, tree verification, plain decoding."""

from __future__ import annotations

import argparse
import asyncio

from services.launch import common_arguments, engine_arguments, parse_and_log, serve


async def main(args: argparse.Namespace) -> None:
    from common.engine.factory import make_verifier, pick_dtype
    from common.engine.verifier import VerifierConfig
    from common.weights import load_checkpoint
    from services.verifier.server import VerifierServicer
    from specdec.v1 import internal_pb2_grpc

    # one engine slot beyond --max-sequences: the spare that recomputes features for a draft catching up
    cfg = VerifierConfig(max_sequences=args.max_sequences + 1, max_context=args.max_context,
                         max_tree_nodes=args.max_tree_nodes, dtype=pick_dtype(args.device, args.dtype),
                         device=args.device)
    ckpt = load_checkpoint(args.model)
    engine = make_verifier(ckpt, cfg, graphs=args.graphs)  # CUDA graphs on a GPU, eager on CPU
    servicer = VerifierServicer(engine, hidden_width=3 * ckpt.config.hidden_size, max_sequences=args.max_sequences,
                                lease_ttl=args.lease_ttl)
    await serve(args.addr, internal_pb2_grpc.add_VerifierServicer_to_server, servicer, "specdec.v1.Verifier",
                args.port_file, args.drain_grace)


def cli() -> None:
    p = argparse.ArgumentParser(prog="python -m services.verifier", description=__doc__)
    common_arguments(p, "VERIFIER_ADDR", "127.0.0.1:50053")
    engine_arguments(p)
    p.add_argument("--max-tree-nodes", type=int, default=64, help="largest draft tree accepted")
    a = parse_and_log(p)
    asyncio.run(main(a))


if __name__ == "__main__":
    cli()
