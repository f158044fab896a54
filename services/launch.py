"""Process plumbing the three services share: port files and serving until SIGINT/SIGTERM."""

from __future__ import annotations

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
