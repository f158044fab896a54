"""Helpers of the fault tests: `python -m services.stack` run as users run it (`make serve`) in a subprocess whose
children the tests find in its --state-file, streams that run in threads while a test kills a process, probes of
the public API, and the figures the tests log (requests sent, failed, seconds to recover)."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from services.stack import bind_to_parent
from specdec.v1 import generation_pb2 as gpb
from specdec.v1 import generation_pb2_grpc as gpb_grpc
from specdec.v1 import internal_pb2 as pb
from specdec.v1 import internal_pb2_grpc as pb_grpc
from tests.helpers import chat, free_port

log = logging.getLogger("faults")
ROOT = Path(__file__).resolve().parents[1]
# the flags of tests/conftest.py's COMMON, as the stack takes them: the real model in float32 on CPU, small caches
STACK_FLAGS = [
    "--device",
    "cpu",
    "--dtype",
    "float32",
    "--engine-arg=--max-context=512",
    "--engine-arg=--max-sequences=8",
]
MAX_SEQUENCES = 8
EXIT_CHILD_FAILED = 3  # services.stack's exit status when a child fails at start or keeps dying


def alive(pid: int) -> bool:
    """Whether `pid` runs (a zombie does not)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except FileNotFoundError:
        return False
    return state[0] != "Z"


def _parent(pid: int) -> int | None:
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
    except FileNotFoundError:
        return None


def _is_service(pid: int) -> bool:
    try:
        return b"\0services." in Path(f"/proc/{pid}/cmdline").read_bytes()
    except FileNotFoundError:
        return False


@dataclass
class ServedStack:
    """`python -m services.stack` in a subprocess of the test, gateway on a free loopback port, children's logs and
    state file (their pids and ports, services/stack.py's Supervisor) in `folder`. Only processes it started are
    ever signalled: the stack by its Popen, a child by a pid the state file gives whose parent is the stack."""

    proc: subprocess.Popen
    gateway: str
    folder: Path
    seen: dict[int, str] = field(default_factory=dict)  # every child pid the state file gave: name

    @classmethod
    def launch(cls, folder: Path, *flags: str, grace: float = 5.0, wait: bool = True) -> ServedStack:
        """Start the stack; with `wait`, return once its gateway is SERVING (RuntimeError with the logs if not)."""
        folder.mkdir(parents=True, exist_ok=True)
        addr = f"127.0.0.1:{free_port()}"
        env = {**os.environ, "GATEWAY_ADDR": addr, "PYTHONPATH": str(ROOT)}
        cmd = [sys.executable, "-m", "services.stack", *STACK_FLAGS, "--drain-grace", str(grace)]
        cmd += ["--log-dir", str(folder / "logs"), "--state-file", str(folder / "state.json"), *flags]
        with open(folder / "stack.log", "a") as out:
            # bound to the test's life too: should pytest be killed, the stack gets SIGTERM, drains and exits
            proc = subprocess.Popen(
                cmd, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT, preexec_fn=bind_to_parent
            )
        s = cls(proc, addr, folder)
        if wait:
            with contextlib.suppress(TimeoutError):
                wait_for(lambda: s.proc.poll() is not None or (s.state() and health(addr) == "SERVING"), 300, 0.2)
            if s.proc.poll() is not None or health(addr) != "SERVING":
                s.close()
                raise RuntimeError(f"the stack did not come up:\n{s.logs()}")
        return s

    def state(self) -> dict:
        """The stack's state file ({} before it is written and after the stack exits)."""
        try:
            state = json.loads((self.folder / "state.json").read_text())
        except FileNotFoundError:
            return {}
        for name, child in state.items():
            self.seen[child["pid"]] = name
        return state

    def pid(self, name: str) -> int:
        return self.state()[name]["pid"]

    def address(self, name: str) -> str:
        return f"127.0.0.1:{self.state()[name]['port']}"

    def kill(self, name: str, sig: int = signal.SIGKILL) -> int:
        """Signal the stack's child `name`; its pid."""
        pid = self.pid(name)
        if _parent(pid) != self.proc.pid:
            raise RuntimeError(f"pid {pid} ({name}) is not a child of the stack {self.proc.pid}")
        os.kill(pid, sig)
        return pid

    def serving_again(self, name: str, old_pid: int, timeout: float = 120) -> float:
        """Seconds until the stack has restarted `name` (a new pid) and it serves."""

        def back() -> bool:
            child = self.state().get(name, {})
            return child.get("pid") not in (None, old_pid) and child.get("phase") == "serving"

        return wait_for(back, timeout, 0.05)

    def children_left(self) -> list[int]:
        return [pid for pid in self.seen if alive(pid)]

    def logs(self, chars: int = 3000) -> str:
        parts = [f"== stack (exit {self.proc.poll()})\n{(self.folder / 'stack.log').read_text()[-chars:]}"]
        for f in sorted((self.folder / "logs").glob("*.log")):
            parts.append(f"== {f.name}\n{f.read_text(errors='replace')[-chars:]}")
        return "\n".join(parts)

    def close(self, timeout: float = 30) -> None:
        """Stop the stack if it runs (SIGTERM, then SIGKILL past `timeout`) and kill -9 what is left of its children
        (they get SIGTERM when the stack dies, so this only reaps stragglers). Safe to call twice."""
        self.state()
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        deadline = time.monotonic() + timeout
        while self.children_left() and time.monotonic() < deadline:
            time.sleep(0.1)
        for pid in self.children_left():
            if _is_service(pid):
                log.warning("killing pid %d (%s), left behind by the stack", pid, self.seen[pid])
                os.kill(pid, signal.SIGKILL)


