"""Process plumbing the three services share: port files, and serving until SIGINT/SIGTERM with a graceful
drain: health NOT_SERVING at once, no new work, in-flight work finishes within --drain-grace,
then exit. A second signal stops at once."""

from __future__ import annotations

import asyncio
import gc
import logging
import os
import signal
from collections.abc import Awaitable, Callable
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


async def serve_forever(server: Server, drain: Callable[[], Awaitable[None]], grace_s: float) -> None:
    """Serve until SIGINT/SIGTERM, then drain: `drain()` stops admitting and returns once in-flight work
    is done; it gets `grace_s` seconds, a second signal cuts it short."""
    signals = asyncio.Queue()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, signals.put_nowait, sig)
    sig = await signals.get()
    log.info("%s: health NOT_SERVING, draining (at most %g s)", signal.Signals(sig).name, grace_s)
    await server.not_serving()
    draining = loop.create_task(asyncio.wait_for(drain(), grace_s))
    second = loop.create_task(signals.get())
    await asyncio.wait([draining, second], return_when=asyncio.FIRST_COMPLETED)
    if second.done():
        log.warning("second signal: stopping without waiting for in-flight work")
        draining.cancel()
    second.cancel()
    try:
        await draining
        log.info("drained: stopping")
    except (TimeoutError, asyncio.CancelledError):
        log.warning("stopping with work still in flight")
    await server.stop(1.0)


def freeze_heap() -> None:
    """Once a service is built, before it serves: collect once, then move every object alive (the model, the
    engines and their graphs, the libraries: ~200,000 objects in the verifier) to the collector's permanent
    generation. A full collection traverses only what serving created since, instead of pausing the process for
    up to 270 ms as the verifier's start-up's did on this project's CPU; vLLM freezes its heap after warm-up alike."""
    gc.collect()
    gc.freeze()


async def serve(
    address: str,
    register: list[tuple],
    names: list[str],
    port_file: str,
    drain: Callable[[], Awaitable[None]],
    grace_s: float,
) -> None:
    """Start a service's servicers ((add_servicer, servicer) each, with health and reflection) on one server,
    freeze the heap, publish the port, serve until SIGINT/SIGTERM, then drain."""
    from common.rpc import start_server

    freeze_heap()
    server = await start_server(address, register, names)
    write_port_file(port_file, server.port)
    await serve_forever(server, drain, grace_s)
