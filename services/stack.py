"""Start the services as separate processes, wait until they serve, and keep them serving.

python -m services.stack            serve until Ctrl-C or SIGTERM (gateway on $GATEWAY_ADDR or 127.0.0.1:50051)
python -m services.stack --demo     also stream one demo generation, time it with a tree and plainly, and say why
                                   the speculation policy chose what it did
python -m services.stack --colocate on|off|auto   the draft inside the verifier's process (two processes, see
                                   README) or in a process of its own; auto (the default): inside on a GPU
Tests use `Stack` with port 0 everywhere, or run this command with --state-file to learn its children.

Supervision: a child that exits on its own is started again on its port with the same arguments, after a
backoff (--restart-backoff, doubled at each further restart up to --restart-backoff-max, back to the start once
the child has served --restart-reset-after seconds), while the others keep serving (they reconnect by
themselves). Each restart is logged with the exit status and the child's log file. A child that dies
--restart-limit times within --restart-window seconds, or that fails while the stack starts, stops the stack
with exit status 3, so that an outer supervisor (Kubernetes, systemd) takes over.

SIGTERM, SIGINT and SIGHUP are forwarded (as SIGTERM) to the children, which drain (in-flight generations finish
within --drain-grace) and exit; the stack waits for them, killing any that outlive the grace. The children run in
their own sessions (a Ctrl-C reaches only the stack, which stops them in order) and are bound to the stack's
life: should the stack itself be killed (-9), the kernel sends them SIGTERM (PR_SET_PDEATHSIG), so no orphan
keeps the ports.

With more than one process on one CUDA GPU (--colocate off) the stack starts the CUDA MPS control daemon when
none is running (--mps auto), so that the processes share the GPU instead of taking turns, and quits it at exit.
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

from services.mps import Mps, mps_wanted
from services.supervise import EXIT_CHILD_FAILED, ChildFailed, RestartPolicy, Supervisor, exit_status

log = logging.getLogger(__name__)
ROOT = Path(__file__).resolve().parents[1]
PR_SET_PDEATHSIG = 1
FORWARDED = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


def colocated(choice: str, device: str) -> bool:
    """Whether the draft runs inside the verifier's process: `choice` on or off, or auto: on a GPU, yes (the device
    chain needs the two engines in one process; docs/decisions.md: colocated, the stack's policy was 2x as fast at
    concurrency 1 and level at 16 and 64, a pinned 6x60 tree 1.6-2x at every one, plain level); on CPU, no (the
    three processes CI checks).
    Example: ("auto", "cuda:0") -> True, ("auto", "cpu") -> False, ("off", "cuda") -> False."""
    if choice not in ("auto", "on", "off"):
        raise ValueError(f"colocate must be auto, on or off, got {choice!r}")
    return choice == "on" or (choice == "auto" and device.startswith("cuda"))


def colocate_argument(p: argparse.ArgumentParser) -> None:
    """--colocate [auto|on|off] (resolve with colocated()): the stack's and the load benchmarks' one flag. Bare, it
    means on."""
    p.add_argument(
        "--colocate",
        nargs="?",
        const="on",
        default="auto",
        choices=("auto", "on", "off"),
        help="on: the draft inside the verifier's process (python -m services.verifier --draft-here), two processes; "
        "off: three processes; auto (default): on with a CUDA device, off on CPU",
    )


def bind_to_parent() -> None:
    """In the child, before exec: SIGTERM when the parent dies (Linux; elsewhere a no-op). The stack's children,
    the benchmarks' stacks and draft services, and the training launcher's processes all start with it."""
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
    log_dir: Path | None = None  # the children's logs, <name>.log (default: a fresh temporary folder)
    env: dict[str, str] = field(default_factory=dict)  # added to the children's environment (e.g. CUDA MPS's)
    procs: dict[str, subprocess.Popen] = field(default_factory=dict)
    ports: dict[str, int] = field(default_factory=dict)
    _binds: dict[str, str] = field(default_factory=dict)  # where each listens: "127.0.0.1:0", then its real port
    _tmp: Path | None = None
    _env: dict = field(default_factory=dict)

    @property
    def names(self) -> tuple[str, ...]:
        """The processes, in start order: each one's dependencies before it."""
        return ("verifier", "gateway") if self.colocate else ("draft", "verifier", "gateway")

    def start(self, timeout: float = 300.0) -> Stack:
        """Start the processes one after the other, each once the one it dials serves; ChildFailed (every process
        stopped) when one exits or does not serve within `timeout`."""
        self._tmp = Path(tempfile.mkdtemp(prefix="specdec-"))
        self.log_dir = Path(self.log_dir or self._tmp)
        self.log_dir.mkdir(parents=True, exist_ok=True)
        pythonpath = f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"
        self._env = {**os.environ, **self.env, "PYTHONPATH": pythonpath}
        for name in self.names:
            self._binds[name] = self.gateway_addr if name == "gateway" else "127.0.0.1:0"
            self.spawn(name)
            self._wait(name, timeout)
        return self

    @property
    def gateway(self) -> str:
        return f"127.0.0.1:{self.ports['gateway']}"

    def address(self, name: str) -> str:
        return f"127.0.0.1:{self.ports[name]}"

    def log_path(self, name: str) -> Path:
        return self.log_dir / f"{name}.log"

    def pids(self) -> dict[str, int]:
        return {n: p.pid for n, p in self.procs.items()}

    def _args(self, name: str) -> list[str]:
        """The gateway dials the verifier; the verifier runs the draft in its process or dials its service."""
        if name == "gateway":
            return ["--verifier", self.address("verifier"), *self.gateway_args]
        if name == "verifier" and self.colocate:
            return [*self.common_args, *self.verifier_args, "--draft-here", *self.draft_args]
        if name == "verifier":
            return [*self.common_args, *self.verifier_args, "--draft", self.address("draft")]
        return [*self.common_args, *self.draft_args]

    def spawn(self, name: str) -> None:
        """Start one process where it listens (its first start: on port 0; later: on the port it had), without
        waiting for it to serve (see serving())."""
        port_file = self._tmp / f"{name}.port"
        port_file.unlink(missing_ok=True)
        cmd = [sys.executable, "-m", f"services.{name}", "--addr", self._binds[name]]
        cmd += ["--drain-grace", str(self.drain_grace), *self._args(name), "--port-file", str(port_file)]
        with open(self.log_path(name), "a") as out:  # the child writes to its own copy of the descriptor
            self.procs[name] = subprocess.Popen(
                cmd,
                cwd=ROOT,
                env=self._env,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                preexec_fn=bind_to_parent,
            )

    def serving(self, name: str) -> bool:
        """Whether the process started last under `name` has published its port (it serves)."""
        port_file = self._tmp / f"{name}.port"
        if not port_file.exists():
            return False
        port = int(port_file.read_text())
        self.ports[name] = port
        self._binds[name] = f"{self._binds[name].rsplit(':', 1)[0]}:{port}"
        if name == "verifier" and self.colocate:
            self.ports["draft"] = port
        return True

    def exit_status(self, name: str) -> int | None:
        """The return code of the process started last under `name`; None while it runs."""
        return self.procs[name].poll()

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
        self.spawn(name)
        self._wait(name, timeout)

    def _wait(self, name: str, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while not self.serving(name):
            code = self.procs[name].poll()
            if code is not None:
                self.stop()
                logfile = self.log_path(name)
                tail = "\n".join(logfile.read_text(errors="replace").splitlines()[-30:])
                raise ChildFailed(f"{name} failed to start ({exit_status(code)}; its log {logfile}):\n{tail}")
            if time.monotonic() > deadline:
                self.stop()
                raise ChildFailed(f"{name} did not serve within {timeout:.0f} s (its log {self.log_path(name)})")
            time.sleep(0.1)

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


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m services.stack", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--demo", action="store_true", help="stream one generation through the gateway")
    p.add_argument("--device", default=os.environ.get("SPECDEC_DEVICE", "cpu"))
    p.add_argument("--dtype", default=os.environ.get("SPECDEC_DTYPE", "auto"))
    p.add_argument("--drafter", default="eagle3")
    colocate_argument(p)
    p.add_argument(
        "--mps",
        default="auto",
        choices=("auto", "off"),
        help="auto: with several processes on one CUDA GPU (--colocate off), start the CUDA MPS control daemon "
        "unless one runs; off: never",
    )
    p.add_argument(
        "--drain-grace",
        type=float,
        default=float(os.environ.get("DRAIN_GRACE", "20")),
        help="seconds the services may drain after SIGTERM",
    )
    for who, example in (("gateway", "--metrics-port=9090"), ("engine", "--max-context=1024"), ("draft", "--model=X")):
        p.add_argument(
            f"--{who}-arg",
            action="append",
            default=[],
            metavar="ARG",
            help=f"extra {'draft and verifier' if who == 'engine' else who} flag, repeatable "
            f"(e.g. --{who}-arg={example})",
        )
    p.add_argument("--log-dir", type=Path, default=None, help="the children's logs (default: a new temporary folder)")
    p.add_argument(
        "--state-file",
        type=Path,
        default=None,
        help="keep here, as JSON, each child's pid, port, phase, restarts and log (rewritten at each change)",
    )
    RestartPolicy.add_arguments(p)
    return p