@dataclass
class Outcome:
    tokens: list[int] = field(default_factory=list)  # [completion_tokens] streamed so far
    error: grpc.RpcError | None = None
    last: gpb.GenerateResponse | None = None
    first_at: float | None = None  # time.monotonic() of the first token
    done_at: float | None = None  # of the end (last message or error)


class Streams:
    """Generate calls running in threads (one channel each); `wait_tokens` blocks until every stream has
    produced at least n tokens, so a fault lands mid-generation."""

    def __init__(self, addr: str, requests: list[gpb.GenerateRequest], timeout: float = 300) -> None:
        self.outcomes = [Outcome() for _ in requests]
        self._threads = [
            threading.Thread(target=self._run, args=(addr, r, o, timeout), daemon=True)
            for r, o in zip(requests, self.outcomes)
        ]
        for t in self._threads:
            t.start()

    @staticmethod
    def _run(addr: str, request: gpb.GenerateRequest, out: Outcome, timeout: float) -> None:
        with grpc.insecure_channel(addr) as ch:
            try:
                for msg in gpb_grpc.GenerationStub(ch).Generate(request, timeout=timeout):
                    if out.first_at is None and msg.token_ids:
                        out.first_at = time.monotonic()
                    out.tokens.extend(msg.token_ids)
                    out.last = msg
            except grpc.RpcError as e:
                out.error = e
            out.done_at = time.monotonic()

    def wait_tokens(self, n: int, timeout: float = 120) -> None:
        deadline = time.monotonic() + timeout
        while any(len(o.tokens) < n and o.error is None for o in self.outcomes):
            if time.monotonic() > deadline:
                raise TimeoutError(f"streams did not reach {n} tokens within {timeout} s")
            time.sleep(0.02)

    def join(self, timeout: float = 300) -> list[Outcome]:
        deadline = time.monotonic() + timeout
        for t in self._threads:
            t.join(max(deadline - time.monotonic(), 0.01))
        return self.outcomes

    @property
    def failed(self) -> list[Outcome]:
        return [o for o in self.outcomes if o.error is not None]


def info(addr: str, draft: bool = False):
    with grpc.insecure_channel(addr) as ch:
        stub = pb_grpc.DraftStub(ch) if draft else pb_grpc.VerifierStub(ch)
        return stub.Info(pb.InfoRequest(), timeout=10)


def wait_for(predicate, timeout: float, interval: float = 0.1) -> float:
    """Seconds until predicate() is true; TimeoutError past `timeout`."""
    t0 = time.monotonic()
    while not predicate():
        if time.monotonic() - t0 > timeout:
            raise TimeoutError(f"condition not met within {timeout} s")
        time.sleep(interval)
    return time.monotonic() - t0


def health(addr: str, timeout: float = 2.0) -> str:
    """The server's overall health: SERVING, NOT_SERVING, or UNREACHABLE."""
    with grpc.insecure_channel(addr) as ch:
        try:
            r = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=timeout)
        except grpc.RpcError:
            return "UNREACHABLE"
    return health_pb2.HealthCheckResponse.ServingStatus.Name(r.status)


def complete(addr: str, request: gpb.GenerateRequest, timeout: float = 120) -> gpb.CompleteResponse:
    with grpc.insecure_channel(addr) as ch:
        return gpb_grpc.GenerationStub(ch).Complete(request, timeout=timeout)


def answers(addr: str, timeout: float = 30) -> bool:
    """Whether a small request succeeds now."""
    try:
        return len(complete(addr, chat("Hi", max_tokens=4, ignore_eos=True), timeout=timeout).token_ids) == 4
    except grpc.RpcError:
        return False


def all_start_together(addr: str, n: int = MAX_SEQUENCES, max_tokens: int = 32) -> float:
    """n generations at once, as many as the services hold: every one has its first token before any finishes when
    no slot is lost to an earlier failure (a lost slot makes one wait for another's end). Returns the spread of
    their first tokens in seconds; AssertionError otherwise."""
    from tests.conftest import CHAT_PROMPTS

    streams = Streams(
        addr, [chat(CHAT_PROMPTS[i % len(CHAT_PROMPTS)], max_tokens=max_tokens, ignore_eos=True) for i in range(n)]
    )
    outcomes = streams.join(timeout=240)
    assert not streams.failed, [str(o.error) for o in streams.failed]
    firsts, ends = [o.first_at for o in outcomes], [o.done_at for o in outcomes]
    assert None not in firsts and None not in ends
    assert max(firsts) < min(ends), "a generation started only after another had finished: a slot was lost"
    return max(firsts) - min(firsts)


def figures(name: str, **numbers) -> None:
    """The measured figures of one fault, in one greppable line."""
    log.info(
        "FAULT %s: %s",
        name,
        ", ".join(f"{k}={v:.2f}" if isinstance(v, float) else f"{k}={v}" for k, v in numbers.items()),
    )
