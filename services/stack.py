"""Start the three services as separate processes on loopback and wait until they serve.

python -m services.stack            serve until Ctrl-C (gateway on $GATEWAY_ADDR or 127.0.0.1:50051)
python -m services.stack --demo     also stream one demo generation with its speculation stats
Tests use `Stack` with port 0 everywhere.
"""

from __future__ import annotations

import argparse
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


@dataclass
class Stack:
    gateway_addr: str = "127.0.0.1:0"
    draft_args: list[str] = field(default_factory=list)     # e.g. ["--drafter", "oracle-greedy"]
    verifier_args: list[str] = field(default_factory=list)
    gateway_args: list[str] = field(default_factory=list)
    common_args: list[str] = field(default_factory=list)    # passed to draft and verifier (e.g. --max-context)
    log_dir: Path | None = None
    procs: dict[str, subprocess.Popen] = field(default_factory=dict)
    ports: dict[str, int] = field(default_factory=dict)

    def start(self, timeout: float = 300.0) -> Stack:
        tmp = Path(tempfile.mkdtemp(prefix="specdec-"))
        self.log_dir = self.log_dir or tmp
        env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
        backends = {"verifier": self.verifier_args, "draft": self.draft_args}
        for name, extra in backends.items():
            self._spawn(name, ["--addr", "127.0.0.1:0", *self.common_args, *extra], tmp, env)
        for name in backends:
            self._wait(name, tmp, timeout)
        self._spawn("gateway", ["--addr", self.gateway_addr, "--verifier", f"127.0.0.1:{self.ports['verifier']}",
                                "--draft", f"127.0.0.1:{self.ports['draft']}", *self.gateway_args], tmp, env)
        self._wait("gateway", tmp, timeout)
        return self

    @property
    def gateway(self) -> str:
        return f"127.0.0.1:{self.ports['gateway']}"

    def _spawn(self, name: str, args: list[str], tmp: Path, env: dict) -> None:
        out = open(self.log_dir / f"{name}.log", "w")  # noqa: SIM115 - lives as long as the process
        self.procs[name] = subprocess.Popen(
            [sys.executable, "-m", f"services.{name}", *args, "--port-file", str(tmp / f"{name}.port")],
            cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)

    def _wait(self, name: str, tmp: Path, timeout: float) -> None:
        port_file, deadline = tmp / f"{name}.port", time.monotonic() + timeout
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

    def stop(self) -> None:
        for p in self.procs.values():
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in self.procs.values():
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                p.kill()

    def __enter__(self) -> Stack:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def main() -> None:
    p = argparse.ArgumentParser(prog="python -m services.stack", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--demo", action="store_true", help="stream one generation through the gateway")
    p.add_argument("--device", default=os.environ.get("SPECDEC_DEVICE", "cpu"))
    p.add_argument("--dtype", default=os.environ.get("SPECDEC_DTYPE", "auto"))
    p.add_argument("--drafter", default="eagle3")
    a = p.parse_args()
    logging.basicConfig(level="INFO", format="%(asctime)s %(name)s %(levelname)s %(message)s")
    addr = os.environ.get("GATEWAY_ADDR", "127.0.0.1:50051")
    stack = Stack(gateway_addr=addr, common_args=["--device", a.device, "--dtype", a.dtype],
                  draft_args=["--drafter", a.drafter])
    log.info("starting verifier, draft and gateway (logs in %s) ...", stack.log_dir or "a temp folder")
    stack.start()
    log.info("gateway serving on %s (verifier :%d, draft :%d; logs in %s)", stack.gateway,
             stack.ports["verifier"], stack.ports["draft"], stack.log_dir)
    try:
        if a.demo:
            from services.client import stream
            stream(stack.gateway, "Why is the sky blue?", max_tokens=96, chat=True, out=sys.stdout)
        log.info("serving until Ctrl-C")
        signal.sigwait({signal.SIGINT, signal.SIGTERM})
    except KeyboardInterrupt:
        pass
    finally:
        stack.stop()


if __name__ == "__main__":
    main()
