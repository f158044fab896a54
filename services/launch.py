"""Process plumbing the three services share: port files, flags, and serving until SIGINT/SIGTERM with a
graceful drain: health NOT_SERVING at once, no new work, in-flight work finishes within --drain-grace,
then exit. A second signal stops at once."""

from __future__ import annotations

import argparse
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
    up to 270 ms as the verifier's start-up's did on this project's CPU (bench/gcprobe: its summary's start-up
    line); vLLM freezes its heap after warm-up alike."""
    gc.collect()
    gc.freeze()


def common_arguments(p: argparse.ArgumentParser, addr_env: str, default_addr: str) -> None:
    """Flags every service takes: where it listens, the port file for tests, the log level."""
    p.add_argument("--addr", default=os.environ.get(addr_env, default_addr))
    p.add_argument("--port-file", default=None, help="write the bound port here once serving")
    p.add_argument("--log-level", default=os.environ.get("LOG_LEVEL", "INFO"))
    p.add_argument(
        "--drain-grace",
        type=float,
        default=float(os.environ.get("DRAIN_GRACE", "20")),
        help="seconds in-flight work may take to finish after SIGTERM (keep below the "
        "orchestrator's kill timeout, e.g. terminationGracePeriodSeconds)",
    )


def parse_cpus(spec: str) -> set[int]:
    """A CPU list as taskset takes it: "3" -> {3}; "2-4,8" -> {2, 3, 4, 8}. ValueError when malformed."""
    cpus: set[int] = set()
    for part in spec.split(","):
        lo, dash, hi = part.strip().partition("-")
        if not lo.isdigit() or (dash and (not hi.isdigit() or int(hi) < int(lo))):
            raise ValueError(f"a CPU list is like 3 or 2-4,8, got {spec!r}")
        cpus.update(range(int(lo), int(hi or lo) + 1))
    return cpus


def engine_arguments(p: argparse.ArgumentParser) -> None:
    """Flags of the two engine services (draft and verifier)."""
    p.add_argument(
        "--cpu-affinity",
        default="",
        help="CPUs this process runs on, as taskset takes them (3, 2-4,8; default: the OS's choice), e.g. those "
        "near the GPU (nvidia-smi topo -m). One CPU made no difference on an H100 (docs/benchmarks.md, session 17)",
    )
    p.add_argument(
        "--model", default=None, help="GGUF file or HF folder (default: $SPECDEC_GGUF or the embedded SmolLM2)"
    )
    p.add_argument("--device", default="cpu")
    p.add_argument(
        "--dtype",
        default="auto",
        choices=["auto", "float32", "bfloat16", "float16"],
        help="auto: bfloat16 on CUDA, float32 on CPU",
    )
    p.add_argument(
        "--graphs",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="capture CUDA graphs at start-up (CUDA only)",
    )
    p.add_argument(
        "--block-on-device",
        action="store_true",
        help="on a GPU, the per-round engine calls (verify, propose) hold the event loop until the device is "
        "done, as before session 16, instead of giving it back while the device works (for A/B runs: "
        "docs/benchmarks.md, session 16)",
    )
    p.add_argument(
        "--max-sequences",
        type=int,
        default=0,
        help="KV cache slots (concurrent sequences); 0 = auto: 8 on CPU, from free GPU memory on CUDA "
        "(see --gpu-memory-fraction), at most 64",
    )
    p.add_argument(
        "--gpu-memory-fraction",
        type=float,
        default=0.4,
        help="share of the GPU memory free at start-up this service may give its KV cache when "
        "--max-sequences is auto (draft and verifier share one GPU)",
    )
    p.add_argument("--max-context", type=int, default=2048, help="prompt + generated tokens per sequence")
    p.add_argument(
        "--lease-ttl",
        type=float,
        default=float(os.environ.get("LEASE_TTL", "30")),
        help="seconds after which the sequences of a gateway that stopped renewing are freed",
    )


def parse_and_log(p: argparse.ArgumentParser) -> argparse.Namespace:
    a = p.parse_args()
    logging.basicConfig(level=a.log_level, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    if getattr(a, "cpu_affinity", ""):  # threads started from here on inherit it
        try:
            os.sched_setaffinity(0, parse_cpus(a.cpu_affinity))
        except (ValueError, OSError) as e:  # malformed, or CPUs this machine does not have
            p.error(f"--cpu-affinity {a.cpu_affinity}: {e}")
    return a


async def serve(address: str, services: list[tuple], port_file: str | None, grace_s: float) -> None:
    """Start engine services, (add_servicer, servicer, service name) each, on one server (with health and
    reflection) and their lease reapers, publish the port, serve until SIGINT/SIGTERM, then drain: no new
    sequences, wait until the held ones are released (by every service)."""
    from common.rpc import start_server

    freeze_heap()
    server = await start_server(address, [(add, servicer) for add, servicer, _ in services], [n for *_, n in services])
    for _, servicer, _ in services:
        servicer.leases.start()
    write_port_file(port_file, server.port)

    async def drain() -> None:
        await asyncio.gather(*(servicer.leases.drain() for _, servicer, _ in services))

    try:
        await serve_forever(server, drain, grace_s)
    finally:
        for _, servicer, _ in services:
            servicer.leases.stop()
            servicer.runner.close()
