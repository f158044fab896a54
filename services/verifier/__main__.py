"""python -m services.verifier: the base model, its KV cache, prefill, tree verification, plain decoding."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os

from services.launch import serve_forever, write_port_file


async def main(args: argparse.Namespace) -> None:
    from common.engine.factory import make_verifier, pick_dtype
    from common.engine.torch_verifier import VerifierConfig
    from common.rpc import start_server
    from common.weights import load_checkpoint
    from services.verifier.server import VerifierServicer
    from specdec.v1 import internal_pb2_grpc

    cfg = VerifierConfig(max_sequences=args.max_sequences, max_context=args.max_context,
                         max_tree_nodes=args.max_tree_nodes, dtype=pick_dtype(args.device, args.dtype),
                         device=args.device)
    ckpt = load_checkpoint(args.model)
    engine = make_verifier(ckpt, cfg, graphs=args.graphs)  # CUDA graphs on a GPU, eager on CPU
    servicer = VerifierServicer(engine, hidden_width=3 * ckpt.config.hidden_size)
    server = await start_server(args.addr, [(internal_pb2_grpc.add_VerifierServicer_to_server, servicer)],
                                ["specdec.v1.Verifier"])
    write_port_file(args.port_file, server.port)
    await serve_forever(server)


def cli() -> None:
    p = argparse.ArgumentParser(prog="python -m services.verifier", description=__doc__)
    p.add_argument("--addr", default=os.environ.get("VERIFIER_ADDR", "127.0.0.1:50053"))
    p.add_argument("--model", default=None,
                   help="GGUF file or HF folder (default: $SPECDEC_GGUF or the embedded SmolLM2)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"],
                   help="auto: bfloat16 on CUDA, float32 on CPU")
    p.add_argument("--graphs", action=argparse.BooleanOptionalAction, default=True,
                   help="capture CUDA graphs at start-up (CUDA only)")
    p.add_argument("--max-sequences", type=int, default=8, help="KV cache slots (concurrent sequences)")
    p.add_argument("--max-context", type=int, default=2048, help="prompt + generated tokens per sequence")
    p.add_argument("--max-tree-nodes", type=int, default=64, help="largest draft tree accepted")
    p.add_argument("--port-file", default=None)
    p.add_argument("--log-level", default=os.environ.get("LOG_LEVEL", "INFO"))
    a = p.parse_args()
    logging.basicConfig(level=a.log_level, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    asyncio.run(main(a))


if __name__ == "__main__":
    cli()
