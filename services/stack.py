"""Start the three services as separate processes on loopback and wait until they serve.

python -m services.stack            serve until Ctrl-C or SIGTERM (gateway on $GATEWAY_ADDR or 127.0.0.1:50051)
python -m services.stack --demo     also stream one demo generation with its speculation stats
python -m services.stack --colocate on|off|auto   the draft inside the verifier's process (two processes, see
                                   README) or in a process of its own; auto (the default): inside on a GPU
Tests use `Stack` with port 0 everywhere.

SIGTERM, SIGINT and SIGHUP are forwarded to the three children, which drain (in-flight generations
finish within --drain-grace) and exit; the stack waits for them, killing any that outlive the grace.
The children run in their own sessions (a Ctrl-C reaches only the stack, which stops them in order) and
are bound to the stack's life: should the stack itself be killed (-9), the kernel sends them SIGTERM
(PR_SET_PDEATHSIG), so no orphan keeps the ports.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import logging
import os
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

log = logging.getLogger(__name__)
ROOT = Path(__file__).resolve().parents[1]
PR_SET_PDEATHSIG = 1


def colocated(choice: str, device: str) -> bool:
    """Whether the draft runs inside the verifier's process: `choice` on or off, or auto: on a GPU, yes (the device
    chain needs the two engines in one process; session 21, one H200, docs/benchmarks.md: colocated the stack's
    policy was 2x as fast at concurrency 1 and level at 16 and 64, a pinned 6x60 tree 1.6-2x at every one, plain
    level); on CPU, no (the three processes CI checks).
    Example: ("auto", "cuda:0") -> True, ("auto", "cpu") -> False, ("off", "cuda") -> False."""
    if choice not in ("auto", "on", "off"):
        raise ValueError(f"colocate must be auto, on or off, got {choice!r}")
    return choice == "on" or (choice == "auto" and device.startswith("cuda"))


def colocate_argument(p: argparse.ArgumentParser) -> None:
    """--colocate [auto|on|off] (resolve with colocated()): the stack's and the load benchmarks' one flag. Bare, it
    means on (as before session 21, when it was a switch)."""
    p.add_argument(
        "--colocate",
        nargs="?",
        const="on",
        default="auto",
        choices=("auto", "on", "off"),
        help="on: the draft inside the verifier's process (python -m services.verifier --draft-here), two processes; "
        "off: three processes; auto (default): on with a CUDA device, off on CPU",
    )


def _bind_to_parent() -> None:
    """In the child, before exec: SIGTERM when the parent dies (Linux; elsewhere a no-op)."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


@dataclass
class Stack:
    gateway_addr: str = "127.0.0.1:0"
    draft_args: list[str] = field(default_factory=list)  # e.g. ["--drafter", "oracle-greedy"]
    verifier_args: list[str] = field(default_factory=list)
    gateway_args: list[str] = field(default_factory=list)
    common_args: list[str] = field(default_factory=list)  # passed to draft and verifier (e.g. --max-context)
    drain_grace: float = 5.0  # seconds each service may drain on SIGTERM
    colocate: bool = False  # the draft inside the verifier's process (--draft-here): two processes
    log_dir: Path | None = None
    procs: dict[str, subprocess.Popen] = field(default_factory=dict)
    ports: dict[str, int] = field(default_factory=dict)
    _tmp: Path | None = None
    _env: dict = field(default_factory=dict)

    def start(self, timeout: float = 300.0) -> Stack:
        self._tmp = Path(tempfile.mkdtemp(prefix="specdec-"))
        self.log_dir = self.log_dir or self._tmp
        self._env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
        engines = ("verifier",) if self.colocate else ("verifier", "draft")
        for name in engines:
            self._spawn(name, "127.0.0.1:0")
        for name in engines:
            self._wait(name, timeout)
        if self.colocate:
            self.ports["draft"] = self.ports["verifier"]
        self._spawn("gateway", self.gateway_addr)
        self._wait("gateway", timeout)
        return self

    @property
    def gateway(self) -> str:
        return f"127.0.0.1:{self.ports['gateway']}"

    def address(self, name: str) -> str:
        return f"127.0.0.1:{self.ports[name]}"

    def _args(self, name: str) -> list[str]:
        if name == "gateway":
            return ["--verifier", self.address("verifier"), "--draft", self.address("draft"), *self.gateway_args]
        if name == "verifier" and self.colocate:
            return [*self.common_args, *self.verifier_args, "--draft-here", *self.draft_args]
        return [*self.common_args, *(self.verifier_args if name == "verifier" else self.draft_args)]

    def _spawn(self, name: str, addr: str) -> None:
        (self._tmp / f"{name}.port").unlink(missing_ok=True)
        out = open(self.log_dir / f"{name}.log", "a")  # noqa: SIM115 - lives as long as the process
        self.procs[name] = subprocess.Popen(
            [
                sys.executable,
                "-m",
                f"services.{name}",
                "--addr",
                addr,
                "--drain-grace",
                str(self.drain_grace),
                *self._args(name),
                "--port-file",
                str(self._tmp / f"{name}.port"),
            ],
            cwd=ROOT,
            env=self._env,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            preexec_fn=_bind_to_parent,
        )

    def kill(self, name: str, sig: int = signal.SIGKILL) -> None:
        """Send `sig` to one service (tests: faults); waits for it to exit when it is SIGKILL."""
        p = self.procs[name]
        p.send_signal(sig)
        if sig == signal.SIGKILL:
            p.wait(timeout=30)

    def restart(self, name: str, timeout: float = 300.0) -> None:
        """Start a service again on the port it had (after kill); returns once it serves."""
        if self.procs[name].poll() is None:
            raise RuntimeError(f"{name} is still running")
        self._spawn(name, self.address(name))
        self._wait(name, timeout)

    def _wait(self, name: str, timeout: float) -> None:
        port_file, deadline = self._tmp / f"{name}.port", time.monotonic() + timeout
        while not port_file.exists():
            if self.procs[name].poll() is not None:
                self.stop()
                tail = (self.log_dir / f"{name}.log").read_text()[-3000:]
                raise RuntimeError(f"{name} exited with {self.procs[name].returncode}:\n{tail}")
            if time.monotonic() > deadline:
                self.stop()
                raise TimeoutError(f"{name} did not start within {timeout:.0f} s")
            time.sleep(0.1)
        self.ports[name] = int(port_file.read_text())

    def alive(self) -> dict[str, bool]:
        return {n: p.poll() is None for n, p in self.procs.items()}

    def stop(self, sig: int = signal.SIGTERM) -> None:
        """Forward `sig` to every service still running, wait for them to drain and exit (up to the
        grace and a margin), and kill those that do not."""
        for p in self.procs.values():
            if p.poll() is None:
                p.send_signal(sig)
        deadline = time.monotonic() + self.drain_grace + 10
        for name, p in self.procs.items():
            try:
                p.wait(timeout=max(deadline - time.monotonic(), 0.1))
            except subprocess.TimeoutExpired:
                log.warning("%s did not exit within its grace: killing it", name)
                p.kill()
                p.wait()

    def __enter__(self) -> Stack:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


