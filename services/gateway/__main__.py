"""python -m services.gateway: the public service, in front of a draft and a verifier service."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
from dataclasses import dataclass
from pathlib import Path

from common.weights import default_model_path
from services.launch import common_arguments, parse_and_log, serve_forever, write_port_file

log = logging.getLogger("services.gateway")


@dataclass(frozen=True)
class GatewayConfig:
    address: str         # where the public API listens
    verifier: str        # verifier service address
    draft: str           # draft service address ("" = plain decoding only)
    model: Path          # GGUF file or HF folder the tokenizer is read from
    max_active: int = 8  # sequences per round
    max_waiting: int = 64
    connect_timeout: float = 120.0
    metrics_port: int = 0  # Prometheus /metrics on 127.0.0.1 (0 = off)
    ipc: bool = True       # use CUDA IPC when draft and verifier share host and GPU

    def __post_init__(self) -> None:
        if not self.address or not self.verifier:
            raise ValueError("gateway needs its own address and the verifier's")
        if self.max_active < 1:
            raise ValueError(f"max_active must be >= 1, got {self.max_active}")


async def main(cfg: GatewayConfig, port_file: str | None) -> None:
    import grpc

    from common.rpc import start_server
    from common.tokenizer import Tokenizer
    from services.gateway.clients import DraftClient, VerifierClient, connect_ipc
    from services.gateway.metrics import Metrics
    from services.gateway.scheduler import Scheduler, SchedulerConfig
    from services.gateway.server import GenerationServicer
    from specdec.v1 import generation_pb2_grpc

    tok = Tokenizer(cfg.model)
    verifier = VerifierClient(cfg.verifier)
    draft = DraftClient(cfg.draft) if cfg.draft else None
    await asyncio.wait_for(verifier.channel.channel_ready(), cfg.connect_timeout)
    vinfo = await verifier.info()
    dinfo = None
    if draft is not None:
        await asyncio.wait_for(draft.channel.channel_ready(), cfg.connect_timeout)
        dinfo = await draft.info()
        if dinfo.verify_tree_size > vinfo.max_tree_nodes:
            raise ValueError(f"draft proposes {dinfo.verify_tree_size} nodes; the verifier takes at most "
                             f"{vinfo.max_tree_nodes}")
        if cfg.ipc:
            try:
                on = await connect_ipc(verifier, draft, vinfo, dinfo)
            except grpc.aio.AioRpcError as e:
                log.warning("CUDA IPC set-up failed (%s): hidden states travel inline", e.details())
                on = False
            log.info("hidden states between verifier and draft: %s", "CUDA IPC" if on else "inline bytes")
    metrics = Metrics()
    if cfg.metrics_port:
        metrics.serve(cfg.metrics_port)
    sched = Scheduler(verifier, draft, SchedulerConfig(max_active=min(cfg.max_active, vinfo.max_sequences),
                                                       max_waiting=cfg.max_waiting,
                                                       tree_size=dinfo.verify_tree_size if dinfo else 1), metrics)
    sched.start()
    servicer = GenerationServicer(sched, tok, vinfo, dinfo)
    server = await start_server(cfg.address, [(generation_pb2_grpc.add_GenerationServicer_to_server, servicer)],
                                ["specdec.v1.Generation"])
    write_port_file(port_file, server.port)
    try:
        await serve_forever(server)
    finally:
        await sched.stop()
        await verifier.close()
        if draft:
            await draft.close()


def cli() -> None:
    p = argparse.ArgumentParser(prog="python -m services.gateway", description=__doc__)
    common_arguments(p, "GATEWAY_ADDR", "127.0.0.1:50051")
    p.add_argument("--verifier", default=os.environ.get("VERIFIER_ADDR", "127.0.0.1:50053"))
    p.add_argument("--draft", default=os.environ.get("DRAFT_ADDR", "127.0.0.1:50052"),
                   help="draft service address; empty for plain decoding only")
    p.add_argument("--model", default=None, help="GGUF file or HF folder for the tokenizer "
                   "(default: $SPECDEC_GGUF or the embedded SmolLM2)")
    p.add_argument("--max-active", type=int, default=8)
    p.add_argument("--max-waiting", type=int, default=64)
    p.add_argument("--metrics-port", type=int, default=int(os.environ.get("METRICS_PORT", "0")),
                   help="serve Prometheus metrics on this port (0 = off)")
    p.add_argument("--no-ipc", action="store_true", help="always send hidden states as inline bytes")
    a = parse_and_log(p)
    cfg = GatewayConfig(address=a.addr, verifier=a.verifier, draft=a.draft,
                        model=Path(a.model) if a.model else default_model_path(),
                        max_active=a.max_active, max_waiting=a.max_waiting, metrics_port=a.metrics_port,
                        ipc=not a.no_ipc)
    asyncio.run(main(cfg, a.port_file))


if __name__ == "__main__":
    cli()
