"""Process plumbing the three services share: port files and serving until SIGINT/SIGTERM."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
from pathlib import Path

from common.rpc import Server

log = logging.getLogger(__name__)


def write_port_file(path: str | None, port: int) -> None:
    """Tests start services on port 0 and read the bound port from here (written atomically)."""
    if not path:
        return
    tmp = Path(f"{path}.tmp")
    tmp.write_text(str(port))
    os.replace(tmp, path)


async def serve_forever(server: Server) -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    log.info("shutting down")
    await server.stop()


def common_arguments(p: argparse.ArgumentParser, addr_env: str, default_addr: str) -> None:
    """Flags every service takes: where it listens, the port file for tests, the log level."""
    p.add_argument("--addr", default=os.environ.get(addr_env, default_addr))
    p.add_argument("--port-file", default=None, help="write the bound port here once serving")
    p.add_argument("--log-level", default=os.environ.get("LOG_LEVEL", "INFO"))


def engine_arguments(p: argparse.ArgumentParser) -> None:
    """Flags of the two engine services (draft and verifier)."""
    p.add_argument("--model", default=None,
                   help="GGUF file or HF folder (default: $SPECDEC_GGUF or the embedded SmolLM2)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"],
                   help="auto: bfloat16 on CUDA, float32 on CPU")
    p.add_argument("--graphs", action=argparse.BooleanOptionalAction, default=True,
                   help="capture CUDA graphs at start-up (CUDA only)")
    p.add_argument("--max-sequences", type=int, default=8, help="KV cache slots (concurrent sequences)")
    p.add_argument("--max-context", type=int, default=2048, help="prompt + generated tokens per sequence")


def parse_and_log(p: argparse.ArgumentParser) -> argparse.Namespace:
    a = p.parse_args()
    logging.basicConfig(level=a.log_level, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    return a


async def serve(address: str, add_servicer, servicer, service_name: str, port_file: str | None) -> None:
    """Start one service (with health and reflection), publish its port, serve until SIGINT/SIGTERM."""
    from common.rpc import start_server

    server = await start_server(address, [(add_servicer, servicer)], [service_name])
    write_port_file(port_file, server.port)
    await serve_forever(server)
