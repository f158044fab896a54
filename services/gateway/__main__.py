"""python -m services.gateway: the public API (specdec.v1.Generation) in front of the verifier, which runs the
rounds. The gateway tokenizes, sends each generation on one stream to the verifier, commits what comes back by
the request's rules (stop strings, text) and streams it. It imports no torch."""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from pathlib import Path

from services.config import Serving, knob, parse

log = logging.getLogger("services.gateway")


@dataclass(frozen=True)
class GatewayConfig(Serving):
    addr: str = knob("127.0.0.1:50051", "where the public API listens", env="GATEWAY_ADDR")
    verifier: str = knob("127.0.0.1:50053", "the verifier's address", env="VERIFIER_ADDR")
    model: str = knob(
        "",
        "GGUF file, Hugging Face folder or tokenizer export to read the tokenizer from ('' = the verifier's default)",
    )
    max_waiting: int = knob(64, "requests beyond the verifier's slots that may wait before RESOURCE_EXHAUSTED")
    connect_timeout: float = knob(600.0, "seconds to wait at start-up for the verifier to serve")
    metrics_port: int = knob(0, "serve Prometheus metrics on this port (0: off)", env="METRICS_PORT")
    metrics_addr: str = knob("127.0.0.1", "interface the metrics listen on (0.0.0.0 in a pod)", env="METRICS_ADDR")
    max_request_bytes: int = knob(
        4 << 20, "largest request accepted (bytes): larger ones get RESOURCE_EXHAUSTED before parsing",
        env="MAX_REQUEST_BYTES",
    )  # fmt: skip
    health_interval: float = knob(0.5, "seconds between probes of the verifier (health, metrics)")

    def __post_init__(self) -> None:
        Serving.__post_init__(self)
        if not self.addr or not self.verifier:
            raise ValueError("the gateway needs its own address and the verifier's")
        if self.max_waiting < 0 or self.max_request_bytes < 1024 or self.health_interval <= 0:
            raise ValueError("max_waiting must be >= 0, max_request_bytes >= 1024, health_interval > 0")


async def main(cfg: GatewayConfig) -> None:
    from common.model_path import default_model_path
    from common.rpc import start_server
    from common.tokenizer import Tokenizer
    from services.gateway.metrics import Metrics
    from services.gateway.router import Router
    from services.gateway.server import GenerationServicer
    from services.launch import freeze_heap, serve_forever, write_port_file
    from specdec.v1 import generation_pb2_grpc

    tok = Tokenizer(Path(cfg.model) if cfg.model else default_model_path())
    metrics = Metrics()
    router = Router(cfg.verifier, max_in_flight=1, metrics=metrics)
    info = await router.link.first_info(cfg.connect_timeout)
    router.max_in_flight = info.max_sequences + cfg.max_waiting
    log.info(
        "verifier %s: %s on %s, %d sequences at once, drafter %s, policy %s",
        cfg.verifier,
        info.model,
        info.device,
        info.max_sequences,
        info.drafter or "none",
        info.speculation_policy,
    )
    router.link.start()
    if cfg.metrics_port:
        metrics.serve(cfg.metrics_port, cfg.metrics_addr)
    servicer = GenerationServicer(router, tok)
    freeze_heap()
    server = await start_server(
        cfg.addr,
        [(generation_pb2_grpc.add_GenerationServicer_to_server, servicer)],
        ["specdec.v1.Generation"],
        max_request_bytes=cfg.max_request_bytes,
    )

    async def watch() -> None:
        """Health says whether requests can be served now: the verifier's stream is up and it answers."""
        serving = True
        while True:
            info = await router.link.probe()
            if info is not None:
                metrics.policy(info)
            now = router.serving and info is not None
            if now != serving:
                log.warning("health: %s", "SERVING" if now else "NOT_SERVING (the verifier is down)")
                serving = now
            if not router.draining:
                await server.set_serving(now)
            await asyncio.sleep(cfg.health_interval)

    watcher = asyncio.get_running_loop().create_task(watch())
    write_port_file(cfg.port_file, server.port)
    try:
        await serve_forever(server, router.drain, cfg.drain_grace)
    finally:
        watcher.cancel()
        await router.stop()
        servicer.close()


def cli() -> None:
    asyncio.run(main(parse(GatewayConfig, "python -m services.gateway", __doc__)))


if __name__ == "__main__":
    cli()