class _Stop(Exception):
    """A forwarded signal: leave whatever the stack is doing (starting, serving) and stop the children."""

    def __init__(self, sig: int) -> None:
        super().__init__(signal.Signals(sig).name)
        self.sig = sig


def _raise_stop(sig: int, _frame) -> None:
    raise _Stop(sig)


def main() -> None:
    p = argparse.ArgumentParser(
        prog="python -m services.stack", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--demo", action="store_true", help="stream one generation through the gateway")
    p.add_argument("--device", default=os.environ.get("SPECDEC_DEVICE", "cpu"))
    p.add_argument("--dtype", default=os.environ.get("SPECDEC_DTYPE", "auto"))
    p.add_argument("--drafter", default="eagle3")
    colocate_argument(p)
    p.add_argument(
        "--drain-grace",
        type=float,
        default=float(os.environ.get("DRAIN_GRACE", "20")),
        help="seconds the services may drain after SIGTERM",
    )
    p.add_argument(
        "--gateway-arg",
        action="append",
        default=[],
        metavar="ARG",
        help="extra gateway flag, repeatable (e.g. --gateway-arg=--metrics-port=9090)",
    )
    a = p.parse_args()
    colocate = colocated(a.colocate, a.device)
    logging.basicConfig(level="INFO", format="%(asctime)s %(name)s %(levelname)s %(message)s")
    addr = os.environ.get("GATEWAY_ADDR", "127.0.0.1:50051")
    stack = Stack(
        gateway_addr=addr,
        common_args=["--device", a.device, "--dtype", a.dtype],
        draft_args=["--drafter", a.drafter],
        gateway_args=a.gateway_arg,
        drain_grace=a.drain_grace,
        colocate=colocate,
    )
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, _raise_stop)
    try:
        log.info("starting verifier, draft%s and gateway ...", " (in the verifier's process)" if colocate else "")
        stack.start()
        log.info(
            "gateway serving on %s (verifier :%d, draft :%d; logs in %s)",
            stack.gateway,
            stack.ports["verifier"],
            stack.ports["draft"],
            stack.log_dir,
        )
        if a.demo:
            from services.client import stream

            stream(stack.gateway, "Why is the sky blue?", max_tokens=96, chat=True, out=sys.stdout)
        log.info("serving until Ctrl-C or SIGTERM")
        while all(stack.alive().values()):
            time.sleep(0.5)
        log.error("a service exited on its own (%s): stopping the others", stack.alive())
    except _Stop as e:
        log.info("%s: forwarding to the services and waiting for them to drain", e)
    finally:
        for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
            signal.signal(sig, signal.SIG_IGN)  # a second signal must not cut the stop short
        stack.stop()


if __name__ == "__main__":
    main()