def main() -> None:
    p = _parser()
    a = p.parse_args()
    try:
        policy = RestartPolicy.from_args(a)
    except ValueError as e:
        p.error(str(e))
    colocate = colocated(a.colocate, a.device)
    logging.basicConfig(level="INFO", format="%(asctime)s %(name)s %(levelname)s %(message)s")
    stack = Stack(
        gateway_addr=os.environ.get("GATEWAY_ADDR", "127.0.0.1:50051"),
        common_args=["--device", a.device, "--dtype", a.dtype, *a.engine_arg],
        draft_args=["--drafter", a.drafter, *a.draft_arg],
        gateway_args=a.gateway_arg,
        drain_grace=a.drain_grace,
        colocate=colocate,
        log_dir=a.log_dir,
    )
    for sig in FORWARDED:
        signal.signal(sig, _raise_stop)
    mps, status = None, 0
    try:
        if mps_wanted(a.mps, a.device, colocate) and (mps := Mps.start(os.environ)):
            stack.env.update(mps.env)
        log.info("starting the draft%s, verifier and gateway ...", " (in the verifier's process)" if colocate else "")
        stack.start()
        if mps is not None:
            gpu, clients = {n: p for n, p in stack.pids().items() if n != "gateway"}, mps.clients()
            missing = sorted(n for n, pid in gpu.items() if pid not in clients)
            if missing:
                log.warning("CUDA MPS: %s did not connect through the daemon: it takes turns at the GPU", missing)
            else:
                log.info("CUDA MPS: %s connected through the daemon", ", ".join(sorted(gpu)))
        supervisor = Supervisor(stack, policy, a.state_file)
        log.info(
            "gateway serving on %s (verifier :%d, draft :%d; logs in %s)",
            stack.gateway,
            stack.ports["verifier"],
            stack.ports["draft"],
            stack.log_dir,
        )
        if a.demo:
            from services.client import demo

            demo(stack.gateway)
        log.info("serving until Ctrl-C or SIGTERM; a child that exits is restarted")
        supervisor.run()
    except _Stop as e:
        log.info("%s: forwarding to the services and waiting for them to drain", e)
    except ChildFailed as e:
        log.error("%s", e)
        status = EXIT_CHILD_FAILED
    finally:
        for sig in FORWARDED:
            signal.signal(sig, signal.SIG_IGN)  # a second signal must not cut the stop short
        stack.stop()
        if mps is not None:
            mps.stop()
        if a.state_file is not None:
            a.state_file.unlink(missing_ok=True)
    if status:
        log.error("stack stopped (exit status %d)", status)
    sys.exit(status)


if __name__ == "__main__":
    main()
